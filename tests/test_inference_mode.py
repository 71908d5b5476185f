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
from compiled import forward, gpt, normal
from model_family import TINY_GPT, decode, in_family, outputs_by_mode

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


TOKENS = jax.device_put(np.arange(8, dtype=np.int32) % 9)  # NumPy's: `%` of a JAX array compiles


def _gpt():
    return gpt(CFG), TOKENS


# Each module with dropout, built with rate 0.5: (module, its inputs).
_BUILDERS = {
    "GPT": lambda: (gpt(CFG), (TOKENS,)),
    "Block": lambda: (Block(16, 2, 32, key=jax.random.key(0), dropout=0.5), (jnp.ones((2, 5, 16)),)),
    "MultiHeadAttention": lambda: (
        MultiHeadAttention(16, 2, key=jax.random.key(0), dropout=0.5, init_std=0.5),
        (normal(3, (2, 5, 16)),),  # test_modules' batch: its two programs of this module are shared
    ),
    "Transformer": lambda: (
        Transformer(T_CFG, key=jax.random.key(0)),
        (np.asarray([[3, 4, 5, 0]], np.int32), np.asarray([[1, 2, 3]], np.int32)),
    ),
}


# Each built once; the three tests below read its outputs in every mode from one compiled program per
# module (model_family.outputs_by_mode), called with each key once.
MODULES = {name: functools.cache(build) for name, build in _BUILDERS.items()}


@functools.cache
def _outputs(name: str, key_seed: int) -> dict:
    module, inputs = MODULES[name]()
    return jax.tree.map(np.asarray, outputs_by_mode(module, inputs, jax.random.key(key_seed)))


@pytest.mark.parametrize("name", MODULES)
def test_inference_mode_is_deterministic_with_any_key(name):
    module, _ = MODULES[name]()
    assert _flags(module) and not any(_flags(module))  # built in training mode
    assert all(_flags(eqx.nn.inference_mode(module)))
    with_k1, with_k2 = _outputs(name, 1), _outputs(name, 2)
    out = with_k1["inference"]
    np.testing.assert_array_equal(with_k1["inference, key"], out)
    np.testing.assert_array_equal(with_k2["inference, key"], out)


@pytest.mark.parametrize("name", MODULES)
def test_training_mode_drops_out_with_a_key_and_refuses_to_run_without_one(name):
    module, inputs = MODULES[name]()
    training = eqx.nn.inference_mode(eqx.nn.inference_mode(module), False)
    a, b = _outputs(name, 1)["training, key"], _outputs(name, 2)["training, key"]
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, _outputs(name, 1)["as built, key"])  # the same masks as built
    with pytest.raises(
        ValueError, match=f"^{name} has dropout 0.5 and is in training mode, so it needs key="
    ):
        training(*inputs)


@pytest.mark.parametrize("name", MODULES)
def test_the_per_call_override_beats_the_mode(name):
    module, inputs = MODULES[name]()
    outputs = _outputs(name, 1)
    out = outputs["inference"]
    np.testing.assert_array_equal(outputs["as built, key, inference=True"], out)
    np.testing.assert_array_equal(outputs["as built, inference=True"], out)
    np.testing.assert_array_equal(outputs["inference, key, inference=False"], outputs["as built, key"])
    with pytest.raises(ValueError, match="needs key="):
        eqx.nn.inference_mode(module)(*inputs, inference=False)


def test_a_model_without_dropout_needs_no_key():
    model = gpt(dataclasses.replace(CFG, dropout=0.0))
    tokens = TOKENS
    np.testing.assert_array_equal(forward(model, tokens), forward(model, tokens, key=K1))
    block = Block(16, 2, 32, key=jax.random.key(0))
    x = jnp.ones((5, 16))
    np.testing.assert_array_equal(forward(block, x), forward(block, x, key=K1))


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
    stacked = _outputs("GPT", 1)  # the stacked model's, computed for the tests above
    np.testing.assert_allclose(forward(unstacked, tokens, key=K1), stacked["inference"], atol=1e-6)
    logits, _ = decode(inference, tokens, inference.init_cache(), 0)
    np.testing.assert_allclose(logits, stacked["inference"], atol=1e-5)
    # Training mode, unstacked: the same masks as the stacked model.
    np.testing.assert_allclose(forward(model.unstack(), tokens, key=K1), stacked["as built, key"], atol=1e-6)


def test_a_flag_is_static_under_plain_jit_of_the_whole_model():
    # `jax.jit` and `jax.make_jaxpr` turn every leaf into a tracer, the flags too; the layer scan
    # must still run (a model without dropout never branches on them).
    model = gpt(dataclasses.replace(CFG, dropout=0.0))
    tokens = TOKENS
    np.testing.assert_allclose(jax.jit(lambda m, t: m(t))(model, tokens), forward(model, tokens), atol=1e-6)
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0))
    x = jnp.ones((6, 16))  # test_modules' attention length: the eager call's operations are compiled
    np.testing.assert_allclose(
        jax.jit(lambda m: m(x, mask=causal_mask(6)))(attn), attn(x, mask=causal_mask(6))
    )


def test_generation_and_translation_run_in_inference_mode():
    model, tokens = _gpt()
    greedy = dict(key=K1, temperature=0)
    np.testing.assert_array_equal(
        generate(model, tokens[:3], 6, **greedy),
        generate(eqx.nn.inference_mode(model), tokens[:3], 6, **greedy),
    )
    transformer, (src, _) = MODULES["Transformer"]()
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
    # Both through the program the tests above compiled for this model's structure.
    np.testing.assert_array_equal(
        outputs_by_mode(loaded, (tokens,), K1)["as built, key"], _outputs("GPT", 1)["as built, key"]
    )


def test_an_old_checkpoint_loads_in_training_mode(tmp_path):
    folder = shutil.copytree(FIXTURES / "checkpoint-v1", tmp_path / "v1")
    meta = json.loads((folder / "latest.json").read_text())
    assert meta["version"] == 1 and "model" not in meta  # written before the model record
    model, tokenizer, meta = load_model(folder)
    assert isinstance(model, GPT) and _flags(model) and not any(_flags(model))
    expected = np.load(FIXTURES / "checkpoint-v1" / "expected.npz")
    # Its dropout is 0: the logits of either mode, computed by the program test_gpt_options compiles.
    logits = forward(model, expected["tokens"])
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
