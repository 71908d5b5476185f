"""Inverted dropout as a plain function, and the dropout contract every module with dropout keeps.

The contract is `eqx.nn.Dropout`'s: a module holds an `inference: bool` field (switched by
`eqx.nn.inference_mode`), its `__call__` takes `inference: bool | None = None` to override it for
one call, and dropout that is active (a rate above 0, not in inference mode) without a `key` is an
error rather than silently no dropout.
"""

import math
import numbers

import jax
import jax.numpy as jnp
from jax.extend.random import threefry_2x32
from jaxtyping import Array, Bool, PRNGKeyArray

from eqx_gpt._checks import is_traced
from eqx_gpt.streams import typed_key

# Dropout decides with 16 random bits per element, so rates are multiples of 1/65536.
_LEVELS = 1 << 16


def keep_probability(rate: float) -> float:
    """The exact probability that `keep_mask` keeps an element: `1 - rate`, with the rate
    rounded to a multiple of 1/65536 (0.2 becomes 0.199997)."""
    return 1.0 - round(rate * _LEVELS) / _LEVELS


def keep_mask(key: PRNGKeyArray, rate: float, shape: tuple[int, ...]) -> Bool[Array, "..."]:
    """A boolean mask of `shape` that keeps each element with probability `keep_probability(rate)`.

    Why not `jax.random.bernoulli`: it spends a whole Threefry block (two 32-bit words hashed
    through 20 rounds) on every element, and the masks over the `T x T` attention weights made
    dropout about a tenth of a training step on CPU. Here each block yields four 16-bit draws.
    """
    threshold = round(rate * _LEVELS)
    data = jax.random.key_data(key)
    if data.shape != (2,):  # not a Threefry key (say "rbg"): the generic path
        return jax.random.bernoulli(key, keep_probability(rate), shape)
    n = math.prod(shape)
    words = threefry_2x32(data, jnp.arange((n + 1) // 2, dtype=jnp.uint32))
    draws = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(-1)[:n]
    return (draws >= threshold).reshape(shape)


def check_static(rate, inference, what: str) -> None:
    """Refuse, in one line, a dropout rate (or, at a rate above 0, an inference flag) that is a JAX
    tracer. They decide in Python whether to drop out, so they must be known: `jax.jit` over a
    model traces every field, its Python floats and bools included; `eqx.filter_jit` keeps them as
    they are. A model without dropout never reads its flag, so `jax.jit` over it works."""
    if is_traced(rate) or (is_traced(inference) and rate > 0):
        raise TypeError(
            f"{what}'s dropout rate or inference flag is traced: jax.jit traces a model's Python floats and "
            f"bools too; use eqx.filter_jit, which keeps them static"
        )


def check_rate(rate: float, what: str = "dropout") -> float:
    """`rate` if it is a dropout rate: a number in `[0, 1)` that stays below 1 at the 1/65536
    resolution of `keep_mask`; else a one-line `TypeError`/`ValueError` naming it and the range."""
    check_static(rate, False, what)
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(f"{what} rate must be a number in [0, 1), got {rate!r}")
    if not 0.0 <= rate < 1.0 or round(rate * _LEVELS) >= _LEVELS:
        raise ValueError(f"{what} rate must be in [0, 1) (the fraction of elements zeroed), got {rate!r}")
    return rate


def dropout_active(rate: float, inference: bool, key, what: str) -> bool:
    """Whether a module drops out on this call: `rate > 0` and not in inference mode. Active
    without a `key` is a one-line `ValueError` (as `eqx.nn.Dropout` refuses it), never silently
    no dropout."""
    check_static(rate, inference, what)
    active = rate > 0 and not inference
    if active and key is None:
        raise ValueError(
            f"{what} has dropout {rate} and is in training mode, so it needs key=; pass one, or run it in "
            f"inference mode: eqx.nn.inference_mode(model), or inference=True for this call"
        )
    return active


def dropout(x: Array, rate: float, key: PRNGKeyArray | None = None, *, inference: bool = False) -> Array:
    """Zero each element of `x` with probability `rate` and scale survivors by `1 / (1 - rate)`.

    `eqx.nn.Dropout`'s contract as a function: with `inference=True` or `rate == 0` it returns `x`
    unchanged; otherwise it needs a `key` (a one-line `ValueError` without one). `rate` must be in
    `[0, 1)`. `key` is one key, or an array of keys for the leading axes of `x` (one per sequence
    of a batch): each sequence then gets the mask it would get on its own, so a batch gives the
    same result as `jax.vmap` over its sequences. The rate is rounded to a multiple of 1/65536
    and survivors are scaled by the exact keep probability, so the expected output is `x` (see
    `keep_mask`).
    """
    check_rate(rate)
    check_static(rate, inference, "dropout")
    if rate == 0 or inference:
        return x
    if key is None:
        raise ValueError(f"dropout at rate {rate} needs key=; pass inference=True (or rate 0) for no dropout")
    key = typed_key(key)
    if key.ndim == 0:
        keep = keep_mask(key, rate, x.shape)
    else:
        inner = x.shape[key.ndim :]
        keep = jax.vmap(lambda k: keep_mask(k, rate, inner))(key.reshape(-1)).reshape(x.shape)
    scale = jnp.asarray(1.0 / keep_probability(rate), x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))
