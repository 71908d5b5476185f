"""Scaled dot-product and multi-head attention (Vaswani et al. 2017, sections 3.2.1-3.2.2)."""

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

from eqx_gpt._checks import check_last_dim, check_size, is_traced, is_whole, typechecked
from eqx_gpt.model.dropout import check_rate, dropout, dropout_active
from eqx_gpt.model.flash_attention import flash_attention_available, flash_multi_head_attention
from eqx_gpt.model.linear import Linear
from eqx_gpt.model.positions import rotary_embedding
from eqx_gpt.streams import keys_per_sequence, projection_keys


def causal_mask(seq_len: int) -> Bool[Array, "{seq_len} {seq_len}"]:
    """Lower-triangular boolean mask `(seq_len, seq_len)`: `mask[i, j]` is True when query `i` may
    attend to key `j <= i`. `seq_len` is a whole number >= 1."""
    check_size(seq_len, "causal_mask: seq_len")
    return jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))


def padding_mask(
    lengths: Int[Array, "*batch"] | None = None,
    *,
    tokens: Int[Array, "*batch kv_seq"] | None = None,
    pad_id: int | None = None,
    kv_seq: int | None = None,
) -> Bool[Array, "*batch kv_seq"]:
    """`mask[..., j]` True where key `j` is a real token, False where it is padding.

    From `lengths` `(*batch,)` of sequences padded at the end to `kv_seq` positions, or from
    `tokens` `(*batch, kv_seq)` and their `pad_id`. Add a query axis to combine it with other masks:

        padding_mask(lengths=src_len, kv_seq=S)[..., None, :]              # encoder self-attention
        causal_mask(T) & padding_mask(lengths=tgt_len, kv_seq=T)[..., None, :]  # decoder self-attention
        padding_mask(lengths=src_len, kv_seq=S)[..., None, :]              # decoder cross-attention

    (the first and last broadcast over the `seq` query rows: `jnp.broadcast_to(m, (*batch, T, S))`
    gives the explicit mask). A query row that sees no key at all stays finite: it attends
    uniformly (see `attention_weights`), and its output is usually ignored as padding itself.
    """
    if (lengths is None) == (tokens is None):
        raise ValueError("padding_mask takes either lengths= (with kv_seq=) or tokens= (with pad_id=)")
    if tokens is not None:
        if pad_id is None:
            raise ValueError("padding_mask(tokens=...) needs pad_id=, the id that marks padding")
        if not is_whole(pad_id, 0):
            raise ValueError(f"padding_mask: pad_id must be a token id (an integer >= 0), got {pad_id!r}")
        return tokens != pad_id
    if kv_seq is None:
        raise ValueError("padding_mask(lengths=...) needs kv_seq=, the padded length")
    if not is_whole(kv_seq, 0):
        raise ValueError(f"padding_mask: kv_seq must be a whole number >= 0, got {kv_seq!r}")
    lengths = _check_lengths(lengths, kv_seq)
    return jnp.arange(kv_seq) < lengths[..., None]


def _check_lengths(lengths, kv_seq: int) -> Int[Array, "*batch"]:
    """`lengths` as an integer array, refused (one line) unless whole numbers in `[0, kv_seq]`;
    under `jit` only the dtype can be checked, the values being unknown."""
    if is_traced(lengths):
        if not jnp.issubdtype(lengths.dtype, jnp.integer):
            raise ValueError(f"padding_mask: lengths must be integers, got dtype {lengths.dtype}")
        return lengths
    values = np.asarray(lengths)
    if values.dtype == bool or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"padding_mask: lengths must be whole numbers, got {values.tolist()!r}")
    if values.size and (values.min() < 0 or values.max() > kv_seq):
        raise ValueError(
            f"padding_mask: lengths must be in [0, kv_seq={kv_seq}], got {values.min()}..{values.max()}"
        )
    return jnp.asarray(values)


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


