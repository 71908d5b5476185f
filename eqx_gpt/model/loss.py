"""The next-token loss of a GPT, and a cross-entropy that never holds every logit at once.

With a large vocabulary the logits dwarf everything else a step holds: GPT-2's 50,304 (padded) ids
over a batch of 3,072 tokens are 155M float32 values, 618 MB, and the plain loss writes several
such buffers (the logits, their float32 copy, the softmax, its gradient), each mapped and
zero-filled afresh by every call. `chunked_cross_entropy` takes the final hidden states and the
head instead, and scans over blocks of the head's columns, each block's logits small enough to
stay in the CPU's cache:
- a first pass keeps each token's running maximum and sum of exponentials (an online
  log-sum-exp); each target's logit is its column of the head times the token's features;
- under differentiation, a second pass computes each block's logits again, and from them the
  block's share of `d features` (summed over blocks, `tokens x d_model`) and its own columns of
  `d head`, each written once.

Blocks of columns rather than of tokens: a block of tokens needs the whole `d head` (`d_model x
vocab`, 26 MB at GPT-2's size) read and written again for every block, which costs more on a CPU
than the second pass's extra matrix multiply (`bench/bpe_step.py`).

`next_token_loss` chooses (`chunks_pay`): the plain loss (`model(inputs)`, then optax's
cross-entropy) while the logits of one call are small (`LOGITS_AT_ONCE`), the chunked one past
that; but a gradient through a wide head (GPT-2-124M's 768) stays plain up to 512 MiB of logits,
since the second pass's matrix multiply costs it more than it saves. The character models'
losses, training's and evaluation's, are thus computed exactly as before. A GPU has bounds of its
own (`GPU_LIMITS`): far more memory, no cache to fit.
"""

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.language_model import LanguageModel

LOGITS_AT_ONCE = 1 << 22  # a loss over more logits than this (16 MiB of float32) is chunked
BLOCK_LOGITS = 1 << 20  # logits per block, about (4 MiB of float32): a block stays in the cache
MIN_BLOCK = 128  # columns per block at least: narrower makes each matrix multiply inefficient
RECOMPUTE_MAX_WIDTH = 256  # a gradient at a wider head is chunked only past the next bound
GRADIENT_LOGITS_AT_ONCE = 1 << 27  # 512 MiB of float32 logits


@dataclass(frozen=True)
class ChunkLimits:
    """When a loss is chunked, and how wide its blocks are, on one kind of device."""

    logits_at_once: int  # a loss over more logits than this is chunked
    gradient_logits_at_once: int  # the same, for a gradient through a head wider than RECOMPUTE_MAX_WIDTH
    block_logits: int  # logits per block


CPU_LIMITS = ChunkLimits(LOGITS_AT_ONCE, GRADIENT_LOGITS_AT_ONCE, BLOCK_LOGITS)
# A GPU holds tens of GB and reads them at terabytes a second, and it has no cache for a block to
# stay in: the CPU's bounds made GPT-2-124M's loss over 8 x 1,024 tokens 393 scan steps of narrow
# products, half of its training step on an H200 (bench/gpu_check.sh's profile). There, a loss is
# plain up to 4 GiB of float32 logits (8 x 1,024 and 16 x 1,024 tokens of GPT-2), and past that its
# blocks hold 256 MiB of logits each.
GPU_LIMITS = ChunkLimits(1 << 28, 1 << 30, 1 << 26)


def chunk_limits() -> ChunkLimits:
    """The bounds for JAX's default backend: `GPU_LIMITS` on a GPU, else `CPU_LIMITS`."""
    return GPU_LIMITS if jax.default_backend() == "gpu" else CPU_LIMITS


