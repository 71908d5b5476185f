"""Issue 53's mistakes of a Python caller of `train()`, each across its class: every argument is
checked before anything touches the disk (a refused call leaves no folder it created), two runs
of one process in one folder, the resume line an interrupted call prints, a resume whose
`max_steps` ends before the run's step, and an `out_dir` that is a loop of symbolic links."""

import importlib.util
import signal
import threading
from pathlib import Path

import pytest
from runs_family import BATCH_SIZE, GROUP, MODEL, corpus, quick_runs

import eqx_gpt.training.run as run_module
from eqx_gpt import EqxGptError, TrainConfig, train
from eqx_gpt.training import run_dir

pytestmark = GROUP
__all__ = ["corpus", "quick_runs"]  # fixtures, used by name

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_cli_arguments", ROOT / "train.py")
train_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_cli)

TINY = dict(
    **MODEL, batch_size=BATCH_SIZE, eval_batches=1, max_minutes=0.0, warmup_steps=1, log_interval=1,
    eval_interval=2, max_steps=4,
)  # fmt: skip
QUIET = dict(log=lambda _: None, progress=False, sample_tokens=0)


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
    "resume and overwrite": (
        dict(resume=True, overwrite=True),
        ValueError,
        ["resume=True", "overwrite=True"],
    ),
    "resume an empty folder": (dict(resume=True), ValueError, ["resume=True but no checkpoint"]),
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
    with pytest.raises(EqxGptError, match="resume=True but no checkpoint"):
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
    _one_line(raised.value, "max_steps=2 ends before step 4", "pass a max_steps of at least 4")
    assert "--" not in str(raised.value)  # a Python caller is told of keywords, not of flags
    assert train_cli.main(["--resume", "--out-dir", str(out), "--max-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_steps=3 ends before step 4" in err, err
    assert "pass a --max-steps of at least 4" in err
    assert train(out_dir=out, resume=True, max_steps=6, **QUIET).step == 6  # a longer one goes on


def test_an_out_dir_that_is_a_loop_of_symbolic_links_is_named(tmp_path, capsys):
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone")
    for resume in (True, False):
        with pytest.raises(EqxGptError) as raised:
            train(out_dir=loop, resume=resume, **QUIET)
        _one_line(raised.value, f"out_dir='{loop}': a loop of symbolic links")
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


def test_two_runs_racing_into_one_new_folder_never_delete_the_winners(tmp_path, monkeypatch):
    # The loser of the lock made the folder; the winner locked it before the loser could. The
    # loser is refused, and the folder stays the winner's (it used to remove it: issue 60, item 17).
    out = tmp_path / "new"
    winner = run_dir.RunDirLock(out)
    made = run_dir.check_writable

    def made_then_lost(path):
        created = made(path)
        monkeypatch.setattr(run_dir, "check_writable", made)
        winner.__enter__()  # another run locks the folder this one has just made
        return created

    monkeypatch.setattr(run_dir, "check_writable", made_then_lost)
    with pytest.raises(EqxGptError, match="in use by a live run"):
        run_dir.RunDirLock(out).__enter__()
    monkeypatch.undo()
    assert out.is_dir()
    winner.claim()  # the winner goes on writing in its folder
    assert (out / run_dir.LOCK_NAME).exists()
    winner.__exit__(None, None, None)


def test_threads_racing_into_one_new_folder_each_train_or_are_refused_in_one_line(corpus, tmp_path):
    for attempt in range(3):
        out, outcomes = tmp_path / f"race{attempt}", []

        def one(out: Path, outcomes: list) -> None:
            try:
                outcomes.append(train(**TINY, data=str(corpus), out_dir=out, **QUIET).step)
            except EqxGptError as e:
                outcomes.append(str(e))

        threads = [threading.Thread(target=one, args=(out, outcomes)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert 4 in outcomes, outcomes  # one trained
        assert all(o == 4 or "in use by a live run" in str(o) for o in outcomes), outcomes


def test_api_refusals_name_keywords_and_take_paths(corpus, tmp_path):
    # A path as a Path, as out_dir takes one.
    result = train(**TINY, data=corpus, out_dir=tmp_path / "run", **QUIET)
    assert result.step == 4 and result.history
    with pytest.raises(EqxGptError) as raised:
        train(init_from=5, out_dir=tmp_path / "other", **QUIET)
    _one_line(raised.value, "init_from")
    assert "d-model" not in str(raised.value) and "d_model" not in str(raised.value)


def test_overwrite_into_a_new_folder_deletes_nothing_and_says_so(corpus, tmp_path):
    lines: list[str] = []
    out = tmp_path / "new"
    train(
        **TINY,
        data=str(corpus),
        out_dir=out,
        overwrite=True,
        log=lines.append,
        progress=False,
        sample_tokens=0,
    )
    assert not [line for line in lines if "deleting" in line], lines
    again: list[str] = []
    train(
        **TINY,
        data=str(corpus),
        out_dir=out,
        overwrite=True,
        log=again.append,
        progress=False,
        sample_tokens=0,
    )
    [said] = [line for line in again if "deleting" in line]
    assert said.startswith("overwrite=True: deleting the run in") and "step 4" in said


def test_train_starts_a_multi_host_run_as_train_py_does(monkeypatch, tmp_path):
    # Issue 58: the API does what the command does (train.py calls train): it joins a multi-host
    # run where the environment says so, before any device use, and refuses a half-set one.
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    with pytest.raises(EqxGptError, match="JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES"):
        train(out_dir=tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()
