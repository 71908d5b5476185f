"""Callbacks and the history of a run, as a user writes them: this file imports only `eqx_gpt`'s
public names (and TensorBoard's reader, and the family's settings, tests/runs_family.py). A callback
hears of every step (with its gradient norm), evaluation, record, checkpoint and the end, in order,
with a view of the run (its model, optimiser state, settings); it logs figures of its own into the
run's records; `TrainResult.history` holds the run's records by kind; a callback stops a run as
Ctrl-C does, and the resumed run ends with the losses of one never stopped; `EarlyStopping` and its
state across a resume; a tracker of the user's own hears every record the built-in ones do."""

import json
import math
from pathlib import Path

import equinox as eqx
import optax
import pytest
from runs_family import API_RECIPE, BATCH_SIZE, GROUP, MODEL, corpus, quick_runs
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from eqx_gpt import (
    GPT,
    Callback,
    EarlyStopping,
    EvaluationRecord,
    FinalRecord,
    RunView,
    SampleText,
    StepRecord,
    StopTraining,
    TensorBoardTracker,
    TrainResult,
    every,
    train,
)

pytestmark = GROUP
__all__ = ["corpus", "quick_runs"]  # fixtures, used by name
RUN = dict(
    **MODEL, batch_size=BATCH_SIZE, eval_batches=2, eval_tokens=2048, warmup_steps=2, log_interval=1,
    max_steps=12, eval_interval=4, max_minutes=0, **API_RECIPE,
)  # fmt: skip


class Recorder(Callback):
    """Keeps what the run tells; raises `StopTraining` at step `stop_at`'s figures, or at the
    evaluation of step `stop_at_evaluation`."""

    def __init__(self, stop_at: int | None = None, stop_at_evaluation: int | None = None):
        self.steps: list[StepRecord] = []
        self.evaluations: list[EvaluationRecord] = []
        self.checkpoints: list[tuple[str, Path, int]] = []
        self.ends: list[TrainResult] = []
        self.events: list[tuple[str, int]] = []  # (event, step of the record or of the run)
        self.stop_at, self.stop_at_evaluation = stop_at, stop_at_evaluation

    def on_train_begin(self, run: RunView) -> None:
        self.events.append(("begin", run.step))

    def on_step(self, record: StepRecord, run: RunView) -> None:
        self.steps.append(record)
        self.events.append(("step", record.step))
        assert run.step >= record.step  # the model in memory is a few steps ahead of the figures read
        if record.step == self.stop_at:
            raise StopTraining("enough steps")

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
        self.evaluations.append(record)
        self.events.append(("evaluation", record.step))
        assert run.step == record.step and isinstance(run.model, GPT) and run.opt_state is not None
        if record.step == self.stop_at_evaluation:
            raise StopTraining

    def on_log(self, record, run: RunView) -> None:
        self.events.append(("log", record.step))

    def on_checkpoint(self, name: str, path: Path, run: RunView) -> None:
        self.checkpoints.append((name, path, run.step))
        self.events.append((name, run.step))

    def on_end(self, result: TrainResult, run: RunView) -> None:
        self.ends.append(result)
        self.events.append(("end", result.step))


def _train(
    corpus: Path, out: Path, callback: Callback, lines: list[str], *, resume: bool = False
) -> TrainResult:
    settings = {} if resume else {**RUN, "data": str(corpus)}
    return train(
        preset=None, out_dir=out, resume=resume, sample_tokens=0, log=lines.append, progress=False,
        callbacks=[callback], **settings,
    )  # fmt: skip


def _steps(history) -> list[tuple[int, float, float]]:
    return [(r.step, r.loss, r.figures["grad_norm"]) for r in history if isinstance(r, StepRecord)]


@pytest.fixture(scope="module")
def never_stopped(corpus, tmp_path_factory) -> tuple[TrainResult, Recorder]:
    recorder = Recorder()
    result = _train(corpus, tmp_path_factory.mktemp("never") / "run", recorder, [])
    return result, recorder


