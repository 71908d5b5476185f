"""Attention with dropout in fused kernels, forward and backward (FlashAttention-2, in Pallas).

`jax.nn.dot_product_attention` has no dropout, so attention dropout in training took the per-head
`vmap` path (`multi_head_attention`): the `(seq, kv_seq)` weights of every head written to memory,
dropped out, read back. Here the forward pass runs over blocks of keys with an online softmax
(Dao 2023, "FlashAttention-2", algorithm 1), saving each query row's running maximum and sum; the
backward pass recomputes the weights block by block from them, one kernel for `dq` (a block of
queries over the keys) and one for `dk` and `dv` (a block of keys over the queries). The weights
never reach memory, and neither does the dropout mask: it is a counter-based hash of (the
sequence's seed, head, query position, key position) in uint32 arithmetic (`dropout_keep`),
drawn again wherever a block is recomputed, so the forward and backward passes see the same mask.
The seed is two uint32 words per sequence, drawn from the step's JAX key (`sequence_seeds`), so
the mask follows the key as `dropout` does, with no recompilation.

The mask is a boolean array, as `multi_head_attention` takes it (`(seq, kv_seq)` for every
sequence, or `(batch, seq, kv_seq)`), because that is what attention receives: a causal mask, with
padding or without. Its blocks are read in the kernel, and a map of which blocks hold any visible
key, computed from it by XLA before the kernel, bounds each block's loop: under a causal mask the
blocks above the diagonal are skipped (what FlashAttention's causal flag does), and with padding
the blocks past a sequence's length. A query row that sees no key attends uniformly to every key,
as `attention_weights` makes it, so its blocks visit every key.

Shapes are padded outside the kernels to whole blocks (the blocks Triton loads are powers of two)
and the head dimension to a power of two of at least 16 (what Triton's matrix multiply takes).
Scores, softmax statistics and accumulators are float32 whatever the inputs' dtype; matrix
multiplies follow JAX's default matmul precision, as XLA's do: on a GPU float32 inputs multiply in
TF32 (tensor cores), and under `jax.default_matmul_precision("highest")` in IEEE float32, where a
float32 kernel matches the XLA path within float32 rounding (at "highest" the char model's step
took 30 times its bf16 step on an H200: Triton's IEEE products use no tensor cores). On a CPU the
kernels run in Pallas's interpret mode, slowly but exactly: that is how the suite tests them.
"""

import concurrent.futures
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, UInt

from eqx_gpt._checks import typechecked
from eqx_gpt.model.dropout import check_rate, keep_probability
from eqx_gpt.streams import keys_per_sequence

# Scores are kept in base 2 (exp2 is the GPU's native exponential): s * log2(e), then exp2.
_LOG2E = math.log2(math.e)
# A hidden key's score, finite as in `attention_weights`, so a row with no visible key is uniform.
_HIDDEN = float(np.finfo(np.float32).min)
# Dropout decides with the top 16 bits of the hash, at `keep_probability`'s resolution.
_LEVELS = 1 << 16
# The hash's odd multipliers: murmur3's finaliser's, the golden ratio, and two of xxHash32's primes.
_MIX_1, _MIX_2 = 0x85EBCA6B, 0xC2B2AE35
_HEAD_STEP, _ROW_STEP, _COLUMN_STEP = 0x9E3779B9, 0x27D4EB2F, 0x165667B1
_MIN_BLOCK = 16  # Triton's matrix multiply takes operands of at least 16 x 16


