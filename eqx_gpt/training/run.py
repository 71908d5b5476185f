"""A training run, start to end: `train(config, model, ..., callbacks=...)`.

    out_dir/metrics.jsonl    one JSON object per line (`records.py`): {"step", "loss", "grad_norm",
                             "lr", "tokens_per_s"} for logged steps, {"step", "train_loss",
                             "val_loss", "elapsed_s"} at evaluations, and the final validation last
    out_dir/loss.png         train and validation curves, redrawn at each evaluation, and the
                             final validation's point
    out_dir/tensorboard/     with `tracker="tensorboard"`: the records of metrics.jsonl as event
                             files (`trackers.py`); `tracker="wandb"` writes out_dir/wandb/
    out_dir/<LATEST> ...     the checkpoint of the last evaluation (or interruption)
    out_dir/<BEST> ...       the checkpoint with the lowest validation loss so far
                             (files named by `checkpoint.py`)

Read it top to bottom, as a run goes:
- the start (`train`): resolve the settings (`options.py`), lock and check the folder
  (`run_dir.py`), set up (`setup.py`: every check, nothing written), claim the folder, say what
  it runs; then `Run`, one run in progress, shared by the loop, its checkpoints and its end;
- the loop (`train_loop`): evaluate where due, dispatch steps, read their figures, fit the
  schedule to the time, until the schedule's end or a stop, reporting through `report.py` (and
  the callbacks, `callbacks.py`). Steps go to the device in calls of up to `STEPS_PER_CALL` (one
  compiled program for any count, so how steps are grouped never changes a bit); the loop never
  waits for a step's figures, which are read `READ_LAG` steps later. The loop alone decides when
  the run stops: at the end of its schedule, at `--max-minutes`, on Ctrl-C, SIGTERM or a
  callback's `StopTraining`, or on a non-finite loss;
- the checkpoints (`save`): `latest` at each evaluation (and when it stops), `best` at each new
  lowest validation loss (files named and written atomically by `eqx_gpt.checkpoint`);
- the end: `finish` (the final validation, a sample, the summary) when the run reached its
  schedule's end, `interrupted` (a checkpoint and how to resume) when it was asked to stop;
  either way a `TrainResult`.
"""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from eqx_gpt.checkpoint import (
    BEST,
    LATEST,
    checkpoint_file,
    delete_checkpoints,
    load_model,
    read_metadata,
    save_checkpoint,
)
from eqx_gpt.errors import TrainingError
from eqx_gpt.evaluation import Shown
from eqx_gpt.generation.decoder import missing_members
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.language_model import LanguageModel, check_language_model
from eqx_gpt.model.lora import has_lora
from eqx_gpt.peft import save_run_adapters
from eqx_gpt.streams import TRAIN_BATCHES
from eqx_gpt.training.callbacks import Callback, Callbacks, RunView, StopFlag, as_callbacks, sample_text
from eqx_gpt.training.config import TrainConfig, resume_command, setting
from eqx_gpt.training.data import batch_reader, window_starts
from eqx_gpt.training.evaluate import (
    RunEvaluations,
    evaluate_run,
    final_evaluations,
    final_validation,
    plan_evaluations,
)
from eqx_gpt.training.options import (
    MODEL_FIELDS,
    TRAIN_FIELDS,
    RunOptions,
    check_printable,
    check_train_arguments,
    given_settings,
    resolve_options,
)
from eqx_gpt.training.parallel import shard_rows, start_jax
from eqx_gpt.training.records import EvaluationRecord, FinalRecord, Record, StepRecord, TrainResult
from eqx_gpt.training.report import Progress, Report
from eqx_gpt.training.run_dir import METRICS_NAME, Metrics, RunDirLock, check_run_dir, kept_records
from eqx_gpt.training.setup import RunSetup, TrainState, set_up
from eqx_gpt.training.step import describe_optimizer, learning_rate
from eqx_gpt.training.time_plan import TimePlan, eval_budget
from eqx_gpt.training.trackers import Tracker, tracker_callbacks

