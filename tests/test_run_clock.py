"""A run against a simulated clock: `--max-minutes` fitting, and stops at any point (evaluations too).

Nothing here reads the wall clock: time moves only when the run works, by fixed amounts, so each
test asserts the same thing on a fast CPU and a slow one.
"""

import importlib
import json
import signal
from pathlib import Path

import numpy as np
import pytest
from runs_family import API_RECIPE, BATCH_SIZE, GROUP, MODEL, corpus, quick_runs

import eqx_gpt.training.run
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.run import train

pytestmark = GROUP
__all__ = ["corpus", "quick_runs"]  # fixtures, used by name
evaluate_module = importlib.import_module("eqx_gpt.evaluation")


def _config(corpus, **changes) -> TrainConfig:
    values = dict(
        data=str(corpus), batch_size=BATCH_SIZE, eval_batches=2, warmup_steps=5, log_interval=1,
        max_steps=100_000, eval_interval=50, **API_RECIPE,
    )  # fmt: skip
    return TrainConfig(**{**values, **changes})


class SimulatedClock:
    """Seconds that pass only as the run works: `compile_s` for the first call of the training
    step, `step_s` per optimiser step, `eval_s` per evaluation call (train and validation windows)."""

    def __init__(self, monkeypatch, *, compile_s=5.0, step_s=0.1, eval_s=0.05):
        self.t, self.steps, self.step_s, self.eval_s = 1000.0, 0, step_s, eval_s
        self.compile_s = compile_s
        dispatch, summed = eqx_gpt.training.run.dispatch_steps, evaluate_module._summed_loss

        def timed_dispatch(run, n):
            self.t += (self.compile_s if self.steps == 0 else 0.0) + n * self.step_s
            self.steps += n
            return dispatch(run, n)

        def timed_summed(*args):
            self.t += self.eval_s
            return summed(*args)

        monkeypatch.setattr(eqx_gpt.training.run, "dispatch_steps", timed_dispatch)
        monkeypatch.setattr(evaluate_module, "_summed_loss", timed_summed)

    def __call__(self) -> float:
        return self.t


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(corpus, out, clock, sample_tokens=0, **changes):
    lines = []
    result = train(
        _config(corpus, **changes), preset=None, out_dir=out, log=lines.append, progress=False, now=clock,
        sample_tokens=sample_tokens, **MODEL,
    )  # fmt: skip
    return result, lines


def test_max_minutes_fits_the_schedule_to_the_steps_that_fit(tmp_path, corpus, monkeypatch):
    clock = SimulatedClock(monkeypatch, step_s=0.1)
    # 30 s: about 210 steps of the tiny model (the slow test below fits 45 s, about 360)
    result, lines = _run(corpus, tmp_path / "run", clock, max_minutes=0.5)
    deadline = 1000.0 + 30
    # The run ends in time for its final evaluation and sample, and uses nearly all of the rest: it
    # keeps back about the start-up's time (5 s compiling, and the first evaluation).
    assert clock() <= deadline, lines
    assert clock() >= deadline - 5.5 - 3.0, lines
    assert any(line.startswith("time plan: ") for line in lines)
    meta = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert meta["step"] == meta["schedule_steps"] == result.step  # the cosine ends where the run does
    assert 193 < result.step < 223  # about (30 - 5 start-up - 3 reserve - evaluations) / 0.1
    assert any(line.startswith("final validation: loss ") and " over all " in line for line in lines), lines
    lrs = [r["lr"] for r in _records(tmp_path / "run") if "lr" in r]
    assert lrs[-1] == pytest.approx(0.002, rel=0.05) and max(lrs) == pytest.approx(0.02)


@pytest.mark.slow  # two whole runs of about 350 steps, each with its sample
def test_a_run_that_ends_with_a_sample_keeps_time_back_for_it(tmp_path, corpus, monkeypatch):
    # The sample (loading the best model, compiling the sampler) is start-up's kind of work, so a
    # run that ends with one keeps back the start-up's time (about 5 s here); one without keeps the
    # least (3 s) and trains about 20 steps of 0.1 s longer.
    steps = {}
    for sample_tokens in (0, 8):
        with monkeypatch.context() as patch:
            clock = SimulatedClock(patch, step_s=0.1)
            out = tmp_path / f"sample-{sample_tokens}"
            result, lines = _run(corpus, out, clock, sample_tokens=sample_tokens, max_minutes=0.75)
            assert clock() <= 1000.0 + 45, lines
            steps[sample_tokens] = result.step
    assert 10 <= steps[0] - steps[8] <= 30, steps


