"""The training loop: dispatch steps, evaluate, checkpoint, fit the schedule to the time left,
finish or stop. It reads the run's fixed `RunSetup`, changes its `TrainState`, and tells what
happens through its `Report`.

Steps go to the device in calls of up to `STEPS_PER_CALL` (one compiled program for any count, so
how steps are grouped never changes a bit); the loop never waits for a step's loss, which is read
`READ_LAG` steps later.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eqx_gpt.checkpoint import BEST, LATEST, checkpoint_file, load_model, read_metadata, save_checkpoint
from eqx_gpt.streams import TRAIN_BATCHES
from eqx_gpt.training import report as reporting
from eqx_gpt.training.batches import window_starts, windows_reader
from eqx_gpt.training.parallel import shard_rows
from eqx_gpt.training.report import Report, TrainResult
from eqx_gpt.training.schedule import learning_rate
from eqx_gpt.training.setup import RunSetup, TrainingError
from eqx_gpt.training.state import TrainState
from eqx_gpt.training.time_plan import TimePlan
from eqx_gpt.training.validation import final_validation, train_loss, validation_loss

READ_LAG = 2  # read a logged loss this many steps after dispatching it, so the device never idles
STEPS_PER_CALL = 8  # optimiser steps per dispatch at most (`make_train_steps`): 1.2-1.3x on small models
SECONDS_PER_CALL = 0.5  # fewer steps per call when steps are slower: a stop waits for the call in flight
PLAN_AFTER = 20  # steps timed after compilation before fitting the schedule to max_minutes


@dataclass
class Run:
    """One run in progress: what was resolved, what changes, how it reports, its time plan, and
    whether Ctrl-C or SIGTERM asked it to stop."""

    setup: RunSetup
    state: TrainState
    report: Report
    plan: TimePlan
    stopping: Callable[[], bool] = lambda: False


def dispatch_steps(run: Run, n: int) -> None:
    """Queue `n` optimiser steps from the current step on the device, in one call (not waiting)."""
    setup, state, c = run.setup, run.state, run.setup.config
    window = setup.model_config.context_length + 1
    steps = list(range(state.step, state.step + n))
    lrs = [learning_rate(s, c, state.horizon) for s in steps]
    starts = np.full((STEPS_PER_CALL, c.batch_size), -1, np.int64)  # -1: an unused slot, zeros
    for i, s in enumerate(steps):
        starts[i] = window_starts(
            s, n_tokens=len(setup.train_ids), seed=c.seed, stream=TRAIN_BATCHES, batch_size=c.batch_size,
            length=window,
        )  # fmt: skip
    # Each process reads only its own devices' rows of the windows from the shards.
    reader = windows_reader(setup.train_ids, starts, window)
    batches = shard_rows(reader, (*starts.shape, window), setup.mesh, 1)
    step_ids, rates = np.zeros(STEPS_PER_CALL, np.int32), np.zeros(STEPS_PER_CALL, np.float32)
    step_ids[:n], rates[:n] = steps, lrs
    state.model, state.opt_state, losses = setup.train_steps(
        state.model, state.opt_state, batches, step_ids, rates, np.int32(n)
    )
    state.step += n
    run.report.pending.append(([s + 1 for s in steps], losses, lrs))


def save(run: Run, name: str) -> None:
    """Write checkpoint `name` (`LATEST` or `BEST`) of the run at its current step."""
    setup, state = run.setup, run.state
    val_step, val_loss = state.last_eval if state.last_eval is not None else (None, None)
    save_checkpoint(
        setup.out_dir, name, state.model, state.opt_state, step=state.step, tokenizer=setup.tokenizer,
        train_config=setup.config.to_dict(), val_loss=val_loss, val_loss_step=val_step,
        best_val_loss=None if math.isinf(state.best_val) else state.best_val, schedule_steps=state.horizon,
        **setup.checkpoint_meta,
    )  # fmt: skip
    if name == LATEST:
        state.last_saved = state.step


def evaluate_and_save(run: Run) -> bool:
    """Evaluate (the train loss on fixed windows; the validation loss over the whole split, in
    non-overlapping windows, so that no sampling noise can pick the best checkpoint, or on a
    larger corpus over the same evenly spread windows each time, `--eval-tokens`), log it,
    checkpoint `latest` (and `best` if it is) and redraw the loss plot. Returns False, having
    recorded nothing, if the run was asked to stop before the evaluation finished."""
    setup, state = run.setup, run.state
    reporting.read_losses(run.report, setup, state, run.plan, state.step)
    t0 = run.report.now()
    train = train_loss(setup, state.model, run.stopping)
    periodic = setup.val_windows(final=False)
    val = validation_loss(setup, state.model, periodic, run.stopping) if train is not None else None
    if val is None:
        return False
    if state.step > setup.start:
        run.plan.add_evaluation(run.report.now() - t0)
    if not (math.isfinite(train) and math.isfinite(val.loss)):
        raise TrainingError(
            f"evaluation loss became non-finite at step {state.step}; stopped. "
            f"{reporting.last_good(setup, state)}"
        )
    is_best = val.loss < state.best_val
    state.best_val = min(state.best_val, val.loss)
    state.last_eval = (state.step, val.loss)
    # The record first, then `best`, then `latest`: a kill before `latest` is written leaves it at the
    # previous evaluation, whose resumption redoes this step (and drops the records after it).
    reporting.record_evaluation(run.report, state, train)
    if is_best:
        save(run, BEST)
    save(run, LATEST)
    reporting.evaluated(run.report, setup, state, train, is_best)
    return True


def fit_to_time(run: Run, *, announce: bool) -> None:
    """Refit the schedule's length to the steps that fit before `--max-minutes` runs out."""
    # Until one is timed, price an evaluation as its forward passes (a third of a step's work per
    # step's worth of tokens): the fixed training batches, then the validation tokens it reads.
    setup, state, c, now = run.setup, run.state, run.setup.config, run.report.now()
    eval_cost = (c.eval_batches + min(len(setup.val_ids), c.eval_tokens) / setup.tokens_per_step) / 3
    horizon = run.plan.fit(state.step, state.horizon, now, c.eval_interval, eval_cost)
    if announce:
        fits = run.plan.steps_that_fit(state.step, now, c.eval_interval, eval_cost)
        if fits is not None and fits > c.max_steps:
            # More steps than the recipe wants: a preset's max_steps is where its model stops gaining.
            run.report.log(
                f"time plan: {fits} steps would fit in {c.max_minutes:g} min; the run stops at {c.max_steps}"
            )
        elif horizon != state.horizon:
            run.report.log(f"time plan: {horizon} steps fit in {c.max_minutes:g} min; schedule refitted")
    state.horizon = horizon


