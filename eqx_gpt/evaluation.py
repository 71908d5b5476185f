"""The loss of a model on a text: over the whole of it, every position predicted once, or over a
fixed sample of its windows within a token budget.

A model sees at most `context_length` tokens, so a long text is cut into windows. With
`stride == context_length` they do not overlap: cheap, but the first positions of each window
are predicted from little context. With a smaller stride (`final` evaluations use
`context_length // 2`) the windows overlap and each counts only the targets that no earlier
window counted, so every target after the first `context_length` is predicted from at least
`context_length - stride` tokens. Either way every token but the first (which nothing precedes)
is a target exactly once, so the mean is over `len(tokens) - 1` predictions (`plan_whole`).

Which windows an evaluation reads, and which of their targets it counts, is an `EvalPlan`. A split
larger than the budget is sampled instead (`plan_sample`): windows spread evenly over it, the same
at every evaluation, each counting all its targets. The periodic evaluations of a run read
`periodic_plan`, the final one `final_plan`: a bounded cost whatever the corpus size.

The model is evaluated in inference mode (`eqx.nn.inference_mode`): no dropout, whatever it was
built with. Given a `Shown` (a progress bar and a label), an evaluation that takes more than a
moment shows its windows done and an ETA there; a quick one adds no line to a log.
"""

from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from typing import Protocol

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float, Int

from eqx_gpt._checks import INT32_MAX, is_whole
from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.errors import DataError
from eqx_gpt.model.language_model import LanguageModel, check_language_model
from eqx_gpt.model.loss import next_token_loss
from eqx_gpt.tokenizer import Tokenizer

TOKENS_PER_CALL = 4096  # windows per call: this many tokens' worth, so one call is short anywhere
LOGITS_PER_CALL = 1 << 27  # and at most this many logits' work, for large vocabularies
FINAL_EVAL_FACTOR = 4  # the final validation reads up to this many times the periodic budget
# Seconds of evaluating before its progress shows: on a terminal a moment, in a log (off a terminal,
# where each update is a line) long enough that a quick evaluation adds none.
SHOW_AFTER_TTY = 1.0
SHOW_AFTER_LOG = 10.0


class Bar(Protocol):
    """A progress line (`eqx_gpt.training.report.Progress`): `update(text)` shows `text` in place
    (on a terminal) or as a line now and then (off one, `tty` False); `clear()` removes it."""

    tty: bool

    def update(self, text: str) -> None: ...

    def clear(self) -> None: ...


@dataclass(frozen=True)
class Shown:
    """Where an evaluation shows its progress: on `bar`, each line starting with `label`."""

    bar: Bar
    label: str = "evaluating"