def _mix32(h):
    """murmur3's 32-bit finaliser: a bijection of uint32 whose every output bit depends on every
    input bit (full avalanche), in multiplies, xors and logical shifts that Triton lowers."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_MIX_1)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(_MIX_2)
    return h ^ (h >> 16)


def _uint32(x):
    return lax.convert_element_type(x, jnp.uint32)


def dropout_keep(seed_words, head, q_idx, k_idx, rate: float) -> Bool[Array, "..."]:
    """Whether attention dropout at `rate` keeps the weight of query `q_idx` on key `k_idx` in
    `head` of the sequence whose seed is `seed_words` (its two uint32 words, `sequence_seeds`).

    The mask of the kernels, as a pure function: `head`, `q_idx` and `k_idx` broadcast together
    (integers, positions in the sequence), so the XLA path draws the identical mask
    (`reference_attention`). A counter-based hash: the seed and head are mixed into one word per
    (sequence, head), that word with the query position into one per row, that with the key
    position into one per weight; its top 16 bits are compared with `rate * 65536` rounded, so the
    weight is kept with probability `keep_probability(rate)`, as `dropout` keeps one.
    """
    threshold = round((1.0 - keep_probability(rate)) * _LEVELS)
    head_word = _mix32(_uint32(seed_words[1]) + _uint32(head) * jnp.uint32(_HEAD_STEP))
    stream = _mix32(_uint32(seed_words[0]) ^ head_word)
    row = _mix32(stream ^ (_uint32(q_idx) * jnp.uint32(_ROW_STEP)))
    word = _mix32(row ^ (_uint32(k_idx) * jnp.uint32(_COLUMN_STEP)))
    return (word >> 16) >= jnp.uint32(threshold)


def sequence_seeds(key: PRNGKeyArray, batch: tuple[int, ...]) -> UInt[Array, "*batch 2"]:
    """The kernel's seed of each sequence of a batch of shape `batch`: two uint32 words drawn from
    its key. `key` is one key (split into one per sequence, as `multi_head_attention` splits it) or
    already one per sequence (`keys_per_sequence`)."""
    keys = keys_per_sequence(key, batch).reshape(-1)
    words = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)
    return words.reshape(*batch, 2)


@typechecked
def reference_attention(
    q: Float[Array, "batch seq heads d_head"],
    k: Float[Array, "batch kv_seq heads d_head"],
    v: Float[Array, "batch kv_seq heads d_head"],
    mask: Bool[Array, "seq kv_seq"] | Bool[Array, "batch seq kv_seq"] | None = None,
    *,
    rate: float = 0.0,
    seeds: UInt[Array, "batch 2"] | None = None,
) -> Float[Array, "batch seq heads d_head"]:
    """What `flash_attention` computes, on XLA, for the tests and the bench: each head as
    `head_attention` runs it (the softmax of `attention_weights`: float32 scores, a hidden key at
    the most negative float32), dropped out with the kernel's mask (`dropout_keep`). Not imported
    from `attention`, which dispatches to this module; a test holds it equal to
    `multi_head_attention`. Its float32 products are exact (`Precision.HIGHEST`), as the kernels'
    are under `jax.default_matmul_precision("highest")`. `flash_attention` takes the same arguments."""
    seq, kv_seq, n_heads = q.shape[1], k.shape[1], q.shape[2]
    scale = jnp.asarray(1.0 / keep_probability(rate), jnp.float32)
    q_idx, k_idx = jnp.arange(seq)[:, None], jnp.arange(kv_seq)[None, :]
    exact = lax.Precision.HIGHEST  # a GPU would multiply float32 in TF32 by default

    def one_head(q, k, v, mask, seed, head):
        scores = jnp.matmul(q, k.T, precision=exact).astype(jnp.float32) / math.sqrt(q.shape[-1])
        w = jax.nn.softmax(scores if mask is None else jnp.where(mask, scores, _HIDDEN), axis=-1)
        if rate > 0:
            w = jnp.where(dropout_keep(seed, head, q_idx, k_idx, rate), w * scale, 0.0)
        return jnp.matmul(w.astype(v.dtype), v, precision=exact)

    if rate > 0 and seeds is None:
        raise ValueError(f"reference_attention at rate {rate} needs seeds= (sequence_seeds)")
    seeds = jnp.zeros((q.shape[0], 2), jnp.uint32) if seeds is None else seeds
    heads = jax.vmap(one_head, in_axes=(1, 1, 1, None, None, 0), out_axes=1)
    mask_axis = 0 if mask is not None and mask.ndim == 3 else None
    sequences = jax.vmap(heads, in_axes=(0, 0, 0, mask_axis, 0, None))
    return sequences(q, k, v, mask, seeds, jnp.arange(n_heads))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Queries x keys per block in each kernel: powers of two of at least 16, shrunk for shorter
    sequences. `forward` and `dq` hold a block of queries and loop over blocks of keys; `dkv`
    holds a block of keys and loops over blocks of queries. (FlashAttention-2's Triton kernels
    hold a larger block than they loop over; which is fastest here is `bench/flash_attention.py`'s
    question, on a GPU.)"""

    forward: tuple[int, int] = (64, 64)
    dq: tuple[int, int] = (64, 64)
    dkv: tuple[int, int] = (64, 64)

    @classmethod
    def uniform(cls, block_q: int, block_k: int) -> "BlockSizes":
        """The same blocks in every kernel."""
        return cls((block_q, block_k), (block_q, block_k), (block_q, block_k))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static shape of one kernel's call: its blocks, the padded sizes, what it computes."""

    block_q: int
    block_k: int
    q_padded: int  # queries, padded to whole blocks of every kernel
    kv_padded: int  # keys, likewise
    kv_seq: int  # keys before padding; later ones are padding's, never seen
    scale: float  # 1 / sqrt(d_head)
    rate: float
    has_mask: bool
    mask_batched: bool  # a mask per sequence, not one for all
    interpret: bool

    @property
    def q_blocks(self) -> int:
        return self.q_padded // self.block_q

    @property
    def k_blocks(self) -> int:
        return self.kv_padded // self.block_k


