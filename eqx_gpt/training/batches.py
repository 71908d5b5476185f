"""Training batches: random windows of `context_length + 1` tokens, drawn by `(seed, stream, step)`.

The first `context_length` tokens of a window are the input, the last `context_length` the targets.
Where the windows start is a pure function of `(seed, stream, step)` computed by JAX
(`window_starts`), so a resumed run sees exactly the batches it would have seen; the tokens are
then read from the corpus's shard files (`TokenSpan.rows`), a window at a time: no corpus is ever
copied whole into memory or onto a device.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.streams import batch_key

INT32_MAX = (1 << 31) - 1


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
