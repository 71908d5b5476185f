"""What a run tells: its log lines, `metrics.jsonl` (and the same records to its trackers, if
any), the callbacks, the loss plot, the progress bar, tokens/s, and the sample at its end.

The loop never waits for the accelerator at a step: it hands each call's figures to the `Report`
(`dispatched`), which reads them a few steps later (`read_losses`), every `log_interval` steps and
at evaluations, and tells the callbacks of every step read, in order.
"""

import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.generate import generate
from eqx_gpt.generation.sampling import SamplingOptions
from eqx_gpt.tokenizer import Tokenizer, TokenizerError
from eqx_gpt.training.callbacks import Callbacks
from eqx_gpt.training.records import EvaluationRecord, FinalRecord, Record, StepRecord, record_from_dict
from eqx_gpt.training.run_dir import Metrics
from eqx_gpt.training.time_plan import TimePlan
from eqx_gpt.training.trackers import Trackers


class Report:
    """A run's reporting: `log` prints a line, `metrics` is `metrics.jsonl`, `bar` the progress
    line; `now` is the run's clock and `t_start` when the run started; `trackers` get every record
    `metrics` gets (`write`, the one place records go); `callbacks` every step's record, and each
    evaluation's and checkpoint's as the loop says. It owns the figures not yet read and the
    tokens/s measured from them."""

    def __init__(
        self,
        log: Callable[[str], None],
        metrics: Metrics,
        bar: "Progress",
        now: Callable[[], float],
        t_start: float,
        *,
        tokens_per_step: int,
        log_interval: int,
        plot: Path,
        trackers: Trackers | None = None,
        callbacks: Callbacks | None = None,
    ):
        self.log, self.metrics, self.bar, self.now, self.t_start = log, metrics, bar, now, t_start
        self.trackers = Trackers() if trackers is None else trackers
        self.callbacks = Callbacks() if callbacks is None else callbacks
        self.tokens_per_step, self.log_interval, self.plot = tokens_per_step, log_interval, plot
        self.tokens_per_s = 0.0
        self.last_read: StepRecord | None = None  # the latest step whose figures were read
        self.last_logged: int | None = None  # the latest step written to metrics.jsonl
        # (steps, figures, lrs) of each dispatched call whose figures have not been read yet
        self._pending: list[tuple[list[int], dict[str, jax.Array], list[float]]] = []
        self._read_points: collections.deque[tuple[int, float]] = collections.deque(maxlen=8)

    def elapsed(self) -> float:
        return self.now() - self.t_start

    def start_rate(self, step: int, now: float) -> None:
        """Measure tokens/s from `step` on (the run's start, after compiling, or an evaluation)."""
        self._read_points.clear()
        self._read_points.append((step, now))

    def dispatched(self, steps: list[int], figures: dict[str, jax.Array], lrs: list[float]) -> None:
        """A call of steps `steps` (1-based) was queued; its `figures` (`step.step_figures`, each
        `(k,)`) are read later."""
        self._pending.append((steps, figures, lrs))

    def compiled(self, step: int) -> float:
        """Wait for the first call (it compiles), log how long start-up took, and measure tokens/s
        from here; returns the time it finished."""
        jax.block_until_ready(self._pending[-1][1])
        now = self.now()
        self.tokens_per_s = self.tokens_per_step / max(now - self.t_start, 1e-9)  # includes compiling
        self.start_rate(step, now)
        self.bar.clear()
        self.log(f"compiled the training step in {now - self.t_start:.1f} s since start")
        return now

    def read_losses(self, until: int, schedule_steps: int, plan: TimePlan) -> tuple[int, float] | None:
        """Read the figures of the dispatched steps up to step `until`: tell the callbacks of each
        step, record the logged ones, update tokens/s and the progress bar. Returns `(step, loss)`
        of the first non-finite loss, recording nothing (the loop stops the run), else None."""
        calls = [p for p in self._pending if p[0][-1] <= until]
        if not calls:
            return None
        del self._pending[: len(calls)]
        ready = [(s, lr) for steps, _, lrs in calls for s, lr in zip(steps, lrs, strict=True)]
        figures = {
            name: np.concatenate([np.asarray(f[name])[: len(steps)] for steps, f, _ in calls])
            for name in calls[0][1]
        }
        losses = figures["loss"]
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            return ready[bad[0]][0], float(losses[bad[0]])
        now = self.now()
        self._read_points.append((ready[-1][0], now))
        (first_step, first_time), (last_step, _) = self._read_points[0], self._read_points[-1]
        if last_step > first_step:  # tokens/s over the last few reads, which smooths their jitter
            self.tokens_per_s = (last_step - first_step) * self.tokens_per_step / max(now - first_time, 1e-9)
        for i, (s, lr) in enumerate(ready):
            step_figures = {name: float(values[i]) for name, values in figures.items()}
            self.last_read = StepRecord(s, step_figures, lr, round(self.tokens_per_s, 1))
            if s % self.log_interval == 0 or s == schedule_steps:
                self.write(self.last_read)
                self.last_logged = s
            self.callbacks.on_step(self.last_read)
        s, lr = ready[-1]
        rate = plan.steps_per_second(s, now)
        eta = f"ETA {clock((schedule_steps - s) / rate)}" if rate else ("compiling" if s == 1 else "")
        self.bar.update(
            f"step {s}/{schedule_steps} | loss {losses[-1]:.4f} | lr {lr:.2e} | "
            f"{self.tokens_per_s / 1e3:.1f}k tok/s | {clock(now - self.t_start)} elapsed | {eta}"
        )
        return None

    def write(self, record: Record) -> None:
        """Append `record` to `metrics.jsonl` and send it to the trackers: every record goes here."""
        line = record.to_dict()
        self.metrics.write(line)
        self.trackers.log(line)

    def history(self) -> tuple[Record, ...]:
        """Every record of the run so far, as `metrics.jsonl` holds them (a resumed run's earlier
        ones included)."""
        return tuple(record_from_dict(line) for line in self.metrics.records)

    def flush(self) -> None:
        """Make the records so far survive a kill (before a checkpoint is written)."""
        self.trackers.flush()

    def record_last_read(self) -> None:
        """Log the latest step read if it is not yet (the step a run stopped at is always logged)."""
        if self.last_read is not None and self.last_logged != self.last_read.step:
            self.write(self.last_read)

    def record_final(self, record: FinalRecord) -> None:
        """The final validation's record, and the loss plot redrawn with its point."""
        self.write(record)
        self.draw_plot()

    def record_evaluation(self, step: int, figures: dict[str, float]) -> EvaluationRecord:
        """An evaluation's record in `metrics.jsonl` (written before its checkpoints)."""
        record = EvaluationRecord(step, figures, round(self.elapsed(), 2))
        self.write(record)
        return record

    def record_sample(self, step: int, text: str) -> None:
        """The sample at the end of a run, to the trackers (the log shows it too)."""
        self.trackers.log_text(step, "sample", text)

    def draw_plot(self) -> None:
        """Redraw the loss plot from the records so far (one small figure: cheap at each evaluation)."""
        from eqx_gpt.visualize import plot_losses  # here: `import eqx_gpt` need not load matplotlib

        plot_losses(self.metrics.records, self.plot)

    def evaluated(self, step: int, figures: dict[str, float], is_best: bool) -> None:
        """After an evaluation's checkpoints: the loss plot redrawn, and its log line."""
        self.draw_plot()
        self.start_rate(step, self.now())  # keep evaluation time out of tokens/s
        self.bar.clear()
        said = ", ".join(f"{name.replace('_', ' ')} {value:.4f}" for name, value in figures.items())
        self.log(f"step {step}: {said}{' (best)' if is_best else ''} [{clock(self.elapsed())}]")

    def close(self) -> None:
        self.bar.clear()
        self.metrics.close()

    def __enter__(self) -> "Report":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Progress:
    """A one-line progress bar on stderr, redrawn with \\r and cleared when the work ends. Off a
    terminal, a plain line now and then instead, on stdout with the log: stderr then holds only
    errors, so a refusal after some work (a full disk found once the cache is verified) is one
    line there, never preceded by progress lines that no one can clear."""

    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        if stream is None and not self.tty:
            self.stream = sys.stdout
        self.shown = False
        self.last_plain = 0.0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + text.ljust(100)[:160])
            self.shown = True
        elif time.monotonic() - self.last_plain > 10:
            self.stream.write(text + "\n")
            self.last_plain = time.monotonic()
        self.stream.flush()

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self.shown = False


def clock(seconds: float) -> str:
    """`m:ss` of a duration in seconds."""
    seconds = int(max(0, seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def sample_text(
    model: Decoder, tokenizer: Tokenizer, n_tokens: int, *, seed: int, temperature: float = 0.8
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