@pytest.mark.parametrize(
    ("step_s", "capped"),
    # Each case is a whole run of 350 to 400 steps. The slow machine's is
    # test_max_minutes_fits_the_schedule_to_the_steps_that_fit's run at 45 s rather than 30, checking
    # its time plan's line; the fast machine's is that run capped by max_steps. Both kept for the
    # slow pass.
    [pytest.param(0.1, False, marks=pytest.mark.slow), pytest.param(0.02, True, marks=pytest.mark.slow)],
)
def test_the_budget_decides_whether_time_or_max_steps_ends_the_schedule(
    tmp_path, corpus, monkeypatch, step_s, capped
):
    # The same recipe on a slow machine and on one five times faster: the slow one fits its cosine
    # to the 45 s; the fast one would fit about 1,500 steps but stops at max_steps, where a preset's
    # model stops gaining, with its schedule ending there, and says so.
    clock = SimulatedClock(monkeypatch, step_s=step_s)
    result, lines = _run(corpus, tmp_path / "run", clock, max_minutes=0.75, max_steps=400)
    plan = [line for line in lines if line.startswith("time plan: ")]
    meta = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert meta["step"] == meta["schedule_steps"] == result.step
    lrs = [r["lr"] for r in _records(tmp_path / "run") if "lr" in r]
    assert lrs[-1] == pytest.approx(0.002, rel=0.05)  # the cosine reaches min_lr either way
    if capped:
        assert result.step == 400 and clock() < 1000.0 + 45 - 20, lines  # done early
        assert len(plan) == 1 and "steps would fit in 0.75 min; the run stops at 400" in plan[0], plan
        assert int(plan[0].split()[2]) > 1000
    else:
        assert 330 < result.step < 380 and clock() > 1000.0 + 45 - 10, lines
        assert plan and "schedule refitted" in plan[0], plan


@pytest.mark.slow  # a 350-step run; test_schedule.py checks the WSD shape quickly
def test_a_wsd_run_fitted_to_time_holds_its_peak_then_decays_to_min_lr_where_it_ends(
    tmp_path, corpus, monkeypatch
):
    clock = SimulatedClock(monkeypatch, step_s=0.1)
    result, lines = _run(
        corpus, tmp_path / "run", clock, max_minutes=0.75, schedule="wsd", decay_fraction=0.5
    )
    assert any("stable until step" in line and "then linear to 0.1 of their peak" in line for line in lines)
    records = [r for r in _records(tmp_path / "run") if "lr" in r]
    lrs = {r["step"]: r["lr"] for r in records}
    # The last step runs one step of the line above min_lr: the line is round(0.5 * schedule_steps) long.
    assert max(lrs) == result.step
    assert lrs[result.step] == pytest.approx(0.002 + 0.018 / round(0.5 * result.step), rel=1e-4)
    # The refits move only the decay: every step before the run's last two fifths ran at the peak.
    stable = [lr for step, lr in lrs.items() if 6 < step <= 0.4 * result.step]
    assert stable and stable == [pytest.approx(0.02)] * len(stable)
    after = [lrs[step] for step in sorted(lrs) if step > 0.4 * result.step]
    assert all(a >= b for a, b in zip(after, after[1:], strict=False)) and after[0] > after[-1]


def test_steps_that_slow_down_mid_run_stop_at_the_time_limit(tmp_path, corpus, monkeypatch):
    clock = SimulatedClock(monkeypatch, step_s=0.05)
    dispatch = eqx_gpt.training.run.dispatch_steps

    def slower_after_step_60(run, n):
        clock.step_s = 0.05 if clock.steps < 60 else 0.5  # the machine got busy
        return dispatch(run, n)

    monkeypatch.setattr(eqx_gpt.training.run, "dispatch_steps", slower_after_step_60)
    result, lines = _run(corpus, tmp_path / "run", clock, max_minutes=0.5, eval_interval=1000)
    assert clock() <= 1000.0 + 30 + 1.0, lines  # one call late at most
    assert 60 < result.step < 150, lines
    meta = json.loads((tmp_path / "run" / "latest.json").read_text())
    assert meta["step"] == meta["schedule_steps"] == result.step


def test_steps_go_one_per_call_when_slow_and_several_when_fast(tmp_path, corpus, monkeypatch):
    for step_s, most in ((0.01, eqx_gpt.training.run.STEPS_PER_CALL), (3.0, 1)):
        clock = SimulatedClock(monkeypatch, step_s=step_s)
        sizes, dispatch = [], eqx_gpt.training.run.dispatch_steps
        monkeypatch.setattr(
            eqx_gpt.training.run,
            "dispatch_steps",
            lambda run, n, d=dispatch, s=sizes: (s.append(n), d(run, n))[1],
        )
        _run(corpus, tmp_path / f"run-{step_s}", clock, max_steps=40, eval_interval=40)
        assert sizes[0] == 1 and max(sizes) == most and sum(sizes) == 40, sizes
        monkeypatch.undo()


