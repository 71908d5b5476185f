"""A training run, start to end: `train(settings, out_dir)`.

    out_dir/metrics.jsonl    one JSON object per line: {"step", "loss", "lr", "tokens_per_s"} for
                             logged steps, {"step", "train_loss", "val_loss", "elapsed_s"} at
                             evaluations, and the final validation last
    out_dir/loss.png         train and validation curves, redrawn at each evaluation
    out_dir/<LATEST> ...     the checkpoint of the last evaluation (or interruption)
    out_dir/<BEST> ...       the checkpoint with the lowest validation loss so far
                             (files named by `checkpoint.py`)

Read it top to bottom: resolve the settings (`options.py`), lock and check the folder
(`run_dir.py`), set up (`setup.py`: every check, nothing written), claim the folder, then the loop
(`loop.py`), which reports through `report.py`.
"""

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from eqx_gpt._checks import INT32_MAX, is_whole
from eqx_gpt.checkpoint import LATEST, checkpoint_file, delete_checkpoints, read_metadata
from eqx_gpt.errors import TrainingError
from eqx_gpt.training.loop import Run, train_loop
from eqx_gpt.training.options import resolve_options
from eqx_gpt.training.progress import Progress
from eqx_gpt.training.report import Report, TrainResult, describe_start
from eqx_gpt.training.run_dir import (
    METRICS_NAME,
    Metrics,
    RunDirLock,
    check_run_dir,
    check_writable,
    kept_records,
)
from eqx_gpt.training.setup import set_up
from eqx_gpt.training.time_plan import TimePlan
from eqx_gpt.training.validation import final_evaluations

__all__ = ["TrainResult", "train"]


class _StopFlag:
    """Set by SIGINT/SIGTERM so the loop stops between steps; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.set = False
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.set and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.set = True

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(
    settings: dict,
    out_dir: str | Path = "out",
    *,
    resume: bool = False,
    overwrite: bool = False,
    sample_tokens: int = 300,
    log: Callable[[str], None] = print,
    progress: bool = True,
    now: Callable[[], float] = time.monotonic,
) -> TrainResult:
    """Train a GPT in `out_dir`. `settings` are the settings given (any `GPTConfig` field but
    `vocab_size`, any `TrainConfig` field, and `preset`, a name or None), resolved by
    `options.resolve_options`: `train({"max_steps": 100})` is the `cpu` preset with 100 steps, and
    `train({}, out_dir, resume=True)` continues the run there with the checkpoint's settings.

    A folder that already holds a run is refused unless `resume` (continue it; settings given
    anew must agree with the checkpoint) or `overwrite` (delete it first). A folder in use by a
    live run is refused. Raises an `EqxGptError` (one-line message) for bad
    input; Ctrl-C or SIGTERM saves a checkpoint and returns with `interrupted`. `now` is the clock
    that `max_minutes` is measured by (tests pass a simulated one).
    """
    t_start = now()
    if not is_whole(sample_tokens, 0):  # checked here, not after the run when the sample is drawn
        raise TrainingError(f"sample_tokens must be an integer in [0, {INT32_MAX}], got {sample_tokens!r}")
    options = None if resume else resolve_options(settings)  # a fresh run's settings, checked first
    out_dir = Path(out_dir)
    check_writable(out_dir)
    with RunDirLock(out_dir) as lock:
        check_run_dir(out_dir, resume=resume, overwrite=overwrite)
        records = []
        if resume:  # the checkpoint's metadata, read once, and the settings laid over it
            options = resolve_options(settings, read_metadata(checkpoint_file(out_dir, LATEST)))
            records = kept_records(out_dir / METRICS_NAME, options.checkpoint["step"])
        setup, state = set_up(options, out_dir, log=log)
        # Every check has passed: from here on the folder is this run's.
        stale = lock.claim()
        if stale:
            log(f"took over {out_dir}/ from a run that is no longer running ({stale})")
        if overwrite and not resume:
            log(f"--overwrite: deleting the run in {out_dir}/ and starting afresh")
            delete_checkpoints(out_dir)
        plan = TimePlan(
            setup.config.max_minutes, setup.config.max_steps, t_start, final_evals=final_evaluations(setup)
        )
        report = Report(
            log, Metrics(out_dir / METRICS_NAME, records), Progress(enabled=progress), now, t_start
        )
        try:
            describe_start(report, setup, state)
            with _StopFlag() as stop:
                return train_loop(Run(setup, state, report, plan, stopping=lambda: stop.set), sample_tokens)
        finally:
            report.bar.clear()
            report.metrics.close()
