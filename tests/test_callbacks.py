"""Callbacks and the history of a run, as a user writes them: this file imports only `eqx_gpt`'s
public names. A callback hears of every step (with its gradient norm), evaluation, checkpoint and
the end; `TrainResult.history` holds the run's records by kind; a callback stops a run as Ctrl-C
does, and the resumed run ends with the losses of one never stopped."""

import math
import random
from pathlib import Path

import pytest

from eqx_gpt import Callback, EvaluationRecord, FinalRecord, StepRecord, StopTraining, TrainResult, train

RUN = dict(
    d_model=32, n_layers=2, n_heads=2, context_length=16, batch_size=4, eval_batches=2, eval_tokens=2048,
    warmup_steps=2, log_interval=1, max_steps=12, eval_interval=4, max_minutes=0, optimizer="muon", lr=0.02,
    min_lr=0.002, adam_lr=4e-3,
)  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    words = "the king my lord thou art so sweet a rose and yet we speak of love".split()
    rng = random.Random(0)
    lines = [" ".join(rng.choices(words, k=rng.randint(4, 12))).capitalize() + "." for _ in range(800)]
    path = tmp_path_factory.mktemp("data") / "verse.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


class Recorder(Callback):
    """Keeps what the run tells; raises `StopTraining` at step `stop_at`'s figures, or at the
    evaluation of step `stop_at_evaluation`."""

    def __init__(self, stop_at: int | None = None, stop_at_evaluation: int | None = None):
        self.steps: list[StepRecord] = []
        self.evaluations: list[EvaluationRecord] = []
        self.checkpoints: list[tuple[str, Path, int]] = []
        self.ends: list[TrainResult] = []
        self.stop_at, self.stop_at_evaluation = stop_at, stop_at_evaluation

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)
        if record.step == self.stop_at:
            raise StopTraining("enough steps")

    def on_evaluation(self, record: EvaluationRecord) -> None:
        self.evaluations.append(record)
        if record.step == self.stop_at_evaluation:
            raise StopTraining

    def on_checkpoint(self, name: str, path: Path, step: int) -> None:
        self.checkpoints.append((name, path, step))

    def on_end(self, result: TrainResult) -> None:
        self.ends.append(result)


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
    assert "Recorder stopped the run: enough steps" in lines
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
    with pytest.raises(TypeError, match="callbacks must be Callback instances"):
        train(callbacks=[print], out_dir=tmp_path / "other")  # type: ignore[list-item]
