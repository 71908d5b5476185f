"""`train.py --init-from DIR` fine-tunes a Hugging Face GPT-2 directory (the committed tiny one),
and `export.py` writes the result back as one; bad input is one line and exit code 2."""

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest
from runs_family import GROUP, MODEL, quick_runs

from eqx_gpt import load_model
from eqx_gpt.gpt2 import load_gpt2
from eqx_gpt.tokenizer import GPT2Tokenizer

pytestmark = GROUP
__all__ = ["quick_runs"]  # a fixture, used by name

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = ROOT / "tests" / "fixtures" / "tiny-gpt2"
FAST = ["--context-length", "32", "--batch-size", "2", "--eval-batches", "1", "--sample-tokens", "0"]


def _cli(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_cli", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_cli, export_cli = _cli("train"), _cli("export")


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, gpt2_corpus):
    out = tmp_path_factory.mktemp("finetune") / "run"
    argv = ["--init-from", str(TINY_GPT2), "--data", str(gpt2_corpus), "--out-dir", str(out), *FAST]
    assert train_cli.main([*argv, "--max-steps", "3", "--eval-interval", "3"]) == 0
    return out


def test_fine_tuning_starts_from_the_directory_and_moves_its_weights(fine_tuned):
    model, tokenizer, meta = load_model(fine_tuned)
    start = load_gpt2(TINY_GPT2, context_length=32)
    assert model.config == start.config and tokenizer == GPT2Tokenizer(512)
    assert meta["preset"] == "finetune-shakespeare" and meta["train_config"]["optimizer"] == "adamw"
    # Three AdamW steps at 3e-5 move a weight by about 1e-4; a fresh model would be 0.15 away.
    pairs = zip(jax.tree.leaves(model), jax.tree.leaves(start), strict=True)
    diffs = [float(np.abs(np.asarray(a, float) - np.asarray(b, float)).max()) for a, b in pairs]  # NumPy
    assert 0 < max(diffs) < 1e-3


def test_the_fine_tuned_model_exports_to_a_gpt2_directory(fine_tuned, tmp_path, capsys):
    out = tmp_path / "hf"
    assert export_cli.main(["--checkpoint", str(fine_tuned), "--out-dir", str(out)]) == 0
    model, _, _ = load_model(fine_tuned)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(load_gpt2(out)), strict=True):
        np.testing.assert_array_equal(a, b)
    # Again into the same folder: refused without --overwrite, nothing touched.
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert export_cli.main(["--checkpoint", str(fine_tuned), "--out-dir", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--init-from", str(TINY_GPT2), "--d-model", "64"], "--d-model sets the model's shape"),
        (["--init-from", str(TINY_GPT2), "--tokenizer", "char"], "whose tokenizer is gpt2"),
        (["--init-from", str(TINY_GPT2), "--context-length", "128"], "at most 64"),
        (["--init-from", "no/such/dir"], "no folder"),
        (["--preset", "finetune-shakespeare"], "pass --init-from DIR"),
    ],
    # The preset's context past the base's positions is cropped, not refused: test_argument_refusals.py.
    ids=["shape-flag", "char-tokenizer", "context-too-long", "missing-dir", "preset-alone"],
)
def test_bad_fine_tuning_input_is_one_line_and_exit_2(argv, words, gpt2_corpus, tmp_path, capsys):
    code = train_cli.main([*argv, "--data", str(gpt2_corpus), "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and err.count("\n") == 1


def test_a_character_model_is_not_exported(tmp_path, capsys):
    from eqx_gpt import GPT, CharTokenizer, GPTConfig, save_checkpoint

    tokenizer = CharTokenizer("abc")
    model = GPT(GPTConfig(vocab_size=3, **MODEL), key=jax.random.key(0))  # the family's block shapes
    save_checkpoint(tmp_path, "best", model, None, step=0, tokenizer=tokenizer, train_config={})
    assert export_cli.main(["--checkpoint", str(tmp_path), "--out-dir", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "not GPT-2-shaped" in err and err.count("\n") == 1 and not (tmp_path / "hf").exists()


@pytest.mark.slow  # a resumed run; the next test resumes a fine-tuning run in the quick suite
def test_a_fine_tuning_run_resumes_from_its_checkpoint(fine_tuned, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(fine_tuned, run)
    assert train_cli.main(["--resume", "--out-dir", str(run), "--max-steps", "4"]) == 0
    model, _, meta = load_model(run / "latest.json")
    assert meta["step"] == 4 and model.config.positions == "learned" and model.head is None


def test_the_fine_tuning_command_repeated_with_resume_goes_on(fine_tuned, gpt2_corpus, tmp_path, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(fine_tuned, run)
    monkeypatch.chdir(ROOT)  # --init-from as typed: relative, while the checkpoint records it absolute
    argv = [
        "--init-from",
        "tests/fixtures/tiny-gpt2",
        "--data",
        str(gpt2_corpus),
        "--out-dir",
        str(run),
        *FAST,
    ]
    assert train_cli.main([*argv, "--max-steps", "4", "--eval-interval", "3", "--resume"]) == 0
    assert load_model(run / "latest.json")[2]["step"] == 4
