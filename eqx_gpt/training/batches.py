"""Training batches: random windows of `context_length + 1` tokens, drawn by `(seed, stream, step)`.

The first `context_length` tokens of a window are the input, the last `context_length` the targets.
Where the windows start is a pure function of `(seed, stream, step)` computed by JAX
(`window_starts`), so a resumed run sees exactly the batches it would have seen; the tokens are
then read from the corpus's shard files (`TokenSpan.rows`), a window at a time: no corpus is ever
copied whole into memory or onto a device.
"""

import functools

import jax
import numpy as np
from jaxtyping import Array, Int

from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.streams import batch_key


@functools.partial(jax.jit, static_argnames=("n_tokens", "seed", "stream", "batch_size", "length"))
def window_starts(
    step: Int[Array, ""] | int, *, n_tokens: int, seed: int, stream: int, batch_size: int, length: int
) -> Int[Array, " b"]:
    """Where the `batch_size` windows of `length` tokens of `stream`'s batch at `step` start, in a
    sequence of `n_tokens`: uniformly at random, the same every time."""
    return jax.random.randint(batch_key(seed, stream, step), (batch_size,), 0, n_tokens - length + 1)


def get_batch(
    tokens: TokenSpan, step: int, *, seed: int, stream: int, batch_size: int, length: int
) -> Int[np.ndarray, "b l"]:
    """The batch of `stream` at `step`: `batch_size` windows of `length` tokens of `tokens`."""
    starts = window_starts(
        step, n_tokens=len(tokens), seed=seed, stream=stream, batch_size=batch_size, length=length
    )
    return tokens.rows(np.asarray(starts), length)


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


def windows_reader(tokens: TokenSpan, starts: np.ndarray, length: int):
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