def head_attention(
    q: Float[Array, "q_seq d_head"],
    k: Float[Array, "kv_seq d_head"],
    v: Float[Array, "kv_seq d_head"],
    mask: Bool[Array, "q_seq kv_seq"] | None,
    rate: float = 0.0,
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, "q_seq d_head"], Float[Array, "q_seq kv_seq"]]:
    """One head's scaled dot-product attention: `dropout(attention_weights(q, k, mask)) @ v`.

    The per-head core of every path: self- and cross-attention, cached decoding and the weights
    drawn in pictures all run this function (`jax.vmap`ped over heads and sequences). Returns the
    output and the attention weights (before dropout's zeros, after its rescaling).
    """
    w = dropout(attention_weights(q, k, mask), rate, key)
    return w.astype(v.dtype) @ v, w


def multi_head_attention(
    q: Float[Array, "*batch q_seq heads d_head"],
    k: Float[Array, "*batch kv_seq heads d_head"] | Float[Array, "*batch heads d_head kv_seq"],
    v: Float[Array, "*batch kv_seq heads d_head"] | Float[Array, "*batch heads kv_seq d_head"],
    mask: Bool[Array, "..."] | None,
    rate: float = 0.0,
    key: PRNGKeyArray | None = None,
    *,
    cached: bool = False,
) -> tuple[Float[Array, "*batch q_seq heads*d_head"], Float[Array, "*batch heads q_seq kv_seq"]]:
    """Every head's `head_attention`, with `jax.vmap` over the heads and then over sequences: the
    one driver of the heads, for training, cross-attention, cached decoding and the pictures.

    `mask` is `(q_seq, kv_seq)` for every sequence, or `(*batch, q_seq, kv_seq)` for one each.
    `key` is one key per sequence (`*batch`), or one key split into those; each sequence splits
    its key into one per head. `cached=True` reads keys and values in a `KVCache`'s layout, head
    first with the keys transposed (`(*batch, heads, d_head, kv_seq)`, `(*batch, heads, kv_seq,
    d_head)`), so decoding multiplies by the cache as it is stored.
    """
    head_axis = 0 if cached else 1  # of one sequence's keys and values

    def one_sequence(q, k, v, mask, key):
        keys = None if key is None else jax.random.split(key, q.shape[-2])
        one_head = lambda q, k, v, key: head_attention(q, k.T if cached else k, v, mask, rate, key)
        in_axes = (1, head_axis, head_axis, 0)
        return jax.vmap(one_head, in_axes=in_axes, out_axes=(1, 0))(q, k, v, keys)

    batch, (q_seq, heads, d_head) = q.shape[:-3], q.shape[-3:]
    if not batch:
        out, weights = one_sequence(q, k, v, mask, key)
    else:
        q1, k1, v1 = (a.reshape(-1, *a.shape[-3:]) for a in (q, k, v))
        masks, mask_axis = mask, None
        if mask is not None and mask.ndim > 2:  # one mask per sequence
            masks, mask_axis = mask.reshape(-1, *mask.shape[-2:]), 0
        keys = None if key is None else keys_per_sequence(key, batch).reshape(-1)
        in_axes = (0, 0, 0, mask_axis, 0)
        out, weights = jax.vmap(one_sequence, in_axes=in_axes)(q1, k1, v1, masks, keys)
        out, weights = out.reshape(*batch, *out.shape[1:]), weights.reshape(*batch, *weights.shape[1:])
    return out.reshape(*batch, q_seq, heads * d_head), weights


def fused_attention(
    q: Float[Array, "q_seq heads d_head"],
    k: Float[Array, "kv_seq heads d_head"],
    v: Float[Array, "kv_seq heads d_head"],
    mask: Bool[Array, "q_seq kv_seq"] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
) -> Float[Array, "q_seq heads d_head"]:
    """All heads' `attention_weights(q, k, mask) @ v` in one `jax.nn.dot_product_attention` call.

    `implementation="cudnn"` is cuDNN's fused (flash) attention on an NVIDIA GPU with bf16/fp16
    inputs; `None` is XLA's reference path, which matches the per-head `vmap` path.
    """
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


