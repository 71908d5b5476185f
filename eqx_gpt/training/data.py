"""A run's data: the corpus (the bundled Tiny Shakespeare or `--data PATH`, prepared into token
shards by `eqx_gpt.data`, split 90/10, checked against the checkpoint a run resumes) and the
training batches drawn from it.

The corpus's identity (`data_sha256` in checkpoints) is the sha256 of its file, or for a folder
of its files' names and hashes (`Manifest.identity`); a resumed run refuses any other corpus.

A batch is `batch_size` windows of `context_length + 1` consecutive tokens: the first
`context_length` are the input, the last `context_length` the targets. Where the windows start is
a pure function of `(seed, stream, step)` computed by JAX (`window_starts`), so a resumed run sees
exactly the batches it would have seen; the tokens are then read from the shard files
(`TokenSpan.rows`), a window at a time: no corpus is ever copied whole into memory or onto a device.
"""

import functools
import hashlib
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from eqx_gpt._checks import INT32_MAX
from eqx_gpt.data.prepare import Corpus, prepare
from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.errors import CheckpointError, DataError
from eqx_gpt.streams import batch_key
from eqx_gpt.training.config import setting

SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
BUNDLED = "Tiny Shakespeare (bundled)"


def shakespeare_path() -> Path:
    """The bundled Tiny Shakespeare text (1,115,394 characters), shipped in the package."""
    return Path(str(resources.files("eqx_gpt") / "data" / "tinyshakespeare.txt"))


def load_corpus(
    data: str | Path | None,
    tokenizer: dict,
    *,
    text_field: str = "text",
    split: str | None = None,
    resumes: dict | None = None,
    check_identity: Callable[[str], None] | None = None,
    log: Callable[[str], None] = lambda line: None,
    progress=None,
) -> Corpus:
    """The corpus at `data` (None: the bundled Tiny Shakespeare, checked against its known sha256)
    tokenized by `tokenizer` (see `prepare`; `text_field` names the records' text field and tables'
    text column, `split` the split of a folder of splits). `resumes` is the metadata of the
    checkpoint a run resumes: a corpus other than its `data_sha256` is refused before anything is
    tokenized (`check_identity(sha)`, if given, checks instead). Every command prepares its corpus
    here, so `log` gets the same lines from each (a damaged cache entry prepared again, a corpus
    prepared and where it is cached, a wait for another process)."""
    bundled = data is None
    source = BUNDLED if bundled else data

    def check(sha: str) -> None:
        if bundled and sha != SHAKESPEARE_SHA256:
            raise DataError(
                f"bundled corpus {shakespeare_path()} does not match its sha256; reinstall eqx_gpt"
            )
        if check_identity is not None:
            check_identity(sha)
        elif resumes is not None and resumes.get("data_sha256") not in (None, sha):
            raise CheckpointError(
                f"{source} is not the corpus the checkpoint in {Path(resumes['path']).parent}/ was trained "
                f"on (its sha256 differs); pass {setting('data')} PATH to that corpus"
            )

    return prepare(
        shakespeare_path() if bundled else data,
        tokenizer,
        text_field=text_field,
        split=split,
        check_identity=check,
        log=log,
        progress=progress,
    )


def check_split(tokens: TokenSpan, name: str, context_length: int, source: str) -> None:
    """Refuse a split shorter than one window of `context_length + 1` tokens."""
    if len(tokens) < context_length + 1:
        raise DataError(
            f"{source}: the {name} split has {len(tokens)} tokens, fewer than one window of "
            f"context_length + 1 = {context_length + 1}; use a longer file or a smaller "
            f"{setting('context_length')}"
        )


def load_text(path: str | Path | None = None) -> str:
    """A small text whole, as a string: the bundled Tiny Shakespeare when `path` is None (checked
    against its sha256), else a UTF-8 file. Training reads corpora with `load_corpus` instead."""
    bundled = path is None
    path = shakespeare_path() if bundled else Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(
            f"data file {path} does not exist; pass {setting('data')} PATH to a UTF-8 text file"
        ) from None
    except IsADirectoryError:
        raise DataError(
            f"data path {path} is a directory; pass {setting('data')} PATH to a UTF-8 text file"
        ) from None
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


@functools.partial(jax.jit, static_argnames=("n_starts", "seed", "stream", "batch_size"))
def _narrow_starts(step: Int[Array, ""] | int, *, n_starts: int, seed: int, stream: int, batch_size: int):
    return jax.random.randint(batch_key(seed, stream, step), (batch_size,), 0, n_starts)


@functools.partial(jax.jit, static_argnames=("seed", "stream", "batch_size"))
def _wide_bits(step: Int[Array, ""] | int, *, seed: int, stream: int, batch_size: int):
    return jax.random.bits(batch_key(seed, stream, step), (batch_size, 2), jnp.uint32)


def window_starts(
    step: Int[Array, ""] | int, *, n_tokens: int, seed: int, stream: int, batch_size: int, length: int
) -> Int[np.ndarray, " b"]:
    """`int64 [batch_size]`: where the windows of `length` tokens of `stream`'s batch at `step`
    start, in a sequence of `n_tokens`: uniformly at random, the same every time. Up to 2^31
    starts, JAX's int32 `randint` draws them (as it always did: runs and resumes stay
    bit-exact); beyond (JAX's x64 is off), two 32-bit words of the same key make a 64-bit draw,
    reduced modulo the count (a bias below count / 2^64: under 2^-24 up to 2^40 tokens)."""
    n_starts = int(n_tokens) - length + 1
    if n_starts <= INT32_MAX:
        starts = _narrow_starts(step, n_starts=n_starts, seed=seed, stream=stream, batch_size=batch_size)
        return np.asarray(starts).astype(np.int64)
    bits = np.asarray(_wide_bits(step, seed=seed, stream=stream, batch_size=batch_size)).astype(np.uint64)
    return ((bits[:, 0] << np.uint64(32) | bits[:, 1]) % np.uint64(n_starts)).astype(np.int64)


def get_batch(
    tokens: TokenSpan, step: int, *, seed: int, stream: int, batch_size: int, length: int
) -> Int[np.ndarray, "b l"]:
    """The batch of `stream` at `step`: `batch_size` windows of `length` tokens of `tokens`."""
    starts = window_starts(
        step, n_tokens=len(tokens), seed=seed, stream=stream, batch_size=batch_size, length=length
    )
    return tokens.rows(starts, length)


def fixed_batches(
    tokens: TokenSpan, *, seed: int, stream: int, n_batches: int, batch_size: int, length: int
) -> Int[np.ndarray, "k b l"]:
    """`n_batches` batches that never change during a run (evaluation uses the same ones each time)."""
    return np.stack(
        [
            get_batch(tokens, i, seed=seed, stream=stream, batch_size=batch_size, length=length)
            for i in range(n_batches)
        ]
    )


def batch_reader(tokens: TokenSpan, starts: np.ndarray, length: int):
    """`read(index)`: the part `index` (a tuple of slices) of the array `[*starts.shape, length]`
    whose rows are the windows starting at `starts`; a negative start is a row of zeros (an unused
    slot). Each process of a multi-host run reads only its own devices' part (`shard_rows`)."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = (*index, *[slice(None)] * (starts.ndim + 1 - len(index)))
        chosen = starts[index[:-1]]
        out = np.zeros((*chosen.shape, length), np.int32)
        used = chosen >= 0
        out[used] = tokens.rows(chosen[used], length)
        return out[..., index[-1]]

    return read
