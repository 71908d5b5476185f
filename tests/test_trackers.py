"""The trackers (`eqx_gpt.training.trackers`), their writers driven directly: TensorBoard's event
files read back with TensorBoard's own reader, across a kill and resume; W&B offline, its
transaction log read back; a missing extra in one line. As callbacks of a run: test_tracker_runs.py
and test_callbacks.py."""

import ast
import json
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator

from eqx_gpt.errors import ConfigError
from eqx_gpt.training import trackers as trackers_module
from eqx_gpt.training.config import parse_trackers
from eqx_gpt.training.run_dir import Metrics, kept_records
from eqx_gpt.training.trackers import TAGS, TensorBoardTracker, Tracker, WandbTracker, tracker_callbacks

KINDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


class Opened:
    """Trackers opened for a run in `out_dir`, as a run's callbacks drive them: every record to each,
    closed at the end (marked failed if the block raised)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def log_text(self, step: int, name: str, text: str) -> None:
        for tracker in self.trackers:
            tracker.log_text(step, name, text)

    def flush(self) -> None:
        for tracker in self.trackers:
            tracker.flush()

    def close(self, *, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed=failed)

    def __enter__(self) -> "Opened":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None)


def open_trackers(names, out_dir, *, config, resume_step, history=()) -> Opened:
    opened = []
    try:
        for name in names:
            tracker = KINDS[name]()
            tracker.open(Path(out_dir), config=config, resume_step=resume_step, history=list(history))
            opened.append(tracker)
    except BaseException:
        Opened(opened).close(failed=True)
        raise
    return Opened(opened)


CONFIG = {"d_model": 64, "lr": 0.001, "optimizer": "adamw", "data": None, "tracker": "tensorboard"}


def train_record(step: int, shift: float = 0.0) -> dict:
    return {
        "step": step,
        "loss": 4.0 - step / 100 + shift,
        "grad_norm": 1.5 - step / 400,
        "lr": 1e-3 * step / 50,
        "tokens_per_s": 4e4 + step,
    }


def eval_record(step: int, shift: float = 0.0) -> dict:
    return {
        "step": step,
        "train_loss": 3.0 - step / 200 + shift,
        "val_loss": 3.1 - step / 300,
        "elapsed_s": 1.5,
    }


def read_scalars(out_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) points, in the order TensorBoard's reader shows them."""
    acc = EventAccumulator(str(out_dir / "tensorboard"), size_guidance={SCALARS: 0, TENSORS: 0}).Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(out_dir: Path) -> dict[str, list[tuple[int, str]]]:
    acc = EventAccumulator(str(out_dir / "tensorboard"), size_guidance={SCALARS: 0, TENSORS: 0}).Reload()
    return {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


def expected(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What the reader must show for `records`: each number under its tag, at its step, as the
    float32 an event file stores."""
    points: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step":
                points.setdefault(TAGS[key], []).append((record["step"], float(np.float32(value))))
    return points


def test_parse_trackers_takes_a_comma_list_or_a_list_and_refuses_an_unknown_name():
    assert parse_trackers(None) == () == parse_trackers("") == parse_trackers("none")
    assert parse_trackers("tensorboard, wandb") == ("tensorboard", "wandb")
    assert parse_trackers(["wandb", "tensorboard,wandb"]) == ("wandb", "tensorboard")
    with pytest.raises(ConfigError, match="'mlflow' is not a tracker; choose from tensorboard, wandb"):
        parse_trackers("tensorboard,mlflow")


def test_the_optional_packages_are_imported_only_when_a_tracker_is_opened():
    tree = ast.parse(Path(trackers_module.__file__).read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m.split(".")[0] for m in names} & {"tensorboardX", "tensorboard", "wandb"}


def test_tensorboard_event_files_equal_metrics_jsonl(tmp_path):
    records = [train_record(s) for s in (10, 20, 30)] + [eval_record(30), train_record(40)]
    records.append({"step": 40, "final_val_loss": 2.875, "val_tokens": 1234, "whole_split": True})
    metrics = Metrics(tmp_path / "metrics.jsonl", [])
    with open_trackers(["tensorboard"], tmp_path, config=CONFIG, resume_step=None) as t:
        for record in records:
            metrics.write(record)
            t.log(record)
        t.log_text(40, "sample", "First Citizen:\nBefore we proceed")
    metrics.close()
    on_disk = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert read_scalars(tmp_path) == expected(on_disk)
    texts = read_texts(tmp_path)
    assert texts["sample/text_summary"] == [(40, "    First Citizen:\n    Before we proceed")]
    [(step, table)] = texts["config/text_summary"]
    assert step == 0 and "| d_model | 64 |" in table and "| optimizer | adamw |" in table


FIRST_RUN = [train_record(s) for s in (10, 20, 30)] + [eval_record(30), train_record(40)]
KILLED_RUN = """
import json, os, signal
from pathlib import Path
from eqx_gpt.training.trackers import TensorBoardTracker
t = TensorBoardTracker()
t.open(Path({out!r}), config=json.loads({config!r}), resume_step=None, history=[])
for record in json.loads({records!r}):  # the evaluation at 30, then its checkpoint, then step 40
    t.log(record)
t.flush()  # step 40 is on disk: the resumed run must hide it
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_run(out_dir: Path) -> None:
    script = KILLED_RUN.format(out=str(out_dir), config=json.dumps(CONFIG), records=json.dumps(FIRST_RUN))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr


# "sigkill" is a new Python process, killed: in the slow pass.
@pytest.mark.parametrize("end", [pytest.param("sigkill", marks=pytest.mark.slow), "closed"])
def test_tensorboard_after_a_kill_and_resume_shows_each_step_once_in_order(tmp_path, end):
    if end == "sigkill":
        _killed_run(tmp_path)
    else:
        t = open_trackers(["tensorboard"], tmp_path, config=CONFIG, resume_step=None)
        for record in FIRST_RUN:
            t.log(record)
        t.close()
    kept = [train_record(s) for s in (10, 20, 30)] + [eval_record(30)]
    resumed = [train_record(40, shift=1.0), train_record(50, shift=1.0)]
    with open_trackers(["tensorboard"], tmp_path, config=CONFIG, resume_step=30) as t:
        for record in resumed:
            t.log(record)
    assert read_scalars(tmp_path) == expected(kept + resumed)
    # Killed again after step 50 and resumed from the checkpoint at 40: 50 once more, in place.
    again = [train_record(50, shift=2.0)]
    with open_trackers(["tensorboard"], tmp_path, config=CONFIG, resume_step=40) as t:
        t.log(again[0])
    assert read_scalars(tmp_path) == expected(kept + resumed[:1] + again)
    assert [step for step, _ in read_texts(tmp_path)["config/text_summary"]] == [0, 31, 41]


def test_tensorboard_a_fresh_run_hides_the_old_runs_curves(tmp_path):
    with open_trackers(["tensorboard"], tmp_path, config=CONFIG, resume_step=None) as t:
        for step in (10, 20):
            t.log(train_record(step))
    with open_trackers(["tensorboard"], tmp_path, config=CONFIG, resume_step=None) as t:
        t.log(train_record(10, shift=5.0))
    assert read_scalars(tmp_path) == expected([train_record(10, shift=5.0)])


def test_tensorboard_added_on_resume_starts_with_the_kept_records(tmp_path):
    metrics = Metrics(tmp_path / "metrics.jsonl", [])
    for record in [train_record(10), train_record(20), eval_record(20), train_record(30)]:
        metrics.write(record)
    metrics.close()
    kept = kept_records(tmp_path / "metrics.jsonl", 20)
    with open_trackers(["tensorboard"], tmp_path, config=CONFIG, resume_step=20, history=kept) as t:
        t.log(train_record(30, shift=1.0))
    assert read_scalars(tmp_path) == expected(kept + [train_record(30, shift=1.0)])


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (`run-<id>.wandb`): a ":W&B" header of 7 bytes, then
    LevelDB's log format, 32 KiB blocks of chunks each with a 7-byte header (crc, length, type)."""
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    pos, chunks, found = header, [], []
    while pos + header <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + header]) if left >= header else (0, 0, 0)
        if kind == 0:  # a block's zero padding
            pos += left
            continue
        chunks.append(data[pos + header : pos + header + length])
        pos += header + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            from wandb.proto import wandb_internal_pb2  # here: W&B takes 0.8 s to import

            # protoc's generated module declares its classes at run time, out of a type checker's sight
            record = wandb_internal_pb2.Record()  # pyright: ignore[reportAttributeAccessIssue]
            record.ParseFromString(b"".join(chunks))
            found.append(record)
            chunks = []
    return found


