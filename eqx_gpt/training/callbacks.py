"""Seams in a run: `train(..., callbacks=[...])` tells each callback of the run's events, with a
read-only view of the run (`RunView`).

    class NormAtEvaluation(Callback):
        def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
            norm = optax.global_norm(eqx.filter(run.model, eqx.is_inexact_array))
            run.log(weight_norm=float(norm))  # joins this evaluation's record

    train(callbacks=[NormAtEvaluation(), EarlyStopping(patience=3), every(100, print_step)])

A callback subclasses `Callback` and overrides the methods it wants; the others do nothing. A plain
function `fn(record, run)` is a callback of every step (`every(n, fn)`: of every n-th). The run
owns its callbacks and tells them from one place, in this order:

    on_train_begin(run)                       set-up done, nothing trained yet
    on_evaluation(record, run)                step 0 (or the resumed step) evaluates first
    on_log(record, run)                       each record as metrics.jsonl gets it
    on_checkpoint(name, path, run)            `best` (if it is), then `latest`
    on_step(record, run) ... on_log           every step, in order, a few steps behind the device
    on_evaluation ... on_log ... on_checkpoint at every evaluation
    on_log(final record, run)                 the final validation
    on_end(result, run)                       the run returned (finished or stopped)
    on_exception(error, run)                  instead of on_end: the run raised `error`

In `on_step` and `on_evaluation` a callback may add figures of its own to the record being told
(`run.log(name=value)`): they land in metrics.jsonl, every tracker and `TrainResult.history`. A
callback whose `state()` returns a dict has it saved with every checkpoint and handed back to its
`load_state` when the run resumes (`EarlyStopping` does).

Raising `StopTraining` from a callback stops the run as Ctrl-C does: the loop stops after the call
of steps in flight, saves the `latest` checkpoint and returns with `interrupted`; the run resumes
with `train(out_dir=..., resume=True)`, with the losses it would have had. Any other exception
ends the run as an error does (the checkpoints written so far stay). Ctrl-C, SIGTERM and a
callback's `StopTraining` set one flag (`StopFlag`), which the loop reads between calls of steps.
"""

import json
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jaxtyping import PyTree

from eqx_gpt.errors import EqxGptError, TrainingError
from eqx_gpt.generation.decoder import Decoder, missing_members
from eqx_gpt.generation.generate import generate
from eqx_gpt.generation.sampling import SamplingOptions
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.language_model import LanguageModel, ModelShape
from eqx_gpt.tokenizer import Tokenizer, TokenizerError
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.records import RESERVED_KEYS, EvaluationRecord, Record, StepRecord, TrainResult


class StopTraining(EqxGptError):
    """Raised by a callback to stop the run cleanly, resumable, as Ctrl-C does; its message is logged.
    Not an error: `train` catches it and returns a result with `interrupted`. An `EqxGptError`, as
    every exception class eqx_gpt defines is (tests/test_exceptions.py)."""


@dataclass(frozen=True)
class RunView:
    """What a callback sees of the run when it is told of an event: read-only, a fresh view each time.

    `model` holds the current weights (training mode: `eqx.nn.inference_mode(run.model)` to sample
    or evaluate; `generate` and `evaluate` switch it themselves), `opt_state` the optimiser's state,
    `step` the optimiser steps done. `config` and `model_config` are the run's resolved settings
    (`settings`: both flat, with the preset and the parameter count, as the trackers record them).
    `resumed_at` is the step this session resumed from (None: a fresh run); `history` the records
    so far, a resumed run's earlier ones included. `log(name=value)` adds figures to the record
    being told (in `on_step` and `on_evaluation`); `say(line)` writes a line to the run's log.
    """

    step: int
    model: LanguageModel  # a `GPT`, or a model of one's own
    opt_state: PyTree
    out_dir: Path
    config: TrainConfig
    model_config: GPTConfig | ModelShape  # a model of one's own records its sizes alone
    tokenizer: Tokenizer
    preset: str | None
    n_params: int
    schedule_steps: int  # where the schedule ends (`--max-minutes` may refit it)
    best_val_loss: float | None
    resumed_at: int | None
    stopping: bool  # the run was asked to stop (Ctrl-C, SIGTERM, a callback)
    is_writer: bool  # the first JAX process: the one that writes files and trackers
    _history: Callable[[], tuple[Record, ...]] = field(repr=False, compare=False)
    _log: Callable[[Mapping[str, object]], None] = field(repr=False, compare=False)
    _say: Callable[[str], None] = field(repr=False, compare=False)

    @property
    def history(self) -> tuple[Record, ...]:
        """Every record of the run so far, as metrics.jsonl holds them."""
        return self._history()

    @property
    def settings(self) -> dict[str, Any]:
        """The run's settings flat: the model's and the training's fields, `preset` and `n_params`."""
        return {
            **self.model_config.to_dict(), **self.config.to_dict(), "preset": self.preset,
            "n_params": self.n_params,
        }  # fmt: skip

    def log(self, **figures: float) -> None:
        """Add `figures` (name=number) to the record being told: the step's in `on_step`, the
        evaluation's in `on_evaluation`. A name may not be one of the record's own."""
        self._log(figures)

    def say(self, line: str) -> None:
        """Write `line` to the run's log (what `train(log=...)` prints)."""
        self._say(line)


