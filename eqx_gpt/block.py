"""One pre-norm transformer decoder block."""

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from eqx_gpt._checks import typechecked
from eqx_gpt.attention import KVCache, MultiHeadAttention
from eqx_gpt.dropout import dropout, split_key
from eqx_gpt.mlp import MLP
from eqx_gpt.norm import RMSNorm


class Block(eqx.Module):
    """`x + attn(norm(x))`, then `x + mlp(norm(x))`, with dropout on each sub-layer's output.

    Normalising *before* each sub-layer (rather than after, as in the paper) keeps the residual
    stream an identity path, which is what lets deep stacks train without warm-up tricks.
    """

    attn_norm: RMSNorm
    attn: MultiHeadAttention
    mlp_norm: RMSNorm
    mlp: MLP
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_hidden: int,
        *,
        key: PRNGKeyArray,
        dropout: float = 0.0,
        norm_eps: float = 1e-5,
    ):
        k_attn, k_mlp = jax.random.split(key)
        self.attn_norm = RMSNorm(d_model, eps=norm_eps)
        self.attn = MultiHeadAttention(d_model, n_heads, key=k_attn, dropout=dropout)
        self.mlp_norm = RMSNorm(d_model, eps=norm_eps)
        self.mlp = MLP(d_model, d_hidden, key=k_mlp)
        self.dropout = dropout

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        *,
        mask: Bool[Array, "seq seq"] | None = None,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Map `x` of shape `(seq, d_model)` to the same shape; dropout only when `key` is given.

        A batch `(batch, seq, d_model)` works too, with one key per sequence (shape `(batch,)`) or one key.
        """
        k_attn, k_res1, k_res2 = (None,) * 3 if key is None else split_key(key, 3)
        x = x + dropout(self.attn(self.attn_norm(x), mask=mask, key=k_attn), self.dropout, k_res1)
        return x + dropout(self.mlp(self.mlp_norm(x)), self.dropout, k_res2)

    @typechecked
    def decode(
        self, x: Float[Array, "*batch new d_model"], cache: KVCache, start: Int[Array, ""] | int
    ) -> tuple[Float[Array, "*batch new d_model"], KVCache]:
        """`__call__` for new positions starting at `start`, attending through a `KVCache`
        (see `MultiHeadAttention.decode`)."""
        h, cache = self.attn.decode(self.attn_norm(x), cache, start)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache
