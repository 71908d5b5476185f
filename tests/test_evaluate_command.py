"""evaluate.py on a run: by default the run's final validation figure, `--whole-split` the whole
split's, `--data` a moved copy of the corpus (and no other corpus); an evaluation's progress shows
only once it takes more than a moment."""

import importlib.util
import io
import itertools
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from runs_family import BATCH_SIZE, GROUP, MODEL, quick_runs, write_corpus

from eqx_gpt import load_model
from eqx_gpt.checkpoint import LATEST, checkpoint_file
from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.evaluation import Shown, evaluate, evaluate_plan, plan_whole
from eqx_gpt.training import data as data_module
from eqx_gpt.training.report import Progress
from eqx_gpt.training.run import train

pytestmark = GROUP
__all__ = ["quick_runs"]  # a fixture, used by name

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(**MODEL, batch_size=BATCH_SIZE, eval_batches=1)


def _cli():
    spec = importlib.util.spec_from_file_location("evaluate_command_cli", ROOT / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _cli()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run whose validation split (3,000 tokens) is over 4x its --eval-tokens (64):
    its final validation reads an even sample of windows, not the whole split."""
    folder = tmp_path_factory.mktemp("evalcmd")
    corpus = write_corpus(folder)  # its own: a test moves it
    out = folder / "run"
    train(
        **TINY, data=str(corpus), max_steps=2, max_minutes=0.0, eval_tokens=64, out_dir=out, sample_tokens=0,
        log=lambda s: None, progress=False,
    )  # fmt: skip
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["whole_split"] is False  # the case where the default and --whole-split differ
    return corpus, out, final


def _score(capsys, *argv) -> tuple[float, int, str]:
    assert cli.main(list(argv)) == 0
    out = capsys.readouterr().out
    loss, predicted = re.search(r"loss (\d+\.\d+) nats/token over ([\d,]+) predicted tokens", out).groups()
    return float(loss), int(predicted.replace(",", "")), out


def test_by_default_the_figure_is_the_runs_final_validation_and_says_so(run, capsys):
    corpus, out, final = run
    loss, predicted, said = _score(capsys, "--checkpoint", str(checkpoint_file(out, LATEST)))
    assert predicted == final["val_tokens"]
    assert loss == pytest.approx(final["final_val_loss"], abs=5.1e-5)  # printed to 4 decimals
    assert "as the run's final validation read it: an even sample of" in said and "--whole-split" in said


def test_whole_split_scores_every_token_of_the_split(run, capsys):
    corpus, out, final = run
    latest = checkpoint_file(out, LATEST)
    loss, predicted, said = _score(capsys, "--checkpoint", str(latest), "--whole-split")
    model, _, _ = load_model(latest, kind="GPT")
    val = data_module.load_corpus(str(corpus), {"kind": "char"}).val.to_array()
    expected = evaluate(model, val)
    assert predicted == expected.n_predicted == len(val) - 1 != final["val_tokens"]
    assert loss == pytest.approx(expected.loss, abs=5.1e-5)
    assert said.startswith("all of the validation split of")


def test_a_moved_corpus_is_scored_with_data_and_another_corpus_is_refused(run, tmp_path, capsys):
    corpus, out, final = run
    latest = str(checkpoint_file(out, LATEST))
    moved = tmp_path / "elsewhere.txt"
    shutil.move(corpus, moved)
    try:
        assert cli.main(["--checkpoint", latest]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is not there" in err and "pass --data PATH" in err
        loss, predicted, said = _score(capsys, "--checkpoint", latest, "--data", str(moved))
        assert predicted == final["val_tokens"]
        assert loss == pytest.approx(final["final_val_loss"], abs=5.1e-5)
        assert f"(the run trained on {corpus})" in said
    finally:
        shutil.move(moved, corpus)
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text(encoding="utf-8").upper(), encoding="utf-8")
    assert cli.main(["--checkpoint", latest, "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(other) in err and str(corpus) in err and "sha256" in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--stride", "4"], "--stride sets the windows of --whole-split or --text"),
        (["--text", "a.txt", "--whole-split"], "--text scores a text of its own, --whole-split"),
        (["--text", "a.txt", "--data", "b.txt"], "--text scores a text of its own, --data"),
        (["--whole-split", "--stride", "0"], "--stride: must be an integer in [1,"),
    ],
)
def test_flags_that_do_not_go_together_exit_2_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


class _Bar(Progress):
    """A `Progress` on a terminal-like stream, recording what it was asked to show."""

    def __init__(self, tty: bool):
        super().__init__(stream=io.StringIO())
        self.tty, self.shown_texts = tty, []

    def update(self, text: str) -> None:
        self.shown_texts.append(text)


@pytest.mark.parametrize("tty", [True, False])
def test_an_evaluations_progress_shows_after_a_moment_with_an_eta(run, tty, monkeypatch):
    from eqx_gpt import evaluation

    corpus, out, _ = run
    model, tokenizer, _ = load_model(checkpoint_file(out, LATEST), kind="GPT")
    ids = np.asarray(tokenizer.encode(corpus.read_text(encoding="utf-8")[:2000]))
    span = TokenSpan([ids.astype(np.int32)])
    plan = plan_whole(len(ids), 16, 8)
    monkeypatch.setattr(evaluation, "monotonic", lambda: 0.0)  # the evaluation's clock, stopped
    monkeypatch.setattr(evaluation, "_COMPILED", set())  # as in a fresh process
    quick = _Bar(tty)
    evaluate_plan(model, span, plan, batch=4, shown=Shown(quick, "evaluating"))
    # A quick evaluation: on a terminal only the phase, in place; in a log nothing at all.
    assert quick.shown_texts == (["evaluating: 249 windows, compiling the evaluation"] if tty else [])
    clock = itertools.count(0.0, 20.0)  # each look at the clock: 20 s later
    monkeypatch.setattr(evaluation, "monotonic", lambda: float(next(clock)))
    slow = _Bar(tty)
    result = evaluate_plan(model, span, plan, batch=4, shown=Shown(slow, "evaluating"))
    assert result is not None and result.n_predicted == len(ids) - 1
    # The first call (it compiles) is not timed: the ETA comes from the calls after it.
    assert slow.shown_texts[:tty] == (["evaluating: 249 windows, starting"] if tty else [])  # compiled
    assert slow.shown_texts[tty:][:2] == [
        "evaluating: 4/249 windows (2%), 0:20 elapsed, timing the first calls",
        "evaluating: 8/249 windows (3%), 0:40 elapsed, ETA 20:05",  # 241 windows at 4 per 20 s
    ]


def test_evaluate_prepares_a_damaged_cache_entry_again_and_says_so_as_train_does(
    run, tmp_path, monkeypatch, capsys
):
    from eqx_gpt.data import prepare as prepare_module

    _, out, _ = run
    monkeypatch.setenv("EQX_GPT_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepare_module, "IN_MEMORY_BYTES", 0)  # the run's corpus, through the cache
    latest = str(checkpoint_file(out, LATEST))
    loss, predicted, said = _score(capsys, "--checkpoint", latest)
    assert "prepared " in said and "cached in" in said
    shard = sorted((tmp_path / "cache").glob("*/shard-*.bin"))[0]
    shard.write_bytes(bytes(shard.stat().st_size))  # zeroed
    again = _score(capsys, "--checkpoint", latest)
    assert f"is damaged ({shard.name} fails its CRC-32 check); preparing it again" in again[2]
    assert again[:2] == (loss, predicted)


def test_characters_the_tokenizer_lacks_are_named_by_their_source_and_a_split_is_scored(
    run, tmp_path, capsys
):
    corpus, out, _ = run
    latest = str(checkpoint_file(out, LATEST))
    notes = tmp_path / "notes.txt"
    notes.write_text("Ünïcode ∑ words\n", encoding="utf-8")
    assert cli.main(["--checkpoint", latest, "--text", str(notes)]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"--text {notes} has characters the tokenizer does not know: 'Ü', 'ï', '∑'" in err
    ), err
    splits = tmp_path / "splits"  # a folder of splits: the run's characters in train, others in test
    splits.mkdir()
    (splits / "train.txt").write_text(corpus.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    (splits / "test.txt").write_text("Ünïcode ∑ words\n", encoding="utf-8")
    assert cli.main(["--checkpoint", latest, "--split", "test", "--data", str(splits)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"data file {splits / 'test.txt'} has characters the tokenizer" in err, (
        err
    )
    loss, predicted, said = _score(capsys, "--checkpoint", latest, "--split", "train", "--data", str(splits))
    assert f"all of split train of {splits}: loss" in said and predicted == 2999
