"""Equinox's dropout contract on every module with dropout: an `inference` field that
`eqx.nn.inference_mode` switches, a per-call `inference=` override, and no silent no-dropout."""

import dataclasses
import functools
import io
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import forward, gpt
from model_family import TINY_GPT, decode, in_family

from eqx_gpt import (
    GPT,
    Block,
    MultiHeadAttention,
    Transformer,
    TransformerConfig,
    causal_mask,
    dropout,
    generate,
    load_model,
    save_checkpoint,
    translate,
)
from eqx_gpt.checkpoint import VERSION, read_metadata
from eqx_gpt.tokenizer import CharTokenizer

pytestmark = in_family
FIXTURES = Path(__file__).parent / "fixtures"
CFG = dataclasses.replace(TINY_GPT, dropout=0.5)
T_CFG = TransformerConfig(src_vocab_size=9, tgt_vocab_size=9, max_len=8, d_model=16, n_heads=2, dropout=0.5)
K1, K2 = jax.random.key(1), jax.random.key(2)


def _flags(tree) -> list[bool]:
    """Every `inference` flag in `tree`: the only Python bools among a model's leaves (its other
    settings are static fields)."""
    return [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, bool)]


def _gpt():
    return gpt(CFG), jnp.arange(8) % 9


# Each module with dropout, built with rate 0.5: (module, its inputs).
_BUILDERS = {
    "GPT": lambda: (gpt(CFG), (jnp.arange(8) % 9,)),
    "Block": lambda: (Block(16, 2, 32, key=jax.random.key(0), dropout=0.5), (jnp.ones((2, 5, 16)),)),
    "MultiHeadAttention": lambda: (
        MultiHeadAttention(16, 2, key=jax.random.key(0), dropout=0.5, init_std=0.5),
        (jax.random.normal(jax.random.key(3), (5, 16)),),
    ),
    "Transformer": lambda: (
        Transformer(T_CFG, key=jax.random.key(0)),
        (jnp.asarray([[3, 4, 5, 0]]), jnp.asarray([[1, 2, 3]])),
    ),
}


# Each built once.
MODULES = {name: functools.cache(build) for name, build in _BUILDERS.items()}


@eqx.filter_jit
def _calls(module, inputs, k1, k2):
    """Every call the three tests below make of `module` (built in training mode), by name, in one
    compiled program per module: the calls that compute the same thing (every call in inference
    mode, key or not) are then compiled once, where one program per call compiled each again."""
    inference = eqx.nn.inference_mode(module)
    training = eqx.nn.inference_mode(inference, False)
    return {
        "inference": inference(*inputs),
        "inference, key 1": inference(*inputs, key=k1),
        "inference, key 2": inference(*inputs, key=k2),
        "switched back to training, key 1": training(*inputs, key=k1),
        "switched back to training, key 2": training(*inputs, key=k2),
        "as built, key 1": module(*inputs, key=k1),
        "as built, key 1, inference=True": module(*inputs, key=k1, inference=True),
        "as built, inference=True": module(*inputs, inference=True),
        "inference, key 1, inference=False": inference(*inputs, key=k1, inference=False),
    }


@functools.cache
def calls(name: str) -> dict[str, np.ndarray]:
    """`_calls` of the module `name` with its inputs and the keys K1, K2, computed once."""
    module, inputs = MODULES[name]()
    return jax.tree.map(np.asarray, _calls(module, inputs, K1, K2))


@pytest.mark.parametrize("name", MODULES)
def test_inference_mode_is_deterministic_with_any_key(name):
    module, _ = MODULES[name]()
    assert _flags(module) and not any(_flags(module))  # built in training mode
    assert all(_flags(eqx.nn.inference_mode(module)))
    out = calls(name)
    np.testing.assert_array_equal(out["inference, key 1"], out["inference"])
    np.testing.assert_array_equal(out["inference, key 2"], out["inference"])


@pytest.mark.parametrize("name", MODULES)
def test_training_mode_drops_out_with_a_key_and_refuses_to_run_without_one(name):
    module, inputs = MODULES[name]()
    out = calls(name)
    a, b = out["switched back to training, key 1"], out["switched back to training, key 2"]
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, out["as built, key 1"])  # the same masks as built
    training = eqx.nn.inference_mode(eqx.nn.inference_mode(module), False)
    with pytest.raises(
        ValueError, match=f"^{name} has dropout 0.5 and is in training mode, so it needs key="
    ):
        training(*inputs)


@pytest.mark.parametrize("name", MODULES)
def test_the_per_call_override_beats_the_mode(name):
    module, inputs = MODULES[name]()
    out = calls(name)
    np.testing.assert_array_equal(out["as built, key 1, inference=True"], out["inference"])
    np.testing.assert_array_equal(out["as built, inference=True"], out["inference"])
    np.testing.assert_array_equal(out["inference, key 1, inference=False"], out["as built, key 1"])
    with pytest.raises(ValueError, match="needs key="):
        eqx.nn.inference_mode(module)(*inputs, inference=False)


@eqx.filter_jit
def _without_and_with_key(module, x, key):
    """`module(x)` and `module(x, key=key)` in one compiled program (without dropout, one pass)."""
    return module(x), module(x, key=key)


