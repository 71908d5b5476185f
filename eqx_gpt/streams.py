"""Random streams: every random number of a run comes from one seed, through named streams.

A run's randomness (initial weights, training batches, dropout masks, the fixed evaluation batches)
is `batch_key(seed, STREAM, step)`: a pure function of its inputs, so a resumed run draws exactly
what it would have drawn, and the streams never overlap. Inside the model, one key is split per
sequence of a batch and per layer (`keys_per_sequence`, `split_key`), whichever key style the
caller uses (`typed_key`).
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

# Independent random streams derived from one seed (folded into the key before the step).
TRAIN_BATCHES, DROPOUT, EVAL_TRAIN_BATCHES, EVAL_VAL_BATCHES, INIT, LORA_INIT = range(6)


def batch_key(seed: int, stream: int, step: int | Int[Array, ""]) -> jax.Array:
    """The PRNG key of `stream` (e.g. `TRAIN_BATCHES`) at `step`: a pure function of its inputs."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), step)


def typed_key(key: PRNGKeyArray) -> PRNGKeyArray:
    """`key` as a typed key array (`jax.random.key`), whichever style it comes in.

    Classic `jax.random.PRNGKey` keys are raw `uint32` arrays with a trailing axis of 2, so one
    key has shape `(2,)` and `ndim` cannot tell one key from many; wrapping them makes one key
    0-d, as `jax.random.key` gives.
    """
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def keys_per_sequence(key: PRNGKeyArray, batch: tuple[int, ...]) -> PRNGKeyArray:
    """One key per sequence of a batch of shape `batch`: `key` itself if it already is that,
    else the single `key` split into them."""
    key = typed_key(key)
    if key.shape == batch:
        return key
    return split_key(key, math.prod(batch)).reshape(batch)


def split_key(key: PRNGKeyArray, n: int) -> PRNGKeyArray:
    """`jax.random.split(key, n)` for one key or an array of keys: shape `(n, *key.shape)`."""
    key = typed_key(key)
    if key.ndim == 0:
        return jax.random.split(key, n)
    split = jax.vmap(lambda k: jax.random.split(k, n), out_axes=1)(key.reshape(-1))
    return split.reshape(n, *key.shape)


def projection_keys(key: PRNGKeyArray | None, batch: tuple[int, ...], n: int) -> tuple:
    """`n` keys for a module's projections (a `LoRALinear` drops out its input), derived from the
    module's own `key`: one per sequence of `batch`, each folded with `1, ..., n`, so the keys the
    module already splits from `key` (its attention dropout) draw what they drew before. `None`s
    without a key."""
    if key is None:
        return (None,) * n
    per_sequence = keys_per_sequence(key, batch).reshape(-1)
    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
    return tuple(fold(per_sequence, i).reshape(batch) for i in range(1, n + 1))
