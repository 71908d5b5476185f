"""The next-token loss of a GPT, and a cross-entropy that never holds every logit at once.

With a large vocabulary the logits dwarf everything else a step holds: GPT-2's 50,304 (padded) ids
over a batch of 3,072 tokens are 155M float32 values, 618 MB, and the plain loss writes several
such buffers (the logits, their float32 copy, the softmax, its gradient). `chunked_cross_entropy`
takes the final hidden states and the head instead, and scans over chunks of tokens: each chunk's
logits, log-sum-exp and target logit, and (under differentiation) at once the chunk's gradient,
so memory is bounded by one chunk's logits and nothing is recomputed in the backward pass.

`next_token_loss` chooses: the plain loss (`model(inputs)`, then optax's cross-entropy) while the
logits of one call are small (`LOGITS_AT_ONCE`), the chunked one past that. The character models'
losses, training's and evaluation's, are thus computed exactly as before.
"""

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Key

from eqx_gpt.model.gpt import GPT

LOGITS_AT_ONCE = 1 << 22  # a loss over more logits than this (16 MiB of float32) is chunked
CHUNK_LOGITS = 1 << 24  # logits per chunk, at most (64 MiB of float32), rounded to whole tokens
MIN_CHUNK = 16  # tokens per chunk at least: fewer makes each chunk's matrix multiplies inefficient


