"""Checkpoints: exact round trips, atomic replacement, corruption detection, and no pickle."""

import io
import json
import os

import equinox as eqx
import jax
import numpy as np
import pytest
from model_family import in_family

from eqx_gpt import GPT, CharTokenizer, CheckpointError, GPTConfig, files, find_checkpoint, load_model
from eqx_gpt import checkpoint as ckpt
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.step import init_optimizer_state, make_optimizer

pytestmark = in_family
TOKENIZER = CharTokenizer("\n abcdefgh")
CONFIG = GPTConfig(vocab_size=TOKENIZER.vocab_size, context_length=8, d_model=16, n_heads=2, n_layers=2)
OPTIMIZER = make_optimizer(TrainConfig())


def _state(seed):
    model = GPT(CONFIG, key=jax.random.key(seed))
    opt_state = init_optimizer_state(OPTIMIZER, model)
    # Make the optimiser state non-trivial so that a round trip of zeros proves nothing.
    # (In NumPy: `x + seed` of a JAX array compiles a program per shape.)
    opt_state = jax.tree.map(
        lambda x: jax.device_put(np.asarray(x) + x.dtype.type(seed)) if eqx.is_inexact_array(x) else x,
        opt_state,
    )
    return model, opt_state


def _save(out, seed, step, name="latest"):
    model, opt_state = _state(seed)
    ckpt.save_checkpoint(
        out, name, model, opt_state, step=step, tokenizer=TOKENIZER, train_config={"seed": seed}, val_loss=1.5
    )
    return model, opt_state


def _opt_like():
    template = ckpt.model_template(CONFIG)
    return eqx.filter_eval_shape(init_optimizer_state, OPTIMIZER, template)


def _assert_trees_equal(a, b):
    a, b = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact(tmp_path):
    model, opt_state = _save(tmp_path, seed=1, step=7)
    loaded, opt_loaded, tokenizer, meta = ckpt.load_checkpoint(tmp_path / "latest.json", _opt_like())
    _assert_trees_equal(model, loaded)
    _assert_trees_equal(opt_state, opt_loaded)
    assert tokenizer == TOKENIZER and meta["step"] == 7 and meta["val_loss"] == 1.5
    sampled, tokenizer, meta = load_model(tmp_path)
    _assert_trees_equal(model, sampled)
    assert sampled.config == CONFIG


def test_find_checkpoint_prefers_best_then_latest(tmp_path):
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path}/ .*: run `uv run train.py"):
        find_checkpoint(tmp_path)
    _save(tmp_path, seed=1, step=5)
    assert find_checkpoint(tmp_path) == tmp_path / "latest.json"
    _save(tmp_path, seed=2, step=3, name="best")
    assert find_checkpoint(tmp_path) == tmp_path / "best.json"
    weights = next(tmp_path.glob("latest-*.eqx"))
    assert find_checkpoint(weights) == tmp_path / "latest.json"
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        find_checkpoint(tmp_path / "nope.json")


def test_saving_again_replaces_the_weights_file(tmp_path):
    _save(tmp_path, seed=1, step=5)
    _save(tmp_path, seed=2, step=10)
    assert len(list(tmp_path.glob("latest-*.eqx"))) == 1
    assert load_model(tmp_path)[2]["step"] == 10


@pytest.mark.parametrize("fail_at", ["weights", "json"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch, fail_at):
    model, _ = _save(tmp_path, seed=1, step=5)
    real_replace = os.replace

    def crash(src, dst):
        if str(dst).endswith(".eqx" if fail_at == "weights" else ".json"):
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        _save(tmp_path, seed=2, step=10)
    monkeypatch.undo()
    loaded, _, meta = load_model(tmp_path)
    assert meta["step"] == 5
    _assert_trees_equal(model, loaded)
    assert not list(tmp_path.glob(".*.tmp"))  # the half-written temporary file is removed


def test_corrupt_files_raise_checkpoint_errors(tmp_path):
    _save(tmp_path, seed=1, step=5)
    meta_path = tmp_path / "latest.json"
    weights = next(tmp_path.glob("latest-*.eqx"))
    good = weights.read_bytes()

    weights.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(CheckpointError, match="do not match their recorded sha256"):
        load_model(tmp_path)
    weights.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])  # one flipped bit
    with pytest.raises(CheckpointError, match="sha256"):
        load_model(tmp_path)
    weights.unlink()
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_model(tmp_path)
    meta_path.write_text('{"format": "eqx_gpt-checkpoint", "vers')
    with pytest.raises(CheckpointError, match="unreadable or corrupt"):
        load_model(tmp_path)
    meta_path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(CheckpointError, match="not an eqx_gpt checkpoint"):
        load_model(tmp_path)


class _Payload:
    """Unpickling this would create a file: the proof that loading ran code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_loading_never_unpickles(tmp_path):
    _save(tmp_path, seed=1, step=5)
    meta = json.loads((tmp_path / "latest.json").read_text())
    marker = tmp_path / "code-ran"
    buffer = io.BytesIO()
    np.save(buffer, np.array([_Payload(str(marker))], dtype=object), allow_pickle=True)
    evil = buffer.getvalue()
    (tmp_path / meta["weights"]).write_bytes(evil)
    meta["sha256"] = __import__("hashlib").sha256(evil).hexdigest()
    (tmp_path / "latest.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="do not fit its config"):
        load_model(tmp_path)
    assert not marker.exists()
