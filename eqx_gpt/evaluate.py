"""The loss of a model on a whole text, every position predicted once.

A model sees at most `context_length` tokens, so a long text is cut into windows. With
`stride == context_length` they do not overlap: cheap, but the first positions of each window
are predicted from little context. With a smaller stride (`final` evaluations use
`context_length // 2`) the windows overlap and each counts only the targets that no earlier
window counted, so every target after the first `context_length` is predicted from at least
`context_length - stride` tokens. Either way every token but the first (which nothing precedes)
is a target exactly once, so the mean is over `len(tokens) - 1` predictions.
"""

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from eqx_gpt.gpt import GPT

WINDOWS_PER_BATCH = 32


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
def _summed_losses(
    model: GPT, tokens: Int[Array, "n_batches batch window"], counted: Float[Array, "n_batches batch seq"]
) -> Float[Array, ""]:
    def one_batch(xs):
        batch, weight = xs
        logits = model(batch[:, :-1])
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
        return jnp.sum(losses * weight)

    return jax.lax.map(one_batch, (tokens, counted)).sum()


def evaluate(
    model: GPT, tokens, *, stride: int | None = None, place=lambda x: x, batch: int = WINDOWS_PER_BATCH
) -> Evaluation:
    """Mean next-token loss of `model` over all of `tokens` `(n,)` (no dropout), in windows of
    `context_length` started every `stride` tokens (default `context_length // 2`; see the module
    docstring). Runs in batches of `batch` windows, in one jitted call; `place` puts the stacked
    batches `(n_batches, batch, ...)` on devices (the trainer splits axis 1 over them)."""
    context = model.config.context_length
    stride = max(1, context // 2) if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= context:
        raise ValueError(f"stride must be an integer in [1, context_length={context}], got {stride!r}")
    ids = np.asarray(tokens, np.int32).reshape(-1)
    starts, counted = windows(len(ids), context, stride)
    n_batches = -(-len(starts) // batch)
    padded_ids = np.concatenate([ids, np.zeros(context + 1, np.int32)])
    grid = np.zeros((n_batches * batch, context + 1), np.int32)
    grid[: len(starts)] = padded_ids[starts[:, None] + np.arange(context + 1)]
    weight = np.zeros((n_batches * batch, context), np.float32)
    weight[: len(starts)] = counted
    shape = (n_batches, batch)
    total = _summed_losses(model, place(grid.reshape(*shape, -1)), place(weight.reshape(*shape, -1)))
    n = int(counted.sum())
    return Evaluation(float(total) / n, n, stride)


def evaluate_text(model: GPT, tokenizer, text: str, *, stride: int | None = None) -> Evaluation:
    """`evaluate` on `text` encoded by `tokenizer` (a `TokenizerError` names unknown characters)."""
    return evaluate(model, tokenizer.encode(text), stride=stride)