def wandb_written(out_dir: Path, run_id: str) -> Path:
    """The offline run folder of `run_id`, once W&B's own process has written all of it:
    `run.finish()` returns before that process has closed the transaction log, and
    `wandb.teardown()` waits for it to end."""
    import wandb

    wandb.teardown()
    [folder] = (out_dir / "wandb").glob(f"offline-run-*-{run_id}")
    return folder


def wandb_history(run_folder: Path) -> list[dict]:
    """The history rows of an offline run, as {key: value} with "_step"; W&B's own keys dropped."""
    [log] = run_folder.glob("run-*.wandb")
    rows = []
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            rows.append({k: v for k, v in row.items() if k not in ("_timestamp", "_runtime")})
    return rows


def wandb_config(run_folder: Path) -> dict:
    [log] = run_folder.glob("run-*.wandb")
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
            return {k: v for k, v in config.items() if k != "_wandb"}  # W&B's own
    raise AssertionError(f"no run record in {log}")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its settings and caches kept under tmp_path (never the home folder)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return tmp_path / "run"


def test_wandb_offline_writes_the_run_and_a_resume_continues_its_id(offline_wandb):
    import wandb

    out = offline_wandb
    first = [train_record(10), train_record(20), eval_record(20)]
    with open_trackers(["wandb"], out, config=CONFIG, resume_step=None) as t:
        for record in first:
            t.log(record)
        t.log_text(20, "sample", "a < b\nc")
    run_id = (out / "wandb-run-id").read_text()
    folder = wandb_written(out, run_id)
    step_20 = {TAGS[k]: v for r in first[1:] for k, v in r.items() if k != "step"}
    history = wandb_history(folder)
    assert [{k: v for k, v in row.items() if not k.startswith("sample/")} for row in history] == [
        {"_step": 10, **{TAGS[k]: v for k, v in first[0].items() if k != "step"}},
        {"_step": 20, **step_20},
    ]
    assert history[1]["sample/_type"] == "html-file"
    [page] = (folder / "files" / "media" / "html").glob("sample_20_*.html")
    assert "<pre>a &lt; b\nc</pre>" in page.read_text()
    assert wandb_config(folder) == CONFIG

    with open_trackers(["wandb"], out, config=CONFIG, resume_step=20) as t:
        t.log(train_record(30, shift=1.0))
    assert (out / "wandb-run-id").read_text() == run_id
    wandb.teardown()
    # Named by start time in seconds, and "-1" added to a second session's within the same second.
    folders = sorted((out / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(folders) == 2 and folders[0] == folder
    resumed = wandb_history(folders[1])
    assert [row["_step"] for row in resumed] == [30]
    assert resumed[0]["train/loss"] == train_record(30, shift=1.0)["loss"]

    with pytest.raises(RuntimeError):
        with open_trackers(["wandb"], out, config=CONFIG, resume_step=None):
            raise RuntimeError("a run that fails")
    fresh_id = (out / "wandb-run-id").read_text()
    assert fresh_id != run_id  # a fresh run is a new W&B run
    [log] = wandb_written(out, fresh_id).glob("run-*.wandb")
    exits = [r.exit.exit_code for r in wandb_records(log) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]  # shown as failed


@pytest.mark.parametrize(("tracker", "package"), [("tensorboard", "tensorboardX"), ("wandb", "wandb")])
def test_a_missing_extra_is_one_line_naming_the_install_command(tmp_path, monkeypatch, tracker, package):
    for name in [package] + [m for m in sys.modules if m.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails as if not installed
    with pytest.raises(ConfigError) as refused:  # made, before a run writes anything
        KINDS[tracker]()
    install = f"uv sync --extra {tracker} (or pip install 'eqx_gpt[{tracker}]')"
    assert str(refused.value) == f"--tracker {tracker} needs {package}: {install}"
    with pytest.raises(ConfigError) as checked:  # `tracker="..."`, the shortcut
        tracker_callbacks([tracker])
    assert str(checked.value) == str(refused.value)
    [other] = tracker_callbacks([t for t in ("tensorboard", "wandb") if t != tracker])  # installed
    assert isinstance(other, Tracker)


def test_the_shortcut_adds_no_second_tracker_of_a_kind_already_passed():
    mine = TensorBoardTracker()
    assert tracker_callbacks(["tensorboard"], [mine]) == ()
    assert [type(t) for t in tracker_callbacks(["tensorboard", "wandb"], [mine])] == [WandbTracker]


def test_wandb_added_on_resume_starts_with_the_kept_records(offline_wandb):
    out = offline_wandb
    out.mkdir()
    kept = [train_record(10), train_record(20), eval_record(20)]
    with open_trackers(["wandb"], out, config=CONFIG, resume_step=20, history=kept) as t:
        t.log(train_record(30))
    rows = wandb_history(wandb_written(out, (out / "wandb-run-id").read_text()))
    assert [(row["_step"], row["train/loss"]) for row in rows] == [
        (s, train_record(s)["loss"]) for s in (10, 20, 30)
    ]
    assert rows[1]["eval/val_loss"] == eval_record(20)["val_loss"]


def test_a_wandb_run_that_cannot_start_is_one_line(tmp_path, monkeypatch):
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError) as refused:
        open_trackers(["tensorboard", "wandb"], tmp_path, config=CONFIG, resume_step=None)
    assert str(refused.value) == (
        "--tracker wandb could not start a W&B run: No API key configured. Use `wandb login` to log in. "
        "(or set WANDB_MODE=offline)"
    )
