"""The loss of a model on a whole text, every position predicted once.

A model sees at most `context_length` tokens, so a long text is cut into windows. With
`stride == context_length` they do not overlap: cheap, but the first positions of each window
are predicted from little context. With a smaller stride (`final` evaluations use
`context_length // 2`) the windows overlap and each counts only the targets that no earlier
window counted, so every target after the first `context_length` is predicted from at least
`context_length - stride` tokens. Either way every token but the first (which nothing precedes)
is a target exactly once, so the mean is over `len(tokens) - 1` predictions.
"""

from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from eqx_gpt._checks import is_whole
from eqx_gpt.model.gpt import GPT

TOKENS_PER_CALL = 4096  # windows per call: this many tokens' worth, so one call is short anywhere


def windows_per_call(context: int) -> int:
    """Windows evaluated per call: about `TOKENS_PER_CALL` tokens, at least one window. Why: an
    evaluation is a loop of calls, and a stop (Ctrl-C, SIGTERM) waits for the call in flight: at
    4,096 tokens that is milliseconds for the default model and about a second or two for the
    6-layer preset's on a slow 2-core CPU."""
    return max(1, TOKENS_PER_CALL // context)


@dataclass(frozen=True)
class Evaluation:
    loss: float  # mean cross-entropy in nats per predicted token
    n_predicted: int  # tokens predicted: len(tokens) - 1
    stride: int  # tokens between window starts


def windows(n_tokens: int, context: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """`(starts, counted)`: window `w` holds tokens `starts[w] : starts[w] + context + 1` and counts
    the loss of its target `j` (token `starts[w] + 1 + j`) where `counted[w, j]`."""
    if n_tokens < 2:
        raise ValueError(f"evaluation needs at least 2 tokens (one to predict from), got {n_tokens}")
    last_start = max(0, n_tokens - 1 - context)  # the window that ends at the last token
    starts = list(range(0, last_start, stride)) + [last_start]
    counted = np.zeros((len(starts), context), bool)
    covered = 0  # targets 1 .. covered are counted already
    for w, s in enumerate(starts):
        end = min(s + context, n_tokens - 1)  # the last target this window predicts
        counted[w, max(covered, s) - s : end - s] = True
        covered = end
    return np.asarray(starts), counted


@eqx.filter_jit
def _summed_loss(
    model: GPT, batch: Int[Array, "batch window"], weight: Float[Array, "batch seq"]
) -> Float[Array, ""]:
    logits = model(batch[:, :-1])
    losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
    return jnp.sum(losses * weight)


def summed_loss(
    model: GPT,
    rows: Int[np.ndarray, "n window"],
    weight: Float[np.ndarray, "n seq"],
    *,
    batch: int,
    place=lambda x: x,
    stop: Callable[[], bool] = lambda: False,
) -> float | None:
    """`sum(weight * loss)` over the windows `rows` (no dropout), `batch` rows per jitted call
    (the last call padded with zero weight, so every call has one shape). Returns None as soon as
    `stop()` is true between calls. One call is kept in flight while the next is dispatched."""
    n_calls = -(-len(rows) // batch)
    padded_rows = np.zeros((n_calls * batch, rows.shape[1]), np.int32)
    padded_rows[: len(rows)] = rows
    padded_weight = np.zeros((n_calls * batch, weight.shape[1]), np.float32)
    padded_weight[: len(weight)] = weight
    total, in_flight = 0.0, None
    for i in range(n_calls):
        if stop():
            return None
        part = slice(i * batch, (i + 1) * batch)
        result = _summed_loss(model, place(padded_rows[part]), place(padded_weight[part]))
        total += 0.0 if in_flight is None else float(in_flight)
        in_flight = result
    return total + float(in_flight)


def evaluate(
    model: GPT,
    tokens,
    *,
    stride: int | None = None,
    place=lambda x: x,
    batch: int | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> Evaluation | None:
    """Mean next-token loss of `model` over all of `tokens` `(n,)` (no dropout), in windows of
    `context_length` started every `stride` tokens (default `context_length // 2`; see the module
    docstring). Runs `batch` windows per jitted call (default `windows_per_call(context_length)`);
    `place` puts each call's `(batch, ...)` arrays on devices. Returns None if `stop()` turns true
    between calls (an interrupted run does not wait for the whole split)."""
    context = model.config.context_length
    stride = max(1, context // 2) if stride is None else stride
    if not is_whole(stride, 1, context):
        raise ValueError(f"stride must be an integer in [1, context_length={context}], got {stride!r}")
    ids = np.asarray(tokens, np.int32).reshape(-1)
    starts, counted = windows(len(ids), context, stride)
    padded_ids = np.concatenate([ids, np.zeros(context + 1, np.int32)])
    rows = padded_ids[starts[:, None] + np.arange(context + 1)]
    batch = windows_per_call(context) if batch is None else batch
    total = summed_loss(model, rows, counted.astype(np.float32), batch=batch, place=place, stop=stop)
    if total is None:
        return None
    n = int(counted.sum())
    return Evaluation(total / n, n, stride)


def evaluate_text(model: GPT, tokenizer, text: str, *, stride: int | None = None) -> Evaluation:
    """`evaluate` on `text` encoded by `tokenizer` (a `TokenizerError` names unknown characters)."""
    return evaluate(model, tokenizer.encode(text), stride=stride)