def default_block(n_tokens: int, padded_vocab: int, limits: ChunkLimits | None = None) -> int:
    """Columns per block for a loss over `n_tokens` with a head of `padded_vocab` columns: about
    `limits.block_logits` logits (default `chunk_limits()`; on a CPU 340 columns for 3,072 tokens
    and GPT-2's 50,304), at least `MIN_BLOCK`, at most the whole head."""
    limits = chunk_limits() if limits is None else limits
    return min(padded_vocab, max(MIN_BLOCK, limits.block_logits // max(1, n_tokens)))


def chunked_cross_entropy(
    features: Float[Array, "*rows d_model"],
    head: Float[Array, "d_model padded_vocab"],
    targets: Int[Array, "*rows"],
    weight: Float[Array, "*rows"] | None = None,
    *,
    vocab_size: int | None = None,
    logit_softcap: float | None = None,
    block: int | None = None,
) -> Float[Array, ""]:
    """`sum(weight * cross_entropy(logits, targets))` with `logits = features @ head` (cast to
    float32, then `logit_softcap * tanh(logits / logit_softcap)` if set), computed `block` columns
    of the head at a time (default `default_block`): the `[tokens, vocab]` logits are never held
    whole.

    Columns from `vocab_size` on (the padding of `GPTConfig.padded_vocab_size`) are not ids: they
    take no probability, as when `GPT.__call__` slices them off. `weight` defaults to ones (the
    summed loss; divide by the count for the mean). Differentiable in `features` and `head` (not
    in `weight`): the gradient is formed in the forward pass, block by block, so the backward pass
    only scales it. The matrix multiplies run in `features`' dtype, as `GPT.logits`' do.
    """
    d_model, padded_vocab = head.shape
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    if not 1 <= vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size must be in [1, {padded_vocab}] (the head's columns), got {vocab_size}")
    if features.shape[-1] != d_model or features.shape[:-1] != targets.shape:
        raise ValueError(
            f"features {features.shape} and targets {targets.shape} do not fit a head {head.shape}: "
            f"features must be targets' shape plus ({d_model},)"
        )
    n = targets.size
    block = default_block(n, padded_vocab) if block is None else min(block, padded_vocab)
    n_blocks = -(-padded_vocab // block)
    block = -(-padded_vocab // n_blocks)  # as even as the count of blocks allows: least padding
    weight = jnp.ones(targets.shape, jnp.float32) if weight is None else weight.astype(jnp.float32)
    # The head's columns as rows, `(n_blocks, block, d_model)`, the added ones padding past vocab_size.
    heads = jnp.pad(head.T, ((0, n_blocks * block - padded_vocab), (0, 0))).reshape(n_blocks, block, d_model)
    x, t, w = features.reshape(n, d_model), targets.reshape(n), weight.reshape(n)
    return _chunked(x, heads, t, w, vocab_size, logit_softcap)


# Each block's logits are held transposed, `(block, tokens)`: XLA's CPU code reduces over the
# leading axis (each token's maximum and sum) about 3x faster than over the trailing one.


def _block_logits(x, head, first: Array, vocab_size: int, softcap: float | None):
    """The float32 logits `(block, tokens)` of the block of columns starting at `first` (`head`:
    `(block, d_model)`), the padding columns at -inf, and the softcap's `tanh` (None without
    one) for its derivative."""
    z = (head.astype(x.dtype) @ x.T).astype(jnp.float32)
    if softcap is None:
        capped, tanh = z, None
    else:
        tanh = jnp.tanh(z / softcap)
        capped = softcap * tanh
    real = first + jnp.arange(head.shape[0]) < vocab_size
    return jnp.where(real[:, None], capped, -jnp.inf), tanh


def _log_sum_exp_and_target(x, heads, targets, vocab_size: int, softcap: float | None):
    """Each token's `logsumexp(logits)`, one block of columns at a time (a running maximum, and
    the sum of exponentials rescaled whenever the maximum grows), and its `logits[target]`."""

    def body(carry, xs):
        high, total = carry
        head, first = xs
        z, _ = _block_logits(x, head, first, vocab_size, softcap)
        new_high = jnp.maximum(high, z.max(axis=0))  # finite from the first block on: it holds id 0
        total = total * jnp.exp(high - new_high) + jnp.exp(z - new_high).sum(axis=0)
        return (new_high, total), None

    n, block = targets.shape[0], heads.shape[1]
    firsts = jnp.arange(heads.shape[0]) * block
    start = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)))
    (high, total), _ = jax.lax.scan(body, start, (heads, firsts))
    # Each target's column of the head, picked out: `tokens x d_model` products, not a block's.
    columns = heads.reshape(-1, heads.shape[2])[targets].astype(x.dtype)
    target = jnp.sum(x * columns, axis=-1, dtype=jnp.float32)
    if softcap is not None:
        target = softcap * jnp.tanh(target / softcap)
    return high + jnp.log(total), target


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(x, heads, targets, weight, vocab_size: int, softcap: float | None):
    """The weighted loss over blocks of columns `heads: (n_blocks, block, d_model)` (no gradient
    formed: one pass)."""
    lse, target = _log_sum_exp_and_target(x, heads, targets, vocab_size, softcap)
    return jnp.sum((lse - target) * weight)


def _chunked_fwd(x, heads, targets, weight, vocab_size: int, softcap: float | None):
    """The loss and its gradient: the first pass's log-sum-exp, then per block `d logits =
    (softmax - one_hot) * weight` (through the softcap's `1 - tanh^2`), `d x += d logits @
    head.T` (float32) and the block's `d head = x.T @ d logits`."""
    lse, target = _log_sum_exp_and_target(x, heads, targets, vocab_size, softcap)
    block = heads.shape[1]

    def body(d_x, xs):
        head, first = xs
        logits, tanh = _block_logits(x, head, first, vocab_size, softcap)
        one_hot = (first + jnp.arange(block))[:, None] == targets
        d_logits = (jnp.exp(logits - lse) - one_hot) * weight
        d_z = (d_logits if tanh is None else d_logits * (1 - tanh * tanh)).astype(x.dtype)
        d_x = d_x + (d_z.T @ head.astype(x.dtype)).astype(jnp.float32)
        return d_x, (d_z @ x).astype(heads.dtype)

    firsts = jnp.arange(heads.shape[0]) * block
    d_x, d_heads = jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), (heads, firsts))
    return jnp.sum((lse - target) * weight), (d_x.astype(x.dtype), d_heads)


