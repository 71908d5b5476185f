"""The embedding lookup's fixed-order gradient (eqx_gpt/model/embedding.py): the one-hot product a
GPU takes instead of XLA's atomic scatter-add, checked here on the CPU by forcing it."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import gpt, token_ids
from model_family import SMALL_GPT, in_family

from eqx_gpt.model.embedding import embedding_lookup, exact_bf16_parts, one_hot_scatter_add

pytestmark = in_family


@pytest.mark.parametrize("dtype, parts", [(jnp.float32, 3), (jnp.bfloat16, 1)])
def test_bf16_parts_hold_the_value_exactly(dtype, parts):
    x = (jax.random.normal(jax.random.key(0), (64, 32)) * 1e3).astype(dtype).astype(jnp.float32)
    total = sum(p.astype(jnp.float32) for p in exact_bf16_parts(x, parts))
    np.testing.assert_array_equal(np.asarray(total), np.asarray(x))


def test_two_parts_do_not_hold_float32():  # the check above could fail: 16 bits are not 24
    x = jax.random.normal(jax.random.key(1), (256,))
    total = sum(p.astype(jnp.float32) for p in exact_bf16_parts(x, 2))
    assert not np.array_equal(np.asarray(total), np.asarray(x))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_hot_scatter_add_equals_the_scatter_add(dtype):
    ids = token_ids(2, (300,), 40)  # many repeats
    rows = jax.random.normal(jax.random.key(2), (300, 16)).astype(dtype).astype(jnp.float32)
    expected = jnp.zeros((40, 16)).at[ids].add(rows)
    got = one_hot_scatter_add(ids, rows, 40, dtype)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_the_lookup_gradient_matches_the_plain_one():
    table = jax.random.normal(jax.random.key(3), (50, 8))
    ids = token_ids(4, (4, 30), 50)
    weights = jax.random.normal(jax.random.key(5), (4, 30, 8))
    loss = lambda t, one_hot: jnp.sum(embedding_lookup(t, ids, one_hot_gradient=one_hot) * weights)
    np.testing.assert_array_equal(np.asarray(loss(table, True)), np.asarray(loss(table, False)))
    g_one_hot, g_plain = jax.grad(loss)(table, True), jax.grad(loss)(table, False)
    np.testing.assert_allclose(np.asarray(g_one_hot), np.asarray(g_plain), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(g_plain)).sum() > 0


@pytest.mark.parametrize(
    "positions, compute_dtype", [("learned", "bfloat16"), ("sinusoidal", "float32"), ("rope", "bfloat16")]
)
def test_a_gpt_gradient_is_the_same_either_way(monkeypatch, positions, compute_dtype):
    # One layer: a scan of one step differentiates into a much smaller program than one of two.
    config = dataclasses.replace(SMALL_GPT, n_layers=1, positions=positions, compute_dtype=compute_dtype)
    model = gpt(config, seed=6)
    tokens = token_ids(7, (3, config.context_length), config.vocab_size)
    loss = lambda m, tokens: jnp.mean(m(tokens).astype(jnp.float32) ** 2)
    grads = {}
    for on_gpu in (False, True):  # the GPU's choice, forced on the CPU
        monkeypatch.setattr("eqx_gpt.model.embedding.one_hot_gradient_default", lambda on_gpu=on_gpu: on_gpu)
        # A new compiled program for each choice (read while tracing), not one per operation.
        grads[on_gpu] = eqx.filter_jit(eqx.filter_grad(lambda m, t: loss(m, t)))(model, tokens).embed
    np.testing.assert_allclose(np.asarray(grads[True]), np.asarray(grads[False]), rtol=1e-5, atol=1e-7)