def test_a_callback_hears_every_step_evaluation_checkpoint_and_the_end(never_stopped):
    result, recorder = never_stopped
    assert not result.interrupted and result.step == 12
    # The order of events: set-up, then step 0 evaluates first (its record, its checkpoints), then
    # each step and its record, an evaluation every 4 steps, the final validation's record, the end.
    assert recorder.events[:6] == [
        ("begin", 0), ("evaluation", 0), ("log", 0), ("best", 0), ("latest", 0), ("step", 1),
    ]  # fmt: skip
    assert recorder.events[6:9] == [("log", 1), ("step", 2), ("log", 2)]
    assert recorder.events[-3:] == [("latest", 12), ("log", 12), ("end", 12)]
    # Every step's figures, in order, though steps go to the device several per call.
    assert [r.step for r in recorder.steps] == list(range(1, 13))
    for record in recorder.steps:
        assert list(record.figures) == ["loss", "grad_norm"]
        assert math.isfinite(record.loss) and record.figures["grad_norm"] > 0 and record.lr > 0
    assert [r.step for r in recorder.evaluations] == [0, 4, 8, 12]
    assert all(math.isfinite(r.val_loss) and math.isfinite(r.train_loss) for r in recorder.evaluations)
    assert ("latest", result.out_dir / "latest.json", 12) in recorder.checkpoints
    assert ("best", result.out_dir / "best.json", 0) in recorder.checkpoints
    assert [step for name, _, step in recorder.checkpoints if name == "latest"] == [0, 4, 8, 12]
    assert recorder.ends == [result]


