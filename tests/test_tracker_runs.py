"""`train.py --tracker` end to end on the tiny model of test_train_cli.py: TensorBoard's event files,
read with TensorBoard's own reader, hold the losses of `metrics.jsonl` (also across a SIGKILL and
`--resume`, and for a tracker added on resume); W&B offline holds them too; a missing extra is one
line and nothing written; only the first JAX process writes; the final `loss.png` shows the final
validation's point."""

import json
import signal
import sys

import jax
import pytest
from runs_family import GROUP, corpus, loss_plot_drawn, quick_runs
from test_trackers import (
    expected,
    offline_wandb,
    read_scalars,
    read_texts,
    wandb_config,
    wandb_history,
    wandb_records,
    wandb_written,
)
from test_train_cli import (
    DIVERGING,
    RESUME_STEPS,
    TINY,
    _fails,
    _records,
    _snapshot,
    _start_and_stop,
    train_cli,
)

from eqx_gpt.errors import ConfigError
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.trackers import TAGS

pytestmark = GROUP
__all__ = ["corpus", "loss_plot_drawn", "quick_runs", "offline_wandb"]  # fixtures, used by name

SHORT = ["--max-steps", "12", "--eval-interval", "6"]


def wandb_rows(records: list[dict]) -> list[dict]:
    """What W&B's history must hold for `records`: one row per step, each record's numbers under
    their tags, a step's records merged."""
    rows: dict[int, dict] = {}
    for record in records:
        numbers = {TAGS[k]: float(v) for k, v in record.items() if k != "step"}
        rows.setdefault(record["step"], {"_step": record["step"]}).update(numbers)
    return [rows[step] for step in sorted(rows)]


@pytest.mark.slow  # a whole train.py run with both trackers, then refused resumes; test_trackers.py checks
# each tracker's records against metrics.jsonl quickly
def test_both_trackers_hold_the_records_of_metrics_jsonl(
    offline_wandb, corpus, monkeypatch, capsys, loss_plot_drawn
):
    import eqx_gpt.visualize as visualize  # here: matplotlib takes 1 s to import

    out = offline_wandb
    drawn = []
    save = visualize.save_figure
    monkeypatch.setattr(visualize, "save_figure", lambda fig, path: drawn.append(fig) or save(fig, path))
    argv = [*TINY, *SHORT, "--data", str(corpus), "--out-dir", str(out), "--sample-tokens", "20"]
    assert train_cli.main([*argv, "--tracker", "tensorboard", "--tracker", "wandb"]) == 0
    assert "trackers: tensorboard --logdir" in capsys.readouterr().out
    records = _records(out)
    assert [r["step"] for r in records if "final_val_loss" in r] == [12]
    assert read_scalars(out) == expected(records)
    texts = read_texts(out)
    [(step, sample)] = texts["sample/text_summary"]
    assert step == 12 and len(sample) > 20
    [(_, table)] = texts["config/text_summary"]
    assert "| d_model | 32 |" in table and "| tracker | tensorboard,wandb |" in table

    folder = wandb_written(out, (out / "wandb-run-id").read_text())
    rows = [{k: v for k, v in row.items() if not k.startswith("sample/")} for row in wandb_history(folder)]
    assert rows == wandb_rows(records)
    config = wandb_config(folder)
    assert config["d_model"] == 32 and config["max_steps"] == 12 and config["n_params"] > 0

    # loss.png's last drawing, after the final validation, has its point.
    [final] = [r for r in records if "final_val_loss" in r]
    lines = {line.get_label(): line for line in drawn[-1].axes[0].get_lines()}
    [label] = [label for label in lines if str(label).startswith("final validation")]
    assert list(lines[label].get_xdata()) == [12] and list(lines[label].get_ydata()) == [
        final["final_val_loss"]
    ]
    assert ("whole split" if final["whole_split"] else "estimated") in str(label)

    # Resuming a run whose tracker is no longer installed is refused in one line, touching nothing.
    before = _snapshot(out)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    more = [*TINY, "--data", str(corpus), "--out-dir", str(out), "--resume", "--max-steps", "14"]
    _fails(more, capsys, "--tracker tensorboard needs tensorboardX: uv sync --extra tensorboard")
    assert _snapshot(out) == before


