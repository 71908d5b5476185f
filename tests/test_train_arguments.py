"""Issue 53's mistakes of a Python caller of `train()`, each across its class: every argument is
checked before anything touches the disk (a refused call leaves no folder it created), two runs
of one process in one folder, the resume line an interrupted call prints, a resume whose
`max_steps` ends before the run's step, and an `out_dir` that is a loop of symbolic links."""

import importlib.util
import signal
import threading
from pathlib import Path

import pytest

import eqx_gpt.training.run as run_module
from eqx_gpt import EqxGptError, TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_cli_arguments", ROOT / "train.py")
train_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_cli)

TINY = dict(
    d_model=16, n_heads=2, n_layers=1, context_length=8, batch_size=2, eval_batches=1, max_minutes=0.0,
    warmup_steps=1, log_interval=1, eval_interval=2, max_steps=4,
)  # fmt: skip
QUIET = dict(log=lambda _: None, progress=False, sample_tokens=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "small.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")
    return path


def _one_line(error: BaseException, *words: str) -> None:
    message = str(error)
    assert "\n" not in message and message, message
    for word in words:
        assert word in message, (word, message)


# (train()'s arguments but out_dir, the exception, words the message must hold)
BAD_CALLS = {
    "out_dir 5": (dict(out_dir=5), TypeError, ["out_dir", "got 5"]),
    "out_dir bytes": (dict(out_dir=b"run"), TypeError, ["out_dir", "b'run'"]),
    "out_dir None": (dict(out_dir=None), TypeError, ["out_dir", "got None"]),
    "out_dir empty": (dict(out_dir=""), TypeError, ["out_dir", "got ''"]),
    "log None": (dict(log=None), TypeError, ["log must be a function", "got None"]),
    "log a string": (dict(log="out.txt"), TypeError, ["log must be a function", "'out.txt'"]),
    "now 3.0": (dict(now=3.0), TypeError, ["now must be a function", "got 3.0"]),
    "resume 'yes'": (dict(resume="yes"), TypeError, ["resume must be True or False", "'yes'"]),
    "overwrite 1": (dict(overwrite=1), TypeError, ["overwrite must be True or False", "got 1"]),
    "progress None": (dict(progress=None), TypeError, ["progress must be True or False"]),
    "sample_tokens -1": (dict(sample_tokens=-1), ValueError, ["sample_tokens", "got -1"]),
    "resume and overwrite": (dict(resume=True, overwrite=True), ValueError, ["--resume", "--overwrite"]),
    "resume an empty folder": (dict(resume=True), ValueError, ["--resume but no checkpoint"]),
    "config a dict": (dict(config={"lr": 1.0}), TypeError, ["config must be a TrainConfig", "dict"]),
    "an unknown setting": (dict(learning_rate=1.0), TypeError, ["learning_rate"]),
    "an unknown preset": (dict(preset="fast"), ValueError, ["unknown preset 'fast'"]),
    "max_steps -1": (dict(max_steps=-1), ValueError, ["max_steps", "got -1"]),
    "data missing": (dict(data="/nonexistent/corpus.txt"), ValueError, ["/nonexistent/corpus.txt"]),
    "data 5": (dict(data=5), ValueError, ["data must be a path", "got 5"]),
    "tracker 'mlflow'": (dict(tracker="mlflow"), ValueError, ["mlflow"]),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_a_bad_argument_is_one_line_and_leaves_no_folder_behind(case, corpus, tmp_path):
    arguments, error, words = BAD_CALLS[case]
    out = tmp_path / "new" / "run"  # two folders a call would create
    call = {**TINY, "data": str(corpus), **QUIET, "out_dir": out, **arguments}
    if call.get("resume"):
        call = {k: v for k, v in call.items() if k not in TINY and k != "data"}
    with pytest.raises(error) as raised:
        train(**call)
    _one_line(raised.value, *words)
    assert not (tmp_path / "new").exists()


def test_a_refusal_keeps_a_folder_the_caller_made(tmp_path):
    out = tmp_path / "made"
    out.mkdir()
    with pytest.raises(EqxGptError, match="--resume but no checkpoint"):
        train(out_dir=out, resume=True, **QUIET)
    assert out.is_dir()


def test_two_threads_of_one_process_in_one_folder_are_told_it_is_this_process(corpus, tmp_path):
    out, inside, release, results = tmp_path / "run", threading.Event(), threading.Event(), []

    def held_log(line: str) -> None:  # the first run holds the folder until released
        inside.set()
        release.wait(60)

    def first() -> None:
        results.append(
            train(**TINY, data=str(corpus), out_dir=out, log=held_log, progress=False, sample_tokens=0)
        )

    thread = threading.Thread(target=first, name="first-run")
    thread.start()
    try:
        assert inside.wait(60)
        with pytest.raises(EqxGptError) as raised:
            train(**TINY, data=str(corpus), out_dir=out, **QUIET)
        _one_line(raised.value, "in use by a live run", "another run in this process", "first-run")
    finally:
        release.set()
        thread.join(120)
    assert results and results[0].step == 4
    # The folder is free again once the first run has ended.
    assert train(out_dir=out, resume=True, max_steps=6, **QUIET).step == 6


def _interrupt_after_the_first_call(monkeypatch):
    dispatch = run_module.dispatch_steps

    def then_interrupt(run, n):
        dispatch(run, n)
        signal.raise_signal(signal.SIGINT)  # the run's handler only sets its stop flag

    monkeypatch.setattr(run_module, "dispatch_steps", then_interrupt)


def test_an_interrupted_call_says_how_its_caller_resumes(corpus, tmp_path, monkeypatch, capsys):
    _interrupt_after_the_first_call(monkeypatch)
    lines, out = [], tmp_path / "api"
    result = train(**TINY, data=str(corpus), out_dir=out, log=lines.append, progress=False, sample_tokens=0)
    assert result.interrupted
    assert f"Resume with: train(..., out_dir='{out}', resume=True)" in lines[-1], lines[-1]
    assert "uv run" not in lines[-1]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    cli_out = tmp_path / "cli"
    assert (
        train_cli.main([*flags, "--data", str(corpus), "--out-dir", str(cli_out), "--sample-tokens", "0"])
        == 130
    )
    assert f"Resume with: uv run train.py --resume --out-dir {cli_out}" in capsys.readouterr().out
    monkeypatch.undo()
    assert train(out_dir=out, resume=True, **QUIET).step == 4


def test_a_resume_whose_max_steps_ends_before_the_runs_step_is_refused(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train(**TINY, data=str(corpus), out_dir=out, **QUIET)
    with pytest.raises(EqxGptError) as raised:
        train(out_dir=out, resume=True, max_steps=2, **QUIET)
    _one_line(raised.value, "max_steps=2 ends before step 4", "at least 4")
    assert train_cli.main(["--resume", "--out-dir", str(out), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_steps=3 ends before step 4" in err, err
    assert train(out_dir=out, resume=True, max_steps=6, **QUIET).step == 6  # a longer one goes on


def test_an_out_dir_that_is_a_loop_of_symbolic_links_is_named(tmp_path, capsys):
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone")
    for resume in (True, False):
        with pytest.raises(EqxGptError) as raised:
            train(out_dir=loop, resume=resume, **QUIET)
        _one_line(raised.value, f"--out-dir {loop}: a loop of symbolic links")
    assert train_cli.main(["--resume", "--out-dir", str(loop)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a loop of symbolic links" in err, err
    with pytest.raises(EqxGptError) as raised:
        train(out_dir=dangling, resume=True, **QUIET)
    _one_line(raised.value, "symbolic link to", "which does not exist")
    assert not (tmp_path / "gone").exists()


@pytest.mark.parametrize(
    "name, value, accepted",
    [("max_minutes", -1, ">= 0"), ("weight_decay", -0.5, ">= 0"), ("grad_clip", -1.0, ">= 0"),
     ("beta2", 1.0, "[0, 1)"), ("muon_momentum", 1.5, "[0, 1)"), ("adam_weight_decay", -1.0, ">= 0"),
     ("decay_fraction", 0.0, "(0, 1]"), ("adam_lr", 0.0, "> 0"), ("min_lr", 0.5, "[0, lr=0.001]")],
)  # fmt: skip
def test_every_out_of_range_train_setting_is_named_with_its_value(name, value, accepted):
    with pytest.raises(ValueError) as raised:
        TrainConfig(**{name: value})
    _one_line(raised.value, f"{name} must be", accepted, f"got {name}={value!r}")