CALLBACK_STATES = "callbacks"  # the checkpoint's key for each callback's `state()`, by name
READ_LAG = 2  # read a logged loss this many steps after dispatching it, so the device never idles
STEPS_PER_CALL = 8  # optimiser steps per dispatch at most (`make_train_steps`): 1.2-1.3x on small models
# Fewer steps per call when steps are slower, since a stop waits for the call in flight; but each
# call maps and faults in its scratch afresh (164 MB at the default step: 42,000 page faults, about
# 100 ms of system time on a 2-core EPYC), so a call of 300 ms steps still holds 8 of them.
SECONDS_PER_CALL = 2.5
PLAN_AFTER = 20  # steps timed after compilation before fitting the schedule to max_minutes

AUTO = (
    "auto"  # `train(preset=AUTO)`: `cpu`, `finetune-shakespeare` with `init_from`, on resume the checkpoint's
)


def train(
    config: TrainConfig | None = None,
    model: GPTConfig | LanguageModel | str | None = None,
    *,
    preset: str | None = AUTO,
    out_dir: str | Path = "out",
    resume: bool = False,
    overwrite: bool = False,
    sample_tokens: int = 300,
    log: Callable[[str], None] = print,
    progress: bool = True,
    now: Callable[[], float] = time.monotonic,
    callbacks: Sequence[Callback | Callable] = (),
    **options: object,
) -> TrainResult:
    """Train a GPT, or a model of your own, in `out_dir` and return it, its tokenizer and the run's
    figures.

    Where each setting comes from: the dataclass defaults, then the preset, then what is passed.
    `preset` is a name of `PRESETS`, None for the defaults alone, or `AUTO` (`cpu`, or
    `finetune-shakespeare` with `init_from`). A config passed gives the fields it was constructed
    with, which override the preset's: `train(TrainConfig(max_steps=40))` is the `cpu` preset's
    recipe for 40 steps, as `train(max_steps=40)` is (pass `preset=None` for the dataclass defaults
    under it). `model` likewise gives the model fields it was constructed with (its `vocab_size` is
    not read: the tokenizer's is). `model` may also be a model of your own (a `LanguageModel`, such
    as `MyDecoder(...)`: trained as it is, with the preset's recipe; its `vocab_size` must be the
    tokenizer's; to resume its run pass a model of its class again, the skeleton the checkpoint is
    read into) or `"MODULE:FUNCTION"`, a function called as `FUNCTION(vocab_size, key=key)` that
    the run records, as `train.py --model` does. A model of your own has its own shape, so model
    settings beside it are refused. `options` are single settings by name, any `TrainConfig` field or
    `GPTConfig` field but `vocab_size`, and override both. The run's first lines name the preset
    and every setting given that changed it.

    A folder that already holds a run is refused unless `resume` (continue it with the
    checkpoint's settings; what is passed anew must agree with them, but for how long and how
    often it reports) or `overwrite` (delete it first). A folder in use by a live run is refused.
    Bad input raises an `EqxGptError` (a `ValueError`) with a one-line message; a setting of the
    wrong name raises `TypeError`. Ctrl-C or SIGTERM, or a callback raising `StopTraining`, saves a
    checkpoint and returns with `interrupted`. `callbacks` (`Callback`s, or functions
    `fn(record, run)` of every step) are told of the run's events (`callbacks.py`); a tracker named
    by `tracker` is one more. `now` is the clock that `max_minutes` is measured by (tests pass a
    simulated one).

    Before anything touches a device, it joins a multi-host run where the environment says this
    process is one of several (`parallel.start_jax`), as `train.py`, which calls it, does.
    """
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    instance = None
    if isinstance(model, str):
        options = {"model": model, **options}
        model = None
    elif model is not None and not isinstance(model, GPTConfig):
        check_language_model(model, "train()'s model")  # a model of one's own, or a one-line error
        instance, model = model, None
    unknown = sorted(set(options) - {*MODEL_FIELDS, *TRAIN_FIELDS})
    if unknown:
        raise TypeError(
            f"train() got unknown setting(s) {unknown}; settings are TrainConfig fields and GPTConfig "
            f"fields but vocab_size"
        )
    told = as_callbacks(callbacks)  # checked before anything is written
    settings = given_settings(config, model, options)
    if preset != AUTO:
        settings["preset"] = preset
    return _train(
        settings, out_dir, resume=resume, overwrite=overwrite, sample_tokens=sample_tokens, log=log,
        progress=progress, now=now, callbacks=told, instance=instance,
    )  # fmt: skip