def _dot(a, b, contract: tuple[int, int] = (1, 1)):
    """A 2-D matrix product contracting axis `contract[0]` of `a` with `contract[1]` of `b`
    (`(1, 1)`: `a @ b.T`), accumulated in float32, at JAX's default matmul precision as XLA's
    own products are (float32 in TF32 on a GPU unless `jax.default_matmul_precision("highest")`)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _block_scores(q, k, mask_block, k_start, plan: _Plan):
    """Scores `(block_q, block_k)` in base 2: `q k^T / sqrt(d_head) * log2(e)`, `_HIDDEN` where
    the mask hides a key, -inf at the keys that padding to whole blocks added; and the mask as
    booleans (None without one)."""
    s = _dot(q, k) * (plan.scale * _LOG2E)
    visible = None
    if mask_block is not None:
        visible = mask_block != 0
        s = jnp.where(visible, s, _HIDDEN)
    if plan.kv_seq < plan.kv_padded:
        k_idx = k_start + jnp.arange(plan.block_k)
        s = jnp.where((k_idx < plan.kv_seq)[None, :], s, -jnp.inf)
    return s, visible


def _keep_block(seed_ref, head, q_start, k_start, plan: _Plan):
    """This (sequence, head)'s dropout mask over one block `(block_q, block_k)`; None at rate 0.
    (`head` is read by the kernel outside its loop: interpret mode knows `pl.program_id` there.)"""
    if plan.rate == 0:
        return None
    q_idx = (q_start + jnp.arange(plan.block_q))[:, None]
    k_idx = (k_start + jnp.arange(plan.block_k))[None, :]
    return dropout_keep((seed_ref[0], seed_ref[1]), head, q_idx, k_idx, plan.rate)


def _forward_kernel(q_ref, k_ref, v_ref, seed_ref, range_ref, mask_ref, o_ref, max_ref, sum_ref, *, plan):
    """One block of queries over its keys: the online softmax, `o = dropout(softmax) @ v`, and
    each row's maximum score and its sum of `exp2(score - maximum)` (before dropout), for the
    backward pass."""
    bq, bk = plan.block_q, plan.block_k
    q_start, head = pl.program_id(0) * bq, pl.program_id(2)
    q = q_ref[...]

    def body(j, carry):
        acc, row_max, row_sum = carry
        k_start = j * bk
        keys = pl.ds(k_start, bk)
        mask_block = None if mask_ref is None else mask_ref[:, keys]
        s, _ = _block_scores(q, k_ref[keys, :], mask_block, k_start, plan)
        max_next = jnp.maximum(row_max, jnp.max(s, axis=1))
        correction = jnp.exp2(row_max - max_next)
        p = jnp.exp2(s - max_next[:, None])
        row_sum = row_sum * correction + jnp.sum(p, axis=1)
        keep = _keep_block(seed_ref, head, q_start, k_start, plan)
        if keep is not None:
            p = jnp.where(keep, p, 0.0)
        v = v_ref[keys, :]
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v, (1, 0))
        return acc, max_next, row_sum

    start = (
        jnp.zeros((bq, q.shape[-1]), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc, row_max, row_sum = lax.fori_loop(range_ref[0], range_ref[1], body, start)
    o_ref[...] = (acc / (row_sum * keep_probability(plan.rate))[:, None]).astype(o_ref.dtype)
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def _gradient_terms(q, k, v, do, row_max, row_sum, delta, mask_block, keep, k_start, plan):
    """A block's softmax `p`, its dropped-out weights `pd` and the scores' gradient `ds`
    (natural-log units, before the `1 / sqrt(d_head)` of the scores): with `W = dropout(P)`,
    `dP = dropout(dO V^T)` and `dS = P * (dP - rowsum(dO * O))` (FlashAttention-2, algorithm 2)."""
    s, visible = _block_scores(q, k, mask_block, k_start, plan)
    p = jnp.exp2(s - row_max[:, None]) / row_sum[:, None]
    dp = _dot(do, v)
    pd = p
    if keep is not None:
        inverse = 1.0 / keep_probability(plan.rate)
        pd = jnp.where(keep, p * inverse, 0.0)
        dp = jnp.where(keep, dp * inverse, 0.0)
    ds = p * (dp - delta[:, None])
    if visible is not None:  # a row that sees no key is uniform, yet a hidden score has no gradient
        ds = jnp.where(visible, ds, 0.0)
    return pd, ds


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, max_ref, sum_ref, delta_ref, seed_ref, range_ref, mask_ref, dq_ref, *, plan
):
    """`dq` of one block of queries, over the blocks of keys it saw in the forward pass."""
    bq, bk = plan.block_q, plan.block_k
    q_start, head = pl.program_id(0) * bq, pl.program_id(2)
    q, do, row_max, row_sum, delta = q_ref[...], do_ref[...], max_ref[...], sum_ref[...], delta_ref[...]

    def body(j, dq):
        k_start = j * bk
        keys = pl.ds(k_start, bk)
        k = k_ref[keys, :]
        mask_block = None if mask_ref is None else mask_ref[:, keys]
        keep = _keep_block(seed_ref, head, q_start, k_start, plan)
        _, ds = _gradient_terms(
            q, k, v_ref[keys, :], do, row_max, row_sum, delta, mask_block, keep, k_start, plan
        )
        return dq + _dot(ds.astype(k.dtype), k, (1, 0))

    dq = lax.fori_loop(range_ref[0], range_ref[1], body, jnp.zeros((bq, q.shape[-1]), jnp.float32))
    dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    max_ref,
    sum_ref,
    delta_ref,
    seed_ref,
    range_ref,
    mask_ref,
    dk_ref,
    dv_ref,
    *,
    plan,
):
    """`dk` and `dv` of one block of keys, over the blocks of queries that saw it."""
    bq, bk = plan.block_q, plan.block_k
    k_start, head = pl.program_id(0) * bk, pl.program_id(2)
    k, v = k_ref[...], v_ref[...]

    def body(i, carry):
        dk, dv = carry
        q_start = i * bq
        rows = pl.ds(q_start, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        mask_block = None if mask_ref is None else mask_ref[rows, :]
        keep = _keep_block(seed_ref, head, q_start, k_start, plan)
        row_max, row_sum, delta = max_ref[rows], sum_ref[rows], delta_ref[rows]
        pd, ds = _gradient_terms(q, k, v, do, row_max, row_sum, delta, mask_block, keep, k_start, plan)
        dv = dv + _dot(pd.astype(do.dtype), do, (0, 0))
        dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))
        return dk, dv

    zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(range_ref[0], range_ref[1], body, (zeros, zeros))
    dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


class _Specs:
    """The kernels' `BlockSpec`s, on a grid `(block, sequence, head)` (the block of queries or of
    keys first, as the kernels' `pl.program_id(0)`)."""

    def __init__(self, plan: _Plan, d_head: int):
        self.plan, self.d_head = plan, d_head
        self.mask_row = (lambda b: b) if plan.mask_batched else (lambda b: 0)

    def rows(self, block: int):
        """The grid's block of rows of `(batch, seq, heads, d_head)`."""
        return pl.BlockSpec((None, block, None, self.d_head), lambda n, b, h: (b, n, h, 0))

    def all_rows(self, length: int):
        """Every row of `(batch, seq, heads, d_head)`, `length` of them."""
        return pl.BlockSpec((None, length, None, self.d_head), lambda n, b, h: (b, 0, h, 0))

    def stats(self, block: int):
        """The grid's block of a row statistic `(batch, heads, seq)`."""
        return pl.BlockSpec((None, None, block), lambda n, b, h: (b, h, n))

    def all_stats(self):
        """Every query's row statistic `(batch, heads, q_padded)`."""
        return pl.BlockSpec((None, None, self.plan.q_padded), lambda n, b, h: (b, h, 0))

    def seeds(self):
        return pl.BlockSpec((None, 2), lambda n, b, h: (b, 0))

    def ranges(self):
        return pl.BlockSpec((None, None, 2), lambda n, b, h: (self.mask_row(b), n, 0))

    def mask(self, by_rows: bool):
        """The mask's rows of a block of queries (`by_rows`), or its columns of a block of keys."""
        if not self.plan.has_mask:
            return None
        p = self.plan
        if by_rows:
            return pl.BlockSpec((None, p.block_q, p.kv_padded), lambda n, b, h: (self.mask_row(b), n, 0))
        return pl.BlockSpec((None, p.q_padded, p.block_k), lambda n, b, h: (self.mask_row(b), 0, n))


