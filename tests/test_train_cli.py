"""`train.py` end to end on a tiny model: outputs, kill-and-resume, Ctrl-C, and every bad input."""

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eqx_gpt import load_model
from eqx_gpt.data import load_text

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
train_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_cli)

TINY = [
    "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--context-length", "16",
    "--batch-size", "4", "--eval-batches", "2", "--warmup-steps", "5", "--max-minutes", "0",
    "--sample-tokens", "0", "--log-interval", "1",
]  # fmt: skip
RESUME_STEPS = ["--max-steps", "300", "--eval-interval", "10"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "shakespeare-slice.txt"
    path.write_text(load_text()[:30_000], encoding="utf-8")
    return path


def _records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _losses(out):
    """Per-step training losses and per-evaluation losses: what must match bit for bit."""
    records = _records(out)
    train = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = {r["step"]: (r["train_loss"], r["val_loss"]) for r in records if "val_loss" in r}
    return train, evals


def test_a_tiny_run_writes_metrics_plot_checkpoints_and_a_sample(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(out), "--max-steps", "12", "--eval-interval", "6"]
    assert train_cli.main([*argv, "--sample-tokens", "40"]) == 0
    stdout = capsys.readouterr().out
    assert "parameters" in stdout and "schedule: AdamW, lr warm-up" in stdout and "sample" in stdout
    records = _records(out)
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 13))
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in logged)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 6, 12]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, tokenizer, meta = load_model(out)
    assert meta["step"] in (6, 12) and tokenizer.vocab_size == model.config.vocab_size


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert train_cli.main([*TINY, *RESUME_STEPS, "--data", str(corpus), "--out-dir", str(out)]) == 0
    return out


def _start_and_stop(out, corpus, sig):
    """Run train.py in a subprocess and send `sig` once its checkpoint at step >= 10 exists."""
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *TINY,
        *RESUME_STEPS,
        "--data",
        str(corpus),
        "--out-dir",
        str(out),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((out / "latest.json").read_text())["step"] >= 10:
                proc.send_signal(sig)
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


def test_a_run_killed_and_resumed_matches_one_never_stopped(tmp_path, corpus, uninterrupted):
    out = tmp_path / "killed"
    rc, _, _ = _start_and_stop(out, corpus, signal.SIGKILL)
    assert rc == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = json.loads((out / "latest.json").read_text())["step"]
    assert 10 <= killed_at < 300
    assert (
        train_cli.main([*TINY, *RESUME_STEPS, "--data", str(corpus), "--out-dir", str(out), "--resume"]) == 0
    )
    expected, resumed = _losses(uninterrupted), _losses(out)
    assert resumed == expected  # every step's loss and every evaluation, bit for bit
    assert sorted(resumed[0]) == list(range(1, 301))


def test_ctrl_c_saves_and_says_how_to_resume(tmp_path, corpus, uninterrupted):
    out = tmp_path / "interrupted"
    rc, stdout, stderr = _start_and_stop(out, corpus, signal.SIGINT)
    assert rc == 130, stderr
    assert f"Resume with: uv run train.py --resume --out-dir {out}" in stdout
    assert "Traceback" not in stderr
    assert (
        train_cli.main([*TINY, *RESUME_STEPS, "--data", str(corpus), "--out-dir", str(out), "--resume"]) == 0
    )
    assert _losses(out)[0] == _losses(uninterrupted)[0]


def _fails(argv, capsys, message):
    try:
        rc = train_cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]  # progress lines may precede it
    assert len(errors) == 1 and message in errors[0] and err.splitlines()[-1] == errors[0], err
    assert "Traceback" not in err


def test_bad_data_files(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("To be, or not to be: that is the question.")
    (tmp_path / "latin1.txt").write_bytes("Roméo et Juliette".encode("latin-1"))
    for name, message in [
        ("missing.txt", "does not exist"),
        ("empty.txt", "is empty"),
        ("short.txt", "fewer than one window of context_length + 1 = 17"),
        ("latin1.txt", "is not UTF-8"),
    ]:
        _fails([*TINY, "--data", str(tmp_path / name), "--out-dir", str(tmp_path / "out")], capsys, message)


def test_bad_flags_and_output_folders(tmp_path, corpus, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    data = ["--data", str(corpus)]
    _fails([*TINY, *data, "--out-dir", str(a_file / "out")], capsys, "cannot write to output folder")
    _fails([*TINY, *data, "--out-dir", str(tmp_path / "none"), "--resume"], capsys, "no checkpoint in")
    _fails([*TINY, "--bogus", "1"], capsys, "unrecognized arguments: --bogus")
    _fails([*TINY, "--preset", "gpu"], capsys, "invalid choice: 'gpu'")
    _fails([*TINY, "--d-model", "30", "--n-heads", "4"], capsys, "not divisible by n_heads=4")
    _fails([*TINY, "--batch-size", "6", "--grad-accum", "4"], capsys, "not divisible by grad_accum")


def test_resume_rejects_flags_that_contradict_the_checkpoint(uninterrupted, corpus, capsys):
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(uninterrupted), "--resume"]
    _fails([*argv, "--d-model", "64"], capsys, "--d-model 64 contradicts the checkpoint")
    _fails([*argv, "--lr", "0.5"], capsys, "--lr 0.5 contradicts the checkpoint")
    _fails(argv, capsys, "already finished at step 300")


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, corpus, capsys):
    out = tmp_path / "diverged"
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(out), "--lr", "1e30", "--min-lr", "1e30"]
    _fails(
        [*argv, "--max-steps", "20", "--eval-interval", "10", "--warmup-steps", "0"], capsys, "loss became"
    )
    meta = json.loads((out / "latest.json").read_text())
    assert meta["step"] == 0  # the checkpoint written before training diverged
    load_model(out)
