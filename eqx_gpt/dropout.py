"""Inverted dropout as a plain function: no key means no dropout (inference)."""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray


def dropout(x: Array, rate: float, key: PRNGKeyArray | None) -> Array:
    """Zero each element of `x` with probability `rate` and scale survivors by `1 / (1 - rate)`.

    With `key=None` or `rate == 0` it returns `x` unchanged, so the same model code serves
    training (pass a key) and inference (pass none). `key` is one key, or an array of keys for the
    leading axes of `x` (one per sequence of a batch): each sequence then gets the mask it would
    get on its own, so a batch gives the same result as `jax.vmap` over its sequences.
    """
    if key is None or rate == 0.0:
        return x
    if key.ndim == 0:
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    else:
        inner = x.shape[key.ndim :]
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, inner))(key.reshape(-1))
        keep = keep.reshape(x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def keys_per_sequence(key: PRNGKeyArray, batch: tuple[int, ...]) -> PRNGKeyArray:
    """One key per sequence of a batch of shape `batch`: `key` itself if it already is that,
    else the single `key` split into them."""
    if key.shape == batch:
        return key
    return split_key(key, math.prod(batch)).reshape(batch)


def split_key(key: PRNGKeyArray, n: int) -> PRNGKeyArray:
    """`jax.random.split(key, n)` for one key or an array of keys: shape `(n, *key.shape)`."""
    if key.ndim == 0:
        return jax.random.split(key, n)
    split = jax.vmap(lambda k: jax.random.split(k, n), out_axes=1)(key.reshape(-1))
    return split.reshape(n, *key.shape)