def _train(
    settings: dict,
    out_dir: str | Path,
    *,
    resume: bool,
    overwrite: bool,
    sample_tokens: int,
    log: Callable[[str], None],
    progress: bool,
    now: Callable[[], float],
    callbacks: tuple[Callback, ...] = (),
    instance: Any = None,
) -> TrainResult:
    """`train` with its settings by name (`options.resolve_options`): JAX started, the settings and
    the folder checked, set up, then the run (`_run`). `instance` is a model of the caller's own."""
    out_dir = check_train_arguments(
        out_dir=out_dir, resume=resume, overwrite=overwrite, sample_tokens=sample_tokens, log=log,
        progress=progress, now=now,
    )  # fmt: skip
    start_jax()
    t_start = now()
    if log is print:  # a path its lines cannot print: refused now, not at the line that names it
        check_printable({"out_dir": out_dir, **{k: settings.get(k) for k in ("data", "init_from")}})
    # a fresh run's settings, checked first
    run_options = None if resume else resolve_options(settings, instance=instance)
    # The trackers `tracker` names, made now: a missing extra is refused before anything is written.
    trackers = () if run_options is None else tracker_callbacks(run_options.trackers, callbacks)
    with RunDirLock(out_dir) as lock:
        found = check_run_dir(out_dir, resume=resume, overwrite=overwrite)
        records = []
        if resume:  # the checkpoint's metadata, and the settings laid over it
            meta = read_metadata(resumed_checkpoint(out_dir, log))
            run_options = resolve_options(settings, meta, instance=instance)
            trackers = tracker_callbacks(run_options.trackers, callbacks)
            records = kept_records(out_dir / METRICS_NAME, meta["step"])
        assert run_options is not None
        setup, state = set_up(run_options, out_dir, log=log)
        # Every check has passed: from here on the folder is this run's.
        stale = lock.claim()
        if stale:
            log(f"took over {out_dir}/ from a run that is no longer running ({stale})")
        if overwrite and found is not None:
            log(f"{setting('overwrite', True)}: deleting the run in {out_dir}/ ({found}) and starting afresh")
            delete_checkpoints(out_dir)
        with Report(
            log, Metrics(out_dir / METRICS_NAME, records), Progress(enabled=progress), now, t_start,
            tokens_per_step=setup.tokens_per_step, log_interval=setup.config.log_interval,
            plot=out_dir / "loss.png",
        ) as report:  # fmt: skip
            return _run(setup, state, report, run_options, (*callbacks, *trackers), t_start, sample_tokens)


def _run(
    setup: RunSetup,
    state: TrainState,
    report: Report,
    options: RunOptions,
    callbacks: tuple[Callback, ...],
    t_start: float,
    sample_tokens: int,
) -> TrainResult:
    """The run, once its folder is claimed: its callbacks told it began, the loop, and its end."""
    evaluations = plan_evaluations(setup)
    plan = TimePlan(
        setup.config.max_minutes, setup.config.max_steps, t_start,
        final_evals=final_evaluations(evaluations), sample=sample_tokens > 0,
    )  # fmt: skip
    stop = StopFlag()
    told = Callbacks(callbacks, request_stop=stop.request)
    if options.checkpoint is not None:  # each callback's state as the checkpoint resumed saved it
        told.load_states(options.checkpoint.get(CALLBACK_STATES) or {})
    run = Run(setup, state, report, plan, evaluations, told, stopping=stop)
    _describe_start(run, options)
    with stop:
        try:
            told.on_train_begin(run.view())
            result = train_loop(run, sample_tokens)
        except BaseException as error:  # trackers close, marked failed (not on a second Ctrl-C)
            told.on_exception(error, run.view())
            raise
    told.on_end(result, run.view())
    return result


def resumed_checkpoint(out_dir: Path, log: Callable[[str], None]) -> Path:
    """The checkpoint a resumed run starts from: `latest`, or `best` where a run ended between the
    two (`best` is written first, at the same step)."""
    latest, best = checkpoint_file(out_dir, LATEST), checkpoint_file(out_dir, BEST)
    if not latest.exists() and best.exists():
        log(f"{out_dir}/ holds no {LATEST} checkpoint, only {BEST}: resuming from {best}")
        return best
    return latest