class Callback:
    """What a run tells a callback of yours, each method optional (the defaults do nothing); the
    module docstring has their order.

    - `on_train_begin(run)` once set-up is done, before the first evaluation.
    - `on_step(record, run)` once per optimiser step (every `every`-th step), in order, as its
      figures are read: steps go to the device several per call and their figures are read a few
      steps behind, so a record arrives a little after its step ran, never out of order, never
      skipped; `run.model` is then the weights of a few steps later.
    - `on_evaluation(record, run)` after each periodic evaluation, before its record is written and
      its checkpoints saved (so figures it logs join the record, and its state the checkpoints).
    - `on_log(record, run)` for each record as metrics.jsonl gets it, figures of callbacks included:
      what a tracker of your own implements.
    - `on_checkpoint(name, path, run)` after checkpoint `name` ("latest" or "best") is written:
      `path` is its metadata file (`out_dir/latest.json`), which `load_model` takes.
    - `on_end(result, run)` when `train` returns, the run finished or stopped.
    - `on_exception(error, run)` when the run raises instead (then re-raised): close what you opened.
    Raise `StopTraining` from any of them to stop the run (see the module docstring).
    """

    every: int = 1  # `on_step` at every this-many-th step

    def on_train_begin(self, run: RunView) -> None:
        """The run is set up (its model built or resumed); nothing trained yet in this session."""

    def on_step(self, record: StepRecord, run: RunView) -> None:
        """A step's figures (`record.figures`: `loss`, `grad_norm`, ...), its learning rate and tokens/s."""

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
        """A periodic evaluation's figures (`record.val_loss`, `record.train_loss`)."""

    def on_log(self, record: Record, run: RunView) -> None:
        """A record as metrics.jsonl got it: a step's, an evaluation's or the final validation's."""

    def on_checkpoint(self, name: str, path: Path, run: RunView) -> None:
        """Checkpoint `name` of `run.step` was written: `path` is its metadata file, the weights beside it."""

    def on_end(self, result: TrainResult, run: RunView) -> None:
        """The run's result, `result.history` holding every record of the run."""

    def on_exception(self, error: BaseException, run: RunView) -> None:
        """The run raised `error` (a bug, a refusal, a second Ctrl-C); `train` re-raises it next."""

    def state(self) -> dict | None:
        """What to save with each checkpoint (JSON-ready) so that a resumed run continues where
        this one stopped; None (the default): nothing."""
        return None

    def load_state(self, state: dict) -> None:
        """Continue from `state`, what `state()` returned when the checkpoint resumed was saved."""


class _Function(Callback):
    """A plain function `fn(record, run)` as a callback of every `every`-th step."""

    def __init__(self, fn: Callable[[StepRecord, RunView], object], every: int):
        self.fn, self.every = fn, every

    def on_step(self, record: StepRecord, run: RunView) -> None:
        self.fn(record, run)


def every(n: int, fn: Callable[[StepRecord, RunView], object]) -> Callback:
    """A callback that calls `fn(record, run)` at every `n`-th step (a `Callback` of your own sets
    its `every` attribute instead)."""
    if isinstance(fn, Callback) or not callable(fn):
        raise TypeError(
            f"every(n, fn) takes a function fn(record, run), got {fn!r}; a Callback sets its `every`"
        )
    _check_every(n, "every(n, fn)")
    return _Function(fn, n)


