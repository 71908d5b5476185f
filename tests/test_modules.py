"""Each module's math against an independent NumPy reference written here."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import normal
from model_family import in_family, outputs_by_mode
from oracles import np_softmax

from eqx_gpt import MLP, Block, MultiHeadAttention, RMSNorm, causal_mask, pad_vocab, sinusoidal_positions

pytestmark = in_family


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_multi_head_attention(x, w_qkv, w_out, n_heads, mask=None):
    """Textbook multi-head attention with explicit loops over heads."""
    seq, d_model = x.shape
    d_head = d_model // n_heads
    qkv = x @ w_qkv
    q, k, v = qkv[:, :d_model], qkv[:, d_model : 2 * d_model], qkv[:, 2 * d_model :]
    heads = []
    for h in range(n_heads):
        sl = slice(h * d_head, (h + 1) * d_head)
        scores = q[:, sl] @ k[:, sl].T / math.sqrt(d_head)
        if mask is not None:
            scores = np.where(mask, scores, -np.inf)
        heads.append(np_softmax(scores) @ v[:, sl])
    return np.concatenate(heads, axis=-1) @ w_out


@pytest.mark.parametrize(("n", "expected"), [(1, 64), (64, 64), (65, 128), (50257, 50304)])
def test_pad_vocab(n, expected):
    assert pad_vocab(n) == expected


def test_pad_vocab_other_multiple_and_bad_input():
    assert pad_vocab(10, multiple=8) == 16
    with pytest.raises(ValueError, match=r"must be an integer in \[1, "):
        pad_vocab(0)


def test_sinusoidal_positions_match_paper_formula():
    seq, d = 50, 16
    table = np.asarray(sinusoidal_positions(seq, d))
    ref = np.zeros((seq, d))
    for pos in range(seq):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            ref[pos, 2 * i] = math.sin(angle)
            ref[pos, 2 * i + 1] = math.cos(angle)
    np.testing.assert_allclose(table, ref, atol=2e-5)


def test_sinusoidal_positions_rejects_odd_d_model():
    with pytest.raises(ValueError, match="even d_model"):
        sinusoidal_positions(8, 7)


def test_rmsnorm_matches_reference_and_learns_a_scale():
    norm = RMSNorm(12, eps=1e-6)
    assert norm.scale.shape == (12,)
    x = np.random.default_rng(0).normal(size=(5, 12)).astype(np.float32) * 3
    scale = np.linspace(0.5, 2.0, 12).astype(np.float32)
    norm = jax.tree_util.tree_map(lambda _: jax.device_put(scale), norm)
    ref = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(np.asarray(norm(jax.device_put(x))), ref, rtol=1e-5, atol=1e-6)


def test_mlp_matches_reference():
    mlp = MLP(8, 12, key=jax.random.key(0))  # the sizes below: the draws of its weights are compiled once
    x = np.random.default_rng(1).normal(size=(6, 8)).astype(np.float32)
    w_in, w_out = np.asarray(mlp.up.weight), np.asarray(mlp.down.weight)
    ref = np_gelu_tanh(x @ w_in) @ w_out
    np.testing.assert_allclose(np.asarray(mlp(jax.device_put(x))), ref, rtol=1e-4, atol=1e-6)


def np_silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize(
    ("make", "act"),
    [
        (lambda k: MLP(8, 12, key=k, activation="swiglu"), np_silu),
        (lambda k: MLP(8, 12, key=k, activation="silu", gated=True), np_silu),
        (lambda k: MLP(8, 12, key=k, activation="geglu"), np_gelu_tanh),
        (lambda k: MLP(8, 12, key=k, gated=True), np_gelu_tanh),
    ],
)
def test_gated_mlp_is_llamas_with_gate_and_value_side_by_side_in_up(make, act):
    mlp = make(jax.random.key(0))
    assert mlp.gated and mlp.up.weight.shape == (8, 24) and mlp.down.weight.shape == (12, 8)
    n_params = sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(mlp, eqx.is_inexact_array)))
    assert n_params == 3 * 8 * 12  # the documented count
    x = np.random.default_rng(1).normal(size=(2, 6, 8)).astype(np.float32)
    w_up = np.asarray(mlp.up.weight)
    gate_proj, up_proj = w_up[:, :12], w_up[:, 12:]  # Llama's two matrices, concatenated in this order
    ref = (act(x @ gate_proj) * (x @ up_proj)) @ np.asarray(mlp.down.weight)
    np.testing.assert_allclose(np.asarray(mlp(jax.device_put(x))), ref, rtol=1e-4, atol=1e-6)


def test_swiglu_is_gated_silu_and_an_ungated_mlp_is_not_gated():
    a = MLP(8, 12, key=jax.random.key(0), activation="swiglu")
    b = MLP(8, 12, key=jax.random.key(0), activation="silu", gated=True)
    assert (a.activation, a.gated) == (b.activation, b.gated) == ("silu", True)
    # eqx.tree_equal's test, in NumPy (eagerly, its comparisons compile a program per shape).
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
    plain = MLP(8, 12, key=jax.random.key(0), activation="silu")
    assert not plain.gated and plain.up.weight.shape == (8, 12)
    with pytest.raises(ValueError, match="gated must be True or False"):
        MLP(8, 12, key=jax.random.key(0), gated=1)  # type: ignore[arg-type]


def test_causal_mask_is_lower_triangular():
    mask = np.asarray(causal_mask(4))
    assert mask.dtype == bool
    np.testing.assert_array_equal(mask, np.tril(np.ones((4, 4), bool)))


@pytest.mark.parametrize("masked", [False, True])
def test_multi_head_attention_matches_reference(masked):
    d_model, n_heads, seq = 16, 4, 6  # seq: the attention tests' length, whose programs repeat
    attn = MultiHeadAttention(d_model, n_heads, key=jax.random.key(2), init_std=0.3)
    x = np.random.default_rng(3).normal(size=(seq, d_model)).astype(np.float32)
    mask = np.asarray(causal_mask(seq)) if masked else None
    out = attn(jax.device_put(x), mask=None if mask is None else jax.device_put(mask))
    ref = np_multi_head_attention(x, np.asarray(attn.qkv.weight), np.asarray(attn.out.weight), n_heads, mask)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


def test_attention_without_mask_sees_the_future_and_with_causal_mask_does_not():
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0), init_std=0.5)
    x = normal(1, (6, 16))
    x2 = jax.device_put(
        np.asarray(x) + (np.arange(6) == 5)[:, None].astype(np.float32)
    )  # the last row moved by 1.0
    full, full2 = np.asarray(attn(x)), np.asarray(attn(x2))
    causal, causal2 = np.asarray(attn(x, mask=causal_mask(6))), np.asarray(attn(x2, mask=causal_mask(6)))
    assert not np.allclose(full[:5], full2[:5])
    np.testing.assert_allclose(causal[:5], causal2[:5], atol=1e-6)


def test_attention_weights_are_distributions_and_respect_the_mask():
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0), init_std=0.5)
    x = normal(1, (6, 16))
    w = np.asarray(attn.weights(x, mask=causal_mask(6)))
    assert w.shape == (2, 6, 6)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-6)
    assert np.all(w[:, np.triu_indices(6, 1)[0], np.triu_indices(6, 1)[1]] == 0)


def test_attention_dropout_in_training_mode_only():
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0), dropout=0.5, init_std=0.5)
    x = normal(1, (6, 16))
    deterministic = attn(x, inference=True)
    np.testing.assert_array_equal(eqx.nn.inference_mode(attn)(x, key=jax.random.key(3)), deterministic)
    a, b = attn(x, key=jax.random.key(3)), attn(x, key=jax.random.key(4))
    assert not np.allclose(a, b)
    assert not np.allclose(a, deterministic)


def test_attention_rejects_heads_that_do_not_divide_d_model():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        MultiHeadAttention(10, 3, key=jax.random.key(0))


def test_attention_and_block_take_a_batch_with_one_dropout_key():
    # The family's sizes, each module's call one compiled program (test_inference_mode's too).
    x = normal(0, (2, 5, 16))
    attn = MultiHeadAttention(16, 2, key=jax.random.key(1), dropout=0.5)
    block = Block(16, 2, 32, key=jax.random.key(2), dropout=0.5)
    for module in (attn, block):
        outputs = outputs_by_mode(module, (x,), jax.random.key(3))  # test_inference_mode's program
        out = outputs["as built, key"]
        assert out.shape == x.shape
        assert not np.allclose(out, outputs["as built, inference=True"])  # the key did turn dropout on


@pytest.mark.parametrize("rate", [0.1, 0.2, 0.5])
def test_dropout_drops_at_its_rate_and_keeps_the_mean(rate):
    from eqx_gpt.model.dropout import dropout, keep_probability

    x = jnp.ones((1000, 999))  # odd size: the last 16-bit draw of the last word is unused
    y = np.asarray(dropout(x, rate, jax.random.key(0)))
    kept = y > 0
    # 999,000 Bernoulli draws: the kept fraction is within 5 standard deviations of 1 - rate.
    assert abs(kept.mean() - (1 - rate)) < 5 * math.sqrt(rate * (1 - rate) / x.size)
    np.testing.assert_allclose(y[kept], 1 / keep_probability(rate), rtol=1e-6)
    assert abs(keep_probability(rate) - (1 - rate)) <= 2**-17
    # Neighbouring elements (drawn from the two halves of one 32-bit word) are independent.
    pairs = kept.reshape(-1)[: x.size // 2 * 2].reshape(-1, 2)
    both = (pairs[:, 0] & pairs[:, 1]).mean()
    assert abs(both - (1 - rate) ** 2) < 5 * math.sqrt((1 - rate) ** 2 / pairs.shape[0])
    # A different key gives a different mask; the same key the same one.
    assert not np.array_equal(kept, np.asarray(dropout(x, rate, jax.random.key(1))) > 0)
    np.testing.assert_array_equal(y, dropout(x, rate, jax.random.key(0)))
