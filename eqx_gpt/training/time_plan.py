"""Fitting a run to the time it has: `TimePlan` measures the step rate and the cost of evaluations,
and sets the schedule's length (`schedule_steps`) to the steps that fit before `--max-minutes` is up."""

import math

from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.language_model import ModelShape

# Seconds kept before the deadline for what follows the last step besides its evaluations: the
# checkpoint and the plot, then, for a run that ends with a sample, loading the best model and
# compiling the sampler. That is start-up's kind of work (loading, compiling), so the reserve is the
# measured start-up time, within these bounds: a fast machine keeps less, a run with no sample the least.
RESERVE_S = 15.0
MIN_RESERVE_S = 3.0
# The final validation of Tiny Shakespeare reads the split in windows every context_length // 2
# tokens: twice the validation windows of a periodic evaluation, which also reads fixed training
# windows. A run prices its own (`final_evals`: its windows over all of a periodic evaluation's).
FINAL_VALIDATION_EVALS = 2.0
# `--eval-tokens` counts tokens at the cost of a model whose head has this many columns (bytes or
# characters): a larger head makes each evaluated token dearer, and the budget smaller with it.
REFERENCE_VOCAB = 256


def forward_cost(config: GPTConfig, head_columns: int | None = None) -> int:
    """Multiply-adds per token of a forward pass (matrix multiplies only, attention at the full
    context): the blocks' projections and attention, then the head of `head_columns` (default
    `padded_vocab_size`) columns."""
    c, columns = config, config.padded_vocab_size if head_columns is None else head_columns
    d_hidden = 4 * c.d_model if c.d_hidden is None else c.d_hidden
    mlp = 3 if c.activation in ("swiglu", "geglu") else 2  # a gated MLP's up is twice as wide
    per_layer = 4 * c.d_model**2 + mlp * c.d_model * d_hidden + 2 * c.context_length * c.d_model
    return c.n_layers * per_layer + c.d_model * columns


def eval_budget(eval_tokens: int, config: GPTConfig | ModelShape) -> int:
    """The validation tokens an evaluation reads for `--eval-tokens eval_tokens`: that many at a
    head of `REFERENCE_VOCAB` columns or fewer (every character vocabulary of Tiny Shakespeare's
    size, whose whole split the default reads), proportionally fewer for a dearer head, at least
    one window. With GPT-2's 50,257 ids on the default model, 131,072 becomes 15,905: the
    evaluation costs what a character model's does."""
    return max(config.context_length, math.floor(eval_tokens / eval_price(config)))


def eval_train_windows(eval_batches: int, batch_size: int, config: GPTConfig | ModelShape) -> int:
    """The fixed training windows an evaluation's train loss reads for `--eval-batches`: that many
    batches at a head of `REFERENCE_VOCAB` columns or fewer, proportionally fewer for a dearer
    head (as `eval_budget`), at least one window. With GPT-2's 50,257 ids on the default model,
    16 batches of 48 (768 windows) become 93."""
    return max(1, math.floor(eval_batches * batch_size / eval_price(config)))


def eval_price(config: GPTConfig | ModelShape) -> float:
    """What an evaluated token of `config` costs against one at a head of `REFERENCE_VOCAB` columns
    (1 for a head that small or smaller): `forward_cost`'s ratio. A model of one's own, whose cost
    eqx_gpt does not know, is priced 1: `--eval-tokens` and `--eval-batches` count its tokens as they
    are."""
    if isinstance(config, ModelShape):
        return 1.0
    return forward_cost(config) / forward_cost(config, min(REFERENCE_VOCAB, config.padded_vocab_size))