def _check_every(n: object, where: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TypeError(f"{where}: every must be a whole number >= 1, got {n!r}")


class EarlyStopping(Callback):
    """Stop the run (resumably, as `StopTraining` does) when the evaluation figure `monitor` has not
    improved by more than `min_delta` for `patience` evaluations in a row. `mode` "min" for a loss,
    "max" for a figure that should rise. Its count survives a stop and a resume (`state`)."""

    def __init__(
        self, monitor: str = "val_loss", *, patience: int = 3, min_delta: float = 0.0, mode: str = "min"
    ):
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(
                f"EarlyStopping: monitor must be a figure's name such as 'val_loss', got {monitor!r}"
            )
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise TypeError(f"EarlyStopping: patience must be a whole number >= 1, got {patience!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, int | float) or not min_delta >= 0:
            raise TypeError(f"EarlyStopping: min_delta must be a number >= 0, got {min_delta!r}")
        if mode not in ("min", "max"):
            raise TypeError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, float(min_delta), mode
        self.best: float | None = None
        self.waited = 0

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
        if self.monitor not in record.figures:
            raise TrainingError(
                f"EarlyStopping monitors {self.monitor!r}, which an evaluation does not hold; choose one of "
                f"{sorted(record.figures)}"
            )
        value = record.figures[self.monitor]
        sign = 1.0 if self.mode == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            raise StopTraining(
                f"{self.monitor} has not improved on {self.best:.4f} by more than {self.min_delta:g} in "
                f"{self.patience} evaluation{'s' if self.patience > 1 else ''}"
            )

    def state(self) -> dict:
        return {"best": self.best, "waited": self.waited}

    def load_state(self, state: dict) -> None:
        self.best, self.waited = state.get("best"), int(state.get("waited", 0))


class SampleText(Callback):
    """At each evaluation, a sample of `tokens` tokens continuing `prompt` (a newline by default),
    drawn from the model in memory (no checkpoint is read) at `temperature` with the run's seed;
    written to the run's log and kept in `samples` as `(step, text)`."""

    def __init__(self, tokens: int = 200, *, prompt: str = "\n", temperature: float = 0.8):
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise TypeError(f"SampleText: tokens must be a whole number >= 1, got {tokens!r}")
        if not isinstance(prompt, str):
            raise TypeError(f"SampleText: prompt must be a str, got {prompt!r}")
        self.tokens, self.prompt, self.temperature = tokens, prompt, temperature
        self.samples: list[tuple[int, str]] = []

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
        model: Any = run.model
        missing = missing_members(model)
        if missing:  # a model of one's own without a cache cannot be sampled from
            run.say(
                f"SampleText: the {type(model).__name__} is not a Decoder (it lacks {', '.join(missing)})"
            )
            return
        text = sample_text(
            model, run.tokenizer, self.tokens, seed=run.config.seed, temperature=self.temperature,
            prompt=self.prompt,
        )  # fmt: skip
        self.samples.append((record.step, text))
        run.say(f"sample at step {record.step}:\n{text}")


def sample_text(
    model: Decoder,
    tokenizer: Tokenizer,
    n_tokens: int,
    *,
    seed: int,
    temperature: float = 0.8,
    prompt: str = "\n",
) -> str:
    """A short continuation of `prompt` (of token 0, in a corpus without its characters), to show
    what the model learned."""
    try:
        ids = tokenizer.encode(prompt)
    except TokenizerError:
        ids = [0]
    options = SamplingOptions(temperature=temperature)
    out = generate(model, ids or [0], n_tokens, key=jax.random.key(seed), options=options)
    return tokenizer.decode(np.asarray(out).reshape(-1).tolist())


def as_callbacks(callbacks: object) -> tuple[Callback, ...]:
    """`train(callbacks=...)` as callbacks: a list of `Callback`s and functions `fn(record, run)`
    (each a callback of every step); anything else is a one-line `TypeError`."""
    if isinstance(callbacks, Callback | str | bytes) or not isinstance(callbacks, Sequence):
        raise TypeError(
            f"callbacks must be a list of Callback instances or functions fn(record, run), got {callbacks!r}"
        )
    found = []
    for callback in callbacks:
        if not isinstance(callback, Callback):
            if not callable(callback):
                raise TypeError(
                    f"callbacks must be Callback instances or functions fn(record, run), got "
                    f"{type(callback).__name__} {callback!r}"
                )
            callback = _Function(callback, 1)
        _check_every(callback.every, f"callback {type(callback).__name__}")
        found.append(callback)
    return tuple(found)


def _name(callback: Callback) -> str:
    """How a message and a checkpoint's states name `callback`: its class's name, or its function's."""
    if isinstance(callback, _Function):
        return getattr(callback.fn, "__name__", type(callback.fn).__name__)
    return type(callback).__name__


class Callbacks:
    """A run's callbacks as one, each call to every callback in order; the one place a run tells them.
    A `StopTraining` from one is caught here: the run stops (`request_stop`) and `stopped_by` says
    who and why. Figures a callback logs in `on_step` or `on_evaluation` (`RunView.log`, which is
    `add_figures`) are collected for the record being told, and returned to the run."""

    def __init__(
        self, callbacks: Sequence[Callback] = (), *, request_stop: Callable[[], None] = lambda: None
    ):
        self.callbacks, self.request_stop = tuple(callbacks), request_stop
        self.stopped_by: str | None = None
        self._record: Record | None = None  # the record that callbacks may add figures to, while told
        self._added: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _each(self, call: Callable[[Callback], None], callbacks: Sequence[Callback] | None = None) -> None:
        for callback in self.callbacks if callbacks is None else callbacks:
            try:
                call(callback)
            except StopTraining as stop:
                if self.stopped_by is None:
                    self.stopped_by = f"{_name(callback)} stopped the run" + (
                        f": {stop}" if str(stop) else ""
                    )
                self.request_stop()

    def add_figures(self, figures: Mapping[str, object]) -> None:
        """`RunView.log`: figures for the record being told, refused in one line when there is none
        or a figure is not a named number."""
        if self._record is None:
            raise TrainingError(
                "run.log(...) adds figures to a step's or an evaluation's record: call it in on_step or "
                "on_evaluation"
            )
        for name, value in figures.items():
            if name in RESERVED_KEYS or name in self._record.figures:
                raise TrainingError(
                    f"run.log({name}=...): {name!r} is the run's own; give your figure another name"
                )
            try:
                number = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                number = None
            if number is None or isinstance(value, bool | str):
                raise TrainingError(f"run.log({name}=...) takes a number, got {value!r}")
            self._added[name] = number

    def _with_figures(self, record: Record, call: Callable[[Callback], None], due) -> dict[str, float]:
        """Tell the callbacks `due` of `record` with `call`; the figures they logged for it."""
        self._record, self._added = record, {}
        try:
            self._each(call, [c for c in self.callbacks if due(c)])
        finally:
            self._record = None
        return self._added

    def on_train_begin(self, run: RunView) -> None:
        self._each(lambda c: c.on_train_begin(run))

    def on_step(self, record: StepRecord, view_now: Callable[[], RunView]) -> dict[str, float]:
        """Tell the callbacks due at this step (`every`), with the view `view_now` makes (only if
        one is due: most steps of a cadence build none); the figures they logged."""
        due = lambda c: record.step % c.every == 0  # noqa: E731
        if not any(due(c) for c in self.callbacks):
            return {}
        view = view_now()
        return self._with_figures(record, lambda c: c.on_step(record, view), due)

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> dict[str, float]:
        return self._with_figures(record, lambda c: c.on_evaluation(record, run), lambda c: True)

    def on_log(self, record: Record, run: RunView) -> None:
        self._each(lambda c: c.on_log(record, run))

    def on_checkpoint(self, name: str, path: Path, run: RunView) -> None:
        self._each(lambda c: c.on_checkpoint(name, path, run))

    def on_end(self, result: TrainResult, run: RunView) -> None:
        """Every callback is told, even if one raises (the first error is raised after)."""
        errors = []
        for callback in self.callbacks:
            try:
                callback.on_end(result, run)
            except StopTraining:  # the run is over: there is nothing left to stop
                continue
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def on_exception(self, error: BaseException, run: RunView) -> None:
        """Every callback is told; an error of its own is dropped (the run's is the one raised)."""
        for callback in self.callbacks:
            try:
                callback.on_exception(error, run)
            except Exception:
                continue

    def states(self) -> dict[str, dict]:
        """Each callback's `state()`, by a name (its class's, numbered from the second of a class on),
        for a checkpoint; refused in one line if a state is not JSON-ready."""
        states = {}
        for key, callback in self._keyed():
            state = callback.state()
            if state is None:
                continue
            try:
                json.dumps(state, allow_nan=True)
            except (TypeError, ValueError) as e:
                raise TrainingError(f"{key}.state() must return a JSON-ready dict: {e}") from None
            states[key] = state
        return states

    def load_states(self, states: Mapping[str, dict]) -> None:
        """Hand each callback its state from the checkpoint resumed (by the same names as `states`)."""
        for key, callback in self._keyed():
            if isinstance(states.get(key), dict):
                callback.load_state(states[key])

    def _keyed(self) -> list[tuple[str, Callback]]:
        seen: dict[str, int] = {}
        keyed = []
        for callback in self.callbacks:
            name = _name(callback)
            seen[name] = seen.get(name, 0) + 1
            keyed.append((name if seen[name] == 1 else f"{name}-{seen[name]}", callback))
        return keyed


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
