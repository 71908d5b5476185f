"""`Linear`: every projection of every model is one, found by type the way Equinox users find
modules, and checkpoints written before it (fields `w_qkv`, `w_out`, ... and a raw head) still load."""

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import forward, gpt, normal, transformer
from model_family import TINY_GPT, TINY_TRANSFORMER, in_family

from eqx_gpt import (
    MLP,
    LayerNorm,
    Linear,
    MultiHeadAttention,
    RMSNorm,
    load_checkpoint,
    load_model,
    make_optimizer,
)
from eqx_gpt.training.config import TrainConfig

pytestmark = in_family
FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint-v2"
CFG = TINY_GPT
TCFG = TINY_TRANSFORMER
is_linear = lambda node: isinstance(node, Linear)


def linears(tree) -> list[Linear]:
    return [node for node in jax.tree.leaves(tree, is_leaf=is_linear) if is_linear(node)]


def arrays_outside_linears(tree) -> list[str]:
    """The paths of the float arrays that no `Linear`, norm or embedding table holds."""
    owned = jax.tree.map(lambda n: None if is_linear(n) or isinstance(n, RMSNorm | LayerNorm) else n, tree,
                         is_leaf=lambda n: is_linear(n) or isinstance(n, RMSNorm | LayerNorm))  # fmt: skip
    paths = jax.tree_util.tree_leaves_with_path(eqx.filter(owned, eqx.is_inexact_array))
    return sorted(jax.tree_util.keystr(p) for p, _ in paths if not jax.tree_util.keystr(p).endswith("embed"))


def test_every_projection_of_a_gpt_is_a_linear():
    model = gpt(CFG)
    # Stacked: one Block holds each layer's 4 projections with a leading n_layers axis; plus the head.
    assert len(linears(model)) == 5 and model.head is not None and is_linear(model.head)
    assert len(linears(model.unstack())) == 2 * 4 + 1
    assert arrays_outside_linears(model) == []
    tied = gpt(dataclasses.replace(CFG, tie_embeddings=True))
    assert len(linears(tied)) == 4 and tied.head is None


def test_every_projection_of_a_transformer_is_a_linear():
    model = transformer(TCFG)
    # Encoder: self-attention's 2 and the MLP's 2; decoder: self- and cross-attention's 4 and the MLP's
    # 2; the head.
    assert len(linears(model)) == 4 + 6 + 1
    assert arrays_outside_linears(model) == []


def test_linear_is_x_at_weight_plus_bias_over_any_leading_axes():
    # 8 x 12: test_modules' MLP's first projection, whose weights' draw is compiled once.
    layer = Linear(8, 12, key=jax.random.key(0), use_bias=True)
    layer = eqx.tree_at(lambda m: m.bias, layer, jnp.arange(12.0))
    x = normal(1, (3, 5, 8))
    expected = np.asarray(x) @ np.asarray(layer.weight) + np.arange(12.0)
    np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert layer.in_features == 8 and layer.out_features == 12 and layer.weight.shape == (8, 12)
    np.testing.assert_allclose(layer.columns(2, 5)(x), expected[..., 2:5], rtol=1e-5, atol=1e-5)
    assert layer(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16  # float32 weights serve bf16 inputs


def test_linear_refuses_a_mismatched_input_in_one_line():
    with pytest.raises(ValueError, match="in_features=8"):
        Linear(8, 12, key=jax.random.key(0))(jnp.ones((3, 7)))
    with pytest.raises(ValueError, match="in_features must be an integer"):
        Linear(0, 6, key=jax.random.key(0))


def test_tree_at_by_type_replaces_every_projection():
    # Equinox's idiom for tree surgery: scale every projection by type, with no field names.
    model = gpt(CFG)
    doubled = eqx.tree_at(
        lambda m: linears(m),
        model,
        # Doubled in NumPy: `2 * weight` of a JAX array compiles a program per shape.
        replace_fn=lambda lin: eqx.tree_at(
            lambda m: m.weight, lin, jax.device_put(2 * np.asarray(lin.weight))
        ),
    )
    for before, after in zip(linears(model), linears(doubled), strict=True):
        np.testing.assert_array_equal(after.weight, 2 * np.asarray(before.weight))
    np.testing.assert_array_equal(doubled.embed, model.embed)


def test_partition_by_type_splits_projections_from_the_rest():
    # test_modules' MLP and input sizes: its draws and its eager call's operations are compiled once.
    model = MLP(8, 12, key=jax.random.key(0))
    projections, rest = eqx.partition(model, is_linear, is_leaf=is_linear)
    assert [lin.weight.shape for lin in linears(projections)] == [(8, 12), (12, 8)]
    assert linears(rest) == [] and rest.up is None  # what is left holds no projection
    x = jax.device_put(np.ones((6, 8), np.float32))
    np.testing.assert_array_equal(eqx.combine(projections, rest, is_leaf=is_linear)(x), model(x))


def test_cross_attention_splits_the_fused_projection_into_query_and_key_value_columns():
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0))
    x, context = normal(1, (4, 16)), normal(2, (6, 16))
    q = attn.project_q(x).reshape(4, 16)
    k, v = (a.reshape(6, 16) for a in attn.project_kv(context))
    w = np.asarray(attn.qkv.weight)
    np.testing.assert_allclose(q, np.asarray(x) @ w[:, :16], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, np.asarray(context) @ w[:, 16:32], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, np.asarray(context) @ w[:, 32:], rtol=1e-5, atol=1e-5)


def test_a_format_2_checkpoint_written_before_linear_loads_to_its_logits():
    # Saved by b027f1c (projections as raw fields); the leaves are in the same order now.
    expected = np.load(FIXTURE / "expected.npz")
    model, _, meta = load_model(FIXTURE / "gpt", kind="GPT")
    assert meta["version"] == 2 and model.config.bias and model.head is not None
    np.testing.assert_allclose(forward(model, expected["tokens"]), expected["logits"], atol=1e-5)
    optimizer = make_optimizer(TrainConfig(optimizer="adamw"))
    like = eqx.filter_eval_shape(optimizer.init, eqx.filter(model, eqx.is_inexact_array))
    _, opt_state, _, _ = load_checkpoint(FIXTURE / "gpt", like)
    assert jax.tree.structure(opt_state) == jax.tree.structure(like)
    loaded, _, _ = load_model(FIXTURE / "transformer", kind="Transformer")
    logits = forward(loaded, expected["src"], expected["tgt"])
    np.testing.assert_allclose(logits, expected["transformer_logits"], atol=1e-5)
