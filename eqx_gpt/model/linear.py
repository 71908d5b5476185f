"""`Linear`, the module every projection of every model is, and `linear`, the one matrix multiply
it computes."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key, PRNGKeyArray

from eqx_gpt._checks import check_last_dim, check_size, typechecked


def linear(
    x: Float[Array, "*rows d_in"], w: Float[Array, "d_in d_out"], b: Float[Array, " d_out"] | None = None
) -> Float[Array, "*rows d_out"]:
    """`x @ w (+ b)` for `x` of shape `(..., d_in)`, computed as one 2-D matrix multiply.

    Every leading axis (positions, and sequences when a whole batch is passed) is folded into the
    rows first. Why: for a batch `(batch, seq, d_in)` the gradient of `w` contracts two axes at once,
    and XLA:CPU lowers that to a transposed copy of the incoming gradient, fused with whatever
    produced it (GELU's derivative, say), which cost more than the matrix multiplies themselves.
    With the axes folded, both gradients are plain 2-D matrix multiplies. `w` and the bias `b` are
    cast to `x`'s dtype (mixed precision keeps parameters in float32).
    """
    out = x.reshape(-1, x.shape[-1]) @ w.astype(x.dtype)
    if b is not None:
        out = out + b.astype(x.dtype)
    return out.reshape(*x.shape[:-1], w.shape[-1])


class Linear(eqx.Module):
    """A learned projection `x @ weight + bias` from `in_features` to `out_features`.

    Every projection of every eqx_gpt model is one: attention's query/key/value and output
    (`MultiHeadAttention.qkv`, `.out`, cross-attention's too), the MLP's (`MLP.up`, `.down`) and
    an untied head (`GPT.head`, `Transformer.head`). Tools find them by type, as Equinox's idiom
    does: `eqx.tree_at(where, model, replace_fn=..., is_leaf=lambda m: isinstance(m, Linear))`,
    `jax.tree.map(..., is_leaf=...)` for optimiser labels, LoRA's adapters (`LoRALinear`, a
    subclass) and GPT-2's tensor names.

    How it differs from `eqx.nn.Linear`:
    - `weight` is stored `(in_features, out_features)`, the `x @ W` layout (GPT-2's `Conv1D`'s too),
      not `(out_features, in_features)`;
    - it acts on `(*rows, in_features)` with any number of leading axes (a sequence, a batch of
      them) as one 2-D matrix multiply (see `linear`), not on one vector under `jax.vmap`;
    - `weight` and `bias` are cast to `x`'s dtype, so float32 parameters serve a bfloat16 forward;
    - the weight starts as N(0, init_std^2) (GPT-2's init), the bias (off by default) as zeros;
    - sizes are read from `weight`, so a stack of layers (`LayerStack`, leading `n_layers` axis)
      holds one `Linear` whose arrays carry that axis.
    """

    weight: Float[Array, "in_features out_features"]
    bias: Float[Array, " out_features"] | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        key: PRNGKeyArray,
        use_bias: bool = False,
        init_std: float = 0.02,
    ):
        check_size(in_features, "Linear: in_features")
        check_size(out_features, "Linear: out_features")
        self.weight = init_std * jax.random.normal(key, (in_features, out_features), jnp.float32)
        self.bias = jnp.zeros((out_features,), jnp.float32) if use_bias else None

    @property
    def in_features(self) -> int:
        return self.weight.shape[-2]

    @property
    def out_features(self) -> int:
        return self.weight.shape[-1]

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*rows d_in"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*rows d_out"]:
        """`x @ weight + bias` for `x` of shape `(*rows, in_features)`: `(*rows, out_features)`.

        `key` and `inference` are ignored (a plain projection is deterministic), as in
        `eqx.nn.Linear`; they are there so that every projection is called alike, and a subclass
        that drops out (`LoRALinear`) gets them from the module that calls it."""
        del key, inference
        check_last_dim(x, self.in_features, "Linear", "in_features")
        return linear(x, self.weight, self.bias)

    def columns(self, start: int, stop: int) -> "Linear":
        """The same projection restricted to output features `start:stop` (cross-attention's
        query part and key/value part of a fused `qkv`). A subclass with more arrays along the
        output axis (LoRA's `B`) slices those too."""
        sliced = eqx.tree_at(lambda m: m.weight, self, self.weight[..., start:stop])
        if self.bias is not None:
            sliced = eqx.tree_at(lambda m: m.bias, sliced, self.bias[..., start:stop])
        return sliced