# On a GPU, attention without dropout takes eqx_gpt's kernels too, not cuDNN's: their backward adds
# in a fixed order (dq and dk/dv in kernels of their own, no atomics), while cuDNN's adds dq with
# atomics unless XLA's global --xla_gpu_deterministic_ops is set, which cost a quarter of a run's
# GPU throughput. So a GPU run gives the same bits every time, and a resumed run continues them.
KERNELS_WITHOUT_DROPOUT = True


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

    @classmethod
    def zeros(
        cls, lead: tuple[int, ...], n_heads: int, d_head: int, capacity: int, dtype=jnp.float32
    ) -> "KVCache":
        """An empty cache of `capacity` positions with leading axes `lead` (layers, sequences)."""
        return cls(
            jnp.zeros((*lead, n_heads, d_head, capacity), dtype),
            jnp.zeros((*lead, n_heads, capacity, d_head), dtype),
        )


class MultiHeadAttention(eqx.Module):
    """Multi-head attention on one sequence (or a batch of them: see `__call__`).

    Not `eqx.nn.MultiheadAttention`: this one is built from `(d_model, n_heads)` alone (queries,
    keys, values and output all `d_model` wide), takes `x` and an optional `context` rather than
    separate query, key and value inputs, and adds KV-cached decoding (`decode`) and RoPE.

    Queries come from `x`; keys and values from `x` too (self-attention) or from another sequence,
    the `context` (cross-attention: a decoder attending to its encoder's output). One fused
    projection, the `Linear` `qkv` (`d_model -> 3 * d_model`), holds the query, key and value
    weights side by side, so self-attention projects all three in one matrix multiply and
    cross-attention splits it into the query part and the key/value part (`Linear.columns`).
    `multi_head_attention` runs the per-head core (`head_attention`) over every head; the `Linear`
    `out` projects the concatenated heads back to `d_model`. Without a `mask` every position
    attends everywhere (an encoder); pass `causal_mask(seq)` for a decoder, `padding_mask(...)` to
    hide padding, or both combined (see `padding_mask`).

    Dropout on the attention weights follows `eqx.nn.Dropout`'s contract: with `dropout > 0` and
    `inference=False` (training mode, as built) a call needs a `key`; `eqx.nn.inference_mode`
    sets `inference=True` (no dropout, any key or none), and `__call__(..., inference=...)`
    overrides it for one call.

    Options: `bias=True` adds a bias to both projections, `qkv` and `out` (GPT-2's; zeros at
    first). `rope=True` rotates the queries and keys of self-attention by their positions
    (`rotary_embedding`), so the heads see relative positions; cross-attention is never rotated.
    """

    qkv: Linear  # d_model -> 3 * d_model: queries, keys, values side by side
    out: Linear  # d_model -> d_model: the concatenated heads back to the residual stream
    inference: bool
    d_model: int = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    rope: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        key: PRNGKeyArray,
        dropout: float = 0.0,
        init_std: float = 0.02,
        bias: bool = False,
        rope: bool = False,
        inference: bool = False,
    ):
        check_size(d_model, "MultiHeadAttention: d_model")
        check_size(n_heads, "MultiHeadAttention: n_heads")
        if d_model % n_heads:
            raise ValueError(
                f"MultiHeadAttention needs d_model divisible by n_heads, got d_model={d_model}, "
                f"n_heads={n_heads}; pick n_heads that divides d_model."
            )
        check_rate(dropout, "MultiHeadAttention: dropout")
        k_qkv, k_out = jax.random.split(key)
        self.d_model, self.n_heads, self.dropout = d_model, n_heads, dropout
        self.inference = inference
        self.qkv = Linear(d_model, 3 * d_model, key=k_qkv, use_bias=bias, init_std=init_std)
        self.out = Linear(d_model, d_model, key=k_out, use_bias=bias, init_std=init_std)
        if rope and self.d_head % 2:
            raise ValueError(f"rope needs an even d_head (feature pairs), got {self.d_head}")
        self.rope = rope

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def _heads(self, x, n: int):
        """A projection `(..., n * d_model)` as `n` arrays' heads `(..., n, heads, d_head)`."""
        return x.reshape(*x.shape[:-1], n, self.n_heads, self.d_head)

    def project_q(self, x, *, key=None, inference: bool | None = None):
        """Queries of every head `(*batch, seq, heads, d_head)` (the first third of `qkv`).
        `key` and `inference` reach the projection (`Linear.__call__`: a `LoRALinear` drops out)."""
        check_last_dim(x, self.d_model, "MultiHeadAttention", "d_model")
        q = self.qkv.columns(0, self.d_model)(x, key=key, inference=inference)
        return self._heads(q, 1)[..., 0, :, :]

    def _project(self, x, context, start: Int[Array, ""] | int = 0, *, key=None, inference=None):
        """`(q, k, v)`: all from `x` in one matrix multiply, or keys and values from `context`.
        Under `rope`, self-attention's queries and keys are rotated as positions `start, ...`.
        `key` (the projections') and `inference` reach `qkv`."""
        if context is not None:
            k_q, k_kv = projection_keys(key, x.shape[:-2], 2)
            q = self.project_q(x, key=k_q, inference=inference)
            return q, *self.project_kv(context, key=k_kv, inference=inference)
        q, k, v = self.project_qkv(x, key=key, inference=inference)
        if self.rope:
            positions = start + jnp.arange(x.shape[-2])
            q, k = rotary_embedding(q, positions), rotary_embedding(k, positions)
        return q, k, v

    @typechecked
    def project_qkv(
        self,
        x: Float[Array, "*batch seq d_model"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> tuple[
        Float[Array, "*batch seq heads d_head"],
        Float[Array, "*batch seq heads d_head"],
        Float[Array, "*batch seq heads d_head"],
    ]:
        """Queries, keys and values of every head, each of shape `(seq, n_heads, d_head)`. `key` and
        `inference` reach the projection (`Linear.__call__`: a `LoRALinear` drops out)."""
        check_last_dim(x, self.d_model, "MultiHeadAttention", "d_model")
        qkv = self._heads(self.qkv(x, key=key, inference=inference), 3)
        return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]

    @typechecked
    def project_kv(
        self,
        context: Float[Array, "*batch kv_seq d_model"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> tuple[Float[Array, "*batch kv_seq heads d_head"], Float[Array, "*batch kv_seq heads d_head"]]:
        """Keys and values of `context` for cross-attention. A decoder computes them once per
        source sequence and passes them to `attend` at every step. `key` and `inference` as in
        `project_qkv`."""
        check_last_dim(context, self.d_model, "MultiHeadAttention context", "d_model")
        kv_part = self.qkv.columns(self.d_model, 3 * self.d_model)
        kv = self._heads(kv_part(context, key=key, inference=inference), 2)
        return kv[..., 0, :, :], kv[..., 1, :, :]

    def _full_mask(self, mask, q_shape, kv_seq: int):
        """`mask` broadcast to `(seq, kv_seq)`, or to `(*batch, seq, kv_seq)` if it has batch axes
        (so `padding_mask(...)[..., None, :]` works as it is); a one-line error if it cannot be."""
        if mask is None:
            return None
        batch, seq = q_shape[:-3], q_shape[-3]
        target = (*batch, seq, kv_seq) if mask.ndim > 2 else (seq, kv_seq)
        try:
            fits = mask.dtype == jnp.bool_ and jnp.broadcast_shapes(mask.shape, target) == target
        except ValueError:
            fits = False
        if not fits:
            shape = f"({seq}, {kv_seq})" + (f" or {(*batch, seq, kv_seq)}" if batch else "")
            raise ValueError(
                f"attention mask has shape {tuple(mask.shape)} and dtype {mask.dtype}; pass a boolean "
                f"mask of shape {shape} (queries x keys), or one that broadcasts to it"
            )
        return jnp.broadcast_to(mask, target)

    def _rate(self, key, inference: bool | None) -> float:
        """This call's attention dropout rate: `self.dropout` in training mode, else 0 (see the
        class docstring; training mode without a `key` raises)."""
        inference = self.inference if inference is None else inference
        return self.dropout if dropout_active(self.dropout, inference, key, "MultiHeadAttention") else 0.0

    def attend(self, x, k, v, *, mask=None, key=None, inference: bool | None = None):
        """Attention of the queries of `x` `(*batch, seq, d_model)` over given keys and values
        `(*batch, kv_seq, heads, d_head)` (from `project_kv`); returns `(*batch, seq, d_model)`.
        `key` and `inference` as in `__call__`."""
        rate = self._rate(key, inference)
        k_q, k_out = projection_keys(key, x.shape[:-2], 2)
        q = self.project_q(x, key=k_q, inference=inference)
        mask = self._full_mask(mask, q.shape, k.shape[-3])
        return self.out(self._attend(q, k, v, mask, key, rate), key=k_out, inference=inference)

    def _attend(self, q, k, v, mask, key, rate: float, cached: bool = False):
        """All heads' outputs `(*batch, seq, d_model)`, attention weights dropped out at `rate`:
        on a GPU the fused kernels of `flash_attention` (the same function, its dropout mask a
        hash of `key`: `dropout_keep`), at any rate unless `KERNELS_WITHOUT_DROPOUT` is off, then
        cuDNN's fused kernel without dropout with 16-bit activations (`fused_attention`); else
        `multi_head_attention`. A cache's layout (`cached`) is read by `multi_head_attention`
        only: the fused kernels take keys position first."""
        kernels = rate > 0.0 or KERNELS_WITHOUT_DROPOUT
        if kernels and not cached and flash_attention_available(q.dtype, q.shape[-1]):
            return flash_multi_head_attention(q, k, v, mask, rate, key)
        if _cudnn_attention_available(q.dtype) and rate == 0.0 and not cached:
            per_sequence = mask is not None and mask.ndim > 2
            fused_mask = mask[..., None, :, :] if mask is not None and per_sequence else mask  # heads=1
            if mask is not None and q.ndim == 3:
                # One sequence, as under `jax.vmap(model)`: JAX's batching rule for cuDNN's kernel
                # reshapes the mask as if it held every head (0.11.2 fails on a (1, q, kv) one).
                fused_mask = jnp.broadcast_to(mask, (q.shape[-2], *mask.shape[-2:]))
            try:
                out = fused_attention(q, k, v, fused_mask, "cudnn")
            except (RuntimeError, ValueError, NotImplementedError):
                pass  # an unsupported shape or cuDNN version: the vmap path below
            else:
                return out.reshape(*q.shape[:-2], self.d_model)
        return multi_head_attention(q, k, v, mask, rate, key if rate else None, cached=cached)[0]

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        context: Float[Array, "*batch kv_seq d_context"] | None = None,
        *,
        mask: Bool[Array, "..."] | None = None,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Attention of `x` `(seq, d_model)` over itself, or over `context` `(kv_seq, d_model)`.

        `mask[i, j]` True lets query `i` see key `j`; shape `(seq, kv_seq)`, or
        `(*batch, seq, kv_seq)` for a different mask per sequence of a batch. `x` may be a batch
        `(batch, seq, d_model)` (with `context` `(batch, kv_seq, d_model)`): the same as `jax.vmap`
        over its sequences, but the projections then run as one matrix multiply for the whole
        batch, which is faster (see `linear`). For a batch, `key` is one key per sequence (shape
        `(batch,)`) or one key. `key` drives the attention dropout, and is needed in training mode
        when `dropout > 0`; `inference=True` or `False` overrides `self.inference` for this call.
        """
        rate = self._rate(key, inference)
        # The projections' own keys (a LoRALinear's dropout), folded from `key`: the attention
        # dropout below draws from `key` itself, as it did before projections took keys.
        k_in, k_out = projection_keys(key, x.shape[:-2], 2)
        q, k, v = self._project(x, context, key=k_in, inference=inference)
        mask = self._full_mask(mask, q.shape, k.shape[-3])
        return self.out(self._attend(q, k, v, mask, key, rate), key=k_out, inference=inference)

    @typechecked
    def weights(
        self,
        x: Float[Array, "seq d_model"],
        context: Float[Array, "kv_seq d_model"] | None = None,
        *,
        mask: Bool[Array, "..."] | None = None,
    ) -> Float[Array, "heads seq kv_seq"]:
        """The attention weights `(n_heads, seq, kv_seq)` that `__call__` uses (no dropout)."""
        q, k, v = self._project(x, context, inference=True)
        return multi_head_attention(q, k, v, self._full_mask(mask, q.shape, k.shape[-3]))[1]

    @typechecked
    def decode(
        self,
        x: Float[Array, "*batch new d_model"],
        cache: KVCache,
        start: Int[Array, ""] | int,
    ) -> tuple[Float[Array, "*batch new d_model"], KVCache]:
        """Causal self-attention for `new` positions `start, ..., start + new - 1`, using a cache.

        Writes the keys and values of `x` into `cache` at `start`, then lets each new position
        attend to every cached position up to and including itself. Prefill a prompt with
        `start=0` and the whole prompt; then decode one token at a time. The caller keeps
        `start + new <= capacity` (`jax.lax.dynamic_update_slice` would otherwise clamp).

        A batch `(*batch, new, d_model)` needs a cache with the same leading `batch` axes; its
        sequences share `start`. Decoding is inference: it never drops out. (Updating in place
        matters here: under `jax.vmap` the update would become a scatter, which XLA:CPU turns
        into a copy of the whole cache per token.)
        """
        q, updated, mask = self._cached(x, cache, start)
        k_all, v_all = updated.k.astype(q.dtype), updated.v.astype(q.dtype)
        out = self._attend(q, k_all, v_all, mask, None, 0.0, cached=True)
        return self.out(out, inference=True), updated

    def _cached(self, x, cache: KVCache, start):
        """`decode`'s queries `(*batch, new, heads, d_head)`, the cache with the keys and values of
        `x` written at `start`, and the causal mask `(new, capacity)` over the cache."""
        q, k, v = self._project(x, None, start, inference=True)  # (*batch, new, heads, d_head)
        lead = (0,) * (x.ndim - 2)
        k_t = jnp.moveaxis(k, -3, -1).astype(cache.k.dtype)  # (*batch, heads, d_head, new)
        v_h = jnp.swapaxes(v, -3, -2).astype(cache.v.dtype)  # (*batch, heads, new, d_head)
        k_all = jax.lax.dynamic_update_slice(cache.k, k_t, (*lead, 0, 0, start))
        v_all = jax.lax.dynamic_update_slice(cache.v, v_h, (*lead, 0, start, 0))
        q_pos = start + jnp.arange(x.shape[-2])
        mask = jnp.arange(cache.v.shape[-2])[None, :] <= q_pos[:, None]
        return q, KVCache(k=k_all, v=v_all), mask

    @typechecked
    def decode_weights(
        self,
        x: Float[Array, "*batch new d_model"],
        cache: KVCache,
        start: Int[Array, ""] | int,
    ) -> Float[Array, "*batch heads new capacity"]:
        """The attention weights `decode(x, cache, start)` attends with: each new position's over
        every cache slot (zero past itself), as `weights` is to `__call__`."""
        q, updated, mask = self._cached(x, cache, start)
        k_all, v_all = updated.k.astype(q.dtype), updated.v.astype(q.dtype)
        return multi_head_attention(q, k_all, v_all, mask, cached=True)[1]
