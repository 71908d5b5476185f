"""The learning-rate schedule and the time plan that fits it to `--max-minutes`."""

import math

import pytest

from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.options import resolve_options
from eqx_gpt.training.step import decay_start, describe_optimizer, learning_rate, warmup_steps
from eqx_gpt.training.time_plan import MIN_RESERVE_S, RESERVE_S, TimePlan


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    c = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    lrs = [learning_rate(s, c, 110) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(5.5e-4)  # half way down the cosine
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[110] == lrs[119] == pytest.approx(1e-4)


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction_of_the_run():
    c = TrainConfig(lr=1e-2, min_lr=0.0, warmup_steps=10, schedule="wsd", decay_fraction=0.4)
    lrs = [learning_rate(s, c, 100) for s in range(101)]
    assert decay_start(c, 100) == 60
    assert lrs[9] == pytest.approx(1e-2 * 10 / 11) and lrs[10:61] == [pytest.approx(1e-2)] * 51
    assert lrs[80] == pytest.approx(5e-3) and lrs[100] == 0.0  # half way down the line, then min_lr
    line = describe_optimizer(c, 100)
    assert "stable until step 60, then linear to 0 at step 100" in line
    # Refitting the schedule's length to the time moves the decay only: the stable part is the same rate.
    assert [learning_rate(s, c, 150) for s in range(61)] == lrs[:61]


def test_wsd_never_decays_into_the_warm_up():
    c = TrainConfig(lr=1e-2, min_lr=1e-3, warmup_steps=30, schedule="wsd", decay_fraction=1.0)
    assert decay_start(c, 100) == 30
    assert max(learning_rate(s, c, 100) for s in range(100)) == pytest.approx(1e-2)


@pytest.mark.parametrize("schedule_steps", [1, 2, 7, 20, 59, 60, 61])
def test_a_warm_up_longer_than_half_the_run_is_shortened_and_the_printed_schedule_is_the_one_run(
    schedule_steps,
):
    c = TrainConfig(lr=4e-3, min_lr=4e-4, warmup_steps=30, max_steps=schedule_steps)
    warmup = warmup_steps(c, schedule_steps)
    assert warmup == min(30, schedule_steps // 2)
    lrs = [learning_rate(s, c, schedule_steps) for s in range(schedule_steps)]
    line = describe_optimizer(c, schedule_steps)
    assert f"over {warmup} steps" in line and f"at step {schedule_steps}" in line
    assert ("shortened" in line) == (warmup < 30)
    if schedule_steps > 1:  # the peak is reached, then the rate decays to min_lr at the schedule_steps
        assert max(lrs) == pytest.approx(4e-3) and lrs.index(max(lrs)) == warmup
        assert learning_rate(schedule_steps, c, schedule_steps) == pytest.approx(4e-4)
    if schedule_steps > 2:
        assert lrs[-1] < max(lrs)


def _plan(max_minutes=1.0, max_steps=10_000):
    return TimePlan(max_minutes, max_steps, t_start=0.0)


def test_the_time_plan_fits_the_steps_that_the_measured_rate_allows():
    plan = _plan(max_minutes=1.0)
    plan.start_timing(1, now=5.0)  # compiled after 5 s
    # 10 steps per second from step 1 at t=5 to step 101 at t=15: 45 s are left, less the reserve,
    # which is the start-up's 5 s.
    schedule_steps = plan.fit(101, 10_000, now=15.0, eval_interval=10_000, eval_cost_steps=0)
    assert plan.reserve_s == 5.0 and schedule_steps == 101 + int((60 - 15 - 5.0) * 10)


@pytest.mark.parametrize(("startup_s", "reserve_s"), [(0.5, MIN_RESERVE_S), (7.0, 7.0), (40.0, RESERVE_S)])
def test_the_reserve_at_the_end_is_the_measured_start_up_within_bounds(startup_s, reserve_s):
    plan = TimePlan(3.0, 10_000, t_start=100.0)
    assert plan.reserve_s == RESERVE_S  # before anything is measured
    plan.start_timing(1, now=100.0 + startup_s)
    assert plan.reserve_s == reserve_s
    assert plan.out_of_time(now=100.0 + 180 - reserve_s + 0.1)
    assert not plan.out_of_time(now=100.0 + 180 - reserve_s - 0.1)


def test_the_final_validation_keeps_the_reserve_only_for_what_follows_it():
    plans = (TimePlan(1.0, 10_000, t_start=0.0, reserve_s=5.0, sample=s) for s in (True, False))
    with_sample, without = plans
    assert (with_sample.reserve_s, without.reserve_s) == (5.0, MIN_RESERVE_S)
    for plan in (with_sample, without):
        plan.add_evaluation(4.0)
    # 50 s in, two evaluations' time (8 s) fit the 60 s, but not with the 5 s reserve after them:
    # a run that samples next skips its final validation; one that ends there runs it.
    assert not with_sample.affords_final(50.0)
    assert without.affords_final(50.0)
    assert not without.affords_final(53.0)


def test_the_time_plan_leaves_out_evaluation_time_and_prices_the_evaluations_left():
    plan = _plan(max_minutes=2.0)
    plan.start_timing(0, now=0.0)
    plan.add_evaluation(5.0)  # 100 steps in 10 s, 5 of which were an evaluation: 20 steps/s
    assert plan.steps_per_second(100, now=10.0) == pytest.approx(20.0)
    schedule_steps = plan.fit(100, 10_000, now=10.0, eval_interval=100, eval_cost_steps=0)
    # Left after the last step: its evaluation, the final validation (two evaluations) and the reserve.
    assert plan.reserve_s == MIN_RESERVE_S  # timed from t=0: no start-up measured
    budget = 120 - 10 - 3 * 5.0 - MIN_RESERVE_S
    assert schedule_steps == 100 + int(budget / (1 / 20 + 5.0 / 100))  # a step plus its share of evaluations
    # The evaluations are priced by the steps that fit, not by the schedule_steps before: a far-off
    # max_steps (whose evaluations would never fit) changes nothing.
    assert plan.fit(100, 10**7, now=10.0, eval_interval=100, eval_cost_steps=0) == schedule_steps
    assert plan.out_of_time(now=120 - 3 * 5.0 - MIN_RESERVE_S + 0.1)
    assert not plan.out_of_time(now=120 - 3 * 5.0 - MIN_RESERVE_S - 0.1)


@pytest.mark.parametrize("max_steps", [1, 7, 8, 9, 20, 24, 25])
def test_the_time_plan_never_goes_past_max_steps_or_back_before_the_current_step(max_steps):
    plan = _plan(max_minutes=60.0, max_steps=max_steps)
    plan.start_timing(1, now=1.0)
    for step in range(1, max_steps + 1):  # plenty of time: the schedule_steps is max_steps exactly
        assert plan.fit(step, max_steps, now=1.0 + step, eval_interval=500, eval_cost_steps=1) == max_steps
    late = _plan(max_minutes=1.0, max_steps=max_steps)
    late.start_timing(0, now=0.0)
    step = max(1, max_steps // 2)  # out of time: the run ends at the step it has reached
    assert late.fit(step, max_steps, now=59.0, eval_interval=500, eval_cost_steps=1) == step
    assert late.out_of_time(now=60 - MIN_RESERVE_S + 0.1) and not late.out_of_time(now=1.0)


def test_without_a_time_limit_the_plan_changes_nothing():
    plan = _plan(max_minutes=0.0, max_steps=50)
    plan.start_timing(0, now=0.0)
    assert not plan.limited and math.isinf(plan.deadline)
    assert plan.fit(10, 50, now=1e9, eval_interval=10, eval_cost_steps=1) == 50
    assert not plan.out_of_time(now=1e9)


@pytest.mark.parametrize(
    ("steps_per_s", "ends_at"),
    # a slow machine, about the Intel and about a Zen 5, in steps of the preset's batch of 48
    [(3.0, "time"), (6.5, "time"), (11.0, "max_steps")],
)
def test_the_default_recipe_fits_slow_machines_to_time_and_stops_fast_ones_at_its_max_steps(
    steps_per_s, ends_at
):
    config = resolve_options({}).train  # what `uv run train.py` runs
    plan = TimePlan(config.max_minutes, config.max_steps, t_start=0.0)
    plan.start_timing(1, now=7.0)  # start-up: 7 s
    step, now = 21, 7.0 + 20 / steps_per_s
    fits = plan.steps_that_fit(step, now, config.eval_interval, eval_cost_steps=25)
    schedule_steps = plan.fit(step, config.max_steps, now, config.eval_interval, eval_cost_steps=25)
    assert fits == pytest.approx(steps_per_s * (60 * config.max_minutes - 7 - 7), rel=0.1)
    assert schedule_steps == (min(fits, config.max_steps) if ends_at == "time" else config.max_steps)
    assert (fits > config.max_steps) == (ends_at == "max_steps")
    # Either way the rates reach their peak after the warm-up and end at zero at the schedule_steps.
    assert learning_rate(config.warmup_steps, config, schedule_steps) == pytest.approx(config.lr)
    assert learning_rate(schedule_steps, config, schedule_steps) == config.min_lr == 0.0
