"""Raw errors that did not name their argument, and lines that misled: `load_model`'s `kind`,
`evaluate`'s and `evaluate_text`'s arguments, a loop of links given to `sample.py` and
`evaluate.py`, `evaluate.py`'s progress off a terminal, a format-1 checkpoint's corpus, and the
line that says what was prepared."""

import gzip
import re
from pathlib import Path

import pytest

import eqx_gpt.evaluation
from eqx_gpt import evaluate, evaluate_text, load_model
from eqx_gpt.commands import evaluate as evaluate_command
from eqx_gpt.commands import sample as sample_command
from eqx_gpt.data.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "tests" / "fixtures" / "checkpoint-v1"


@pytest.fixture(scope="module")
def v1():
    return load_model(V1)


@pytest.mark.parametrize("kind", ["gpt", "Encoder", ["GPT"], 5])
def test_a_kind_load_model_does_not_know_is_named(kind):
    with pytest.raises(
        ValueError, match=r"kind must be 'GPT' or 'Transformer' .* or None, got " + re.escape(repr(kind))
    ):
        load_model(V1, kind=kind)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, t: evaluate(m, None), "tokens must be a sequence of integer ids, got NoneType"),
        (lambda m, t: evaluate(m, 7), "tokens must be a sequence of integer ids, got int"),
        (lambda m, t: evaluate(m, [1, None, 2]), "tokens must be integer ids, got object values such as 1"),
        (lambda m, t: evaluate(m, [1, 2, 3], shown=5), "shown must be a Shown"),
        (lambda m, t: evaluate_text(m, None, "First Citizen"), "tokenizer must be a tokenizer"),
        (lambda m, t: evaluate_text(None, t, "First Citizen"), "must be a language model"),
        (lambda m, t: evaluate_text(m, t, None), "text must be a str, got NoneType"),
    ],
)
def test_evaluations_name_the_argument_that_is_wrong(v1, call, message):
    model, tokenizer, _ = v1
    with pytest.raises(TypeError, match=re.escape(message)):
        call(model, tokenizer)


@pytest.mark.parametrize("command", [sample_command, evaluate_command])
def test_a_loop_of_links_given_as_checkpoint_is_named_a_loop(tmp_path, capsys, command):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert command.main(["--checkpoint", str(tmp_path / "loop")]) == 2
    err = capsys.readouterr().err
    assert "is a loop of symbolic links" in err and "train.py" not in err and err.count("\n") == 1


def test_evaluate_off_a_terminal_writes_the_figure_alone_to_stdout(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(eqx_gpt.evaluation, "SHOW_AFTER_LOG", 0.0)  # progress at once, were it shown
    text = tmp_path / "t.txt"
    text.write_text("a bad cab fed a dace each age " * 4000)  # several calls
    assert evaluate_command.main(["--checkpoint", str(V1), "--text", str(text), "--stride", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and "loss" in out and "evaluating" not in out, out
    assert err == ""


def test_a_format_1_checkpoint_is_not_said_to_have_trained_on_the_bundled_corpus(capsys):
    assert evaluate_command.main(["--checkpoint", str(V1), "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert "records no training corpus" in err and "Tiny Shakespeare" not in err


def test_the_prepared_line_gives_a_compressed_files_text_and_a_rate_that_is_not_zero(tmp_path):
    line = "All the world's a stage, and all the men and women merely players.\n"
    (tmp_path / "big.txt.gz").write_bytes(gzip.compress((line * 2000).encode(), 9))
    logged = []
    prepare(
        tmp_path / "big.txt.gz",
        {"kind": "char"},
        cache=tmp_path / "cache",
        in_memory_bytes=0,
        log=logged.append,
    )
    prepared = next(x for x in logged if x.startswith("prepared"))
    stored = (tmp_path / "big.txt.gz").stat().st_size
    assert f"{stored:,} bytes, {len(line) * 2000 / 1e3:,.1f} KB of text" in prepared, prepared
    assert "0.0 MB/s" not in prepared and " of text/s" in prepared, prepared


def test_a_fine_tune_crops_its_presets_context_to_the_bases_positions_and_says_so():
    from eqx_gpt.errors import EqxGptError
    from eqx_gpt.gpt2 import read_gpt2_config
    from eqx_gpt.training.options import resolve_options

    base = str(ROOT / "tests" / "fixtures" / "tiny-gpt2")  # 64 positions; finetune-shakespeare asks 256
    for settings in ({"init_from": base, "lora_rank": 4}, {"init_from": base}):
        options = resolve_options(settings)
        assert options.model.context_length == 64
        assert "context_length 64, the base's positions (the preset's 256 is longer)" in options.describe()
    given = resolve_options({"init_from": base, "lora_rank": 4, "context_length": 256})
    assert given.model.context_length == 256 and not given.cropped  # given: kept, and refused on loading
    with pytest.raises(EqxGptError, match="context_length 256 is longer than the 64 positions"):
        read_gpt2_config(base, **given.model.gpt2_options())
    assert resolve_options({"init_from": base, "context_length": 32}).model.context_length == 32