def _compiler_params(plan: _Plan, d_head: int):
    """Triton's launch settings: 4 warps, or 8 for a block of 128 x 128 or a d_head above 64 (JAX's
    reference kernel's rule); None where this JAX has none to give (interpret mode ignores them)."""
    try:
        from jax.experimental.pallas import triton as pallas_triton
    except ImportError:
        return None
    params = getattr(pallas_triton, "CompilerParams", None) or getattr(
        pallas_triton, "TritonCompilerParams", None
    )
    if params is None:
        return None
    wide = plan.block_q * plan.block_k >= 128 * 128 or d_head > 64
    return params(num_warps=8 if wide else 4, num_stages=2)


def _forward(q, k, v, seeds, ranges, mask, plans):
    """The forward kernel over every (block of queries, sequence, head): `o` and the row
    statistics `row_max`, `row_sum` `(batch, heads, q_padded)`."""
    plan = plans[0]
    batch, _, heads, d_head = q.shape
    specs = _Specs(plan, d_head)
    stats = jax.ShapeDtypeStruct((batch, heads, plan.q_padded), jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_kernel, plan=plan),
        grid=(plan.q_blocks, batch, heads),
        in_specs=[
            specs.rows(plan.block_q),
            specs.all_rows(plan.kv_padded),
            specs.all_rows(plan.kv_padded),
            specs.seeds(),
            specs.ranges(),
            specs.mask(by_rows=True),
        ],
        out_specs=[specs.rows(plan.block_q), specs.stats(plan.block_q), specs.stats(plan.block_q)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), stats, stats],
        compiler_params=_compiler_params(plan, d_head),
        interpret=plan.interpret,
        name="flash_attention_forward",
    )(q, k, v, seeds, ranges[0], mask)


