"""One transformer block: self-attention, optionally cross-attention, and the MLP, each a residual
sub-layer with its norm before it (pre-norm) or after the sum (post-norm, the paper's Add & Norm)."""

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from eqx_gpt._checks import typechecked
from eqx_gpt.model.attention import KVCache, MultiHeadAttention
from eqx_gpt.model.config import NORM_POSITIONS
from eqx_gpt.model.dropout import check_rate, dropout, dropout_active
from eqx_gpt.model.mlp import MLP
from eqx_gpt.model.norm import LayerNorm, RMSNorm, make_norm
from eqx_gpt.streams import split_key

# A block's projections: the names of Hugging Face GPT-2's modules, and the `Block`'s paths to the
# `Linear`s they are. GPT-2's tensor names (`eqx_gpt.gpt2`) and LoRA's PEFT names translate through it.
GPT2_PROJECTIONS = {
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.out",
    "mlp.c_fc": "mlp.up",
    "mlp.c_proj": "mlp.down",
}


class Block(eqx.Module):
    """Residual sub-layers with dropout on each sub-layer's output:

    pre-norm (default):  `x + attn(norm(x))`, [`x + cross(norm(x), context)`], `x + mlp(norm(x))`
    post-norm (paper):   `norm(x + attn(x))`, [`norm(x + cross(x, context))`], `norm(x + mlp(x))`

    Normalising *before* each sub-layer keeps the residual stream an identity path, which is what
    lets deep stacks train without warm-up tricks; post-norm is the original Transformer's
    placement. `norm` is `"rms"` (`RMSNorm`) or `"layer"` (`LayerNorm`). With
    `cross_attention=True` the block is a decoder block of an encoder-decoder: between
    self-attention and the MLP it attends to a `context` (the encoder's output). `bias`,
    `activation` and `rope` reach the sub-layers (see `MultiHeadAttention` and `MLP`; `rope`
    rotates self-attention only).

    Dropout (on each sub-layer's output, and inside attention) follows `eqx.nn.Dropout`'s
    contract: in training mode (`inference=False`, as built) with `dropout > 0` a call needs a
    `key`; `eqx.nn.inference_mode` switches the block and its attention to inference mode, and
    `__call__(..., inference=...)` overrides them for one call.
    """

    attn_norm: RMSNorm | LayerNorm
    attn: MultiHeadAttention
    cross_norm: RMSNorm | LayerNorm | None
    cross_attn: MultiHeadAttention | None
    mlp_norm: RMSNorm | LayerNorm
    mlp: MLP
    inference: bool
    dropout: float = eqx.field(static=True)
    norm_position: str = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_hidden: int,
        *,
        key: PRNGKeyArray,
        dropout: float = 0.0,
        norm_eps: float = 1e-5,
        norm: str = "rms",
        norm_position: str = "pre",
        cross_attention: bool = False,
        bias: bool = False,
        activation: str = "gelu_tanh",
        rope: bool = False,
        inference: bool = False,
    ):
        check_rate(dropout, "Block: dropout")
        if norm_position not in NORM_POSITIONS:
            raise ValueError(f"norm_position must be one of {NORM_POSITIONS}, got {norm_position!r}")
        k_attn, k_mlp, k_cross = jax.random.split(key, 3)
        self.attn_norm = make_norm(norm, d_model, norm_eps)
        self.attn = MultiHeadAttention(
            d_model, n_heads, key=k_attn, dropout=dropout, bias=bias, rope=rope, inference=inference
        )
        self.cross_norm = make_norm(norm, d_model, norm_eps) if cross_attention else None
        self.cross_attn = (
            MultiHeadAttention(d_model, n_heads, key=k_cross, dropout=dropout, bias=bias, inference=inference)
            if cross_attention
            else None
        )
        self.mlp_norm = make_norm(norm, d_model, norm_eps)
        self.mlp = MLP(d_model, d_hidden, key=k_mlp, bias=bias, activation=activation)
        self.dropout = dropout
        self.norm_position = norm_position
        self.inference = inference

    def _residual(self, x, norm, sublayer, key, inference: bool):
        """One sub-layer with its residual connection and norm, in this block's placement; its
        output dropped out unless `inference`."""
        if self.norm_position == "pre":
            return x + dropout(sublayer(norm(x)), self.dropout, key, inference=inference)
        return norm(x + dropout(sublayer(x), self.dropout, key, inference=inference))

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        context: Float[Array, "*batch kv_seq d_context"] | None = None,
        *,
        mask: Bool[Array, "..."] | None = None,
        context_mask: Bool[Array, "..."] | None = None,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Map `x` of shape `(seq, d_model)` to the same shape.

        `mask` is the self-attention mask, `(seq, seq)` or per sequence `(*batch, seq, seq)`;
        `context` `(kv_seq, d_model)` and `context_mask` `(seq, kv_seq)` feed the cross-attention
        of a block built with `cross_attention=True`. A batch `(batch, seq, d_model)` works too,
        with one key per sequence (shape `(batch,)`) or one key. `key` drives dropout and is
        needed in training mode when `dropout > 0`; `inference=True` or `False` overrides the
        block's and its attention's `inference` for this call.
        """
        if (context is None) != (self.cross_attn is None):
            raise ValueError(
                "a block built with cross_attention=True needs a context, and one without takes none"
            )
        own = self.inference if inference is None else inference
        dropout_active(self.dropout, own, key, "Block")
        k_attn = k_res1 = k_cross = k_res2 = k_res3 = None
        if key is not None and self.cross_attn is None:  # three keys, as before cross-attention existed
            k_attn, k_res1, k_res3 = split_key(key, 3)
        elif key is not None:
            k_attn, k_res1, k_cross, k_res2, k_res3 = split_key(key, 5)
        attend = lambda h: self.attn(h, mask=mask, key=k_attn, inference=inference)
        x = self._residual(x, self.attn_norm, attend, k_res1, own)
        if self.cross_attn is not None:
            cross_norm, cross_attn = self.cross_sublayer()
            cross = lambda h: cross_attn(h, context, mask=context_mask, key=k_cross, inference=inference)
            x = self._residual(x, cross_norm, cross, k_res2, own)
        # The MLP's projections fold their keys from k_res3 (`projection_keys`): the residual
        # dropout draws from k_res3 itself, as before projections took keys.
        feed_forward = lambda h: self.mlp(h, key=k_res3, inference=inference)
        return self._residual(x, self.mlp_norm, feed_forward, k_res3, own)

    def attention_weights(self, x, *, mask=None):
        """The self-attention weights `(heads, seq, seq)` that `__call__` uses on `x` `(seq,
        d_model)` (no dropout): on `norm(x)` before a pre-norm sub-layer, on `x` itself in post-norm."""
        query = self.attn_norm(x) if self.norm_position == "pre" else x
        return self.attn.weights(query, mask=mask)

    def cross_sublayer(self) -> tuple[RMSNorm | LayerNorm, MultiHeadAttention]:
        """The cross-attention sub-layer's norm and attention; a one-line error without them."""
        if self.cross_attn is None or self.cross_norm is None:
            raise ValueError("this block has no cross-attention; build it with cross_attention=True")
        return self.cross_norm, self.cross_attn

    def cross_attention_weights(self, x, context, *, mask=None, context_mask=None):
        """The cross-attention weights `(heads, seq, kv_seq)` that `__call__` uses on `x`
        `(seq, d_model)` and `context` `(kv_seq, d_model)` (no dropout)."""
        cross_norm, cross_attn = self.cross_sublayer()
        x = self._residual(x, self.attn_norm, lambda h: self.attn(h, mask=mask, inference=True), None, True)
        query = cross_norm(x) if self.norm_position == "pre" else x
        return cross_attn.weights(query, context, mask=context_mask)

    @typechecked
    def decode(
        self,
        x: Float[Array, "*batch new d_model"],
        cache: KVCache,
        start: Int[Array, ""] | int,
        context_kv: tuple[Array, Array] | None = None,
        context_mask: Bool[Array, "..."] | None = None,
    ) -> tuple[Float[Array, "*batch new d_model"], KVCache]:
        """`__call__` for new positions starting at `start`, attending through a `KVCache` (see
        `MultiHeadAttention.decode`); a decoder block attends to the context's keys and values
        `context_kv` (from `cross_attn.project_kv`, computed once per source sequence). Decoding
        is inference: it never drops out."""
        attend = lambda h: self.attn.decode(h, cache, start)
        if self.norm_position == "pre":
            h, cache = attend(self.attn_norm(x))
            x = x + h
        else:
            h, cache = attend(x)
            x = self.attn_norm(x + h)
        if self.cross_attn is not None:
            cross_norm, cross_attn = self.cross_sublayer()
            if context_kv is None:
                raise ValueError("a block with cross-attention decodes with context_kv=(keys, values)")
            k, v = context_kv
            cross = lambda h: cross_attn.attend(h, k, v, mask=context_mask, inference=True)
            x = self._residual(x, cross_norm, cross, None, True)
        feed_forward = lambda h: self.mlp(h, inference=True)
        return self._residual(x, self.mlp_norm, feed_forward, None, True), cache
