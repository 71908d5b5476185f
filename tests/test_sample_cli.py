"""`sample.py`: streaming output, determinism per seed, pictures, and one-line errors (exit 2)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from runs_family import CORPUS_CHARACTERS, GROUP, MODEL

from eqx_gpt import GPT, CharTokenizer, GPTConfig, save_checkpoint
from eqx_gpt.training.data import load_text

pytestmark = GROUP

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = (ROOT / "eqx_gpt" / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")


def load_cli():
    spec = importlib.util.spec_from_file_location("sample_cli", ROOT / "sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cli():
    return load_cli()  # the compilation cache stays the session's (conftest): the environment names it


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory holding a random-weight character model's `best` checkpoint: the shape and
    characters of the family's runs (tests/runs_family.py), whose sampler it shares."""
    out = tmp_path_factory.mktemp("run")
    tokenizer = CharTokenizer.from_text(load_text()[:CORPUS_CHARACTERS])
    config = GPTConfig(vocab_size=tokenizer.vocab_size, **MODEL)
    model = GPT(config, key=jax.random.key(0))
    save_checkpoint(out, "best", model, None, step=0, tokenizer=tokenizer, train_config={})
    return out


def sample(cli, capsys, *argv):
    """`(exit code, stdout, stderr)` of `sample.py argv`."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_streams_the_prompt_then_the_continuation(cli, capsys, run_dir):
    code, out, err = sample(
        cli, capsys, "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "50"
    )
    assert code == 0, err
    assert out.startswith("ROMEO:") and out.endswith("\n")
    assert len(out) == len("ROMEO:") + 50 + 1  # one character per token, then a newline
    assert set(out) <= set(SHAKESPEARE)


def test_same_seed_same_text_other_seed_other_text(cli, capsys, run_dir):
    args = ("--checkpoint", str(run_dir), "--prompt", "MENENIUS:", "--max-new-tokens", "40")
    first = sample(cli, capsys, *args, "--seed", "5")[1]
    assert first == sample(cli, capsys, *args, "--seed", "5")[1]
    assert first != sample(cli, capsys, *args, "--seed", "6")[1]


def test_several_samples_and_a_prompt_file(cli, capsys, run_dir, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("First Citizen:\n", encoding="utf-8")
    code, out, err = sample(
        cli, capsys, "--checkpoint", str(run_dir / "best.json"), "--prompt-file", str(prompt),
        "--max-new-tokens", "20", "--num-samples", "3", "--temperature", "0",
    )  # fmt: skip
    assert code == 0, err
    samples = out.rstrip("\n").split("\n" + "-" * 40 + "\n")
    assert len(samples) == 3
    assert all(s.startswith("First Citizen:\n") for s in samples)
    assert samples[0] == samples[1] == samples[2]  # greedy: no randomness


def test_writes_the_attention_and_position_pictures(cli, capsys, run_dir, tmp_path):
    attention, positions = tmp_path / "attention.png", tmp_path / "positions.png"
    code, out, err = sample(
        cli, capsys, "--checkpoint", str(run_dir), "--prompt", "To be, or not", "--max-new-tokens", "0",
        "--attention-png", str(attention), "--positions-png", str(positions),
    )  # fmt: skip
    assert code == 0, err
    for png in (attention, positions):
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000


def corrupt_copy(run_dir, tmp_path, how):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in run_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = next(bad.glob("*.eqx"))
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "garbled json":
        (bad / "best.json").write_text('{"format": "eqx_gpt-checkpoint", "vers')
    elif how == "weights missing":
        weights.unlink()
    return bad


@pytest.mark.parametrize("how", ["truncated", "garbled json", "weights missing"])
def test_a_broken_checkpoint_is_one_line_exit_2(cli, capsys, run_dir, tmp_path, how):
    code, out, err = sample(cli, capsys, "--checkpoint", str(corrupt_copy(run_dir, tmp_path, how)))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "checkpoint" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--prompt", "héllo €"], "the prompt has characters the tokenizer does not know: 'é', '€'"),
        (["--prompt-file", "{accents}"], "accents.txt has characters the tokenizer does not know: 'é'"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt-file", "{empty}"], "prompt is empty"),
        (["--prompt-file", "{missing}"], "cannot read --prompt-file"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--temperature", "-0.5"], "temperature must be a finite number >= 0"),
        (["--top-k", "0"], "must be an integer in [1, 2147483647], got 0"),
        (["--top-k", "3000000000"], "must be an integer in [1, 2147483647]"),
        (["--seed", "18446744073709551616"], "must be an integer in [0, 9223372036854775807]"),
        (["--max-new-tokens", "-1"], "--max-new-tokens"),
        (["--num-samples", "0"], "--num-samples"),
        (["--temperature", "hot"], "expected a number, got 'hot'"),
        (["--prompt", "a", "--prompt-file", "b"], "not allowed with"),
    ],
)
def test_bad_input_is_one_line_exit_2(cli, capsys, run_dir, tmp_path, args, needle):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "accents.txt").write_text("héllo", encoding="utf-8")
    files = {
        "empty": tmp_path / "empty.txt",
        "missing": tmp_path / "nope.txt",
        "accents": tmp_path / "accents.txt",
    }
    args = [a.format(**files) for a in args]
    code, out, err = sample(cli, capsys, "--checkpoint", str(run_dir), *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.slow  # a new Python process; the refusals above run sample.py's main in this one
def test_no_checkpoint_says_to_train_first_from_a_real_process(tmp_path):
    # A real interpreter, to check the exit code and that no stack trace reaches the user.
    result = subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--checkpoint", str(tmp_path), "--prompt", "hi"],
        capture_output=True,
        text=True,
        env={"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "uv run train.py" in result.stderr, result.stderr


def test_checkpoint_metadata_is_what_the_trainer_writes(run_dir):
    # Guard against the fixture drifting from the checkpoint format sample.py reads.
    meta = json.loads((run_dir / "best.json").read_text())
    assert meta["tokenizer"]["kind"] == "char" and meta["model_config"]["context_length"] == 16


def test_samples_a_hugging_face_gpt2_directory(cli, capsys):
    # The tiny GPT-2 that `transformers` made (tests/fixtures/tiny-gpt2): greedy text is its tokens.
    from eqx_gpt.tokenizer import GPT2Tokenizer, TokenizerError

    try:
        tokenizer = GPT2Tokenizer(512)
    except TokenizerError as error:
        pytest.skip(f"GPT-2 BPE files unavailable (set TIKTOKEN_CACHE_DIR): {error}")
    tiny = ROOT / "tests" / "fixtures" / "tiny-gpt2"
    expected = np.load(tiny / "expected.npz")
    code, out, err = sample(
        cli, capsys, "--checkpoint", str(tiny), "--prompt", "ROMEO: soft!", "--temperature", "0",
        "--max-new-tokens", str(len(expected["greedy"])),
    )  # fmt: skip
    assert code == 0, err
    assert out == "ROMEO: soft!" + tokenizer.decode(expected["greedy"]) + "\n"