def _dq(q, k, v, do, row_max, row_sum, delta, seeds, ranges, mask, plan: _Plan):
    """The `dq` kernel over every (block of queries, sequence, head)."""
    batch, _, heads, d_head = q.shape
    specs = _Specs(plan, d_head)
    return pl.pallas_call(
        functools.partial(_dq_kernel, plan=plan),
        grid=(plan.q_blocks, batch, heads),
        in_specs=[
            specs.rows(plan.block_q),
            specs.all_rows(plan.kv_padded),
            specs.all_rows(plan.kv_padded),
            specs.rows(plan.block_q),
            *(specs.stats(plan.block_q),) * 3,
            specs.seeds(),
            specs.ranges(),
            specs.mask(by_rows=True),
        ],
        out_specs=specs.rows(plan.block_q),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(plan, d_head),
        interpret=plan.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, row_max, row_sum, delta, seeds, ranges, mask)


def _dkv(q, k, v, do, row_max, row_sum, delta, seeds, ranges, mask, plan: _Plan):
    """The `dk`/`dv` kernel over every (block of keys, sequence, head)."""
    batch, _, heads, d_head = q.shape
    specs = _Specs(plan, d_head)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, plan=plan),
        grid=(plan.k_blocks, batch, heads),
        in_specs=[
            specs.all_rows(plan.q_padded),
            specs.rows(plan.block_k),
            specs.rows(plan.block_k),
            specs.all_rows(plan.q_padded),
            *(specs.all_stats(),) * 3,
            specs.seeds(),
            specs.ranges(),
            specs.mask(by_rows=False),
        ],
        out_specs=[specs.rows(plan.block_k), specs.rows(plan.block_k)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(plan, d_head),
        interpret=plan.interpret,
        name="flash_attention_dkv",
    )(q, k, v, do, row_max, row_sum, delta, seeds, ranges, mask)


