"""Root-mean-square layer normalisation (Zhang & Sennrich 2019)."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from eqx_gpt._checks import check_last_dim, typechecked


class RMSNorm(eqx.Module):
    """`x / sqrt(mean(x^2) + eps) * scale` over the last axis, with a learned `scale` and no bias.

    Cheaper than LayerNorm (no mean subtraction) and just as good in a pre-norm transformer.
    Statistics are computed in float32 whatever the input dtype.
    """

    scale: Float[Array, " dim"]
    dim: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5):
        if dim < 1:
            raise ValueError(f"RMSNorm needs dim >= 1, got {dim}")
        self.dim = dim
        self.eps = eps
        self.scale = jnp.ones((dim,), jnp.float32)

    @typechecked
    def __call__(self, x: Float[Array, "*seq dim"]) -> Float[Array, "*seq dim"]:
        """Normalise `x` of shape `(..., dim)`; returns the same shape and dtype."""
        check_last_dim(x, self.dim, "RMSNorm", "dim")
        x32 = x.astype(jnp.float32)
        inv_rms = jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps))
        return (x32 * inv_rms * self.scale).astype(x.dtype)