def test_a_missing_extra_or_an_unknown_tracker_is_one_line_and_writes_nothing(
    tmp_path, corpus, capsys, monkeypatch
):
    out = tmp_path / "run"
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(out)]
    _fails([*argv, "--tracker", "tensorboard,mlflow"], capsys, "'mlflow' is not a tracker; choose from")
    monkeypatch.setitem(sys.modules, "wandb", None)
    _fails([*argv, "--tracker", "wandb"], capsys, "--tracker wandb needs wandb: uv sync --extra wandb")
    assert not out.exists()


@pytest.mark.slow  # three train.py runs; test_trackers.py's tensorboard_added_on_resume is the quick one
def test_a_tracker_added_on_resume_starts_with_the_kept_records(tmp_path, corpus):
    out = tmp_path / "run"
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(out), "--log-interval", "4"]
    assert train_cli.main([*argv, "--max-steps", "6", "--eval-interval", "6"]) == 0
    assert not (out / "tensorboard").exists()
    resumed = [*argv, "--resume", "--max-steps", "10", "--eval-interval", "6", "--tracker", "tensorboard"]
    assert train_cli.main(resumed) == 0
    records = _records(out)
    # Only the logged steps (every 4th, and each run's last) reach the tracker, as metrics.jsonl.
    assert [r["step"] for r in records if "loss" in r] == [4, 6, 8, 10]
    assert read_scalars(out) == expected(records)
    # Dropped again on the next resume with "none": nothing more is written to it.
    before = _snapshot(out / "tensorboard")
    assert train_cli.main([*argv, "--resume", "--max-steps", "12", "--tracker", "none"]) == 0
    assert _snapshot(out / "tensorboard") == before and max(r["step"] for r in _records(out)) == 12


def test_the_tracker_setting_is_checked_where_it_enters():
    assert TrainConfig(tracker="tensorboard, wandb").tracker == "tensorboard, wandb"
    with pytest.raises(ConfigError, match="'mlflow' is not a tracker; choose from tensorboard, wandb"):
        TrainConfig(tracker="mlflow")
    with pytest.raises(ConfigError, match=r"tracker must be a comma list of names .* got \['wandb'\]"):
        TrainConfig(tracker=["wandb"])  # pyright: ignore[reportArgumentType]


def test_only_the_first_process_writes_to_the_trackers(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda *args, **kwargs: 1)
    out = tmp_path / "run"
    argv = [*TINY, "--max-steps", "4", "--eval-interval", "2", "--data", str(corpus), "--out-dir", str(out)]
    assert train_cli.main([*argv, "--tracker", "tensorboard,wandb"]) == 0
    assert _records(out) and not (out / "tensorboard").exists() and not (out / "wandb").exists()
    assert not (out / "wandb-run-id").exists()


def test_a_run_that_fails_is_closed_as_failed(offline_wandb, corpus, capsys):
    out = offline_wandb
    argv = [*DIVERGING, "--data", str(corpus), "--out-dir", str(out)]
    argv += ["--max-steps", "20", "--eval-interval", "10", "--tracker", "wandb"]
    _fails(argv, capsys, "loss became")
    [log] = wandb_written(out, (out / "wandb-run-id").read_text()).glob("run-*.wandb")
    assert [r.exit.exit_code for r in wandb_records(log) if r.WhichOneof("record_type") == "exit"] == [1]
    assert wandb_history(log.parent) == wandb_rows(_records(out))  # what it recorded before it failed


@pytest.mark.slow
def test_tensorboard_equals_metrics_jsonl_across_a_sigkill_and_resume(tmp_path, corpus):
    out = tmp_path / "killed"
    tracker = ["--tracker", "tensorboard"]
    rc, _, err = _start_and_stop(out, corpus, signal.SIGKILL, extra=tracker)
    assert rc == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = json.loads((out / "latest.json").read_text())["step"]
    # The resumed run keeps the checkpoint's tracker without being told again.
    argv = [*TINY, *RESUME_STEPS, "--data", str(corpus), "--out-dir", str(out), "--resume"]
    assert train_cli.main(argv) == 0
    records = _records(out)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 301))
    assert read_scalars(out) == expected(
        records
    )  # each step once, in order: the killed run's later ones hidden
    assert [step for step, _ in read_texts(out)["config/text_summary"]] == [0, killed_at + 1]
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2, err