def _backward(plans, residuals, do):
    """`dq`, `dk`, `dv` from the forward's residuals: `delta = rowsum(do * o)` on XLA, then the
    `dq` kernel over blocks of queries and the `dk`/`dv` kernel over blocks of keys."""
    q, k, v, seeds, ranges, mask, o, row_max, row_sum = residuals
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    common = (q, k, v, do, row_max, row_sum, delta, seeds)
    dq = _dq(*common, ranges[1], mask, plans[1])
    dk, dv = _dkv(*common, ranges[2], mask, plans[2])
    return dq, dk, dv, None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, seeds, ranges, mask, plans) -> jax.Array:
    """`o` of the forward kernel; `ranges` and `plans` are the forward's, `dq`'s and `dkv`'s."""
    return _forward(q, k, v, seeds, ranges, mask, plans)[0]


def _flash_forward(q, k, v, seeds, ranges, mask, plans):
    o, row_max, row_sum = _forward(q, k, v, seeds, ranges, mask, plans)
    return o, (q, k, v, seeds, ranges, mask, o, row_max, row_sum)


_flash.defvjp(_flash_forward, _backward)


def _spans(visit: Bool[Array, "mask rows cols"], axis: int) -> Int[Array, "mask n 2"]:
    """For each block along the other axis of `visit` (query blocks x key blocks), the range
    `[first, last + 1)` of blocks along `axis` that it visits; `[0, 0)` where it visits none."""
    n = visit.shape[axis]
    seen = visit.any(axis)
    first = jnp.argmax(visit, axis)
    end = n - jnp.argmax(jnp.flip(visit, axis), axis)
    return jnp.stack([jnp.where(seen, first, 0), jnp.where(seen, end, 0)], -1).astype(jnp.int32)


def _visits(mask: Bool[Array, "mask q_padded kv_padded"], plan: _Plan) -> Bool[Array, "mask nq nk"]:
    """Which (block of queries, block of keys) a kernel computes: those with a visible key, and
    every block of a row of blocks that holds a query seeing no key at all (it sees every key)."""
    n = mask.shape[0]
    visit = mask.reshape(n, plan.q_blocks, plan.block_q, plan.k_blocks, plan.block_k).any(axis=(2, 4))
    blind_rows = ~mask[..., : plan.kv_seq].any(-1)
    return visit | blind_rows.reshape(n, plan.q_blocks, plan.block_q).any(-1)[..., None]


def _key_block_ranges(mask, plan: _Plan) -> Int[Array, "mask q_blocks 2"]:
    """For each block of queries, the range of blocks of keys that it sees."""
    if mask is None:
        return jnp.tile(jnp.array([0, plan.k_blocks], jnp.int32), (1, plan.q_blocks, 1))
    return _spans(_visits(mask, plan), 2)


def _query_block_ranges(mask, plan: _Plan) -> Int[Array, "mask k_blocks 2"]:
    """For each block of keys, the range of blocks of queries that see it."""
    if mask is None:
        return jnp.tile(jnp.array([0, plan.q_blocks], jnp.int32), (1, plan.k_blocks, 1))
    return _spans(_visits(mask, plan), 1)


def _block(requested: int, length: int) -> int:
    """A block of at most `requested` (a power of two) for `length` positions: no larger than
    the power of two that holds them, and at least Triton's 16."""
    if not isinstance(requested, int) or requested < _MIN_BLOCK or requested & (requested - 1):
        raise ValueError(
            f"flash_attention: a block must be a power of two >= {_MIN_BLOCK}, got {requested!r}"
        )
    return max(_MIN_BLOCK, min(requested, pl.next_power_of_2(length)))