def rows_per_call(context: int, vocab_size: int = 0) -> int:
    """Windows evaluated per call: about `TOKENS_PER_CALL` tokens, at least one window. Why: an
    evaluation is a loop of calls, and a stop (Ctrl-C, SIGTERM) waits for the call in flight: at
    4,096 tokens that is milliseconds for the default model and about a second or two for the
    6-layer preset's on a slow 2-core CPU. With GPT-2's 50,257 ids, fewer: a call computes at most
    `LOGITS_PER_CALL` logits (block by block: `eqx_gpt.model.loss`), 41 windows of 64 for the
    default body (about 0.4 s on a 2-core AVX2 EPYC, and 1.3x the tokens/s of 5 windows a call),
    2 of 1,024 for GPT-2-124M."""
    tokens = min(TOKENS_PER_CALL, LOGITS_PER_CALL // vocab_size) if vocab_size else TOKENS_PER_CALL
    return max(1, tokens // context)


@dataclass(frozen=True)
class Evaluation:
    """A model's mean next-token loss over a text (`evaluate`) or over the windows of a plan."""

    loss: float  # mean cross-entropy in nats per predicted token
    n_predicted: int  # tokens predicted: len(tokens) - 1 over the whole text
    stride: int  # tokens between window starts (a sample: its windows' length)
    whole: bool = True  # every token of the text predicted (False: a sample of its windows)


@dataclass(frozen=True)
class EvalPlan:
    """The windows of `context + 1` tokens an evaluation reads in a text of `n_tokens`, and the
    targets each counts: window `w` starts at `starts[w]` and counts the loss of its targets
    `first[w] <= j < end[w]` (target `j` is token `starts[w] + 1 + j`)."""

    starts: np.ndarray
    first: np.ndarray
    end: np.ndarray
    context: int
    n_tokens: int
    stride: int
    whole: bool

    @property
    def n_predicted(self) -> int:
        return int(np.sum(self.end - self.first))

    def __len__(self) -> int:
        return len(self.starts)


def plan_whole(n_tokens: int, context: int, stride: int) -> EvalPlan:
    """Windows every `stride` tokens, the last one ending at the last token, that predict every
    token but the first exactly once (see the module docstring)."""
    if n_tokens < 2:
        raise DataError(f"evaluation needs at least 2 tokens (one to predict from), got {n_tokens}")
    last_start = max(0, n_tokens - 1 - context)  # the window that ends at the last token
    starts = np.append(np.arange(0, last_start, stride), last_start)
    ends = np.minimum(starts + context, n_tokens - 1)  # the last target each window predicts
    covered = np.append(0, ends[:-1])  # targets 1 .. covered are counted by earlier windows
    return EvalPlan(
        starts, np.maximum(covered, starts) - starts, ends - starts, context, n_tokens, stride, True
    )


def plan_sample(n_tokens: int, context: int, budget: int) -> EvalPlan:
    """`budget // context` windows (at least one) spread evenly over the text, each counting all
    its `context` targets: about `budget` predicted tokens, the same every time."""
    if n_tokens < context + 1:
        return plan_whole(n_tokens, context, context)
    k = min(max(1, budget // context), n_tokens // context)
    starts = np.linspace(0, n_tokens - 1 - context, k).round().astype(np.int64)
    return EvalPlan(starts, np.zeros(k, np.int64), np.full(k, context), context, n_tokens, context, False)


def periodic_plan(n_tokens: int, context: int, budget: int) -> EvalPlan:
    """What a run's periodic evaluations read: the whole split in non-overlapping windows if it
    fits `budget` tokens (Tiny Shakespeare's does), else an even sample of `budget` tokens."""
    return (
        plan_whole(n_tokens, context, context)
        if n_tokens <= budget
        else plan_sample(n_tokens, context, budget)
    )


def final_plan(n_tokens: int, context: int, budget: int) -> EvalPlan:
    """What a run's final validation reads: the whole split in overlapping windows (every
    `context // 2`) if it is at most `FINAL_EVAL_FACTOR` times the periodic budget, else an even
    sample of that many tokens."""
    if n_tokens <= FINAL_EVAL_FACTOR * budget:
        return plan_whole(n_tokens, context, max(1, context // 2))
    return plan_sample(n_tokens, context, FINAL_EVAL_FACTOR * budget)


@eqx.filter_jit
def _summed_loss(
    model: LanguageModel, batch: Int[Array, "batch window"], weight: Float[Array, "batch seq"]
) -> Float[Array, ""]:
    """`sum(weight * loss)` of one call's windows: the loss of each of `batch[:, 1:]` given the
    tokens before it."""
    return next_token_loss(model, batch[:, :-1], batch[:, 1:], weight)


_COMPILED: set[tuple] = set()  # (config, shapes) of the calls compiled in this process: the phase shown


class _Ticker:
    """An evaluation's progress on a `Shown`: windows done of all, and an ETA from the calls after
    the first (which compiles). Nothing shows before `SHOW_AFTER_TTY` (a terminal) or
    `SHOW_AFTER_LOG` seconds (a log), so a quick evaluation leaves no trace."""

    def __init__(self, shown: Shown | None, n_rows: int):
        self.shown, self.n_rows, self.t0 = shown, n_rows, monotonic()
        self.after = SHOW_AFTER_TTY if shown is not None and shown.bar.tty else SHOW_AFTER_LOG
        self.first: tuple[int, float] | None = None  # (rows, time) when the first call had finished

    def start(self, compiles: bool) -> None:
        """On a terminal, say at once (in place: no line) that the evaluation starts, and whether it
        compiles first, which for a large model or vocabulary takes a while."""
        if self.shown is not None and self.shown.bar.tty:
            phase = "compiling the evaluation" if compiles else "starting"
            self.shown.bar.update(f"{self.shown.label}: {self.n_rows:,} windows, {phase}")

    def tick(self, done: int) -> None:
        """`done` windows are evaluated."""
        if self.shown is None or done == 0:
            return
        now = monotonic()
        if self.first is None:
            self.first = (done, now)
        if now - self.t0 < self.after:
            return
        rows, t = self.first
        rate = (done - rows) / (now - t) if done > rows and now > t else 0.0
        eta = f"ETA {_clock((self.n_rows - done) / rate)}" if rate else "timing the first calls"
        share = 100 * done / max(self.n_rows, 1)
        self.shown.bar.update(
            f"{self.shown.label}: {done:,}/{self.n_rows:,} windows ({share:.0f}%), "
            f"{_clock(now - self.t0)} elapsed, {eta}"
        )

    def close(self) -> None:
        if self.shown is not None:
            self.shown.bar.clear()


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _summed(
    model: LanguageModel, n_rows: int, read, *, batch: int, place, stop, shown: Shown | None = None
) -> float | None:
    """`sum(weight * loss)` over `n_rows` windows, `batch` per jitted call; `read(i, j)` gives the
    `(rows, weight)` of windows `i..j`. The last call is padded with zero weight, so every call has
    one shape. None as soon as `stop()` is true between calls. One call is kept in flight while the
    next is dispatched; its progress shows on `shown` once it takes more than a moment. The model
    runs in inference mode (no dropout)."""
    model = eqx.nn.inference_mode(model)
    total, in_flight, ticker = 0.0, None, _Ticker(shown, n_rows)
    try:
        for i in range(0, n_rows, batch):
            if stop():
                return None
            rows, weight = read(i, min(i + batch, n_rows))
            padded_rows = np.zeros((batch, rows.shape[1]), np.int32)
            padded_rows[: len(rows)] = rows
            padded_weight = np.zeros((batch, weight.shape[1]), np.float32)
            padded_weight[: len(weight)] = weight
            if i == 0:
                shapes = (getattr(model, "config", type(model)), padded_rows.shape, padded_weight.shape)
                ticker.start(compiles=shapes not in _COMPILED)
                _COMPILED.add(shapes)
            result = _summed_loss(model, place(padded_rows), place(padded_weight))
            total += 0.0 if in_flight is None else float(in_flight)  # waits for the previous call
            ticker.tick(i)
            in_flight = result
        return total + (0.0 if in_flight is None else float(in_flight))
    finally:
        ticker.close()


def summed_loss(
    model: LanguageModel,
    rows: Int[np.ndarray, "n window"],
    weight: Float[np.ndarray, "n seq"],
    *,
    batch: int,
    place=lambda x: x,
    stop: Callable[[], bool] = lambda: False,
    shown: Shown | None = None,
) -> float | None:
    """`sum(weight * loss)` over the windows `rows` (no dropout), `batch` rows per jitted call;
    None if `stop()` turns true between calls. Its progress shows on `shown` if it takes a while."""
    read = lambda i, j: (rows[i:j], weight[i:j])
    return _summed(model, len(rows), read, batch=batch, place=place, stop=stop, shown=shown)


def evaluate_plan(
    model: LanguageModel,
    tokens: TokenSpan,
    plan: EvalPlan,
    *,
    place=lambda x: x,
    batch: int | None = None,
    stop: Callable[[], bool] = lambda: False,
    shown: Shown | None = None,
) -> Evaluation | None:
    """Mean next-token loss of `model` (no dropout) over the windows of `plan` in `tokens`, read from
    them a call at a time (a split is never copied whole); None if `stop()` turns true between
    calls. Its progress shows on `shown` once it takes more than a moment (`SHOW_AFTER_TTY`). See
    `evaluate` for the other arguments."""
    context, j = plan.context, np.arange(plan.context)

    def read(i: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        starts, fits = plan.starts[i:k], plan.starts[i:k] + context + 1 <= len(tokens)
        rows = np.zeros((k - i, context + 1), np.int32)  # a text shorter than a window: zeros after it
        rows[fits] = tokens.rows(starts[fits], context + 1)
        for r in np.flatnonzero(~fits):
            rows[r, : len(tokens) - starts[r]] = tokens.span(int(starts[r]), len(tokens)).to_array()
        weight = (j >= plan.first[i:k, None]) & (j < plan.end[i:k, None])
        return rows, weight.astype(np.float32)

    batch = rows_per_call(context, model.vocab_size) if batch is None else batch
    total = _summed(model, len(plan), read, batch=batch, place=place, stop=stop, shown=shown)
    if total is None:
        return None
    return Evaluation(total / plan.n_predicted, plan.n_predicted, plan.stride, plan.whole)


def check_tokens(tokens, vocab_size: int) -> np.ndarray:
    """`tokens` as a 1-D int32 array, or a one-line `TypeError` (not integer ids) or `ValueError` (an
    id outside `[0, vocab_size)`, naming it): a float is never truncated, nor an id wrapped."""
    try:
        ids = np.asarray(tokens)
    except (TypeError, ValueError):
        raise TypeError(f"tokens must be a sequence of integer ids, got {type(tokens).__name__}") from None
    if ids.ndim == 0:  # None, a lone id, a string: not a sequence of ids
        raise TypeError(f"tokens must be a sequence of integer ids, got {type(tokens).__name__}")
    flat = ids.reshape(-1)
    if ids.dtype == object and all(isinstance(t, int) and not isinstance(t, bool) for t in flat):
        flat = [t for t in flat if not 0 <= t < vocab_size]  # ints numpy cannot hold: out of range
        raise ValueError(f"token id {flat[0]} is outside the model's vocabulary [0, {vocab_size})")
    if ids.size == 0:
        return np.zeros(0, np.int32)
    if ids.dtype.kind not in "iu":
        example = flat[0].item() if isinstance(flat[0], np.generic) else flat[0]
        raise TypeError(f"tokens must be integer ids, got {ids.dtype} values such as {example!r}")
    outside = flat[(flat < 0) | (flat >= vocab_size)]
    if outside.size:
        raise ValueError(f"token id {outside[0]} is outside the model's vocabulary [0, {vocab_size})")
    return flat.astype(np.int32)


def evaluate(
    model: LanguageModel,
    tokens,
    *,
    stride: int | None = None,
    batch: int | None = None,
    shown: Shown | None = None,
) -> Evaluation:
    """Mean next-token loss of `model` over all of `tokens` `(n,)` (integer ids in `[0, vocab_size)`,
    or a `TokenSpan`; no dropout), in windows of `context_length` started every `stride` tokens
    (default `context_length // 2`; see the module docstring), `batch` windows per jitted call
    (default `rows_per_call`); progress on `shown` if it takes a while. Bad arguments raise a
    one-line `TypeError` or `ValueError`."""
    check_language_model(model)
    context = model.context_length
    stride = max(1, context // 2) if stride is None else stride
    if not is_whole(stride, 1, context):
        raise ValueError(f"stride must be an integer in [1, context_length={context}], got {stride!r}")
    if batch is not None and not is_whole(batch, 1):
        raise ValueError(f"batch must be an integer in [1, {INT32_MAX}], got {batch!r}")
    if shown is not None and not isinstance(shown, Shown):
        raise TypeError(
            f"shown must be a Shown (a progress bar and a label) or None, got {type(shown).__name__}"
        )
    if not isinstance(tokens, TokenSpan):
        tokens = TokenSpan([check_tokens(tokens, model.vocab_size)])
    result = evaluate_plan(model, tokens, plan_whole(len(tokens), context, stride), batch=batch, shown=shown)
    assert result is not None  # only a `stop` (none here) ends an evaluation early
    return result


def evaluate_text(
    model: LanguageModel,
    tokenizer: Tokenizer,
    text: str,
    *,
    stride: int | None = None,
    shown: Shown | None = None,
) -> Evaluation:
    """`evaluate` on `text` encoded by `tokenizer` (a `TokenizerError` names unknown characters)."""
    check_language_model(model)
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"tokenizer must be a tokenizer (the one load_model returns, a CharTokenizer, a GPT2Tokenizer), "
            f"got {type(tokenizer).__name__}"
        )
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return evaluate(model, tokenizer.encode(text), stride=stride, shown=shown)
