"""The position-wise feed-forward network (Vaswani et al. 2017, section 3.3)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from eqx_gpt._checks import check_last_dim, typechecked


class MLP(eqx.Module):
    """`gelu(x @ w_in) @ w_out`, applied to every position independently.

    Weights are stored `(in, out)` so that a whole sequence is one matrix multiply; there are no
    biases (the surrounding RMSNorm makes them redundant). Weights start as N(0, init_std^2).
    """

    w_in: Float[Array, "d_model d_hidden"]
    w_out: Float[Array, "d_hidden d_model"]
    d_model: int = eqx.field(static=True)
    d_hidden: int = eqx.field(static=True)

    def __init__(self, d_model: int, d_hidden: int, *, key: PRNGKeyArray, init_std: float = 0.02):
        if d_model < 1 or d_hidden < 1:
            raise ValueError(f"MLP needs positive sizes, got d_model={d_model}, d_hidden={d_hidden}")
        k_in, k_out = jax.random.split(key)
        self.d_model, self.d_hidden = d_model, d_hidden
        self.w_in = init_std * jax.random.normal(k_in, (d_model, d_hidden), jnp.float32)
        self.w_out = init_std * jax.random.normal(k_out, (d_hidden, d_model), jnp.float32)

    @typechecked
    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        """Map `x` of shape `(seq, d_model)` to the same shape."""
        check_last_dim(x, self.d_model, "MLP", "d_model")
        h = jax.nn.gelu(x @ self.w_in.astype(x.dtype))
        return h @ self.w_out.astype(x.dtype)
