"""GPTConfig's options for other classic shapes (GPT-2's among them), one at a time, and proof
that the default model is the one it was before they existed."""

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import forward, gpt, normal, token_ids
from model_family import SMALL_GPT, decode, in_family

from eqx_gpt import GPT, load_model
from eqx_gpt.model.positions import rotary_embedding
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.step import (
    decay_mask,
    init_optimizer_state,
    make_optimizer,
    make_train_step,
    muon_labels,
)

pytestmark = in_family
FIXTURES = Path(__file__).parent / "fixtures"
CFG = SMALL_GPT
TOKENS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], np.int32)  # NumPy: slicing it compiles nothing


def model_with(**options) -> GPT:
    return gpt(dataclasses.replace(CFG, **options))


def cached_logits(model: GPT, tokens, start: int = 0):
    """Logits of `tokens` decoded at positions `start, ...`: the prompt then one token at a time."""
    logits, cache = decode(model, tokens[:4], model.init_cache(), start)
    rows = [logits]
    for i in range(4, len(tokens)):
        logits, cache = decode(model, tokens[i : i + 1], cache, start + i)
        rows.append(logits)
    return np.concatenate(rows)


def test_a_checkpoint_written_before_the_options_loads_and_gives_its_logits():
    # The fixture was saved by the code before these options (commit 00b92fb) with its logits; the
    # defaults must rebuild the same model from the same leaves.
    model, tokenizer, meta = load_model(FIXTURES / "checkpoint-v1")
    assert "positions" not in meta["model_config"]
    assert model.config.positions == "sinusoidal" and not model.config.bias and model.head is not None
    expected = np.load(FIXTURES / "checkpoint-v1" / "expected.npz")
    np.testing.assert_allclose(forward(model, expected["tokens"]), expected["logits"], atol=1e-5)


def test_the_default_model_has_no_parameter_of_the_options():
    model = gpt(CFG)
    attn, mlp = model.blocks.layers.attn, model.blocks.layers.mlp
    assert model.pos_embed is None and model.head is not None
    assert attn.qkv.bias is None and attn.out.bias is None and mlp.up.bias is None and mlp.down.bias is None
    assert not attn.rope and mlp.activation == "gelu_tanh"


@pytest.mark.parametrize(
    "options",
    [dict(positions="learned"), dict(positions="rope"), dict(bias=True), dict(tie_embeddings=True),
     dict(activation="relu"), dict(activation="gelu")],
    ids=lambda o: "-".join(map(str, o.values())),
)  # fmt: skip
def test_each_option_keeps_the_model_causal_and_the_cache_exact(options):
    model = model_with(**options)
    changed_tokens = TOKENS.copy()
    changed_tokens[7] = 0
    full, changed = np.asarray(forward(model, TOKENS)), np.asarray(forward(model, changed_tokens))
    np.testing.assert_array_equal(full[:7], changed[:7])  # no position sees a later token
    assert not np.allclose(full[7:], changed[7:])
    np.testing.assert_allclose(cached_logits(model, TOKENS), full, atol=1e-5)


def test_learned_positions_are_a_table_added_to_unscaled_token_vectors():
    model = model_with(positions="learned")
    assert model.pos_embed.shape == (CFG.context_length, CFG.d_model)
    # Moving the table's row 5 changes what position 5 (and, through attention, later ones) sees.
    table = np.array(model.pos_embed)
    table[5] += 1.0
    moved = eqx.tree_at(lambda m: m.pos_embed, model, jax.device_put(table))
    logits, moved_logits = np.asarray(forward(model, TOKENS)), np.asarray(forward(moved, TOKENS))
    np.testing.assert_array_equal(logits[:5], moved_logits[:5])
    assert not np.allclose(logits[5], moved_logits[5])
    x = forward(model._embed, TOKENS, 0, len(TOKENS))  # one program, not one per operation
    expected = np.asarray(model.embed)[TOKENS] + np.asarray(model.pos_embed)[: len(TOKENS)]
    np.testing.assert_allclose(x, expected, rtol=1e-6)


