"""The learning-rate schedule and the time plan that fits it to `--max-minutes`."""

import math

import pytest

from eqx_gpt.training.schedule import learning_rate, warmup_steps
from eqx_gpt.training.time_plan import RESERVE_S, TimePlan
from eqx_gpt.training.train_config import TrainConfig
from eqx_gpt.training.train_step import describe_optimizer


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    c = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    lrs = [learning_rate(s, c, 110) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(5.5e-4)  # half way down the cosine
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[110] == lrs[119] == pytest.approx(1e-4)


@pytest.mark.parametrize("horizon", [1, 2, 7, 20, 59, 60, 61])
def test_a_warm_up_longer_than_half_the_run_is_shortened_and_the_printed_schedule_is_the_one_run(horizon):
    c = TrainConfig(lr=4e-3, min_lr=4e-4, warmup_steps=30, max_steps=horizon)
    warmup = warmup_steps(c, horizon)
    assert warmup == min(30, horizon // 2)
    lrs = [learning_rate(s, c, horizon) for s in range(horizon)]
    line = describe_optimizer(c, horizon)
    assert f"over {warmup} steps" in line and f"at step {horizon}" in line
    assert ("shortened" in line) == (warmup < 30)
    if horizon > 1:  # the peak is reached, then the rate decays to min_lr at the horizon
        assert max(lrs) == pytest.approx(4e-3) and lrs.index(max(lrs)) == warmup
        assert learning_rate(horizon, c, horizon) == pytest.approx(4e-4)
    if horizon > 2:
        assert lrs[-1] < max(lrs)


def _plan(max_minutes=1.0, max_steps=10_000):
    return TimePlan(max_minutes, max_steps, t_start=0.0)


def test_the_time_plan_fits_the_steps_that_the_measured_rate_allows():
    plan = _plan(max_minutes=1.0)
    plan.start_timing(1, now=5.0)  # compiled after 5 s
    # 10 steps per second from step 1 at t=5 to step 101 at t=15: 45 s are left, less the reserve.
    horizon = plan.fit(101, 10_000, now=15.0, eval_interval=10_000, eval_cost_steps=0)
    assert horizon == 101 + int((60 - 15 - RESERVE_S) * 10)


def test_the_time_plan_leaves_out_evaluation_time_and_prices_the_evaluations_left():
    plan = _plan(max_minutes=2.0)
    plan.start_timing(0, now=0.0)
    plan.add_evaluation(5.0)  # 100 steps in 10 s, 5 of which were an evaluation: 20 steps/s
    assert plan.steps_per_second(100, now=10.0) == pytest.approx(20.0)
    horizon = plan.fit(100, 10_000, now=10.0, eval_interval=100, eval_cost_steps=0)
    # Left after the last step: its evaluation, the final validation (two evaluations) and the reserve.
    budget = 120 - 10 - 3 * 5.0 - RESERVE_S
    assert horizon == 100 + int(budget / (1 / 20 + 5.0 / 100))  # a step plus its share of evaluations
    # The evaluations are priced by the steps that fit, not by the horizon before: a far-off
    # max_steps (whose evaluations would never fit) changes nothing.
    assert plan.fit(100, 10**7, now=10.0, eval_interval=100, eval_cost_steps=0) == horizon
    assert plan.out_of_time(now=120 - 3 * 5.0 - RESERVE_S + 0.1)
    assert not plan.out_of_time(now=120 - 3 * 5.0 - RESERVE_S - 0.1)


@pytest.mark.parametrize("max_steps", [1, 7, 8, 9, 20, 24, 25])
def test_the_time_plan_never_goes_past_max_steps_or_back_before_the_current_step(max_steps):
    plan = _plan(max_minutes=60.0, max_steps=max_steps)
    plan.start_timing(1, now=1.0)
    for step in range(1, max_steps + 1):  # plenty of time: the horizon is max_steps exactly
        assert plan.fit(step, max_steps, now=1.0 + step, eval_interval=500, eval_cost_steps=1) == max_steps
    late = _plan(max_minutes=1.0, max_steps=max_steps)
    late.start_timing(0, now=0.0)
    step = max(1, max_steps // 2)  # out of time: the run ends at the step it has reached
    assert late.fit(step, max_steps, now=59.0, eval_interval=500, eval_cost_steps=1) == step
    assert late.out_of_time(now=60 - RESERVE_S + 0.1) and not late.out_of_time(now=1.0)


def test_without_a_time_limit_the_plan_changes_nothing():
    plan = _plan(max_minutes=0.0, max_steps=50)
    plan.start_timing(0, now=0.0)
    assert not plan.limited and math.isinf(plan.deadline)
    assert plan.fit(10, 50, now=1e9, eval_interval=10, eval_cost_steps=1) == 50
    assert not plan.out_of_time(now=1e9)