def _chunked_bwd(vocab_size, softcap, residuals, g):
    d_x, d_heads = residuals
    return (g * d_x).astype(d_x.dtype), (g * d_heads).astype(d_heads.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunks_pay(
    n_tokens: int,
    padded_vocab: int,
    d_model: int = 0,
    *,
    gradient: bool = False,
    limits: ChunkLimits | None = None,
) -> bool:
    """Whether a loss over `n_tokens` is chunked: when its logits would exceed
    `limits.logits_at_once` (default `chunk_limits()`); but under differentiation (`gradient`) at a
    head wider than `RECOMPUTE_MAX_WIDTH`, only past `limits.gradient_logits_at_once`, because there
    the second pass's matrix multiply costs more than the memory traffic it saves (GPT-2-124M's step
    on 4 x 256 tokens: 7.8 s plain, 9.2 s chunked, on a 2-core AVX2 EPYC)."""
    limits = chunk_limits() if limits is None else limits
    logits = n_tokens * padded_vocab
    if gradient and d_model > RECOMPUTE_MAX_WIDTH:
        return logits > limits.gradient_logits_at_once
    return logits > limits.logits_at_once


def next_token_loss(
    model: LanguageModel,
    inputs: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    weight: Float[Array, "batch seq"] | None = None,
    *,
    key: Key[Array, " batch"] | None = None,
    gradient: bool = False,
) -> Float[Array, ""]:
    """The mean cross-entropy (nats) of `model` predicting `targets` from `inputs`, or with `weight`
    the weighted sum `sum(weight * loss)`. `key` (one per sequence) turns dropout on; `gradient`
    says the loss will be differentiated (training), which changes only how it is computed.

    Plain (`model(inputs)`, then optax's cross-entropy) while `chunks_pay` is false, as for every
    character vocabulary at the presets' batch sizes, and for every model but a `GPT`; else
    `chunked_cross_entropy` on `model.features(inputs)`, equal to float rounding."""
    if not isinstance(model, GPT) or not chunks_pay(
        targets.size, model.config.padded_vocab_size, model.config.d_model, gradient=gradient
    ):
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(model(inputs, key=key), targets)
        return losses.mean() if weight is None else jnp.sum(losses * weight)
    c = model.config
    total = chunked_cross_entropy(
        model.features(inputs, key=key), model.head_weight, targets, weight,
        vocab_size=c.vocab_size, logit_softcap=c.logit_softcap,
    )  # fmt: skip
    return total / targets.size if weight is None else total