def default_chunk(padded_vocab: int) -> int:
    """Tokens per chunk for a head of `padded_vocab` columns: the largest power of two whose logits
    fit `CHUNK_LOGITS` (256 for GPT-2's 50,304), at least `MIN_CHUNK`."""
    tokens = max(MIN_CHUNK, CHUNK_LOGITS // padded_vocab)
    return 1 << (tokens.bit_length() - 1)


def chunked_cross_entropy(
    features: Float[Array, "*rows d_model"],
    head: Float[Array, "d_model padded_vocab"],
    targets: Int[Array, "*rows"],
    weight: Float[Array, "*rows"] | None = None,
    *,
    vocab_size: int | None = None,
    logit_softcap: float | None = None,
    chunk: int | None = None,
) -> Float[Array, ""]:
    """`sum(weight * cross_entropy(logits, targets))` with `logits = features @ head` (cast to
    float32, then `logit_softcap * tanh(logits / logit_softcap)` if set), computed `chunk` tokens
    at a time (default `default_chunk`): the `[tokens, vocab]` logits are never held whole.

    Columns from `vocab_size` on (the padding of `GPTConfig.padded_vocab_size`) are not ids: they
    take no probability, as when `GPT.__call__` slices them off. `weight` defaults to ones (the
    summed loss; divide by the count for the mean). Differentiable in `features` and `head` (not
    in `weight`): the gradient is formed in the forward pass, chunk by chunk, so the backward pass
    only scales it. The matrix multiplies run in `features`' dtype, as `GPT.logits`' do.
    """
    d_model, padded_vocab = head.shape
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    chunk = default_chunk(padded_vocab) if chunk is None else chunk
    if not 1 <= vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size must be in [1, {padded_vocab}] (the head's columns), got {vocab_size}")
    if features.shape[-1] != d_model or features.shape[:-1] != targets.shape:
        raise ValueError(
            f"features {features.shape} and targets {targets.shape} do not fit a head {head.shape}: "
            f"features must be targets' shape plus ({d_model},)"
        )
    weight = jnp.ones(targets.shape, jnp.float32) if weight is None else weight.astype(jnp.float32)
    n = targets.size
    chunk = -(-n // -(-n // chunk))  # as even as the count of chunks allows: least padding
    pad = -n % chunk
    x = jnp.pad(features.reshape(n, d_model), ((0, pad), (0, 0))).reshape(-1, chunk, d_model)
    t = jnp.pad(targets.reshape(n), (0, pad)).reshape(-1, chunk)
    w = jnp.pad(weight.reshape(n), (0, pad)).reshape(-1, chunk)  # padded rows weigh 0
    return _chunked(x, head, t, w, vocab_size, logit_softcap)


def _chunk_logits(x, head, vocab_size: int, softcap: float | None):
    """One chunk's float32 logits `(chunk, padded_vocab)`, the padding columns at -inf, and the
    softcap's `tanh` (None without one) for its derivative."""
    z = (x @ head.astype(x.dtype)).astype(jnp.float32)
    if softcap is None:
        capped, tanh = z, None
    else:
        tanh = jnp.tanh(z / softcap)
        capped = softcap * tanh
    real = jnp.arange(head.shape[1]) < vocab_size
    return jnp.where(real, capped, -jnp.inf), tanh


def _chunk_losses(logits, targets):
    """Each row's `logsumexp(logits) - logits[target]`, and the log-sum-exp."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0], lse


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(x, head, targets, weight, vocab_size: int, softcap: float | None):
    """The weighted loss summed over chunks `x: (n_chunks, chunk, d_model)` (no gradient formed)."""

    def body(total, xs):
        x_c, t_c, w_c = xs
        losses, _ = _chunk_losses(_chunk_logits(x_c, head, vocab_size, softcap)[0], t_c)
        return total + jnp.sum(losses * w_c), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (x, targets, weight))
    return total


def _chunked_fwd(x, head, targets, weight, vocab_size: int, softcap: float | None):
    """The loss and its gradient in one pass: per chunk, `d logits = (softmax - one_hot) * weight`
    (through the softcap's `1 - tanh^2`), then `d x = d logits @ head.T` and `d head += x.T @ d
    logits`, accumulated in float32."""

    def body(carry, xs):
        total, d_head = carry
        x_c, t_c, w_c = xs
        logits, tanh = _chunk_logits(x_c, head, vocab_size, softcap)
        losses, lse = _chunk_losses(logits, t_c)
        one_hot = jnp.arange(logits.shape[1]) == t_c[:, None]
        d_logits = (jnp.exp(logits - lse[:, None]) - one_hot) * w_c[:, None]
        d_z = (d_logits if tanh is None else d_logits * (1 - tanh * tanh)).astype(x_c.dtype)
        d_x = d_z @ head.astype(x_c.dtype).T
        d_head = d_head + (x_c.T @ d_z).astype(jnp.float32)
        return (total + jnp.sum(losses * w_c), d_head), d_x

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros(head.shape, jnp.float32))
    (total, d_head), d_x = jax.lax.scan(body, zeros, (x, targets, weight))
    return total, (d_x, d_head.astype(head.dtype))


def _chunked_bwd(vocab_size, softcap, residuals, g):
    d_x, d_head = residuals
    return (g * d_x).astype(d_x.dtype), (g * d_head).astype(d_head.dtype), None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunks_pay(n_tokens: int, padded_vocab: int) -> bool:
    """Whether a loss over `n_tokens` is chunked: when its logits would exceed `LOGITS_AT_ONCE`."""
    return n_tokens * padded_vocab > LOGITS_AT_ONCE


def next_token_loss(
    model: GPT,
    inputs: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    weight: Float[Array, "batch seq"] | None = None,
    *,
    key: Key[Array, " batch"] | None = None,
) -> Float[Array, ""]:
    """The mean cross-entropy (nats) of `model` predicting `targets` from `inputs`, or with `weight`
    the weighted sum `sum(weight * loss)`. `key` (one per sequence) turns dropout on.

    Plain (`model(inputs)`, then optax's cross-entropy) while `chunks_pay` is false, as for every
    character vocabulary at the presets' batch sizes; else `chunked_cross_entropy` on
    `model.features(inputs)`, equal to float rounding."""
    if not chunks_pay(targets.size, model.config.padded_vocab_size):
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(model(inputs, key=key), targets)
        return losses.mean() if weight is None else jnp.sum(losses * weight)
    c = model.config
    total = chunked_cross_entropy(
        model.features(inputs, key=key), model.head_weight, targets, weight,
        vocab_size=c.vocab_size, logit_softcap=c.logit_softcap,
    )  # fmt: skip
    return total / targets.size if weight is None else total
