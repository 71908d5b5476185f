"""The optimisation step: weight-decay mask, schedule, overfitting one batch, gradient accumulation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import token_ids
from train_family import (
    CONFIG,
    FAMILY,
    MUON,
    loss_logits_and_grads,
    optimizer_of,
    train_step,
    train_steps,
    update,
)

from eqx_gpt import GPT, GPTConfig
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.step import (
    decay_mask,
    init_optimizer_state,
    make_optimizer,
    make_train_step,
    make_train_steps,
    muon_labels,
)

pytestmark = FAMILY  # one process for the family: programs compiled once


def test_weight_decay_applies_to_matrices_not_to_stacked_norm_scales():
    model = GPT(CONFIG, key=jax.random.key(0))
    assert model.blocks.layers.attn_norm.scale.ndim == 2  # stacked over layers: ndim alone cannot decide
    mask = decay_mask(eqx.filter(model, eqx.is_inexact_array))
    assert (
        mask.embed
        and mask.head.weight
        and mask.blocks.layers.attn.qkv.weight
        and mask.blocks.layers.mlp.down.weight
    )
    assert (
        not mask.blocks.layers.attn_norm.scale
        and not mask.blocks.layers.mlp_norm.scale
        and not mask.final_norm.scale
    )


def _step(config: TrainConfig, model_config=CONFIG):
    optimizer = make_optimizer(config)
    model = GPT(model_config, key=jax.random.key(0))
    step = make_train_step(optimizer, config, dropout=model_config.dropout > 0)
    return model, init_optimizer_state(optimizer, model), step


DROPOUT_CONFIG = GPTConfig(**{**CONFIG.to_dict(), "dropout": 0.1})
# NumPy (drawn by `token_ids`): indexing and stacking it compile nothing.
BATCH = np.asarray(token_ids(1, (8, 17), CONFIG.vocab_size))


def loss_and_grads(model, batch):
    """`(loss, grads)` of `model` on `batch`: one compiled program at BATCH's shape, shared by the
    tests below and test_mixed_precision.py (`loss_logits_and_grads`)."""
    (loss, _), grads = loss_logits_and_grads(model, jax.device_put(batch))
    return loss, grads


@pytest.fixture(scope="module")
def dropout_step():
    """One compiled step with dropout, shared by the tests below (compiling is the slow part)."""
    return _step(TrainConfig(batch_size=8), DROPOUT_CONFIG)[2]


@pytest.fixture(scope="module")
def dropout_steps():
    """The same step, several per call (`make_train_steps`): one compiled program for the module."""
    config = TrainConfig(batch_size=8)
    return make_train_steps(make_optimizer(config), config, dropout=True)


def test_loss_falls_when_overfitting_one_batch():
    # The family's Muon steps, three per call: test_muon_steps_grouped_per_call_match_single_steps_...'s
    # compiled program.
    model = GPT(CONFIG, key=jax.random.key(0))
    opt_state = init_optimizer_state(make_optimizer(MUON), model)
    first = float(loss_and_grads(model, BATCH)[0])
    assert first == pytest.approx(np.log(11), abs=0.3)  # starts near uniform
    batches, lrs = np.stack([BATCH] * 3), np.full(3, MUON.lr, np.float32)
    for i in range(20):  # 60 steps, three per call
        steps = np.arange(3 * i, 3 * i + 3, dtype=np.int32)
        model, opt_state, _ = train_steps(MUON, dropout=False)(
            model, opt_state, batches, steps, lrs, np.int32(3)
        )
    assert float(loss_and_grads(model, BATCH)[0]) < 0.3 * first


def _fresh_state():
    # The step donates the model and optimiser state, so each call gets its own copy.
    model = GPT(DROPOUT_CONFIG, key=jax.random.key(0))
    return model, init_optimizer_state(make_optimizer(TrainConfig()), model)


def test_gradient_accumulation_gives_the_full_batch_update(dropout_step):
    full, _, loss_full = dropout_step(*_fresh_state(), BATCH, np.int32(3), np.float32(1e-2))
    _, _, accumulate = _step(TrainConfig(batch_size=8, grad_accum=4), DROPOUT_CONFIG)
    accumulated, _, loss_accum = accumulate(*_fresh_state(), BATCH, np.int32(3), np.float32(1e-2))
    assert float(loss_full) == pytest.approx(float(loss_accum), rel=1e-5)
    # Adam's first update is about lr * sign(grad), 1e-2 per element; summation order changes ~1e-6.
    full_leaves = jax.tree.leaves(eqx.filter(full, eqx.is_array))
    accumulated_leaves = jax.tree.leaves(eqx.filter(accumulated, eqx.is_array))
    for a, b in zip(full_leaves, accumulated_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
    assert not np.allclose(full.embed, _fresh_state()[0].embed)  # the update did move the weights


def test_dropout_masks_change_with_the_step(dropout_step):
    losses = [float(dropout_step(*_fresh_state(), BATCH, np.int32(s), np.float32(0.0))[2]) for s in (0, 1, 0)]
    assert losses[0] != losses[1] and losses[0] == losses[2]


def _leaves(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


def test_steps_grouped_into_calls_any_way_give_the_same_bits(dropout_steps):
    # What resume relies on: every step runs one compiled program (a loop with a traced count),
    # so how steps are grouped into calls, and where a process started, cannot change a bit.
    # This holds by construction on any CPU: it compares one program with itself.
    steps_fn = dropout_steps
    batches = np.asarray(token_ids(2, (4, 8, 17), CONFIG.vocab_size))
    steps, lrs = np.arange(10, 14, dtype=np.int32), np.asarray([1e-2, 5e-3, 2e-3, 1e-3], np.float32)
    results = []
    for groups in ([4], [1, 3], [2, 1, 1]):
        model, opt_state = _fresh_state()
        losses, done = [], 0
        for n in groups:
            padded = [np.roll(x, -done, axis=0) for x in (batches, steps, lrs)]  # call i starts at step done
            model, opt_state, figures = steps_fn(model, opt_state, *padded, np.int32(n))
            call_losses = figures["loss"]
            assert np.all(np.asarray(call_losses)[n:] == 0)
            losses += np.asarray(call_losses)[:n].tolist()
            done += n
        results.append((losses, _leaves(model), _leaves(opt_state)))
    for losses, params, state in results[1:]:
        assert losses == results[0][0]
        for a, b in zip(params + state, results[0][1] + results[0][2], strict=True):
            np.testing.assert_array_equal(a, b)


# Two different compiled programs (a single step, and the same step inside a loop) may round
# differently: XLA fuses and vectorises each on its own, and the result depends on the instruction
# set (one ulp apart on an AVX2-only CPU). Their agreement is checked to float32 rounding: the
# losses to 1e-5 relative; the weights to 1e-4, since Adam's first updates are lr * g / |g| and
# turn a rounding difference in a near-zero gradient into up to lr * 1e-2 per element.
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-4


def test_several_steps_per_call_match_as_many_single_steps(dropout_step, dropout_steps):
    steps_fn = dropout_steps
    batches = np.asarray(token_ids(2, (4, 8, 17), CONFIG.vocab_size))  # NumPy: batches[i] compiles nothing
    steps, lrs = np.arange(10, 14, dtype=np.int32), np.asarray([1e-2, 5e-3, 2e-3, 1e-3], np.float32)
    for n in (4, 3):  # all of the stack, and fewer (the rest is ignored); one compiled program
        model, opt_state = _fresh_state()
        losses = []
        for i in range(n):
            model, opt_state, loss = dropout_step(model, opt_state, batches[i], steps[i], lrs[i])
            losses.append(float(loss))
        grouped, _, figures = steps_fn(*_fresh_state(), batches, steps, lrs, np.int32(n))
        grouped_losses = figures["loss"]
        np.testing.assert_allclose(np.asarray(grouped_losses)[:n], losses, rtol=LOSS_RTOL)
        assert np.all(np.asarray(grouped_losses)[n:] == 0)
        for a, b in zip(_leaves(model), _leaves(grouped), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_ATOL)


def test_invalid_train_configs_are_rejected():
    with pytest.raises(ValueError, match="not divisible by grad_accum"):
        TrainConfig(batch_size=6, grad_accum=4)
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        TrainConfig(tokenizer="bpe")
    with pytest.raises(ValueError, match="min_lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


def test_muon_takes_the_block_matrices_and_adamw_the_embedding_head_and_norm_scales():
    labels = muon_labels(eqx.filter(GPT(CONFIG, key=jax.random.key(0)), eqx.is_inexact_array))
    blocks = labels.blocks.layers
    assert (
        blocks.attn.qkv.weight
        == blocks.attn.out.weight
        == blocks.mlp.up.weight
        == blocks.mlp.down.weight
        == "muon"
    )
    assert labels.embed == labels.head.weight == labels.final_norm.scale == "adamw"
    assert blocks.attn_norm.scale == blocks.mlp_norm.scale == "adamw"


def _normal_like(params, seed: int):
    """Standard normal arrays shaped as `params`' leaves, drawn by NumPy (`jax.random.normal`
    compiles a program per shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jax.device_put(rng.standard_normal(p.shape, np.float32)), params)


