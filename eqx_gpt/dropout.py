"""Inverted dropout as a plain function: no key means no dropout (inference)."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray


def dropout(x: Array, rate: float, key: PRNGKeyArray | None) -> Array:
    """Zero each element of `x` with probability `rate` and scale survivors by `1 / (1 - rate)`.

    With `key=None` or `rate == 0` it returns `x` unchanged, so the same model code serves
    training (pass a key) and inference (pass none).
    """
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))
