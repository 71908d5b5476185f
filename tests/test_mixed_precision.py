"""Mixed precision: bf16 activations with fp32 parameters train, and stay close to fp32."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from compiled import forward, token_ids
from oracles import np_softmax
from train_family import CONFIG, FAMILY, loss_logits_and_grads

from eqx_gpt import GPT, MultiHeadAttention, causal_mask
from eqx_gpt.model.attention import fused_attention
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.step import init_optimizer_state, make_optimizer, make_train_step

pytestmark = FAMILY  # one process for the family: programs compiled once

FP32 = CONFIG  # the family's small GPT: its initialising programs are compiled already
BF16 = dataclasses.replace(FP32, compute_dtype="bfloat16")


def _tokens(seed, n=4):
    return token_ids(seed, (n, FP32.context_length + 1), FP32.vocab_size)


def test_bf16_compute_trains_with_fp32_parameters_and_optimiser_state():
    config = TrainConfig(batch_size=4, seed=0)
    optimizer = make_optimizer(config)
    model = GPT(BF16, key=jax.random.key(0))
    opt_state = init_optimizer_state(optimizer, model)
    step = make_train_step(optimizer, config, dropout=False)
    batch = _tokens(2)
    losses = []
    for i in range(25):
        model, opt_state, loss = step(model, opt_state, batch, np.int32(i), np.float32(3e-3))
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
    floats = [a for a in jax.tree.leaves((model, opt_state)) if eqx.is_inexact_array(a)]
    assert floats and all(a.dtype == jnp.float32 for a in floats)


def test_bf16_logits_loss_and_gradients_stay_close_to_fp32():
    tokens = _tokens(3, n=8)  # the shape of test_training.py's batch: its float32 program serves here
    model16 = GPT(BF16, key=jax.random.key(0))  # the same fp32 parameters as model32
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(eqx.filter(model16, eqx.is_array)))
    (l32, logits32), g32 = loss_logits_and_grads(GPT(FP32, key=jax.random.key(0)), tokens)
    (l16, logits16), g16 = loss_logits_and_grads(model16, tokens)

    assert logits16.dtype == jnp.float32 and logits16.shape == logits32.shape
    # Compared in NumPy (float32, as the arrays are): each jnp operation would compile a program.
    logits32, logits16 = np.asarray(logits32), np.asarray(logits16)
    # bf16 keeps 8 bits of mantissa: about 0.4% relative error per rounding.
    scale = np.abs(logits32).max()
    assert 0 < np.abs(logits16 - logits32).max() <= 0.03 * scale  # close, and really bf16
    p32, p16 = np_softmax(logits32), np_softmax(logits16)
    assert np.abs(p16 - p32).max() <= 2e-3
    assert abs(float(l16) - float(l32)) <= 1e-2

    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))
    flat32 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(g32)])
    flat16 = np.concatenate([np.ravel(g) for g in jax.tree.leaves(g16)])
    cosine = np.dot(flat32, flat16) / (np.linalg.norm(flat32) * np.linalg.norm(flat16))
    assert cosine > 0.99


def test_fused_attention_matches_the_per_head_vmap_path():
    # On CPU this is XLA's path of jax.nn.dot_product_attention, the call that GPUs send to cuDNN.
    # Width 16 and 2 heads, as test_compose.py's attention: its weights' initialising programs serve.
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0))
    x = jax.device_put(np.random.default_rng(1).standard_normal((12, 16), np.float32))
    mask = causal_mask(12)
    # Each path compiled whole: op by op, each of their operations is a program of its own.
    fused = forward(_fused_path, attn, x, mask)
    np.testing.assert_allclose(fused, forward(attn, x, mask=mask), atol=1e-5, rtol=1e-5)


def _fused_path(attn: MultiHeadAttention, x, mask):
    """`attn`'s output through `fused_attention` (`jax.nn.dot_product_attention`)."""
    q, k, v = attn.project_qkv(x)
    return fused_attention(q, k, v, mask).reshape(x.shape) @ attn.out.weight