def test_a_muon_update_orthogonalises_each_layers_matrix_in_our_x_at_w_layout():
    config = MUON  # its update is test_speedrun_options.py's too, compiled once
    model = GPT(CONFIG, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    optimizer = optimizer_of(config)
    grads = _normal_like(params, 1)
    updates, _ = update(optimizer, grads, optimizer.init(params), params)
    for name in ("qkv", "out"):
        stacked = getattr(updates.blocks.layers.attn, name).weight
        fan_in, fan_out = stacked.shape[-2:]
        scale = max(1.0, fan_out / fan_in) ** 0.5  # optax's shape scaling, from the axes we name
        for layer in np.asarray(stacked):  # one orthogonalisation per layer: singular values near 1
            s = np.linalg.svd(layer / scale, compute_uv=False)  # (5 Newton-Schulz steps leave the
            assert 0.5 < np.median(s) and s.max() < 1.3, (name, s)  # smallest few lower)
    # The AdamW group runs at adam_lr / lr of the scheduled rate: its first step is about that size.
    assert float(np.abs(updates.embed).mean()) == pytest.approx(3e-3 / 0.02, rel=0.05)


def test_muon_steps_grouped_per_call_match_single_steps_and_accumulation_the_full_batch():
    batches = np.asarray(token_ids(2, (3, 8, 17), CONFIG.vocab_size))
    steps, lrs = np.arange(3, dtype=np.int32), np.asarray([0.02, 0.01, 0.005], np.float32)

    def fresh():
        model = GPT(CONFIG, key=jax.random.key(0))
        return model, init_optimizer_state(make_optimizer(MUON), model)

    step = train_step(MUON, dropout=False)  # test_speedrun_options.py's step too: compiled once
    model, opt_state = fresh()
    losses = []
    for i in range(3):
        model, opt_state, loss = step(model, opt_state, batches[i], steps[i], lrs[i])
        losses.append(float(loss))
    grouped, _, figures = train_steps(MUON, dropout=False)(*fresh(), batches, steps, lrs, np.int32(3))
    np.testing.assert_allclose(np.asarray(figures["loss"]), losses, rtol=LOSS_RTOL)
    for a, b in zip(_leaves(model), _leaves(grouped), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=WEIGHT_ATOL)
    accumulating = TrainConfig(**{**MUON.to_dict(), "grad_accum": 4})
    accumulated, _, _ = make_train_step(make_optimizer(accumulating), accumulating, dropout=False)(
        *fresh(), batches[0], steps[0], lrs[0]
    )
    single, _, _ = step(*fresh(), batches[0], steps[0], lrs[0])
    np.testing.assert_allclose(
        accumulated.blocks.layers.mlp.up.weight, single.blocks.layers.mlp.up.weight, atol=2e-5
    )


# Muon without momentum, its AdamW group decaying at 0.5: the two tests below read each what the
# other leaves alone (the AdamW group's decay; Muon's matrices), so they share one optimiser, and
# one compiled update.
MEMORYLESS = TrainConfig(
    **{**MUON.to_dict(), "grad_clip": 0.0, "muon_momentum": 0.0, "adam_weight_decay": 0.5}
)


def test_muon_s_adamw_group_decays_the_embedding_and_head_by_adam_weight_decay_but_not_norm_scales():
    params = eqx.filter(GPT(CONFIG, key=jax.random.key(0)), eqx.is_inexact_array)
    optimizer = optimizer_of(MEMORYLESS)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = update(optimizer, zeros, optimizer.init(params), params)
    ratio = 3e-3 / 0.02  # the AdamW group's share of the scheduled rate
    # In NumPy: a product or a test of jax arrays compiles a program per shape.
    np.testing.assert_allclose(updates.embed, -ratio * 0.5 * np.asarray(params.embed), rtol=1e-5)
    np.testing.assert_allclose(updates.head.weight, -ratio * 0.5 * np.asarray(params.head.weight), rtol=1e-5)
    assert not np.asarray(updates.final_norm.scale).any()
    assert not np.asarray(updates.blocks.layers.attn_norm.scale).any()


def test_muon_momentum_sets_how_much_of_the_last_gradient_the_next_update_keeps():
    # With momentum 0 Muon keeps no memory: the second update is the first update of its gradient
    # alone. With the default 0.95 the first gradient still steers it.
    params = eqx.filter(GPT(CONFIG, key=jax.random.key(0)), eqx.is_inexact_array)
    g1, g2 = _normal_like(params, 3), _normal_like(params, 4)

    def second_update(config):
        optimizer = optimizer_of(config)
        _, state = update(optimizer, g1, optimizer.init(params), params)
        return update(optimizer, g2, state, params)[0].blocks.layers.mlp.up.weight, optimizer

    # (MEMORYLESS's AdamW decay touches no Muon matrix: mlp.up is one.)
    memoryless, optimizer = second_update(MEMORYLESS)
    alone = update(optimizer, g2, optimizer.init(params), params)[0].blocks.layers.mlp.up.weight
    np.testing.assert_allclose(memoryless, alone, rtol=1e-5, atol=1e-6)
    remembering, _ = second_update(TrainConfig(**{**MUON.to_dict(), "muon_momentum": 0.95}))
    assert not np.allclose(remembering, alone, rtol=1e-2, atol=1e-3)


def test_the_steps_report_the_gradient_norm_before_clipping_beside_the_loss():
    # Clipped to 0.01 (MUON's), far below the gradient's norm: the figure is the norm before clipping.
    config, steps_fn = MUON, train_steps(MUON, dropout=False)
    model = GPT(CONFIG, key=jax.random.key(0))
    loss, grads = loss_and_grads(model, BATCH)
    expected = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
    loss, batches = float(loss), np.stack([BATCH] * 3)
    _, _, figures = steps_fn(
        model, init_optimizer_state(make_optimizer(config), model), batches, np.arange(3, dtype=np.int32),
        np.full(3, 1e-3, np.float32), np.int32(1),
    )  # fmt: skip
    assert list(figures) == ["loss", "grad_norm"]
    assert expected > 10 * config.grad_clip  # far above the clip
    norms = np.asarray(figures["grad_norm"])  # indexed in NumPy: no program
    assert float(norms[0]) == pytest.approx(expected, rel=1e-4)
    assert float(np.asarray(figures["loss"])[0]) == pytest.approx(loss, rel=1e-5)
    assert float(norms[1]) == float(norms[2]) == 0  # slots past n