def test_rope_attention_sees_only_relative_positions():
    # A sequence's attention scores under RoPE are the same wherever it starts (they depend on
    # t - s only); its queries and keys themselves are not.
    model = model_with(positions="rope")
    assert model.pos_embed is None and model.blocks.layers.attn.rope
    attn = model.unstack().blocks.layers[0].attn
    x = normal(4, (6, CFG.d_model))
    # Both starts through one compiled program (a start given as an array is traced).
    (q0, k0), (q9, k9) = (_queries_and_keys(attn, x, jnp.int32(start)) for start in (0, 9))
    scores = lambda q, k: np.einsum("qhd,khd->hqk", q, k)
    np.testing.assert_allclose(scores(q0, k0), scores(q9, k9), atol=1e-5)
    assert not np.allclose(q0, q9, atol=1e-3)


@eqx.filter_jit
def _queries_and_keys(attn, x, start):
    """`attn`'s queries and keys of `x` at positions `start, ...`, as NumPy can take them."""
    return attn._project(x, None, start)[:2]


def test_rotary_embedding_turns_positions_into_offsets():
    q, k = normal(1, (2, 1, 1, 8))
    rotated = lambda x, t: np.asarray(_rotary_embedding(x, jnp.array([t])))  # one program for all
    score = lambda t, s: float((rotated(q, t) * rotated(k, s)).sum())
    assert score(7, 4) == pytest.approx(score(3, 0), abs=1e-5)
    assert score(7, 4) != pytest.approx(score(7, 3), abs=1e-3)
    # Position 0 is the identity, and rotations keep each vector's length.
    np.testing.assert_allclose(rotated(q, 0), q, atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(rotated(q, 5)), np.linalg.norm(q), rtol=1e-6)


_rotary_embedding = jax.jit(rotary_embedding)


def test_bias_adds_zero_biases_that_leave_the_function_as_it_was():
    with_bias, without = model_with(bias=True), model_with()
    attn, mlp = with_bias.blocks.layers.attn, with_bias.blocks.layers.mlp
    n = CFG.n_layers
    assert attn.qkv.bias.shape == (n, 3 * CFG.d_model) and attn.out.bias.shape == (n, CFG.d_model)
    assert mlp.up.bias.shape == (n, CFG.d_hidden) and mlp.down.bias.shape == (n, CFG.d_model)
    # Biases start at zero and draw no random numbers, so the weights are those of `without`.
    np.testing.assert_allclose(forward(with_bias, TOKENS), forward(without, TOKENS), atol=1e-6)
    shifted = eqx.tree_at(
        lambda m: m.blocks.layers.mlp.down.bias,
        with_bias,
        jax.device_put(np.asarray(mlp.down.bias) + np.float32(0.5)),
    )
    assert not np.allclose(forward(shifted, TOKENS), forward(without, TOKENS), atol=1e-3)


def test_biases_and_positions_go_to_adamw_undecayed_under_muon():
    model = model_with(bias=True, positions="learned")
    params = eqx.filter(model, eqx.is_inexact_array)
    labels, mask = muon_labels(params), decay_mask(params)
    attn, mlp = labels.blocks.layers.attn, labels.blocks.layers.mlp
    assert attn.qkv.bias == attn.out.bias == mlp.up.bias == mlp.down.bias == "adamw"
    assert attn.qkv.weight == mlp.up.weight == "muon" and labels.pos_embed == "adamw"
    assert not mask.blocks.layers.attn.qkv.bias and not mask.blocks.layers.mlp.down.bias
    assert mask.pos_embed and mask.blocks.layers.attn.qkv.weight


def test_activation_is_the_named_function():
    x = normal(2, (5, CFG.d_model))
    for name, act in (("relu", jax.nn.relu), ("gelu", lambda h: jax.nn.gelu(h, approximate=False)),
                      ("gelu_tanh", lambda h: jax.nn.gelu(h, approximate=True)),
                      ("relu2", lambda h: jnp.maximum(h, 0) ** 2)):  # fmt: skip
        mlp = model_with(activation=name).unstack().blocks.layers[0].mlp
        np.testing.assert_allclose(mlp(x), act(x @ mlp.up.weight) @ mlp.down.weight, atol=1e-6)


def test_a_gated_activation_gives_every_block_a_gated_mlp():
    model = model_with(activation="swiglu")
    mlp = model.unstack().blocks.layers[0].mlp
    assert mlp.gated and mlp.up.weight.shape == (CFG.d_model, 2 * CFG.d_hidden)
    x = normal(2, (5, CFG.d_model))
    gate, value = np.split(np.asarray(x) @ np.asarray(mlp.up.weight), 2, axis=-1)
    silu = gate / (1 + np.exp(-gate))
    np.testing.assert_allclose(mlp(x), (silu * value) @ np.asarray(mlp.down.weight), atol=1e-6)
    assert forward(model, TOKENS[:-1]).shape == (11, CFG.vocab_size)


