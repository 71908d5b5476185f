"""The training corpus: loading, the train/validation split, and random batches.

A batch is `batch_size` random windows of `context_length + 1` consecutive tokens: the first
`context_length` are the input, the last `context_length` the targets. Which windows are drawn is a
pure function of `(seed, step)`, so a resumed run sees exactly the batches it would have seen.
"""

import functools
import hashlib
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from eqx_gpt.streams import batch_key

SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TRAIN_FRACTION = 0.9


class DataError(ValueError):
    """The corpus cannot be used (one-line message naming the file and the fix)."""


def shakespeare_path() -> Path:
    """The bundled Tiny Shakespeare text (1,115,394 characters), shipped in the package."""
    return Path(str(resources.files("eqx_gpt") / "data" / "tinyshakespeare.txt"))


def load_text(path: str | Path | None = None) -> str:
    """The corpus as a string: the bundled Tiny Shakespeare when `path` is None, else a UTF-8 file.

    The bundled file is checked against its known sha256, so a damaged install is reported rather
    than trained on.
    """
    bundled = path is None
    path = shakespeare_path() if bundled else Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist; pass --data PATH to a UTF-8 text file") from None
    except IsADirectoryError:
        raise DataError(f"data path {path} is a directory; pass --data PATH to a UTF-8 text file") from None
    except OSError as e:
        raise DataError(f"data file {path} cannot be read ({e.strerror or e})") from None
    if bundled and hashlib.sha256(raw).hexdigest() != SHAKESPEARE_SHA256:
        raise DataError(f"bundled corpus {path} does not match its sha256; reinstall eqx_gpt")
    if not raw:
        raise DataError(f"data file {path} is empty; pass a text file with some content")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data file {path} is not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r}); "
            f"convert it, e.g. `iconv -t UTF-8`"
        ) from None


def split_text(text: str, train_fraction: float = TRAIN_FRACTION) -> tuple[str, str]:
    """The first `train_fraction` of the characters for training, the rest for validation."""
    n = int(len(text) * train_fraction)
    return text[:n], text[n:]


def to_ids(ids: list[int], name: str, context_length: int, source: str) -> Int[Array, " n"]:
    """`ids` as a device array, checked to hold at least one window of `context_length + 1`."""
    if len(ids) < context_length + 1:
        raise DataError(
            f"{source}: the {name} split has {len(ids)} tokens, fewer than one window of "
            f"context_length + 1 = {context_length + 1}; use a longer file or a smaller --context-length"
        )
    return jnp.asarray(np.asarray(ids, dtype=np.int32))


def sample_windows(data: Int[Array, " n"], key: jax.Array, batch_size: int, length: int) -> Int[Array, "b l"]:
    """`batch_size` windows of `length` consecutive tokens of `data`, starting uniformly at random."""
    starts = jax.random.randint(key, (batch_size,), 0, data.shape[0] - length + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, length))(starts)


@functools.partial(jax.jit, static_argnames=("seed", "stream", "batch_size", "length"))
def get_batch(
    data: Int[Array, " n"],
    step: Int[Array, ""] | int,
    *,
    seed: int,
    stream: int,
    batch_size: int,
    length: int,
) -> Int[Array, "b l"]:
    """The batch of `stream` at `step`: `batch_size` windows of `length` tokens, the same every time."""
    return sample_windows(data, batch_key(seed, stream, step), batch_size, length)


def fixed_batches(
    data: Int[Array, " n"], *, seed: int, stream: int, n_batches: int, batch_size: int, length: int
) -> Int[Array, "k b l"]:
    """`n_batches` batches that never change during a run (evaluation uses the same ones each time)."""
    return jnp.stack(
        [
            get_batch(data, i, seed=seed, stream=stream, batch_size=batch_size, length=length)
            for i in range(n_batches)
        ]
    )
