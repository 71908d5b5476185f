"""What a run tells: its log lines, `metrics.jsonl`, the loss plot, the progress bar, tokens/s,
and the sample and summary at its end.

The loop never waits for the accelerator at a step: the losses of dispatched steps wait in
`Report.pending` and are read a few steps later (`read_losses`), every `log_interval` steps and at
evaluations.
"""

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from eqx_gpt.checkpoint import LATEST, checkpoint_file
from eqx_gpt.generation.generate import generate
from eqx_gpt.generation.sampling import SamplingOptions
from eqx_gpt.model.gpt import GPT
from eqx_gpt.tokenizer import Tokenizer, TokenizerError
from eqx_gpt.training.progress import Progress, clock
from eqx_gpt.training.run_dir import Metrics
from eqx_gpt.training.setup import RunSetup, TrainingError
from eqx_gpt.training.state import TrainState
from eqx_gpt.training.time_plan import TimePlan
from eqx_gpt.training.train_step import describe_optimizer
from eqx_gpt.visualize import plot_losses


@dataclass
class TrainResult:
    step: int
    val_loss: float | None
    best_val_loss: float | None
    elapsed_s: float
    interrupted: bool
    sample: str | None
    out_dir: Path


@dataclass
class Report:
    """The run's reporting: `log` prints a line, `metrics` is `metrics.jsonl`, `bar` the progress
    line; `now` is the run's clock and `t_start` when the run started."""

    log: Callable[[str], None]
    metrics: Metrics
    bar: Progress
    now: Callable[[], float]
    t_start: float
    tokens_per_s: float = 0.0
    last_read: dict | None = None  # the metrics record of the latest step whose loss was read
    last_logged: int | None = None  # the latest step written to metrics.jsonl
    # (steps, losses, lrs) of each dispatched call whose losses have not been read yet
    pending: list = field(default_factory=list)
    read_points: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))

    def elapsed(self) -> float:
        return self.now() - self.t_start

    def restart_rate(self, step: int, now: float) -> None:
        """Measure tokens/s from `step` on (after compiling, or an evaluation, which is no step)."""
        self.read_points.clear()
        self.read_points.append((step, now))


def describe_start(report: Report, setup: RunSetup, state: TrainState) -> None:
    """The lines a run starts with: what it trains, how, for how long, and from where."""
    c, m, preset = setup.config, setup.model_config, setup.checkpoint_meta.get("preset")
    report.log(
        f"model: {setup.checkpoint_meta['n_params'] / 1e6:.2f}M parameters, {m.n_layers} layers, d_model "
        f"{m.d_model}, {m.n_heads} heads, context {m.context_length}; batch {c.batch_size} "
        f"({setup.tokens_per_step:,} tokens/step) on {setup.mesh.size} {jax.devices()[0].platform} "
        f"device{'s' if setup.mesh.size > 1 else ''}" + (f"; preset {preset}" if preset else "")
    )
    report.log(f"schedule: {describe_optimizer(c, state.horizon)}")
    if c.max_minutes:
        report.log(f"time limit: {c.max_minutes:g} min; the schedule is refitted to the steps that fit")
    if setup.resumed_from is not None:
        report.log(f"resuming {setup.resumed_from} at step {setup.start}")


def last_good(setup: RunSetup, state: TrainState) -> str:
    latest = checkpoint_file(setup.out_dir, LATEST)
    where = f"{latest} (step {state.last_saved})" if state.last_saved is not None else "none"
    return f"Last good checkpoint: {where}"


def read_losses(report: Report, setup: RunSetup, state: TrainState, plan: TimePlan, until: int) -> None:
    """Record the logged steps among the dispatched ones up to step `until`, update tokens/s and
    the progress bar; stop on a non-finite loss."""
    calls = [p for p in report.pending if p[0][-1] <= until]
    if not calls:
        return
    del report.pending[: len(calls)]
    ready = [(s, lr) for steps, _, lrs in calls for s, lr in zip(steps, lrs, strict=True)]
    losses = np.concatenate([np.asarray(losses)[: len(steps)] for steps, losses, _ in calls])
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        raise TrainingError(
            f"loss became {losses[bad[0]]} at step {ready[bad[0]][0]}; stopped. {last_good(setup, state)}. "
            f"Try a lower --lr or --grad-clip"
        )
    now = report.now()
    report.read_points.append((ready[-1][0], now))
    (first_step, first_time), (last_step, _) = report.read_points[0], report.read_points[-1]
    if last_step > first_step:  # tokens/s over the last few reads, which smooths their jitter
        report.tokens_per_s = (last_step - first_step) * setup.tokens_per_step / max(now - first_time, 1e-9)
    for (s, lr), loss in zip(ready, losses, strict=True):
        report.last_read = {
            "step": s,
            "loss": float(loss),
            "lr": lr,
            "tokens_per_s": round(report.tokens_per_s, 1),
        }
        if s % setup.config.log_interval == 0 or s == state.horizon:
            report.metrics.write(report.last_read)
            report.last_logged = s
    s, lr = ready[-1]
    rate = plan.steps_per_second(s, now)
    eta = f"ETA {clock((state.horizon - s) / rate)}" if rate else ("compiling" if s == 1 else "")
    report.bar.update(
        f"step {s}/{state.horizon} | loss {losses[-1]:.4f} | lr {lr:.2e} | "
        f"{report.tokens_per_s / 1e3:.1f}k tok/s | {clock(now - report.t_start)} elapsed | {eta}"
    )


def record_evaluation(report: Report, state: TrainState, train: float) -> None:
    """An evaluation's record in `metrics.jsonl` (written before its checkpoints)."""
    elapsed = round(report.elapsed(), 2)
    record = {"step": state.step, "train_loss": train, "val_loss": state.last_eval[1], "elapsed_s": elapsed}
    report.metrics.write(record)


def evaluated(report: Report, setup: RunSetup, state: TrainState, train: float, is_best: bool) -> None:
    """After an evaluation's checkpoints: the loss plot redrawn, and its log line."""
    val = state.last_eval[1]
    plot_losses(report.metrics.records, setup.out_dir / "loss.png")
    report.restart_rate(state.step, report.now())  # keep evaluation time out of tokens/s
    report.bar.clear()
    report.log(
        f"step {state.step}: train loss {train:.4f}, val loss {val:.4f}"
        f"{' (best)' if is_best else ''} [{clock(report.elapsed())}]"
    )


def result(report: Report, state: TrainState, out_dir: Path, **outcome) -> TrainResult:
    """The run's `TrainResult` (`val_loss`, `interrupted` and `sample` in `outcome`)."""
    best = None if math.isinf(state.best_val) else state.best_val
    return TrainResult(state.step, best_val_loss=best, elapsed_s=report.elapsed(), out_dir=out_dir, **outcome)


def sample_text(
    model: GPT, tokenizer: Tokenizer, n_tokens: int, *, seed: int, temperature: float = 0.8
) -> str:
    """A short continuation of a newline (or of token 0, in a corpus without newlines), to show
    what the model learned."""
    try:
        prompt = tokenizer.encode("\n")
    except TokenizerError:
        prompt = [0]
    options = SamplingOptions(temperature=temperature)
    out = generate(model, prompt, n_tokens, key=jax.random.key(seed), options=options)
    return tokenizer.decode(np.asarray(out).reshape(-1).tolist())