def _signal_at_eval_call(monkeypatch, clock, call: int | None) -> list[bool]:
    """Send SIGTERM to this process at the start of evaluation call number `call` (0-based,
    counted over the whole run; None: never). Returns a list that records, for every evaluation
    call, whether the signal had been sent before it."""
    summed, calls = evaluate_module._summed_loss, []  # `summed` is already timed by `clock`

    def signalling(*args):
        if len(calls) == call:
            signal.raise_signal(signal.SIGTERM)  # the run's handler only sets its stop flag
        calls.append(call is not None and len(calls) >= call)
        return summed(*args)

    monkeypatch.setattr(evaluate_module, "_summed_loss", signalling)
    monkeypatch.setattr(evaluate_module, "TOKENS_PER_CALL", 256)  # 16 windows a call: several calls
    return calls


def _without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("elapsed_s", "tokens_per_s")} for r in records]


def test_sigterm_during_an_evaluation_stops_after_the_call_in_flight_and_resume_redoes_it(
    tmp_path, corpus, monkeypatch
):
    changes = dict(max_steps=40, eval_interval=20)
    never, out = tmp_path / "never", tmp_path / "stopped"
    clock = SimulatedClock(monkeypatch)
    calls = _signal_at_eval_call(monkeypatch, clock, None)
    _run(corpus, never, clock, **changes)
    per_evaluation = len(calls) // 4  # steps 0, 20, 40 and the final validation (twice the windows)
    assert per_evaluation >= 4
    monkeypatch.undo()

    clock = SimulatedClock(monkeypatch)
    calls = _signal_at_eval_call(monkeypatch, clock, per_evaluation + 2)  # mid-way through step 20's
    result, lines = _run(corpus, out, clock, **changes)
    assert result.interrupted and result.step == 20, lines
    assert calls.count(True) == 1  # the call the signal came in, and no other
    meta = json.loads((out / "latest.json").read_text())
    assert meta["step"] == 20 and meta["val_loss_step"] == 0  # the evaluation at 20 is not recorded
    assert not any(r["step"] == 20 and "val_loss" in r for r in _records(out))

    monkeypatch.undo()  # resume redoes the evaluation at 20: the metrics are those of a run never stopped
    monkeypatch.setattr(evaluate_module, "TOKENS_PER_CALL", 256)  # the same calls sum the same floats
    resumed = train(out_dir=out, resume=True, log=lambda _: None, progress=False, sample_tokens=0)
    assert not resumed.interrupted and resumed.step == 40
    assert _without_timing(_records(out)) == _without_timing(_records(never))


def test_sigterm_during_the_final_validation_ends_a_complete_run_without_the_figure(
    tmp_path, corpus, monkeypatch
):
    changes = dict(max_steps=20, eval_interval=20, sample_tokens=5)
    clock = SimulatedClock(monkeypatch)
    calls = _signal_at_eval_call(monkeypatch, clock, None)
    finish, before_final = eqx_gpt.training.run.finish, []
    monkeypatch.setattr(
        eqx_gpt.training.run, "finish", lambda *a: (before_final.append(len(calls)), finish(*a))[1]
    )
    result, _ = _run(corpus, tmp_path / "never", clock, **changes)
    assert not result.interrupted and result.sample
    assert len(calls) - before_final[0] >= 4  # the final validation is several calls
    monkeypatch.undo()

    out = tmp_path / "stopped"
    clock = SimulatedClock(monkeypatch)
    calls = _signal_at_eval_call(monkeypatch, clock, before_final[0] + 1)
    result, lines = _run(corpus, out, clock, **changes)
    assert result.interrupted and result.step == 20 and result.sample is None, lines
    assert calls.count(True) == 1
    assert "interrupted during the final validation" in lines[-1] and "evaluate.py --checkpoint" in lines[-1]
    meta = json.loads((out / "latest.json").read_text())
    assert meta["step"] == meta["val_loss_step"] == 20  # the run's last checkpoint is complete
    assert not any("final_val_loss" in r for r in _records(out))
    assert np.isfinite(meta["val_loss"])


def test_a_run_stopped_in_its_last_evaluation_resumes_to_evaluate_and_finish(tmp_path, corpus, monkeypatch):
    changes = dict(max_steps=20, eval_interval=20)
    clock = SimulatedClock(monkeypatch)
    calls = _signal_at_eval_call(monkeypatch, clock, None)
    _run(corpus, tmp_path / "never", clock, **changes)
    per_evaluation = len(calls) // 4  # steps 0 and 20, then the final validation (twice the windows)
    monkeypatch.undo()

    out = tmp_path / "stopped"
    clock = SimulatedClock(monkeypatch)
    _signal_at_eval_call(monkeypatch, clock, per_evaluation + 1)  # inside step 20's evaluation
    result, _ = _run(corpus, out, clock, **changes)
    meta = json.loads((out / "latest.json").read_text())
    assert result.interrupted and meta["step"] == 20 and meta["val_loss_step"] == 0
    # The steps are all done, but the run is not finished: --resume evaluates and finishes it.
    resumed = train(out_dir=out, resume=True, log=lambda _: None, progress=False, sample_tokens=0)
    assert not resumed.interrupted and resumed.step == 20
    assert _without_timing(_records(out)) == _without_timing(_records(tmp_path / "never"))