def steps_per_call(run: Run) -> int:
    """Steps in the next call: 1 until the step rate is measured, then as many as run in about
    `SECONDS_PER_CALL`, at most `STEPS_PER_CALL`. A stop waits for the call in flight, so slow steps
    go one at a time. Every group size runs the same compiled program (`make_train_steps`), so the
    grouping never changes what a step computes."""
    rate = run.plan.steps_per_second(run.state.step, run.report.now())
    return 1 if rate is None else max(1, min(STEPS_PER_CALL, int(SECONDS_PER_CALL * rate)))


def train_loop(run: Run, sample_tokens: int) -> TrainResult:
    """Evaluate where due, then step until the horizon or a stop; then finish, or save and say how
    to resume."""
    setup, state, c = run.setup, run.state, run.setup.config
    run.report.read_points.append((setup.start, run.report.t_start))
    repair_best(run)
    # The start of a run, and a resumption from a checkpoint whose evaluation was interrupted.
    if (state.step % c.eval_interval == 0 or state.step == state.horizon) and not state.evaluated:
        evaluate_and_save(run)
    while state.step < state.horizon and not run.stopping():
        # The first call is one step alone: it compiles, and the time plan starts after it.
        # Calls end at the next evaluation.
        next_eval = (state.step // c.eval_interval + 1) * c.eval_interval
        first = state.step == setup.start
        n = min(steps_per_call(run), state.horizon - state.step, next_eval - state.step)
        dispatch_steps(run, n)
        if first:
            _time_first_step(run)
        elif state.step - n < run.plan.timed_from[0] + PLAN_AFTER <= state.step:
            fit_to_time(run, announce=True)
        if state.step // c.log_interval > (state.step - n) // c.log_interval or state.step == state.horizon:
            reporting.read_losses(run.report, setup, state, run.plan, state.step - READ_LAG)
        if run.plan.out_of_time(run.report.now()) and state.step < state.horizon:
            state.horizon = state.step
            run.report.log(f"time limit reached at step {state.step}")
        if state.step % c.eval_interval == 0 or state.step == state.horizon:
            if evaluate_and_save(run) and state.step < state.horizon:
                fit_to_time(run, announce=False)
    reporting.read_losses(run.report, setup, state, run.plan, state.step)
    if run.stopping() and not (state.step == state.horizon and state.evaluated):
        return interrupted(run)
    return finish(run, sample_tokens)


def repair_best(run: Run) -> None:
    """On resume, rewrite `best` when `latest`'s own evaluation is the best but `best` is from an
    earlier step: a run killed between the two writes, before they were ordered, left it behind. (A
    `best` from a later step is this run's own, written just before a kill; the resumed run redoes
    that step and writes it again.)"""
    state = run.state
    if state.last_saved is None or state.last_eval is None or state.last_eval != (state.step, state.best_val):
        return
    best = checkpoint_file(run.setup.out_dir, BEST)
    if not best.exists() or read_metadata(best)["step"] < state.step:
        run.report.log(f"best checkpoint behind the latest (step {state.step}, the best): rewritten")
        save(run, BEST)


def _time_first_step(run: Run) -> None:
    """Wait for the first step (it compiles), then start timing the steps from here."""
    report = run.report
    report.pending[-1][1].block_until_ready()
    now = report.now()
    report.tokens_per_s = run.setup.tokens_per_step / max(now - report.t_start, 1e-9)  # includes compiling
    run.plan.start_timing(run.state.step, now)
    report.restart_rate(run.state.step, now)
    report.bar.clear()
    report.log(f"compiled the training step in {now - report.t_start:.1f} s since start")


def interrupted(run: Run) -> TrainResult:
    """Ctrl-C or SIGTERM: log the step reached, checkpoint it, say how to resume."""
    report, state, out_dir = run.report, run.state, run.setup.out_dir
    if report.last_read is not None and report.last_logged != report.last_read["step"]:
        report.metrics.write(report.last_read)  # the step the run stopped at is always logged
    if state.last_saved is None or state.step > state.last_saved:
        save(run, LATEST)
    report.log(
        f"interrupted at step {state.step}; saved {checkpoint_file(out_dir, LATEST)}. Resume with: "
        f"uv run train.py --resume --out-dir {out_dir}"
    )
    val = state.last_eval[1] if state.last_eval is not None else None
    return reporting.result(report, state, out_dir, val_loss=val, interrupted=True, sample=None)


def finish(run: Run, sample_tokens: int) -> TrainResult:
    """The end of a run that reached its horizon: the final model's loss over the whole validation
    split in overlapping windows (the figure to quote; `final_validation`), a sample from the best
    checkpoint, the summary. A stop during the final validation skips it and the sample: the
    checkpoints are complete."""
    setup, state, report = run.setup, run.state, run.report
    t0, stride, val = report.now(), max(1, setup.model_config.context_length // 2), state.last_eval[1]
    final, covers = final_validation(setup, state.model, val, run.plan, t0, run.stopping)
    if final is None:
        report.log(
            f"interrupted during the final validation; the run is complete at step {state.step} (periodic "
            f"val loss {val:.4f}). The final figure: uv run evaluate.py --checkpoint "
            f"{checkpoint_file(setup.out_dir, LATEST)} --stride {stride}"
        )
        return reporting.result(report, state, setup.out_dir, val_loss=val, interrupted=True, sample=None)
    record = {"step": state.step, "final_val_loss": final.loss, "val_tokens": final.n_predicted}
    report.metrics.write({**record, "whole_split": final.whole})
    report.log(f"final validation: loss {final.loss:.4f} {covers} in {report.now() - t0:.1f} s")
    sample = None
    if sample_tokens > 0 and not run.stopping():
        has_best = checkpoint_file(setup.out_dir, BEST).exists()
        best = load_model(setup.out_dir)[0] if has_best else state.model
        sample = reporting.sample_text(best, setup.tokenizer, sample_tokens, seed=setup.config.seed)
    report.log(
        f"done: step {state.step}, final val loss {final.loss:.4f} (periodic {val:.4f}, best "
        f"{state.best_val:.4f}) in {report.elapsed() / 60:.1f} min; checkpoints in {setup.out_dir}/"
    )
    if sample is not None:
        report.log(f"sample (best checkpoint, temperature 0.8):\n{sample}")
    return reporting.result(
        report, state, setup.out_dir, val_loss=final.loss, interrupted=False, sample=sample
    )