def _describe_start(run: "Run", options: RunOptions) -> None:
    """The lines a run starts with: what it trains, from which settings, how, for how long, and from where."""
    setup, report = run.setup, run.report
    c, m, preset = setup.config, setup.model_config, setup.checkpoint_meta.get("preset")
    shape = (
        f"{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads" if isinstance(m, GPTConfig)
        else f"a {type(run.state.model).__name__}" + (f" (--model {c.model})" if c.model else "")
    )  # fmt: skip
    report.log(
        f"model: {setup.checkpoint_meta['n_params'] / 1e6:.2f}M parameters, {shape}, context "
        f"{m.context_length}; batch {c.batch_size} "
        f"({setup.tokens_per_step:,} tokens/step) on {setup.mesh.size} {jax.devices()[0].platform} "
        f"device{'s' if setup.mesh.size > 1 else ''}" + (f"; preset {preset}" if preset else "")
    )
    report.log(options.describe())
    report.log(f"schedule: {describe_optimizer(c, run.state.schedule_steps)}")
    if c.max_minutes:
        report.log(f"time limit: {c.max_minutes:g} min; the schedule is refitted to the steps that fit")
    if setup.resumed_from is not None:
        report.log(f"resuming {setup.resumed_from} at step {setup.start}")
    trackers = [c for c in run.callbacks.callbacks if isinstance(c, Tracker)]
    if trackers:  # where to look (only the first process writes them)
        report.log("trackers: " + "; ".join(t.where(setup.out_dir) for t in trackers))


@dataclass
class Run:
    """One run in progress: what was resolved, what changes, how it reports, its time plan, its
    evaluations, its callbacks (which it alone tells, `Callbacks`), and whether Ctrl-C, SIGTERM or
    a callback asked it to stop. `last_read` is the latest step whose figures were read."""

    setup: RunSetup
    state: TrainState
    report: Report
    plan: TimePlan
    evaluations: RunEvaluations
    callbacks: Callbacks
    stopping: Callable[[], bool] = lambda: False
    last_read: StepRecord | None = None

    def view(self) -> RunView:
        """What the callbacks see of the run now (read-only)."""
        setup, state = self.setup, self.state
        return RunView(
            step=state.step, model=state.model, opt_state=state.opt_state, out_dir=setup.out_dir,
            config=setup.config, model_config=setup.model_config, tokenizer=setup.tokenizer,
            preset=setup.checkpoint_meta.get("preset"), n_params=setup.checkpoint_meta["n_params"],
            schedule_steps=state.schedule_steps,
            best_val_loss=None if math.isinf(state.best_val) else state.best_val,
            resumed_at=setup.start if setup.resumed_from is not None else None, stopping=self.stopping(),
            is_writer=jax.process_index() == 0, _history=self.report.history, _log=self.callbacks.add_figures,
            _say=self.report.say,
        )  # fmt: skip


