"""The embedding lookup's fixed-order gradient (eqx_gpt/model/embedding.py): the one-hot product a
GPU takes instead of XLA's atomic scatter-add, checked here on the CPU by forcing it."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import drawn_gpt, token_ids
from model_family import SMALL_GPT, in_family

from eqx_gpt.model.embedding import embedding_lookup, exact_bf16_parts, one_hot_scatter_add

pytestmark = in_family


def _normal(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float32 draws by NumPy (`jax.random.normal` compiles a program per shape)."""
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def _sum_as_float32(parts) -> np.ndarray:
    return sum(np.asarray(p, np.float32) for p in parts)


@pytest.mark.parametrize("dtype, parts", [(jnp.float32, 3), (jnp.bfloat16, 1)])
def test_bf16_parts_hold_the_value_exactly(dtype, parts):
    x = (_normal(0, (64, 32)) * 1e3).astype(dtype).astype(np.float32)
    np.testing.assert_array_equal(_sum_as_float32(exact_bf16_parts(jax.device_put(x), parts)), x)


def test_two_parts_do_not_hold_float32():  # the check above could fail: 16 bits are not 24
    x = _normal(1, (64, 32))  # the shape above: its operations are compiled already
    assert not np.array_equal(_sum_as_float32(exact_bf16_parts(jax.device_put(x), 2)), x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_hot_scatter_add_equals_the_scatter_add(dtype):
    ids = np.random.default_rng(2).integers(0, 40, 300)  # many repeats
    rows = _normal(2, (300, 16)).astype(dtype).astype(np.float32)
    expected = np.zeros((40, 16), np.float32)
    np.add.at(expected, ids, rows)  # NumPy's scatter-add
    got = one_hot_scatter_add(jax.device_put(ids), jax.device_put(rows), 40, dtype)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


@jax.jit
def _lookup_losses_and_gradients(table, ids, weights):
    """The lookup's loss and its gradient in `table`, with the one-hot gradient and without, in one
    compiled program (eagerly, each operation would compile on its own)."""

    def loss(t, one_hot):
        return jnp.sum(embedding_lookup(t, ids, one_hot_gradient=one_hot) * weights)

    return [jax.value_and_grad(loss)(table, one_hot) for one_hot in (True, False)]


def test_the_lookup_gradient_matches_the_plain_one():
    table, weights = _normal(3, (50, 8)), _normal(5, (4, 30, 8))
    ids = np.random.default_rng(4).integers(0, 50, (4, 30))
    (loss_one_hot, g_one_hot), (loss_plain, g_plain) = jax.tree.map(
        np.asarray, _lookup_losses_and_gradients(table, ids, weights)
    )
    np.testing.assert_array_equal(loss_one_hot, loss_plain)
    np.testing.assert_allclose(g_one_hot, g_plain, rtol=1e-6, atol=1e-6)
    assert np.abs(g_plain).sum() > 0


@pytest.mark.parametrize(
    "positions, compute_dtype", [("learned", "bfloat16"), ("sinusoidal", "float32"), ("rope", "bfloat16")]
)
def test_a_gpt_gradient_is_the_same_either_way(monkeypatch, positions, compute_dtype):
    # One layer: a scan of one step differentiates into a much smaller program than one of two.
    config = dataclasses.replace(SMALL_GPT, n_layers=1, positions=positions, compute_dtype=compute_dtype)
    model = drawn_gpt(config, seed=6)  # NumPy's weights: GPT's own init would compile a draw per shape
    tokens = token_ids(7, (3, config.context_length), config.vocab_size)
    loss = lambda m, tokens: jnp.mean(m(tokens).astype(jnp.float32) ** 2)

    def embedding_gradients(m, t):
        grads = {}
        for on_gpu in (False, True):  # the GPU's choice, forced on the CPU
            # Read while tracing: each gradient below is traced with its own choice.
            monkeypatch.setattr(
                "eqx_gpt.model.embedding.one_hot_gradient_default", lambda on_gpu=on_gpu: on_gpu
            )
            grads[on_gpu] = eqx.filter_grad(loss)(m, t).embed
        return grads

    # Both in one compiled program: their forward passes, the same operations, are compiled once.
    grads = eqx.filter_jit(embedding_gradients)(model, tokens)
    np.testing.assert_allclose(np.asarray(grads[True]), np.asarray(grads[False]), rtol=1e-5, atol=1e-7)