def test_tied_embeddings_make_the_head_the_embedding():
    model = model_with(tie_embeddings=True, positions="learned")
    assert model.head is None
    x = model.final_norm(jnp.ones((3, CFG.d_model)))
    expected = (np.asarray(x) @ np.asarray(model.embed).T)[:, : CFG.vocab_size]
    np.testing.assert_allclose(model._logits(x), expected, rtol=1e-5)
    # One matrix gets the gradient of both uses: the input rows and the output logits.
    loss = lambda m: -jax.nn.log_softmax(m(TOKENS[:-1]))[jnp.arange(11), TOKENS[1:]].sum()
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)  # one program, not one per operation
    unused = np.setdiff1d(np.arange(CFG.vocab_size), TOKENS)
    assert np.abs(np.asarray(grads.embed)[unused]).sum() > 0  # reached only through the head


def test_a_gpt2_shaped_model_trains():
    config = dataclasses.replace(CFG, positions="learned", bias=True, norm="layer", tie_embeddings=True)
    model = GPT(config, key=jax.random.key(0))  # its own: a training step donates the model's arrays
    train = TrainConfig(optimizer="muon", lr=0.02, adam_lr=3e-3, grad_clip=1.0, batch_size=4)
    optimizer = make_optimizer(train)
    opt_state = init_optimizer_state(optimizer, model)
    step = make_train_step(optimizer, train, dropout=False)
    batch = token_ids(3, (4, CFG.context_length + 1), CFG.vocab_size)
    losses = []
    for i in range(8):
        model, opt_state, loss = step(model, opt_state, batch, jnp.int32(i), jnp.float32(train.lr))
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5
    assert np.abs(np.asarray(model.blocks.layers.attn.qkv.bias)).max() > 0


def test_zero_init_starts_every_block_as_the_identity_and_the_logits_uniform():
    model = GPT(dataclasses.replace(CFG, zero_init=True), key=jax.random.key(0))  # trained below: its own
    # NumPy's copies: `np.any` of a JAX array is a compiled program per shape.
    layers = jax.tree.map(np.asarray, model.blocks.layers)
    assert (
        not np.any(layers.attn.out.weight)
        and not np.any(layers.mlp.down.weight)
        and not np.any(np.asarray(model.head.weight))
    )
    assert np.any(layers.attn.qkv.weight) and np.any(layers.mlp.up.weight)  # the rest as before
    np.testing.assert_array_equal(forward(model, TOKENS), np.zeros((len(TOKENS), CFG.vocab_size)))
    # Training moves the zeroed matrices: the first step the head (nothing flows back through a zero
    # head), the second the output projections.
    config = TrainConfig(batch_size=2, lr=1e-2, warmup_steps=0, optimizer="muon")
    optimizer = make_optimizer(config)
    step = make_train_step(optimizer, config, dropout=False)
    batch, state = jax.device_put(np.stack([TOKENS[:9], TOKENS[3:]])), init_optimizer_state(optimizer, model)
    for i in range(2):
        model, state, _ = step(model, state, batch, jnp.int32(i), jnp.float32(1e-2))
    assert np.any(np.asarray(model.blocks.layers.mlp.down.weight)) and np.any(np.asarray(model.head.weight))


def test_the_logit_softcap_bounds_the_logits_and_keeps_their_order():
    plain, capped = model_with(), model_with(logit_softcap=0.5)
    logits, bounded = np.asarray(forward(plain, TOKENS)), np.asarray(forward(capped, TOKENS))
    assert np.all(np.abs(bounded) < 0.5)
    np.testing.assert_allclose(bounded, 0.5 * np.tanh(logits / 0.5), atol=1e-6)
    np.testing.assert_array_equal(np.argmax(bounded, -1), np.argmax(logits, -1))


@pytest.mark.parametrize(
    "options, words",
    [(dict(positions="alibi"), "positions"), (dict(activation="swish"), "activation"),
     (dict(bias=1), "bias"), (dict(positions="rope", d_model=20, n_heads=4), "even"),
     (dict(logit_softcap=0.0), "logit_softcap"), (dict(zero_init=1), "zero_init")],
)  # fmt: skip
def test_impossible_options_are_one_line_errors(options, words):
    with pytest.raises(ValueError, match=words) as e:
        dataclasses.replace(CFG, **options)
    assert "\n" not in str(e.value)