class TimePlan:
    """Fits the schedule's length (`schedule_steps`) to the steps that fit before a deadline.

    The step rate is measured from `start_timing` (called after the first step, which compiles),
    leaving out the time spent in evaluations, which are priced separately. Every method takes the
    current time `now` (seconds, `time.monotonic()`), so the plan is a pure function of what it is
    told and can be tested without waiting.
    """

    def __init__(
        self,
        max_minutes: float,
        max_steps: int,
        t_start: float,
        reserve_s: float = RESERVE_S,
        final_evals: float = FINAL_VALIDATION_EVALS,
        sample: bool = True,
    ):
        self.max_steps = max_steps
        self.final_evals = final_evals  # the final validation's cost, in periodic evaluations
        self.t_start = t_start
        self.sample = sample  # whether the run ends with a sample, after its final validation
        # Kept before the deadline for what follows the last step; without a sample, the least.
        self.reserve_s = reserve_s if sample else MIN_RESERVE_S
        self.deadline = t_start + 60 * max_minutes if max_minutes else math.inf
        self.timed_from: tuple[int, float] | None = None  # (step, time) after compilation
        self.eval_seconds = 0.0
        self.n_evals = 0

    @property
    def limited(self) -> bool:
        return math.isfinite(self.deadline)

    def start_timing(self, step: int, now: float) -> None:
        """Start timing the steps (called once the first step, which compiles, has run); the time
        since `t_start` is the start-up, which sets the reserve."""
        self.timed_from = (step, now)
        self.reserve_s = min(self.reserve_s, max(MIN_RESERVE_S, now - self.t_start))

    @property
    def seconds_per_evaluation(self) -> float | None:
        """The mean time of the evaluations timed so far (None before the first)."""
        return self.eval_seconds / self.n_evals if self.n_evals else None

    def add_evaluation(self, seconds: float) -> None:
        self.eval_seconds += seconds
        self.n_evals += 1

    def steps_per_second(self, step: int, now: float) -> float | None:
        """Training steps per second since timing started, evaluations left out (None: no data)."""
        if self.timed_from is None or step <= self.timed_from[0]:
            return None
        return (step - self.timed_from[0]) / max(now - self.timed_from[1] - self.eval_seconds, 1e-9)

    def _after_last_step(self, per_eval: float) -> float:
        """Seconds a run needs after its last step: the evaluation there, the final validation and
        the reserve (checkpoint, plot, sample)."""
        return (1 + self.final_evals) * per_eval + self.reserve_s

    def affords_final(self, now: float) -> bool:
        """Whether the final validation fits before the deadline, the reserve kept for the sample if
        one follows (True before any evaluation is timed, and without a time limit)."""
        per_eval, reserve = self.seconds_per_evaluation, self.reserve_s if self.sample else 0.0
        return per_eval is None or now + self.final_evals * per_eval + reserve <= self.deadline

    def out_of_time(self, now: float) -> bool:
        """Whether the run must stop now to finish (evaluate, save, sample) before the deadline."""
        return now > self.deadline - self._after_last_step(self.seconds_per_evaluation or 0.0)

    def steps_that_fit(self, step: int, now: float, eval_interval: int, eval_cost_steps: float) -> int | None:
        """The step at which the run must end to finish at the deadline, `max_steps` aside (None:
        no time limit, or no step timed yet).

        Each step costs its measured time plus its share of the evaluations every `eval_interval`
        steps; `eval_cost_steps` prices an evaluation in training steps until one has been timed.
        """
        rate = self.steps_per_second(step, now)
        if not self.limited or rate is None:
            return None
        measured = self.seconds_per_evaluation
        per_eval = eval_cost_steps / rate if measured is None else measured
        budget = self.deadline - now - self._after_last_step(per_eval)
        seconds_per_step = 1 / rate + per_eval / eval_interval
        return max(step, step + int(budget / seconds_per_step))

    def fit(
        self, step: int, schedule_steps: int, now: float, eval_interval: int, eval_cost_steps: float
    ) -> int:
        """The schedule's length that ends the run at the deadline, within `[step, max_steps]`
        (`schedule_steps` unchanged without a time limit or a timed step)."""
        fits = self.steps_that_fit(step, now, eval_interval, eval_cost_steps)
        return schedule_steps if fits is None else max(step, min(self.max_steps, fits))
