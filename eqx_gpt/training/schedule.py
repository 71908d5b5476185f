"""The learning-rate schedule: linear warm-up, then half a cosine down to `min_lr` (or, under
`schedule="wsd"`, a stable `lr` and a linear decay to `min_lr` over the run's last part).

A run's schedule is `horizon` steps long. With `--max-minutes`, `time_plan.TimePlan` shortens the
horizon so that the schedule ends when the time does; the optimiser is built with a unit learning
rate and each step is passed its rate, so changing the horizon needs no recompiling.
"""

import math

from eqx_gpt.training.train_config import TrainConfig


def warmup_steps(config: TrainConfig, horizon: int) -> int:
    """The warm-up actually run: `config.warmup_steps`, shortened to half the schedule if longer,
    so that a short run still reaches `lr` and decays (rather than ending mid-warm-up)."""
    return min(config.warmup_steps, horizon // 2)


def decay_start(config: TrainConfig, horizon: int) -> int:
    """The step where the decay to `min_lr` begins: the end of the warm-up under the cosine, the
    last `decay_fraction` of the run under `schedule="wsd"`."""
    warmup = warmup_steps(config, horizon)
    if config.schedule == "cosine":
        return warmup
    return max(warmup, horizon - round(config.decay_fraction * horizon))


def learning_rate(step: int, config: TrainConfig, horizon: int) -> float:
    """The learning rate of optimiser step `step` (0-based) in a schedule `horizon` steps long.

    Linear warm-up to `lr` over `warmup_steps(config, horizon)`, then half a cosine down to
    `min_lr` at `horizon` (nanoGPT's schedule); `min_lr` after that. Under `schedule="wsd"`
    (warm-up, stable, decay), `lr` holds until the last `decay_fraction` of the run, which decays
    linearly to `min_lr`: refitting the horizon to the time then moves only the decay.
    """
    c, warmup = config, warmup_steps(config, horizon)
    if step < warmup:
        return c.lr * (step + 1) / (warmup + 1)
    if step >= horizon:
        return c.min_lr
    start = decay_start(c, horizon)
    progress = max(0, step - start) / max(1, horizon - start)
    if c.schedule == "wsd":
        return c.lr + progress * (c.min_lr - c.lr)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c.lr - c.min_lr)