def test_the_history_holds_the_runs_records_by_kind_as_metrics_jsonl_does(never_stopped):
    result, recorder = never_stopped
    history = result.history
    assert [r for r in history if isinstance(r, StepRecord)] == recorder.steps  # log_interval 1: all
    assert [r for r in history if isinstance(r, EvaluationRecord)] == recorder.evaluations
    final = history[-1]
    assert isinstance(final, FinalRecord) and final.step == 12 and final.final_val_loss == result.val_loss
    lines = (result.out_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(history) and '"grad_norm"' in lines[1]


def test_a_callback_stops_the_run_resumably_and_the_resumed_run_ends_as_one_never_stopped(
    corpus, tmp_path, never_stopped
):
    never, _ = never_stopped
    out, lines = tmp_path / "run", []
    recorder = Recorder(stop_at=5)
    stopped = _train(corpus, out, recorder, lines)
    assert stopped.interrupted and 5 <= stopped.step < 12, lines
    said = lines.index("Recorder stopped the run: enough steps")
    assert lines[said + 1].startswith(f"interrupted at step {stopped.step}; saved")
    assert [r.step for r in recorder.steps] == list(range(1, stopped.step + 1))  # every step read
    assert recorder.ends == [stopped]
    resumed = _train(corpus, out, Recorder(), [], resume=True)
    assert not resumed.interrupted and resumed.step == 12
    # The history covers the whole run, the steps before the stop read back from metrics.jsonl,
    # with the losses and gradient norms of the run never stopped, bit for bit: every step runs
    # the same compiled program, however steps are grouped into calls and wherever a run resumed.
    assert _steps(resumed.history) == _steps(never.history)
    evaluations = lambda history: [(r.step, r.figures) for r in history if isinstance(r, EvaluationRecord)]
    assert evaluations(resumed.history) == evaluations(never.history)
    assert resumed.val_loss == never.val_loss


def test_a_stop_at_an_evaluation_ends_the_run_at_that_step(corpus, tmp_path):
    recorder = Recorder(stop_at_evaluation=4)
    result = _train(corpus, tmp_path / "run", recorder, [])
    assert result.interrupted and result.step == 4 and result.val_loss == recorder.evaluations[-1].val_loss
    assert [r.step for r in recorder.steps] == [1, 2, 3, 4]
    with pytest.raises(TypeError, match="callbacks must be Callback instances or functions"):
        train(callbacks=[5], out_dir=tmp_path / "other")  # type: ignore[list-item]


class NormEMA(Callback):
    """The model's weight norm at each evaluation, averaged (an EMA), logged as the figure `ema`;
    its average is its state, so a resumed run goes on from it."""

    def __init__(self):
        self.ema: float | None = None

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
        norm = float(optax.tree.norm(eqx.filter(run.model, eqx.is_inexact_array)))
        self.ema = norm if self.ema is None else 0.5 * self.ema + 0.5 * norm
        run.log(ema=self.ema)

    def state(self) -> dict:
        return {"ema": self.ema}

    def load_state(self, state: dict) -> None:
        self.ema = state["ema"]


class MyTracker(Callback):
    """A tracker of the user's own: every record the run writes."""

    def __init__(self):
        self.records: list[dict] = []

    def on_log(self, record, run: RunView) -> None:
        self.records.append(record.to_dict())


class StopAt(Callback):
    def __init__(self, evaluation: int):
        self.evaluation = evaluation

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
        if record.step == self.evaluation:
            raise StopTraining("asked to")


def _own(corpus: Path, out: Path, *extra: Callback, resume: bool = False) -> tuple[TrainResult, MyTracker]:
    mine = MyTracker()
    every_3 = every(3, lambda record, run: run.log(loss_x2=2 * record.loss))
    callbacks = [NormEMA(), every_3, mine, TensorBoardTracker(), *extra]
    settings = {} if resume else {**RUN, "data": str(corpus), "log_interval": 4}
    result = train(
        preset=None, out_dir=out, resume=resume, sample_tokens=0, log=lambda line: None, progress=False,
        callbacks=callbacks, **settings,
    )  # fmt: skip
    return result, mine


def _scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={SCALARS: 0}).Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow  # three runs and both trackers; the stop-and-resume test above is the quick one
def test_own_figures_join_metrics_jsonl_history_and_every_tracker_across_a_stop_and_resume(corpus, tmp_path):
    never, mine = _own(corpus, tmp_path / "never")
    lines = [json.loads(line) for line in (never.out_dir / "metrics.jsonl").read_text().splitlines()]
    # A tracker of one's own hears every record metrics.jsonl gets, figures of callbacks included.
    assert mine.records == lines == [record.to_dict() for record in never.history]
    evaluations = [r for r in never.history if isinstance(r, EvaluationRecord)]
    assert [r.step for r in evaluations] == [0, 4, 8, 12] and all(r.figures["ema"] > 0 for r in evaluations)
    # every(3, fn): at steps 3, 6, 9 and 12, each recorded though log_interval is 4.
    logged = {r.step: dict(r.figures) for r in never.history if isinstance(r, StepRecord)}
    assert sorted(logged) == [3, 4, 6, 8, 9, 12]
    assert [s for s, figures in logged.items() if "loss_x2" in figures] == [3, 6, 9, 12]
    assert all(
        figures["loss_x2"] == 2 * figures["loss"] for figures in logged.values() if "loss_x2" in figures
    )
    final = never.history[-1]
    assert isinstance(final, FinalRecord) and list(final.figures) == ["final_val_loss"]
    as_float32 = lambda value: float(__import__("numpy").float32(value))  # noqa: E731
    assert _scalars(never.out_dir)["ema"] == [(r.step, as_float32(r.figures["ema"])) for r in evaluations]

    # Stopped at the evaluation of step 4 and resumed: the EMA goes on from its saved state.
    out = tmp_path / "stopped"
    stopped, _ = _own(corpus, out, StopAt(4))
    assert stopped.interrupted and stopped.step == 4
    resumed, _ = _own(corpus, out, resume=True)
    assert not resumed.interrupted
    ema = lambda result: [
        (r.step, r.figures["ema"]) for r in result.history if isinstance(r, EvaluationRecord)
    ]  # noqa: E731
    assert ema(resumed) == ema(never)
    assert _scalars(out)["ema"] == [(step, as_float32(value)) for step, value in ema(never)]
    assert _scalars(out)["train/loss"] == _scalars(never.out_dir)["train/loss"]