def _plans(q, kv_seq: int, mask, rate: float, blocks: BlockSizes, interpret: bool) -> tuple[_Plan, ...]:
    """The forward's, `dq`'s and `dkv`'s plans: their blocks, and the sizes padded to whole
    blocks of all three (the blocks are powers of two, so the largest's multiple)."""
    seq, d_head = q.shape[1], q.shape[3]
    pairs = [(_block(bq, seq), _block(bk, kv_seq)) for bq, bk in (blocks.forward, blocks.dq, blocks.dkv)]
    q_block, k_block = max(bq for bq, _ in pairs), max(bk for _, bk in pairs)
    base = _Plan(
        block_q=q_block,
        block_k=k_block,
        q_padded=-(-seq // q_block) * q_block,
        kv_padded=-(-kv_seq // k_block) * k_block,
        kv_seq=kv_seq,
        scale=1.0 / math.sqrt(d_head),
        rate=float(rate),
        has_mask=mask is not None,
        mask_batched=mask is not None and mask.ndim == 3 and mask.shape[0] > 1,
        interpret=interpret,
    )
    return tuple(dataclasses.replace(base, block_q=bq, block_k=bk) for bq, bk in pairs)


def _pad_to(x, sizes: dict[int, int], mode: str = "constant"):
    """`x` padded at the end of each axis in `sizes` to that size."""
    widths = [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)]
    return jnp.pad(x, widths, mode=mode) if any(w for _, w in widths) else x


def _check_call(q, k, mask, rate, seeds) -> None:
    """Refuse, in one line, what the kernels cannot take."""
    check_rate(rate, "flash_attention")
    if rate > 0 and seeds is None:
        raise ValueError(
            f"flash_attention at rate {rate} needs seeds=, two uint32 words per sequence (sequence_seeds)"
        )
    if mask is not None and mask.ndim == 3 and mask.shape[0] not in (1, q.shape[0]):
        raise ValueError(
            f"flash_attention: a mask per sequence needs {q.shape[0]} of them, got {mask.shape[0]}"
        )
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"flash_attention: q has {q.shape[0]} sequences and k {k.shape[0]}; pass as many")


