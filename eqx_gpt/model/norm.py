"""The normalisations: RMSNorm (Zhang & Sennrich 2019) and LayerNorm (Ba et al. 2016)."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqx_gpt._checks import check_eps, check_last_dim, check_size, typechecked
from eqx_gpt.model.config import NORM_KINDS


class RMSNorm(eqx.Module):
    """`x / sqrt(mean(x^2) + eps) * scale` over the last axis, with a learned `scale` and no bias.

    Cheaper than LayerNorm (no mean subtraction) and just as good in a pre-norm transformer.
    Statistics are computed in float32 whatever the input dtype.

    Not `eqx.nn.RMSNorm`: built from a feature count `dim` (not a `shape`), with a weight called
    `scale` and no bias (Equinox's has one by default), and it normalises the last axis of
    `(..., dim)` inputs, a whole sequence or batch at once.
    """

    scale: Float[Array, " dim"]
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5):
        self.dim = check_size(dim, "RMSNorm: dim")
        self.eps = check_eps(eps, "RMSNorm:")
        self.scale = jnp.ones((dim,), jnp.float32)

    @typechecked
    def __call__(self, x: Float[Array, "*seq dim"]) -> Float[Array, "*seq dim"]:
        """Normalise `x` of shape `(..., dim)`; returns the same shape and dtype."""
        check_last_dim(x, self.dim, "RMSNorm", "dim")
        x32 = x.astype(jnp.float32)
        inv_rms = jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps))
        return (x32 * inv_rms * self.scale).astype(x.dtype)


class LayerNorm(eqx.Module):
    """`(x - mean(x)) / sqrt(var(x) + eps) * scale + bias` over the last axis (Ba et al. 2016).

    The norm of "Attention Is All You Need" (its "Add & Norm"). Learned `scale` (ones) and `bias`
    (zeros); statistics are computed in float32 whatever the input dtype, as in `RMSNorm`.

    Not `eqx.nn.LayerNorm`: built from a feature count `dim` (not a `shape`; no `use_weight`,
    `use_bias` or `dtype`), with its weight called `scale`, and it normalises the last axis of
    `(..., dim)` inputs, a whole sequence or batch at once.
    """

    scale: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5):
        self.dim = check_size(dim, "LayerNorm: dim")
        self.eps = check_eps(eps, "LayerNorm:")
        self.scale = jnp.ones((dim,), jnp.float32)
        self.bias = jnp.zeros((dim,), jnp.float32)

    @typechecked
    def __call__(self, x: Float[Array, "*seq dim"]) -> Float[Array, "*seq dim"]:
        """Normalise `x` of shape `(..., dim)`; returns the same shape and dtype."""
        check_last_dim(x, self.dim, "LayerNorm", "dim")
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        inv_std = jnp.reciprocal(jnp.sqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps))
        return (centred * inv_std * self.scale + self.bias).astype(x.dtype)


NORMS = dict(zip(NORM_KINDS, (RMSNorm, LayerNorm), strict=True))


def make_norm(kind: str, dim: int, eps: float) -> RMSNorm | LayerNorm:
    """`RMSNorm(dim, eps)` for `"rms"`, `LayerNorm(dim, eps)` for `"layer"`."""
    if kind not in NORMS:
        raise ValueError(f"norm must be one of {tuple(NORMS)}, got {kind!r}")
    return NORMS[kind](dim, eps=eps)
