"""Issue 15's classes of defect: each test reproduces one class of bad input across the whole class."""

import dataclasses
import json
import math
import os
import typing
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import gpt
from model_family import TINY_GPT, decode, in_family
from oracles import naive_generate
from test_sample_cli import load_cli, sample
from test_train_cli import TINY, _fails, _records, train_cli

from eqx_gpt import GPT, Block, GPTConfig, MultiHeadAttention, dropout, generate
from eqx_gpt.training.config import TrainConfig

pytestmark = in_family


def _float_fields(cls):
    hints = typing.get_type_hints(cls)
    return [
        f.name for f in dataclasses.fields(cls) if float in typing.get_args(hints[f.name]) + (hints[f.name],)
    ]


# -- non-finite numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [GPTConfig, TrainConfig])
def test_every_float_field_of_the_configs_refuses_nan_and_infinity(cls):
    fields = _float_fields(cls)
    assert fields, cls
    base = {"vocab_size": 5} if cls is GPTConfig else {}
    for name in fields:
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=f"{cls.__name__}.{name} must be a finite number|{name}"):
                cls(**base, **{name: bad})


def test_every_float_flag_of_train_py_refuses_nan_and_infinity(capsys, tmp_path):
    for name in _float_fields(GPTConfig) + _float_fields(TrainConfig):
        for bad in ("nan", "inf", "-inf"):
            flag = "--" + name.replace("_", "-")
            _fails(
                [*TINY, "--out-dir", str(tmp_path / "x"), f"{flag}={bad}"],
                capsys,
                f"must be a finite number, got {bad}",
            )
    assert not (tmp_path / "x").exists()


def test_every_float_flag_of_sample_py_refuses_nan_and_infinity(capsys, tmp_path):
    cli = load_cli()
    for flag in ("--temperature", "--top-p"):
        for bad in ("nan", "inf", "-inf"):
            code, _, err = sample(cli, capsys, "--checkpoint", str(tmp_path), f"{flag}={bad}")
            assert code == 2 and f"must be a finite number, got {bad}" in err and "Traceback" not in err


# -- output paths -----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--attention-png", "--positions-png"])
def test_every_picture_path_of_sample_py_is_checked_before_any_work(capsys, tmp_path, flag):
    cli = load_cli()
    missing_checkpoint = str(tmp_path / "no-run")  # the path error must come first
    for path, message in (
        (tmp_path / "missing" / "a.png", "does not exist"),
        (tmp_path / "a.txt", "unsupported picture format '.txt'"),
        (tmp_path / "a", "unsupported picture format '(none)'"),
        (tmp_path, "unsupported picture format"),
    ):
        code, _, err = sample(cli, capsys, "--checkpoint", missing_checkpoint, flag, str(path))
        assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


# -- keys: classic PRNGKey and typed keys ------------------------------------------------------


def _modules(make):
    """Every key-taking module, built with keys made by `make(seed)` (the family's sizes: their
    weights are drawn by the programs other tests compiled)."""
    attention = MultiHeadAttention(16, 2, key=make(0), dropout=0.5)
    block = Block(16, 2, 32, key=make(1), dropout=0.5)
    model = GPT(dataclasses.replace(TINY_GPT, dropout=0.5), key=make(2))
    return attention, block, model


def _outputs_with_keys(modules, make):
    """What every key-taking module gives with keys made by `make(seed)`."""
    attention, block, model = modules
    x = jnp.ones((2, 5, 16))
    tokens = jnp.zeros((3, 4), jnp.int32)
    return [
        attention(x[0], key=make(3)),
        attention(x, key=make(3)),
        block(x, key=make(4)),
        dropout(x, 0.5, make(5)),
        model(tokens, key=make(6)),
        jax.vmap(lambda t, k: model(t, key=k))(tokens, jax.random.split(make(7), 3)),
    ]


@eqx.filter_jit
def _outputs_with_both_kinds_of_key(modules):
    """`_outputs_with_keys` with classic keys and with typed ones, in one compiled program (eagerly,
    every operation would compile on its own; the same keys' draws are then compiled once)."""
    return [_outputs_with_keys(modules, make) for make in (jax.random.PRNGKey, jax.random.key)]


def test_every_module_taking_a_key_accepts_classic_keys_with_the_result_of_typed_ones():
    classic_built = _modules(jax.random.PRNGKey)
    # Built with either kind of key, the modules are the same: their calls are made with one.
    for leaf, typed_leaf in zip(
        jax.tree.leaves(classic_built), jax.tree.leaves(_modules(jax.random.key)), strict=True
    ):
        np.testing.assert_array_equal(leaf, typed_leaf)
    classic, typed = _outputs_with_both_kinds_of_key(classic_built)
    for out, ref in zip(classic, typed, strict=True):
        np.testing.assert_array_equal(out, ref)


