"""Scaled dot-product and multi-head attention (Vaswani et al. 2017, sections 3.2.1-3.2.2)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from eqx_gpt._checks import check_last_dim, typechecked
from eqx_gpt.dropout import dropout, keys_per_sequence
from eqx_gpt.linear import linear


@typechecked
def causal_mask(seq_len: int) -> Bool[Array, "{seq_len} {seq_len}"]:
    """Lower-triangular boolean mask: `mask[i, j]` is True when query `i` may attend to key `j <= i`."""
    return jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))


@typechecked
def attention_weights(
    q: Float[Array, "q_seq d_head"],
    k: Float[Array, "kv_seq d_head"],
    mask: Bool[Array, "q_seq kv_seq"] | None = None,
) -> Float[Array, "q_seq kv_seq"]:
    """`softmax(q k^T / sqrt(d_head))` for one head, hidden keys given zero weight.

    Scores and softmax are computed in float32 whatever the input dtype. A hidden position gets
    the most negative finite score rather than -inf, so a fully hidden row is uniform, not NaN.
    """
    scores = (q @ k.T).astype(jnp.float32) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def fused_attention(
    q: Float[Array, "q_seq heads d_head"],
    k: Float[Array, "kv_seq heads d_head"],
    v: Float[Array, "kv_seq heads d_head"],
    mask: Bool[Array, "q_seq kv_seq"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "q_seq heads d_head"]:
    """All heads' `attention_weights(q, k, mask) @ v` in one `jax.nn.dot_product_attention` call.

    `implementation="cudnn"` is cuDNN's fused (flash) attention on an NVIDIA GPU with bf16/fp16
    inputs; `None` is XLA's reference path, which matches the per-head `vmap` path.
    """
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def _cudnn_attention_available(dtype) -> bool:
    """cuDNN attention needs a GPU and 16-bit inputs; elsewhere the `vmap` path runs."""
    return jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


class KVCache(eqx.Module):
    """Keys and values of the positions seen so far, in buffers of fixed `capacity`.

    For one attention layer and one sequence, `k` is `(n_heads, d_head, capacity)` and `v` is
    `(n_heads, capacity, d_head)`. A batch of sequences adds leading `batch` axes, and a whole
    `GPT` a leading `n_layers` axis before those (or, unstacked by `GPT.unstack`, a tuple of
    per-layer caches). Why this layout: decoding multiplies one query by every cached key
    (`q @ K^T`) and the weights by every cached value (`w @ V`); with each head's `K^T` and `V`
    stored as the matrices those products read, no transposed copy of the cache is made per token.
    Slots past the current position hold stale values that the decoding mask hides, so the
    buffers never change shape and `jit` compiles once.
    """

    k: Float[Array, "*lead heads d_head capacity"]
    v: Float[Array, "*lead heads capacity d_head"]


class MultiHeadAttention(eqx.Module):
    """Multi-head self-attention on one sequence (or a batch of them: see `__call__`).

    A fused projection computes queries, keys and values for all heads in one matrix multiply;
    `jax.vmap` over the head axis runs scaled dot-product attention per head; the concatenated
    heads are projected back to `d_model`. Without a `mask` every position attends everywhere
    (as in an encoder); pass `causal_mask(seq)` for a decoder. When `key` is given and
    `dropout > 0`, attention weights are dropped out (training); without a key it is deterministic.
    """

    w_qkv: Float[Array, "d_model 3*d_model"]
    w_out: Float[Array, "d_model d_model"]
    d_model: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        key: PRNGKeyArray,
        dropout: float = 0.0,
        init_std: float = 0.02,
    ):
        if n_heads < 1 or d_model < 1 or d_model % n_heads:
            raise ValueError(
                f"MultiHeadAttention needs d_model divisible by n_heads, got d_model={d_model}, "
                f"n_heads={n_heads}; pick n_heads that divides d_model."
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        k_qkv, k_out = jax.random.split(key)
        self.d_model, self.n_heads, self.dropout = d_model, n_heads, dropout
        self.w_qkv = init_std * jax.random.normal(k_qkv, (d_model, 3 * d_model), jnp.float32)
        self.w_out = init_std * jax.random.normal(k_out, (d_model, d_model), jnp.float32)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @typechecked
    def project_qkv(
        self, x: Float[Array, "*batch seq d_model"]
    ) -> tuple[
        Float[Array, "*batch seq heads d_head"],
        Float[Array, "*batch seq heads d_head"],
        Float[Array, "*batch seq heads d_head"],
    ]:
        """Queries, keys and values of every head, each of shape `(seq, n_heads, d_head)`."""
        check_last_dim(x, self.d_model, "MultiHeadAttention", "d_model")
        qkv = linear(x, self.w_qkv).reshape(*x.shape[:-1], 3, self.n_heads, self.d_head)
        return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]

    def _attend(self, q, k, v, mask, key):
        """Every head's attention; returns `(output (*batch, seq, d_model), weights)`.

        One sequence runs its heads with `jax.vmap` over the head axis; a batch `jax.vmap`s that
        over its sequences, each with its own dropout key (`key` is one per sequence, or one split
        into those).
        """

        def one_sequence(q, k, v, key):
            def one_head(q, k, v, key):
                w = dropout(attention_weights(q, k, mask), self.dropout, key)
                return w.astype(v.dtype) @ v, w

            keys = None if key is None else jax.random.split(key, self.n_heads)
            return jax.vmap(one_head, in_axes=(1, 1, 1, 0), out_axes=(1, 0))(q, k, v, keys)

        batch, (seq, heads, d_head) = q.shape[:-3], q.shape[-3:]
        if batch:
            flat = [a.reshape(-1, *a.shape[-3:]) for a in (q, k, v)]
            keys = None if key is None else keys_per_sequence(key, batch).reshape(-1)
            out, weights = jax.vmap(one_sequence)(*flat, keys)
            out, weights = out.reshape(*batch, *out.shape[1:]), weights.reshape(*batch, *weights.shape[1:])
        else:
            out, weights = one_sequence(q, k, v, key)
        return out.reshape(*batch, seq, heads * d_head), weights

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        *,
        mask: Bool[Array, "seq seq"] | None = None,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Self-attention over `x` of shape `(seq, d_model)`; `mask[i, j]` True lets `i` see `j`.

        `x` may also be a batch `(batch, seq, d_model)`: the same as `jax.vmap` over its sequences,
        but the projections then run as one matrix multiply for the whole batch, which is faster
        (see `linear`). For a batch, `key` is one key per sequence (shape `(batch,)`) or one key.

        On a GPU with bf16/fp16 activations and no attention dropout, the heads run in cuDNN's
        fused attention kernel (same result; see `fused_attention`) when cuDNN supports the shape.
        """
        q, k, v = self.project_qkv(x)
        if _cudnn_attention_available(q.dtype) and (key is None or self.dropout == 0.0):
            try:
                out = fused_attention(q, k, v, mask, implementation="cudnn")
            except (RuntimeError, ValueError, NotImplementedError):
                pass  # an unsupported shape or cuDNN version: the vmap path below
            else:
                return linear(out.reshape(x.shape), self.w_out)
        return linear(self._attend(q, k, v, mask, key)[0], self.w_out)

    @typechecked
    def weights(
        self, x: Float[Array, "seq d_model"], *, mask: Bool[Array, "seq seq"] | None = None
    ) -> Float[Array, "heads seq seq"]:
        """The attention weights `(n_heads, seq, seq)` that `__call__` uses (no dropout)."""
        q, k, v = self.project_qkv(x)
        return self._attend(q, k, v, mask, None)[1]

    @typechecked
    def decode(
        self,
        x: Float[Array, "*batch new d_model"],
        cache: KVCache,
        start: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "*batch new d_model"], KVCache]:
        """Causal attention for `new` positions `start, ..., start + new - 1`, using a cache.

        Writes the keys and values of `x` into `cache` at `start`, then lets each new position
        attend to every cached position up to and including itself. Prefill a prompt with
        `start=0` and the whole prompt; then decode one token at a time. The caller keeps
        `start + new <= capacity` (`jax.lax.dynamic_update_slice` would otherwise clamp).

        A batch `(*batch, new, d_model)` needs a cache with the same leading `batch` axes; its
        sequences share `start`. (Updating in place matters here: under `jax.vmap` the update would
        become a scatter, which XLA:CPU turns into a copy of the whole cache per token.)
        """
        q, k, v = self.project_qkv(x)  # (*batch, new, heads, d_head)
        lead = (0,) * (x.ndim - 2)
        k_t = jnp.moveaxis(k, -3, -1).astype(cache.k.dtype)  # (*batch, heads, d_head, new)
        v_h = jnp.swapaxes(v, -3, -2).astype(cache.v.dtype)  # (*batch, heads, new, d_head)
        k_all = jax.lax.dynamic_update_slice(cache.k, k_t, (*lead, 0, 0, start))
        v_all = jax.lax.dynamic_update_slice(cache.v, v_h, (*lead, 0, start, 0))
        q_pos = start + jnp.arange(x.shape[-2])
        mask = jnp.arange(cache.v.shape[-2])[None, :] <= q_pos[:, None]

        def one_head(q, k_t, v):
            return attention_weights(q, k_t.T, mask).astype(v.dtype) @ v

        heads = jax.vmap(one_head, in_axes=(1, 0, 0), out_axes=1)
        for _ in lead:
            heads = jax.vmap(heads)
        out = heads(q, k_all.astype(q.dtype), v_all.astype(q.dtype))
        return linear(out.reshape(x.shape), self.w_out), KVCache(k=k_all, v=v_all)