def test_early_stopping_stops_a_run_that_does_not_improve_and_its_count_survives_a_resume(corpus, tmp_path):
    out, lines = tmp_path / "run", []
    # An improvement must beat the best by 100 nats: none does. Evaluations at 0 (the best), 4, 8.
    sampler = SampleText(5)
    settings = {**RUN, "data": str(corpus), "max_steps": 16}
    stopped = train(
        preset=None, out_dir=out, sample_tokens=0, log=lines.append, progress=False,
        callbacks=[EarlyStopping(patience=2, min_delta=100), sampler], **settings,
    )  # fmt: skip
    assert stopped.interrupted and stopped.step == 8, lines
    assert "EarlyStopping stopped the run: val_loss has not improved on" in "\n".join(lines)
    # The sample at each evaluation, drawn from the model in memory.
    assert [step for step, _ in sampler.samples] == [0, 4, 8] and all(len(t) >= 5 for _, t in sampler.samples)
    assert any(line.startswith("sample at step 4:") for line in lines)
    # Resumed with a fresh EarlyStopping: its count (2 evaluations without improvement) is the
    # checkpoint's, so the next evaluation without one stops the run again, at 12 (afresh it would
    # wait for two more and finish at 16).
    again = train(
        out_dir=out, resume=True, sample_tokens=0, log=lines.append, progress=False,
        callbacks=[EarlyStopping(patience=2, min_delta=100)],
    )  # fmt: skip
    assert again.interrupted and again.step == 12
    with pytest.raises(TypeError, match="patience must be a whole number >= 1, got 0"):
        EarlyStopping(patience=0)


class FailsAtBest(Callback):
    def on_checkpoint(self, name: str, path: Path, run: RunView) -> None:
        if name == "best" and run.step == 4:
            raise RuntimeError("a bug in a callback")


class StopsAtTheEnd(Callback):
    def on_end(self, result: TrainResult, run: RunView) -> None:
        raise StopTraining("too late")


def test_a_callback_failing_at_best_leaves_latest_and_a_stop_at_the_end_changes_nothing(corpus, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="a bug in a callback"):
        _train(corpus, out, FailsAtBest(), [])
    # Both checkpoints of step 4 were written before any callback heard of them.
    assert json.loads((out / "latest.json").read_text())["step"] == 4
    # A run killed between the two (best is written first) resumes from best, saying so.
    (out / "latest.json").unlink()
    lines: list[str] = []
    result = _train(corpus, out, StopsAtTheEnd(), lines, resume=True)
    assert f"{out}/ holds no latest checkpoint, only best: resuming from {out / 'best.json'}" in lines
    assert not result.interrupted and result.step == 12
    assert not [line for line in lines if "stopped the run" in line]  # the run had ended


class LogsOutOfPlace(Callback):
    def __init__(self, where: str):
        self.where = where

    def on_log(self, record, run: RunView) -> None:
        if self.where == "on_log":
            run.log(x=1.0)

    def on_evaluation(self, record: EvaluationRecord, run: RunView) -> None:
        if self.where == "val_loss":
            run.log(val_loss=0.0)
        if self.where == "text":
            run.log(note="text")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("on_log", "adds figures to a step's or an evaluation's record: call it in on_step or on_evaluation"),
        ("val_loss", "'val_loss' is the run's own; give your figure another name"),
        ("text", "takes a number, got 'text'"),
    ],
)
def test_a_figure_logged_out_of_place_is_one_line(corpus, tmp_path, where, message):
    with pytest.raises(ValueError, match=message):
        _train(corpus, tmp_path / "run", LogsOutOfPlace(where), [])


def test_callbacks_that_are_not_callbacks_are_one_line(tmp_path):
    with pytest.raises(TypeError, match="callbacks must be a list of Callback instances or functions"):
        train(callbacks=5, out_dir=tmp_path / "run")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="every must be a whole number >= 1, got 0"):
        every(0, print)
    assert not (tmp_path / "run").exists()