def train_loop(run: Run, sample_tokens: int) -> TrainResult:
    """Evaluate where due, then step until the schedule's end or a stop; then finish, or save and
    say how to resume."""
    setup, state, c = run.setup, run.state, run.setup.config
    run.report.start_rate(setup.start, run.report.t_start)
    # The start of a run, and a resumption from a checkpoint whose evaluation was interrupted.
    if (state.step % c.eval_interval == 0 or state.step == state.schedule_steps) and not state.evaluated:
        evaluate_and_save(run)
    while state.step < state.schedule_steps and not run.stopping():
        # The first call is one step alone: it compiles, and the time plan starts after it.
        # Calls end at the next evaluation.
        next_eval = (state.step // c.eval_interval + 1) * c.eval_interval
        first = state.step == setup.start
        n = min(steps_per_call(run), state.schedule_steps - state.step, next_eval - state.step)
        if first and run.report.bar.tty:  # the first call compiles: say so, in place, while it does
            run.report.bar.update("compiling the training step")
        dispatch_steps(run, n)
        if first:
            run.plan.start_timing(state.step, run.report.compiled(state.step))
        elif state.step >= _timed_from(run) + PLAN_AFTER:
            # Refitted after every call: calls run ahead of the steps done, so the first fit reads
            # the rate high (798 steps planned where 650 fit in a 3-minute run, cut at step 500).
            fit_to_time(run, announce=state.step - n < _timed_from(run) + PLAN_AFTER)
        if (
            state.step // c.log_interval > (state.step - n) // c.log_interval
            or state.step == state.schedule_steps
        ):
            read_losses(run, state.step - READ_LAG)
        if run.plan.out_of_time(run.report.now()) and state.step < state.schedule_steps:
            state.schedule_steps = state.step
            run.report.log(f"time limit reached at step {state.step}")
        if state.step % c.eval_interval == 0 or state.step == state.schedule_steps:
            if evaluate_and_save(run) and state.step < state.schedule_steps:
                fit_to_time(run, announce=False)
    read_losses(run, state.step)
    if run.stopping() and not (state.step == state.schedule_steps and state.evaluated):
        return interrupted(run)
    return finish(run, sample_tokens)


def read_losses(run: Run, until: int) -> None:
    """Read the figures of the steps up to `until`, tell the callbacks of each (`on_step`) and record
    the logged ones (and those a callback added figures to); stop the run on a non-finite loss."""
    state, c = run.state, run.setup.config
    records, bad = run.report.read_losses(until, state.schedule_steps, run.plan)
    if bad is not None:
        step, loss = bad
        raise TrainingError(
            f"loss became {loss} at step {step}; stopped. {last_good(run)}. Try a lower "
            f"{setting('lr')} or {setting('grad_clip')}"
        )
    for record in records:
        added = run.callbacks.on_step(record, run.view) if run.callbacks else {}
        record = run.last_read = record.with_figures(added)
        if added or record.step % c.log_interval == 0 or record.step == state.schedule_steps:
            write(run, record)


def write(run: Run, record: Record) -> None:
    """Record `record` in metrics.jsonl, then tell the callbacks (`on_log`): every record goes here."""
    run.report.write(record)
    if run.callbacks:
        run.callbacks.on_log(record, run.view())


def dispatch_steps(run: Run, n: int) -> None:
    """Queue `n` optimiser steps from the current step on the device, in one call (not waiting)."""
    setup, state, c = run.setup, run.state, run.setup.config
    length = setup.model_config.context_length + 1  # a window: the input and its targets
    steps = list(range(state.step, state.step + n))
    lrs = [learning_rate(s, c, state.schedule_steps) for s in steps]
    starts = np.full((STEPS_PER_CALL, c.batch_size), -1, np.int64)  # -1: an unused slot, zeros
    for i, s in enumerate(steps):
        starts[i] = window_starts(
            s, n_tokens=len(setup.train_ids), seed=c.seed, stream=TRAIN_BATCHES, batch_size=c.batch_size,
            length=length,
        )  # fmt: skip
    # Each process reads only its own devices' rows of the windows from the shards.
    reader = batch_reader(setup.train_ids, starts, length)
    batches = shard_rows(reader, (*starts.shape, length), setup.mesh, 1)
    step_ids, rates = np.zeros(STEPS_PER_CALL, np.int32), np.zeros(STEPS_PER_CALL, np.float32)
    step_ids[:n], rates[:n] = steps, lrs
    state.model, state.opt_state, figures = setup.train_steps(
        state.model, state.opt_state, batches, step_ids, rates, np.int32(n)
    )
    state.step += n
    run.report.dispatched([s + 1 for s in steps], figures, lrs)


def evaluate_and_save(run: Run) -> bool:
    """Evaluate (`evaluate_run`: the train loss on fixed windows; the validation loss over the whole
    split, in non-overlapping windows, so that no sampling noise can pick the best checkpoint, or
    on a larger corpus over the same evenly spread windows each time, `--eval-tokens`), log it,
    checkpoint `latest` (and `best` if it is), redraw the loss plot and tell the callbacks.
    Returns False, having recorded nothing, if the run was asked to stop before the evaluation
    finished."""
    setup, state, report = run.setup, run.state, run.report
    read_losses(run, state.step)
    t0 = report.now()
    figures = evaluate_run(
        run.evaluations, state.model, run.stopping, Shown(report.bar, f"step {state.step} evaluation")
    )
    if figures is None:
        return False
    if state.step > setup.start:
        run.plan.add_evaluation(report.now() - t0)
    if not all(math.isfinite(value) for value in figures.values()):
        raise TrainingError(
            f"evaluation loss became non-finite at step {state.step}; stopped. {last_good(run)}"
        )
    val = figures["val_loss"]
    is_best = val < state.best_val
    state.best_val = min(state.best_val, val)
    state.last_eval = (state.step, val)
    # The callbacks first (the figures they add join the record, their state the checkpoints), then
    # the record, then `best`, then `latest`: a kill before `latest` is written leaves it at the
    # previous evaluation, whose resumption redoes this step (and drops the records after it).
    record = EvaluationRecord(state.step, figures, round(report.elapsed(), 2))
    if run.callbacks:
        record = record.with_figures(run.callbacks.on_evaluation(record, run.view()))
    write(run, record)
    saved = [(name, save(run, name)) for name in ((BEST, LATEST) if is_best else (LATEST,))]
    for name, path in saved:  # told once both are written: a callback that raises loses neither
        run.callbacks.on_checkpoint(name, path, run.view())
    report.evaluated(state.step, dict(record.figures), is_best)
    return True


def _sample(run: Run, sample_tokens: int) -> str | None:
    """The run's closing sample, from its best checkpoint (else the last step's model): None, said
    in a line, for a model of one's own that is not a `Decoder` (generation needs its cache)."""
    setup, state = run.setup, run.state
    missing = missing_members(state.model)
    if missing:
        run.report.log(
            f"no sample: the {type(state.model).__name__} is not a Decoder (it lacks {', '.join(missing)})"
        )
        return None
    has_best = checkpoint_file(setup.out_dir, BEST).exists()
    like = None if isinstance(state.model, GPT) else state.model
    best: Any = load_model(setup.out_dir, like=like)[0] if has_best else state.model
    return sample_text(best, setup.tokenizer, sample_tokens, seed=setup.config.seed)


def fit_to_time(run: Run, *, announce: bool) -> None:
    """Refit the schedule's length to the steps that fit before `--max-minutes` runs out."""
    # Until one is timed, price an evaluation as its forward passes (a third of a step's work per
    # step's worth of tokens): the fixed training windows, then the validation tokens it reads.
    setup, state, c, now = run.setup, run.state, run.setup.config, run.report.now()
    val_tokens = min(len(setup.val_ids), eval_budget(c.eval_tokens, setup.model_config))
    eval_cost = (len(setup.eval_train_rows) / c.batch_size + val_tokens / setup.tokens_per_step) / 3
    schedule_steps = run.plan.fit(state.step, state.schedule_steps, now, c.eval_interval, eval_cost)
    if announce:
        fits = run.plan.steps_that_fit(state.step, now, c.eval_interval, eval_cost)
        if fits is not None and fits > c.max_steps:
            # More steps than the recipe wants: a preset's max_steps is where its model stops gaining.
            run.report.log(
                f"time plan: {fits} steps would fit in {c.max_minutes:g} min; the run stops at {c.max_steps}"
            )
        elif schedule_steps != state.schedule_steps:
            run.report.log(
                f"time plan: {schedule_steps} steps fit in {c.max_minutes:g} min; schedule refitted"
            )
    state.schedule_steps = schedule_steps


def steps_per_call(run: Run) -> int:
    """Steps in the next call: 1 until the step rate is measured, then as many as run in about
    `SECONDS_PER_CALL`, at most `STEPS_PER_CALL`. A stop waits for the call in flight, so slow steps
    go one at a time. Every group size runs the same compiled program (`make_train_steps`), so the
    grouping never changes what a step computes."""
    rate = run.plan.steps_per_second(run.state.step, run.report.now())
    return 1 if rate is None else max(1, min(STEPS_PER_CALL, int(SECONDS_PER_CALL * rate)))


def _timed_from(run: Run) -> int:
    """The step the time plan started timing at (after the first call, which compiles)."""
    assert run.plan.timed_from is not None
    return run.plan.timed_from[0]


def save(run: Run, name: str) -> Path:
    """Write checkpoint `name` (`LATEST` or `BEST`) of the run at its current step, with each
    callback's state; return its metadata file."""
    setup, state = run.setup, run.state
    val_step, val_loss = state.last_eval if state.last_eval is not None else (None, None)
    states = run.callbacks.states()
    path = save_checkpoint(
        setup.out_dir, name, state.model, state.opt_state, step=state.step, tokenizer=setup.tokenizer,
        train_config=setup.config.to_dict(), val_loss=val_loss, val_loss_step=val_step,
        best_val_loss=None if math.isinf(state.best_val) else state.best_val,
        schedule_steps=state.schedule_steps, **setup.checkpoint_meta,
        **({CALLBACK_STATES: states} if states else {}),
    )  # fmt: skip
    if has_lora(state.model):  # and its adapters: PEFT's format for a GPT, eqx_gpt's for one's own
        base = setup.config.init_from if isinstance(state.model, GPT) else setup.config.model
        save_run_adapters(setup.out_dir, name, state.model, base=str(base or type(state.model).__name__))
    if name == LATEST:
        state.last_saved = state.step
    return path


def last_good(run: Run) -> str:
    """Which checkpoint a run that failed can resume from, for its error message."""
    latest, saved = checkpoint_file(run.setup.out_dir, LATEST), run.state.last_saved
    return f"Last good checkpoint: {f'{latest} (step {saved})' if saved is not None else 'none'}"


def result(run: Run, *, val_loss: float | None, interrupted: bool, sample: str | None) -> TrainResult:
    """The run's `TrainResult`, its history every record of `metrics.jsonl`."""
    state = run.state
    return TrainResult(
        state.model, run.setup.tokenizer, state.step, val_loss=val_loss,
        best_val_loss=None if math.isinf(state.best_val) else state.best_val, elapsed_s=run.report.elapsed(),
        interrupted=interrupted, sample=sample, out_dir=run.setup.out_dir, history=run.report.history(),
    )  # fmt: skip


def interrupted(run: Run) -> TrainResult:
    """Ctrl-C, SIGTERM or a callback's stop: log the step reached, checkpoint it, say how to resume."""
    report, state, out_dir = run.report, run.state, run.setup.out_dir
    if report.unlogged(run.last_read):  # the step a run stopped at is always recorded
        assert run.last_read is not None
        write(run, run.last_read)
    if state.last_saved is None or state.step > state.last_saved:
        run.callbacks.on_checkpoint(LATEST, save(run, LATEST), run.view())
    if run.callbacks.stopped_by is not None:
        report.log(run.callbacks.stopped_by)
    report.log(
        f"interrupted at step {state.step}; saved {checkpoint_file(out_dir, LATEST)}. Resume with: "
        f"{resume_command(out_dir)}"
    )
    val = state.last_eval[1] if state.last_eval is not None else None
    return result(run, val_loss=val, interrupted=True, sample=None)


def finish(run: Run, sample_tokens: int) -> TrainResult:
    """The end of a run that reached its schedule's end: the final model's loss over the whole
    validation split in overlapping windows (the figure to quote; `final_validation`), a sample
    from the best checkpoint, the summary. A stop during the final validation skips it and the
    sample: the checkpoints are complete."""
    setup, state, report = run.setup, run.state, run.report
    assert state.last_eval is not None  # the loop evaluates at the schedule's end
    t0, val = report.now(), state.last_eval[1]
    shown = Shown(report.bar, "final validation")
    final, covers = final_validation(run.evaluations, state.model, val, run.plan, t0, run.stopping, shown)
    if final is None:
        if run.callbacks.stopped_by is not None:
            report.log(run.callbacks.stopped_by)
        report.log(
            f"interrupted during the final validation; the run is complete at step {state.step} (periodic "
            f"val loss {val:.4f}). The final figure: uv run evaluate.py --checkpoint "
            f"{checkpoint_file(setup.out_dir, LATEST)}"
        )
        return result(run, val_loss=val, interrupted=True, sample=None)
    write(run, FinalRecord(state.step, {"final_val_loss": final.loss}, final.n_predicted, final.whole))
    report.draw_plot()
    report.log(f"final validation: loss {final.loss:.4f} {covers} in {report.now() - t0:.1f} s")
    sample = None
    if sample_tokens > 0 and not run.stopping():
        sample = _sample(run, sample_tokens)
    report.log(
        f"done: step {state.step}, final val loss {final.loss:.4f} (periodic {val:.4f}, best "
        f"{state.best_val:.4f}) in {report.elapsed() / 60:.1f} min; checkpoints in {setup.out_dir}/"
    )
    if sample is not None:
        report.log(f"sample (best checkpoint, temperature 0.8):\n{sample}")
    return result(run, val_loss=final.loss, interrupted=False, sample=sample)