@typechecked
def flash_attention(
    q: Float[Array, "batch seq heads d_head"],
    k: Float[Array, "batch kv_seq heads d_head"],
    v: Float[Array, "batch kv_seq heads d_head"],
    mask: Bool[Array, "seq kv_seq"] | Bool[Array, "_ seq kv_seq"] | None = None,
    *,
    rate: float = 0.0,
    seeds: UInt[Array, "batch 2"] | None = None,
    blocks: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> Float[Array, "batch seq heads d_head"]:
    """Every head's `dropout(attention_weights(q, k, mask)) @ v`, in fused kernels (differentiable).

    `mask[..., i, j]` True lets query `i` see key `j`: `(seq, kv_seq)` for every sequence or
    `(batch, seq, kv_seq)`; None lets every query see every key. At `rate > 0` the weights are
    dropped out with the mask `dropout_keep` draws from each sequence's `seeds` (two uint32 words,
    `sequence_seeds(key, (batch,))`), the survivors scaled by `1 / keep_probability(rate)`.
    `blocks` are the queries x keys each kernel's program holds (`BlockSizes`); `interpret` runs
    the kernels in Pallas's interpret mode (by default, on any backend but a GPU). The result has
    `q`'s dtype, computed in float32 within.
    """
    _check_call(q, k, mask, rate, seeds)
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    batch, seq, _, d_head = q.shape
    kv_seq = k.shape[1]
    plans = _plans(q, kv_seq, mask, rate, blocks, interpret)
    q_padded, kv_padded = plans[0].q_padded, plans[0].kv_padded
    d_padded = max(_MIN_BLOCK, pl.next_power_of_2(d_head))
    q_p = _pad_to(q, {1: q_padded, 3: d_padded})
    k_p, v_p = (_pad_to(a, {1: kv_padded, 3: d_padded}) for a in (k, v))
    if mask is not None:
        mask = mask.reshape(-1, seq, kv_seq)
        # Padding's query rows repeat the last row (no block visited in vain); its keys are hidden.
        mask = _pad_to(_pad_to(mask, {1: q_padded}, "edge"), {2: kv_padded})
    ranges = (
        _key_block_ranges(mask, plans[0]),
        _key_block_ranges(mask, plans[1]),
        _query_block_ranges(mask, plans[2]),
    )
    mask8 = None if mask is None else mask.astype(jnp.int8)
    seeds = jnp.zeros((batch, 2), jnp.uint32) if seeds is None else seeds.astype(jnp.uint32)
    out: jax.Array = _flash(q_p, k_p, v_p, seeds, ranges, mask8, plans)  # pyright: ignore[reportAssignmentType]
    return out[:, :seq, :, :d_head]


def flash_multi_head_attention(
    q: Float[Array, "*batch q_seq heads d_head"],
    k: Float[Array, "*batch kv_seq heads d_head"],
    v: Float[Array, "*batch kv_seq heads d_head"],
    mask: Bool[Array, "..."] | None,
    rate: float = 0.0,
    key: PRNGKeyArray | None = None,
) -> Float[Array, "*batch q_seq heads*d_head"]:
    """`multi_head_attention`'s output from `flash_attention`, taking what it takes: `mask`
    `(q_seq, kv_seq)` or `(*batch, q_seq, kv_seq)`, `key` one key or one per sequence (`*batch`).
    The dropout mask differs from `multi_head_attention`'s (the kernel's hash, not Threefry), with
    the same keep probability."""
    batch, (q_seq, heads, d_head) = q.shape[:-3], q.shape[-3:]
    q1, k1, v1 = (a.reshape(-1, *a.shape[-3:]) for a in (q, k, v))
    if mask is not None and mask.ndim > 2:
        mask = mask.reshape(-1, *mask.shape[-2:])
    seeds = None
    if rate > 0:
        if key is None:
            raise ValueError(f"flash_multi_head_attention at rate {rate} needs key=")
        seeds = sequence_seeds(key, batch).reshape(-1, 2)
    out = flash_attention(q1, k1, v1, mask, rate=rate, seeds=seeds)
    return out.reshape(*batch, q_seq, heads * d_head)


def flash_attention_available(dtype, d_head: int) -> bool:
    """Whether attention takes the fused kernels: on a GPU, where they compiled, ran and matched
    the XLA path for this dtype and head size (tried once per process on a tiny causal call with
    dropout, forward and backward; a failure is warned of once, and attention keeps its `vmap`
    path)."""
    if jax.default_backend() != "gpu":
        return False
    return _kernel_works(jnp.dtype(dtype).name, d_head)


@functools.cache
def _kernel_works(dtype_name: str, d_head: int, interpret: bool | None = None) -> bool:
    """Whether the kernels at their default blocks give the XLA path's output and gradients
    (within the dtype's rounding) on two blocks of a causal sequence; a failure warned of once."""
    # In a thread of its own: JAX's trace state is per thread, so the trial runs eagerly even when
    # attention asks while JAX traces a model (in this thread it would be traced into the model).
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reason = pool.submit(_kernel_failure, dtype_name, d_head, interpret).result()
    if reason is None:
        return True
    warnings.warn(
        f"the fused attention kernels failed on this GPU ({dtype_name}, d_head {d_head}): {reason}; "
        f"attention with dropout keeps the per-head path",
        stacklevel=3,
    )
    return False


def _kernel_failure(dtype_name: str, d_head: int, interpret: bool | None) -> str | None:
    """Why the kernels fail the trial of `_kernel_works` (None: they pass)."""
    q, k, v, cotangent = jax.random.normal(jax.random.key(0), (4, 1, 128, 2, d_head), jnp.float32)
    q, k, v = (a.astype(dtype_name) for a in (q, k, v))
    mask, seeds = jnp.tril(jnp.ones((128, 128), bool)), jnp.ones((1, 2), jnp.uint32)

    def output_and_grads(attend):
        def loss(q, k, v):
            out = attend(q, k, v, mask, rate=0.5, seeds=seeds)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [a.astype(jnp.float32) for a in (out, *grads)]

    try:  # at exact products on both sides: the trial is of the kernels' arithmetic, not TF32's
        with jax.default_matmul_precision("highest"):
            got = output_and_grads(functools.partial(flash_attention, interpret=interpret))
            want = output_and_grads(reference_attention)
    except Exception as failure:  # any failure to lower or run: the vmap path still works
        return (str(failure).strip().splitlines() or [type(failure).__name__])[0]
    error = max(
        float(jnp.abs(a - b).max() / jnp.maximum(1.0, jnp.abs(b).max()))
        for a, b in zip(got, want, strict=True)
    )
    if error > (1e-4 if dtype_name == "float32" else 5e-2):
        return f"its results differ from the XLA path's by {error:.3g} (relative)"
    return None
