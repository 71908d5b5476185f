"""Embedding lookup, `table[ids]`, with a gradient that adds in a fixed order on a GPU.

The gradient of a lookup is a scatter-add: each id's row of `d table` sums the rows of `d out` at
the positions holding that id. On a CPU XLA adds them one after another, the same way every run.
On a GPU its scatter adds with atomics, so the order of a sum, and its last bit, depends on which
thread finishes first: a resumed run then leaves the bits of the run it resumes, and two runs of one
command differ (the first H100 run saw it: 38 of 2,048 embedding entries one ulp apart). XLA's
global `--xla_gpu_deterministic_ops` cures it by making *every* kernel deterministic, which cost
27% of `train.py`'s GPU throughput. This module cures the one kernel instead.

`d table = one_hot(ids)^T @ d out`: a matrix multiply, which adds in a fixed order on every device.
Its products are exact: the one-hot is 0 or 1, and `d out` is split into bfloat16 parts that hold
it exactly (one part when the cotangent arrives from a bfloat16 activation, as in bf16 training;
three, 8 bits of mantissa each, for float32), each multiplied with float32 accumulation. On a GPU
that is `(tokens x padded_vocab x d_model)` multiply-adds per part, about a millisecond for
GPT-2-124M's 8,192 tokens on an H100 or H200, and next to nothing for a character vocabulary. On
other backends the lookup keeps XLA's own scatter-add (on a CPU the one-hot product would cost a
second a step at GPT-2's vocabulary), so CPU results are the same bits as before.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_PARTS = {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2, jnp.dtype(jnp.float32): 3}


def one_hot_gradient_default() -> bool:
    """Whether `embedding_lookup` forms its gradient by the one-hot product: on a GPU."""
    return jax.default_backend() == "gpu"


def exact_bf16_parts(x: Float[Array, "..."], parts: int) -> list[Float[Array, "..."]]:
    """`parts` bfloat16 arrays whose float32 sum is `x`: each holds the next 8 bits of mantissa of
    what the earlier ones left (exact for float32 with 3 parts, for bfloat16 with 1)."""
    out, rest = [], x.astype(jnp.float32)
    for _ in range(parts):
        part = rest.astype(jnp.bfloat16)
        out.append(part)
        rest = rest - part.astype(jnp.float32)
    return out


def one_hot_scatter_add(
    ids: Int[Array, " tokens"], rows: Float[Array, "tokens d"], n_ids: int, exact_dtype
) -> Float[Array, "n_ids d"]:
    """`zeros((n_ids, d)).at[ids].add(rows)` as `one_hot(ids)^T @ rows`, in float32: the same sums,
    added in the fixed order of a matrix multiply. `rows` must be exactly representable in
    `exact_dtype` (bfloat16, float16 or float32), which sets how many bfloat16 parts are multiplied."""
    hot = jax.nn.one_hot(ids, n_ids, dtype=jnp.bfloat16)  # (tokens, n_ids), exact
    total = jnp.zeros((n_ids, rows.shape[-1]), jnp.float32)
    for part in exact_bf16_parts(rows, _PARTS[jnp.dtype(exact_dtype)]):
        total = total + jnp.einsum("tv,td->vd", hot, part, preferred_element_type=jnp.float32)
    return total


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _lookup(table, ids, exact_dtype):
    return table[ids]


def _lookup_fwd(table, ids, exact_dtype):
    return table[ids], (ids, table)  # the table for its shape and dtype: it is held anyway


def _lookup_bwd(exact_dtype, residuals, d_out):
    ids, table = residuals
    d_table = one_hot_scatter_add(
        ids.reshape(-1), d_out.reshape(-1, d_out.shape[-1]), table.shape[0], exact_dtype
    )
    return d_table.astype(table.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def embedding_lookup(
    table: Float[Array, "n_ids d"],
    ids: Int[Array, "*shape"],
    *,
    exact_dtype=jnp.float32,
    one_hot_gradient: bool | None = None,
) -> Float[Array, "*shape d"]:
    """`table[ids]`. With `one_hot_gradient` (default: on a GPU, `one_hot_gradient_default`) its
    gradient in `table` is `one_hot_scatter_add`, which adds in a fixed order; `exact_dtype` is a
    dtype that holds the cotangent exactly (the compute dtype the lookup's output is cast to, when
    it is cast straight after: bfloat16 makes the gradient one matrix multiply instead of three).
    Without it, XLA's scatter-add (the same bits as `table[ids]` always gave on a CPU)."""
    use = one_hot_gradient_default() if one_hot_gradient is None else one_hot_gradient
    return _lookup(table, ids, jnp.dtype(exact_dtype).name) if use else table[ids]  # a name: hashable
