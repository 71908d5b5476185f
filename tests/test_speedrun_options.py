"""The speedrun's optimiser option (issue 33), which the `cpu` preset turns on: Muon orthogonalising
the query, key and value projections each on its own; and the compiled step's cache, which once
dropped new options. Each is checked for what it builds or does, not only that it runs."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import optax
from compiled import token_ids
from train_family import CONFIG, FAMILY, MUON, loss_logits_and_grads, optimizer_of, update

from eqx_gpt import GPT, MultiHeadAttention
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.setup import optimizer_and_step
from eqx_gpt.training.step import (
    matrix_axes,
    split_qkv,
)

pytestmark = FAMILY  # one process for the family: programs compiled once

CFG = CONFIG  # the family's: its gradient and Muon update (MUON) are test_training's too, compiled once


def first_qkv_update(config: TrainConfig) -> np.ndarray:
    """The first layer's `w_qkv` update of a first training step at the peak rate, from init: the
    peak rate times the optimiser's update of the batch's gradient, as the step applies it. Through
    the family's compiled gradient and update (a whole step compiled for each option would add its
    forward and backward pass and check nothing more)."""
    model = GPT(CFG, key=jax.random.key(0))
    batch = token_ids(1, (config.batch_size, CFG.context_length + 1), CFG.vocab_size)
    _, grads = loss_logits_and_grads(model, batch)
    params, optimizer = eqx.filter(model, eqx.is_inexact_array), optimizer_of(config)
    updates, _ = update(optimizer, grads, optimizer.init(params), params)
    return config.lr * np.asarray(updates.blocks.layers.attn.qkv.weight)[0]  # indexed in NumPy


def test_split_qkv_gives_queries_and_keys_updates_as_large_as_the_values():
    # At init attention is near uniform, so the queries' and keys' gradients are small beside the
    # values'. Orthogonalised together, the fused matrix spends its update on the values; apart,
    # each projection gets an orthogonal update of its own, of the same size.
    d = CFG.d_model

    def top_singular_values(update):
        return [np.linalg.svd(update[:, i * d : (i + 1) * d], compute_uv=False)[0] for i in range(3)]

    q, k, v = top_singular_values(first_qkv_update(dataclasses.replace(MUON, weight_decay=0.0)))
    assert max(q, k) < 0.5 * v
    q, k, v = top_singular_values(
        first_qkv_update(dataclasses.replace(MUON, weight_decay=0.0, muon_split_qkv=True))
    )
    np.testing.assert_allclose([q, k], [v, v], rtol=0.2)


def test_the_compiled_step_is_shared_only_by_configs_that_step_alike():
    # Runs in one process share a compiled step when only what the step never reads differs; an
    # optimiser option must never be dropped from that key (new ones once were, by omission).
    shared = optimizer_and_step(MUON, dropout=False)
    elsewhere = dataclasses.replace(MUON, max_steps=7, warmup_steps=3, eval_interval=2, schedule="wsd")
    assert optimizer_and_step(elsewhere, dropout=False) is shared
    for option in (dict(muon_split_qkv=True), dict(grad_clip=1.0), dict(beta1=0.8)):
        assert optimizer_and_step(dataclasses.replace(MUON, **option), dropout=False) is not shared


def _fused(qkv_weight):
    """An attention's parameters whose fused `qkv` weight is `qkv_weight` `(layers, 16, 48)` (width
    16: test_compose.py's attention's, whose weights' initialising programs the family compiles)."""
    attn = MultiHeadAttention(16, 2, key=jax.random.key(1))
    fused = eqx.tree_at(lambda a: a.qkv.weight, attn, jax.device_put(qkv_weight))
    return eqx.filter(fused, eqx.is_inexact_array)


def test_split_qkv_orthogonalises_the_query_key_and_value_projections_each_on_its_own():
    # Muon through split_qkv on a fused (layers, d, 3d) gradient gives exactly what Muon gives
    # the three (layers, d, d) thirds as separate matrices.
    # Drawn and cut in NumPy; each update compiled whole (`update`): run op by op, Muon's
    # Newton-Schulz iterations compile dozens of programs.
    grads = np.random.default_rng(0).standard_normal((2, 16, 48), np.float32)
    split = split_qkv(optax.contrib.muon(1.0, muon_weight_dimension_numbers=matrix_axes(True)))
    fused_update, _ = update(split, _fused(grads), split.init(_fused(grads)), _fused(grads))
    thirds = [jax.device_put(grads[..., 16 * i : 16 * (i + 1)]) for i in range(3)]
    alone = optax.contrib.muon(1.0, muon_weight_dimension_numbers=matrix_axes(False))
    separate, _ = update(alone, thirds, alone.init(thirds), thirds)
    separate = np.concatenate([np.asarray(x) for x in separate], axis=-1)
    np.testing.assert_allclose(fused_update.qkv.weight, separate, rtol=1e-4, atol=1e-5)
    # Fused, the thirds share one orthogonalisation, which is another update.
    whole = optax.contrib.muon(1.0, muon_weight_dimension_numbers=matrix_axes(False))
    together, _ = update(whole, _fused(grads), whole.init(_fused(grads)), _fused(grads))
    assert not np.allclose(together.qkv.weight, fused_update.qkv.weight, atol=1e-3)