def test_a_model_without_dropout_needs_no_key():
    model = gpt(dataclasses.replace(CFG, dropout=0.0))
    tokens = jnp.arange(8) % 9
    np.testing.assert_array_equal(*_without_and_with_key(model, tokens, K1))
    block = Block(16, 2, 32, key=jax.random.key(0))
    x = jnp.ones((5, 16))
    np.testing.assert_array_equal(*_without_and_with_key(block, x, K1))


def test_the_dropout_function_keeps_the_contract():
    x = jnp.ones((4, 6))
    np.testing.assert_array_equal(dropout(x, 0.5, K1, inference=True), x)
    np.testing.assert_array_equal(dropout(x, 0.0), x)
    assert not np.array_equal(dropout(x, 0.5, K1), x)
    with pytest.raises(ValueError, match="needs key="):
        dropout(x, 0.5)


def test_stacked_and_unstacked_models_switch_every_flag_and_agree():
    model, tokens = _gpt()
    inference = eqx.nn.inference_mode(model)
    unstacked = inference.unstack()
    assert len(_flags(unstacked)) == 1 + CFG.n_layers * 2  # the model, then each block and its attention
    assert all(_flags(unstacked))
    stacked = calls("GPT")  # the stacked model's logits for these tokens, in both modes
    np.testing.assert_allclose(forward(unstacked, tokens, key=K1), stacked["inference"], atol=1e-6)
    logits, _ = decode(inference, tokens, inference.init_cache(), 0)
    np.testing.assert_allclose(logits, stacked["inference"], atol=1e-5)
    # Training mode, unstacked: the same masks as the stacked model.
    np.testing.assert_allclose(
        forward(model.unstack(), tokens, key=K1), stacked["as built, key 1"], atol=1e-6
    )


def test_a_flag_is_static_under_plain_jit_of_the_whole_model():
    # `jax.jit` and `jax.make_jaxpr` turn every leaf into a tracer, the flags too; the layer scan
    # must still run (a model without dropout never branches on them).
    model = gpt(dataclasses.replace(CFG, dropout=0.0))
    tokens = jnp.arange(8) % 9
    expected, _ = _without_and_with_key(model, tokens, K1)
    np.testing.assert_allclose(jax.jit(lambda m, t: m(t))(model, tokens), expected, atol=1e-6)
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0))
    x = jnp.ones((5, 16))
    np.testing.assert_allclose(
        jax.jit(lambda m: m(x, mask=causal_mask(5)))(attn), attn(x, mask=causal_mask(5))
    )


def test_generation_and_translation_run_in_inference_mode():
    model, tokens = _gpt()
    greedy = dict(key=K1, temperature=0)
    np.testing.assert_array_equal(
        generate(model, tokens[:3], 6, **greedy),
        generate(eqx.nn.inference_mode(model), tokens[:3], 6, **greedy),
    )
    transformer = Transformer(T_CFG, key=jax.random.key(0))
    src = np.asarray([[3, 4, 5, 0]])
    kw = dict(bos_id=1, eos_id=2, temperature=0)
    np.testing.assert_array_equal(
        translate(transformer, src, 5, **kw), translate(eqx.nn.inference_mode(transformer), src, 5, **kw)
    )


def test_checkpoints_hold_arrays_only_and_load_in_training_mode(tmp_path):
    model, tokens = _gpt()
    tokenizer = CharTokenizer("abcdefghi")
    (tmp_path / "training").mkdir()
    (tmp_path / "inference").mkdir()
    paths = [
        save_checkpoint(tmp_path / name, "latest", m, None, step=0, tokenizer=tokenizer, train_config={})
        for name, m in (("training", model), ("inference", eqx.nn.inference_mode(model)))
    ]
    weights = [(p.parent / read_metadata(p)["weights"]).read_bytes() for p in paths]
    assert weights[0] == weights[1]  # the mode is not stored
    loaded, _, meta = load_model(paths[1])
    assert meta["version"] == VERSION and not any(_flags(loaded))
    np.testing.assert_array_equal(forward(loaded, tokens, key=K1), calls("GPT")["as built, key 1"])


def test_an_old_checkpoint_loads_in_training_mode(tmp_path):
    folder = shutil.copytree(FIXTURES / "checkpoint-v1", tmp_path / "v1")
    meta = json.loads((folder / "latest.json").read_text())
    assert meta["version"] == 1 and "model" not in meta  # written before the model record
    model, tokenizer, meta = load_model(folder)
    assert isinstance(model, GPT) and _flags(model) and not any(_flags(model))
    expected = np.load(FIXTURES / "checkpoint-v1" / "expected.npz")
    logits = forward(eqx.nn.inference_mode(model), jnp.asarray(expected["tokens"]), key=K1)
    np.testing.assert_allclose(logits, expected["logits"], rtol=1e-5, atol=1e-5)


def test_a_version_2_checkpoint_without_its_model_record_is_refused(tmp_path):
    model, _ = _gpt()
    path = save_checkpoint(tmp_path, "latest", model, None, step=0, tokenizer=CharTokenizer("abcdefghi"),
                           train_config={})  # fmt: skip
    meta = json.loads(path.read_text())
    del meta["model"]
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="lacks 'model'"):
        load_model(path)


def test_equinox_serialisation_round_trips_the_mode_exactly():
    model, tokens = _gpt()
    inference = eqx.nn.inference_mode(model)
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, inference)
    buffer.seek(0)
    restored = eqx.tree_deserialise_leaves(buffer, model)  # a training-mode template
    assert all(_flags(restored))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(inference), strict=True):
        np.testing.assert_array_equal(a, b)
