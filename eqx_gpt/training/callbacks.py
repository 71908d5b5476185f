"""Seams in a run: `train(..., callbacks=[...])` calls each callback as the run goes.

    class EarlyStop(Callback):
        def __init__(self, patience: int):
            self.best, self.patience, self.waited = math.inf, patience, 0

        def on_evaluation(self, record: EvaluationRecord) -> None:
            if record.val_loss < self.best:
                self.best, self.waited = record.val_loss, 0
            elif (self.waited := self.waited + 1) >= self.patience:
                raise StopTraining(f"no better val loss in {self.patience} evaluations")

A callback subclasses `Callback` and overrides the methods it wants; the others do nothing. Raising
`StopTraining` from any of them stops the run as Ctrl-C does: the loop stops after the call of
steps in flight, saves the `latest` checkpoint and returns with `interrupted`; the run resumes with
`train(out_dir=..., resume=True)`, with the losses it would have had. Any other exception from a
callback ends the run as an error does (the checkpoints written so far stay).

Ctrl-C, SIGTERM and a callback's `StopTraining` set one flag (`StopFlag`), which the loop reads
between calls of steps and evaluations read between their calls.
"""

import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from eqx_gpt.errors import EqxGptError
from eqx_gpt.training.records import EvaluationRecord, StepRecord, TrainResult


class StopTraining(EqxGptError):
    """Raised by a callback to stop the run cleanly, resumable, as Ctrl-C does; its message is logged.
    Not an error: `train` catches it and returns a result with `interrupted`. An `EqxGptError`, as
    every exception class eqx_gpt defines is (tests/test_exceptions.py)."""


class Callback:
    """What a run tells a callback of yours, each method optional (the defaults do nothing).

    Called in the training process, in the order of the run, between the steps the loop dispatches:
    - `on_step(record)` once per optimiser step, in order, as its figures are read: steps go to the
      device several per call and their figures are read a few steps behind, so a record arrives
      a little after its step ran, never out of order and never skipped.
    - `on_evaluation(record)` after each periodic evaluation, once its checkpoints are written.
    - `on_checkpoint(name, path, step)` after checkpoint `name` ("latest" or "best") of `step` is
      written: `path` is its metadata file (`out_dir/latest.json`), which `load_model` takes.
    - `on_end(result)` when `train` returns, the run finished or stopped (not when it raises).
    Raise `StopTraining` from any of them to stop the run (see the module docstring).
    """

    def on_step(self, record: StepRecord) -> None:
        """A step's figures (`record.figures`: `loss`, `grad_norm`, ...), its learning rate and tokens/s."""

    def on_evaluation(self, record: EvaluationRecord) -> None:
        """A periodic evaluation's figures (`record.val_loss`, `record.train_loss`)."""

    def on_checkpoint(self, name: str, path: Path, step: int) -> None:
        """Checkpoint `name` of `step` was written: `path` is its metadata file, the weights beside it."""

    def on_end(self, result: TrainResult) -> None:
        """The run's result, `result.history` holding every record of the run."""


class Callbacks:
    """A run's callbacks as one: each call goes to every callback in order. A `StopTraining` from
    one is caught here: `log` says why and `request_stop` asks the loop to stop."""

    def __init__(
        self,
        callbacks: Sequence[Callback] = (),
        *,
        request_stop: Callable[[], None] = lambda: None,
        log: Callable[[str], None] = print,
    ):
        for callback in callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks must be Callback instances, got {type(callback).__name__}")
        self.callbacks, self.request_stop, self.log = tuple(callbacks), request_stop, log

    def _each(self, call: Callable[[Callback], None]) -> None:
        for callback in self.callbacks:
            try:
                call(callback)
            except StopTraining as stop:
                reason = f": {stop}" if str(stop) else ""
                self.log(f"{type(callback).__name__} stopped the run{reason}")
                self.request_stop()

    def on_step(self, record: StepRecord) -> None:
        if self.callbacks:
            self._each(lambda c: c.on_step(record))

    def on_evaluation(self, record: EvaluationRecord) -> None:
        self._each(lambda c: c.on_evaluation(record))

    def on_checkpoint(self, name: str, path: Path, step: int) -> None:
        self._each(lambda c: c.on_checkpoint(name, path, step))

    def on_end(self, result: TrainResult) -> None:
        self._each(lambda c: c.on_end(result))  # a stop asked now changes nothing: the run is over


class StopFlag:
    """Set by SIGINT/SIGTERM (while the run holds the main thread's handlers) or by `request()`, so
    the loop stops between steps; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.set = False
        self.previous = {}

    def request(self) -> None:
        """Stop the run at the loop's next check (a callback's `StopTraining`)."""
        self.set = True

    def __call__(self) -> bool:
        """Whether the run was asked to stop."""
        return self.set

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.set and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.set = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
