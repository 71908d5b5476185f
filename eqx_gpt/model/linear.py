"""The one matrix multiply every projection in the model goes through."""

from jaxtyping import Array, Float


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
