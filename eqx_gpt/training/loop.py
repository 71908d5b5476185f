"""The training loop: evaluate where due, dispatch steps, read their figures, fit the schedule to
the time, until the schedule's end or a stop; then the run's end (`end.py`).

Steps go to the device in calls of up to `STEPS_PER_CALL` (one compiled program for any count, so
how steps are grouped never changes a bit); the loop never waits for a step's figures, which are
read `READ_LAG` steps later. The loop alone decides when the run stops: at the end of its
schedule, at `--max-minutes`, on Ctrl-C, SIGTERM or a callback's `StopTraining`, or on a
non-finite loss.
"""

import math

import numpy as np

from eqx_gpt.checkpoint import BEST, LATEST
from eqx_gpt.errors import TrainingError
from eqx_gpt.evaluation import Shown
from eqx_gpt.streams import TRAIN_BATCHES
from eqx_gpt.training.data import batch_reader, window_starts
from eqx_gpt.training.end import finish, interrupted
from eqx_gpt.training.evaluate import evaluate_run
from eqx_gpt.training.parallel import shard_rows
from eqx_gpt.training.result import TrainResult
from eqx_gpt.training.running import Run
from eqx_gpt.training.saving import last_good, save
from eqx_gpt.training.step import learning_rate
from eqx_gpt.training.time_plan import eval_budget

READ_LAG = 2  # read a logged loss this many steps after dispatching it, so the device never idles
STEPS_PER_CALL = 8  # optimiser steps per dispatch at most (`make_train_steps`): 1.2-1.3x on small models
# Fewer steps per call when steps are slower, since a stop waits for the call in flight; but each
# call maps and faults in its scratch afresh (164 MB at the default step: 42,000 page faults, about
# 100 ms of system time on a 2-core EPYC), so a call of 300 ms steps still holds 8 of them.
SECONDS_PER_CALL = 2.5
PLAN_AFTER = 20  # steps timed after compilation before fitting the schedule to max_minutes


def read_losses(run: Run, until: int) -> None:
    """Have the report read the figures of the steps up to `until` (and tell the callbacks); stop
    the run on a non-finite loss."""
    bad = run.report.read_losses(until, run.state.schedule_steps, run.plan)
    if bad is not None:
        step, loss = bad
        raise TrainingError(
            f"loss became {loss} at step {step}; stopped. {last_good(run)}. Try a lower --lr or --grad-clip"
        )


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
    # The record first, then `best`, then `latest`: a kill before `latest` is written leaves it at the
    # previous evaluation, whose resumption redoes this step (and drops the records after it).
    record = report.record_evaluation(state.step, figures)
    if is_best:
        save(run, BEST)
    save(run, LATEST)
    report.evaluated(state.step, figures, is_best)
    report.callbacks.on_evaluation(record)
    return True


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


def _timed_from(run: Run) -> int:
    """The step the time plan started timing at (after the first call, which compiles)."""
    assert run.plan.timed_from is not None
    return run.plan.timed_from[0]
