"""The learning-rate schedule, and fitting its length to the time a run has.

A run's schedule is `horizon` steps long: linear warm-up, then half a cosine down to `min_lr`. With
`--max-minutes`, `TimePlan` measures the step rate and shortens the horizon so that the schedule
ends when the time does; the optimiser is built with a unit learning rate and each step is passed
its rate, so changing the horizon needs no recompiling.
"""

import math

from eqx_gpt.training.train_config import TrainConfig

RESERVE_S = 15.0  # seconds kept before the deadline for the last checkpoint, the plot and the sample
# The final validation reads the split in windows every context_length // 2 tokens: twice the
# windows of a periodic evaluation, which also covers fixed training batches. Priced as two.
FINAL_VALIDATION_EVALS = 2.0


def warmup_steps(config: TrainConfig, horizon: int) -> int:
    """The warm-up actually run: `config.warmup_steps`, shortened to half the schedule if longer,
    so that a short run still reaches `lr` and decays (rather than ending mid-warm-up)."""
    return min(config.warmup_steps, horizon // 2)


def learning_rate(step: int, config: TrainConfig, horizon: int) -> float:
    """The learning rate of optimiser step `step` (0-based) in a schedule `horizon` steps long.

    Linear warm-up to `lr` over `warmup_steps(config, horizon)`, then half a cosine down to
    `min_lr` at `horizon` (nanoGPT's schedule); `min_lr` after that.
    """
    c, warmup = config, warmup_steps(config, horizon)
    if step < warmup:
        return c.lr * (step + 1) / (warmup + 1)
    if step >= horizon:
        return c.min_lr
    progress = (step - warmup) / max(1, horizon - warmup)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c.lr - c.min_lr)


def describe_schedule(config: TrainConfig, horizon: int) -> str:
    """The schedule line a run prints: exactly what `learning_rate` will do over `horizon` steps."""
    c, warmup = config, warmup_steps(config, horizon)
    shortened = (
        f" (--warmup-steps {c.warmup_steps} shortened to half the run)" if warmup < c.warmup_steps else ""
    )
    if c.optimizer == "adamw":
        return (
            f"AdamW, lr warm-up 0 -> {c.lr:g} over {warmup} steps{shortened}, cosine to {c.min_lr:g} at step "
            f"{horizon}; betas ({c.beta1:g}, {c.beta2:g}), weight decay {c.weight_decay:g} on matrices, "
            f"gradient clip {c.grad_clip:g}"
        )
    adam_lr = c.adam_lr or c.lr
    return (
        f"Muon (momentum {c.muon_momentum:g}, Nesterov, {c.muon_ns_steps} Newton-Schulz steps) on the "
        f"block matrices: lr {c.lr:g}, weight decay "
        f"{c.weight_decay:g}; AdamW on embedding, head and norm scales: lr {adam_lr:g}, betas "
        f"({c.beta1:g}, {c.beta2:g}), weight decay {c.adam_weight_decay:g} (not on norm scales); both "
        f"warmed up over {warmup} steps{shortened}, then a cosine to {c.min_lr / c.lr:g} of their peak "
        f"at step {horizon}; gradient clip {c.grad_clip:g}"
    )


class TimePlan:
    """Fits the schedule's length (the horizon) to the steps that fit before a deadline.

    The step rate is measured from `start_timing` (called after the first step, which compiles),
    leaving out the time spent in evaluations, which are priced separately. Every method takes the
    current time `now` (seconds, `time.monotonic()`), so the plan is a pure function of what it is
    told and can be tested without waiting.
    """

    def __init__(self, max_minutes: float, max_steps: int, t_start: float, reserve_s: float = RESERVE_S):
        self.max_steps = max_steps
        self.reserve_s = reserve_s  # kept before the deadline for what follows the last step
        self.deadline = t_start + 60 * max_minutes if max_minutes else math.inf
        self.timed_from: tuple[int, float] | None = None  # (step, time) after compilation
        self.eval_seconds = 0.0
        self.n_evals = 0

    @property
    def limited(self) -> bool:
        return math.isfinite(self.deadline)

    def start_timing(self, step: int, now: float) -> None:
        self.timed_from = (step, now)

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
        return (1 + FINAL_VALIDATION_EVALS) * per_eval + self.reserve_s

    def out_of_time(self, now: float) -> bool:
        """Whether the run must stop now to finish (evaluate, save, sample) before the deadline."""
        return now > self.deadline - self._after_last_step(self.seconds_per_evaluation or 0.0)

    def fit(self, step: int, horizon: int, now: float, eval_interval: int, eval_cost_steps: float) -> int:
        """The horizon that ends the run at the deadline, within `[step, max_steps]`.

        Each step costs its measured time plus its share of the evaluations every `eval_interval`
        steps; `eval_cost_steps` prices an evaluation in training steps until one has been timed.
        """
        rate = self.steps_per_second(step, now)
        if not self.limited or rate is None:
            return horizon
        measured = self.seconds_per_evaluation
        per_eval = eval_cost_steps / rate if measured is None else measured
        budget = self.deadline - now - self._after_last_step(per_eval)
        seconds_per_step = 1 / rate + per_eval / eval_interval
        return max(step, min(self.max_steps, step + int(budget / seconds_per_step)))