# -- token ids and the cache -------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_are_refused_where_they_are_concrete():
    # The family's tiny model: test_bad_values calls it eagerly on 3 ids, so the call below that
    # runs compiles nothing new.
    model = gpt(TINY_GPT)
    assert model.config.vocab_size == 9
    assert model.config.padded_vocab_size > 9  # 8 is a real id; 9 .. padded are padding rows
    for ids in ([9], [40], [-1], [[1, 2], [3, 12]]):
        with pytest.raises(ValueError, match=r"outside \[0, vocab_size=9\)"):
            model(jnp.asarray(ids))
    model(jnp.asarray([0, 4, 8]))  # the extremes of the vocabulary are fine
    cache = model.init_cache(4)
    with pytest.raises(ValueError, match="outside"):
        model.decode(jnp.asarray([9]), cache, 0)


def test_decoding_past_the_cache_and_empty_caches_are_refused():
    model = gpt(TINY_GPT)
    for capacity in (0, -1):
        with pytest.raises(ValueError, match="capacity >= 1"):
            model.init_cache(capacity)
    _, cache = decode(model, jnp.arange(4), model.init_cache(4), 0)  # full: compiled, it is not the subject
    for tokens, start in (([1], 4), ([1, 2], 3), ([1], -1)):
        with pytest.raises(ValueError, match="does not fit a cache of capacity 4"):
            model.decode(jnp.asarray(tokens), cache, start)
    model.decode(jnp.asarray([1]), cache, 3)  # the last slot is fine


# -- the smallest legal sizes ------------------------------------------------------------------


def test_the_smallest_legal_model_generates_with_both_generators():
    config = GPTConfig(vocab_size=1, context_length=1, d_model=2, n_heads=1, n_layers=1, d_hidden=1)
    model = GPT(config, key=jax.random.key(0))
    for fn in (generate, naive_generate):
        assert fn(model, [0], 5, key=jax.random.key(0)).tolist() == [0] * 5


@pytest.mark.slow  # three commands (train, resume, sample); the smallest model generates in the test above
def test_a_run_at_the_smallest_legal_sizes_trains_samples_and_resumes(tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("ab" * 20)
    out = tmp_path / "run"
    argv = [
        "--data", str(data), "--out-dir", str(out), "--context-length", "1", "--d-model", "2",
        "--n-heads", "1", "--n-layers", "1", "--d-hidden", "1", "--batch-size", "1", "--grad-accum", "1",
        "--max-steps", "1", "--eval-interval", "1", "--eval-batches", "1", "--log-interval", "1",
        "--warmup-steps", "0", "--scan-unroll", "1", "--max-minutes", "0", "--sample-tokens", "5",
    ]  # fmt: skip
    assert train_cli.main(argv) == 0, capsys.readouterr().err
    assert train_cli.main([*argv[:4], "--resume", "--max-steps", "2", "--sample-tokens", "3"]) == 0
    capsys.readouterr()
    code, text, err = sample(
        load_cli(), capsys, "--checkpoint", str(out), "--prompt", "a", "--max-new-tokens", "5"
    )
    assert code == 0 and len(text) == len("a") + 5 + 1, err


# -- resume from anywhere ----------------------------------------------------------------------


@pytest.mark.slow  # a run, then its resume from another folder
def test_a_run_with_a_relative_data_path_resumes_from_another_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    text = (
        Path(__file__).resolve().parents[1].joinpath("eqx_gpt/data/tinyshakespeare.txt").read_text()[:20_000]
    )
    (tmp_path / "a" / "tiny.txt").write_text(text)
    (tmp_path / "b" / "copy.txt").write_text(text)
    (tmp_path / "b" / "other.txt").write_text(text[::-1])
    out = str(tmp_path / "run")
    monkeypatch.chdir(tmp_path / "a")
    assert train_cli.main([*TINY, "--data", "tiny.txt", "--out-dir", out, "--max-steps", "2"]) == 0
    monkeypatch.chdir(tmp_path / "b")
    assert train_cli.main(["--out-dir", out, "--resume", "--max-steps", "3"]) == 0
    # Any path to the same corpus is accepted; another corpus is refused, naming the fix.
    assert train_cli.main(["--out-dir", out, "--resume", "--max-steps", "4", "--data", "copy.txt"]) == 0
    _fails(
        ["--out-dir", out, "--resume", "--max-steps", "5", "--data", "other.txt"], capsys, "sha256 differs"
    )
    assert json.loads(Path(out, "latest.json").read_text())["step"] == 4
    assert os.path.isabs(json.loads(Path(out, "latest.json").read_text())["train_config"]["data"])
    assert [r["step"] for r in _records(out) if "loss" in r] == [1, 2, 3, 4]
