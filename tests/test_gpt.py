"""The assembled GPT: causality, padded vocabulary, shape checks, config validation, scan."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import drawn_gpt, forward, gpt, token_ids, transformer
from jaxtyping import TypeCheckError
from model_family import SMALL_GPT, TINY_GPT, TINY_TRANSFORMER, decode, in_family, outputs_by_mode, vmapped

from eqx_gpt import GPT, MLP, Block, GPTConfig, LayerStack, MultiHeadAttention, RMSNorm, causal_mask
from eqx_gpt.training.step import loss_fn

pytestmark = in_family
CFG = SMALL_GPT
DROPPING = dataclasses.replace(CFG, dropout=0.3)
# Each a compiled program shared by the tests (an eager call compiles every operation, and a new
# `jax.jit(lambda ...)` per test compiles again).
logits_of = forward
attention_weights = eqx.filter_jit(GPT.attention_weights)
loss_and_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))


@pytest.fixture(scope="module")
def model():
    return gpt(CFG)


# The length of the token sequences the tests below give the model `CFG`: one length, so one
# compiled forward pass for all of them (test_gpt_options' too).
SEQ = 12


def test_changing_token_t_never_changes_earlier_logits(model):
    tokens = np.asarray(token_ids(1, (SEQ,), CFG.vocab_size))
    base = np.asarray(logits_of(model, tokens))
    for t in (0, 5, SEQ - 1):
        changed = tokens.copy()
        changed[t] = (tokens[t] + 7) % CFG.vocab_size
        out = np.asarray(logits_of(model, changed))
        np.testing.assert_array_equal(out[:t], base[:t])
        assert not np.allclose(out[t:], base[t:])


def test_logits_cover_exactly_the_real_vocabulary(model):
    assert CFG.padded_vocab_size == 128
    assert model.embed.shape == (128, CFG.d_model)
    assert model.head.weight.shape == (CFG.d_model, 128)
    assert logits_of(model, jnp.arange(SEQ)).shape == (SEQ, CFG.vocab_size)


def test_padded_ids_never_win_even_with_huge_head_weights(model):
    # Make every padding column of the head dominate: they must still not be predictable.
    weight = np.array(model.head.weight)
    weight[:, CFG.vocab_size :] = 1e4
    rigged = eqx.tree_at(lambda m: m.head.weight, model, jax.device_put(weight))
    logits = np.asarray(logits_of(rigged, jnp.arange(SEQ)))
    assert logits.shape[-1] == CFG.vocab_size
    assert int(np.argmax(logits, -1).max()) < CFG.vocab_size
    assert np.all(np.isfinite(logits))


def test_layers_start_different(model):
    w = np.asarray(model.blocks.layers.attn.qkv.weight)
    assert w.shape[0] == CFG.n_layers
    assert not np.allclose(w[0], w[1])


def test_dropout_needs_a_key_in_training_mode():
    m = gpt(DROPPING)
    tokens = jnp.arange(SEQ)
    with pytest.raises(ValueError, match="needs key="):
        logits_of(m, tokens)
    outputs = outputs_by_mode(m, (tokens,), jax.random.key(1))  # one program for every mode
    deterministic = outputs["inference"]
    np.testing.assert_array_equal(deterministic, outputs["inference, key"])
    assert not np.allclose(outputs["as built, key"], deterministic)


def test_batched_and_jitted_call(model):
    batch = np.asarray(token_ids(2, (3, SEQ), CFG.vocab_size))
    out = np.asarray(vmapped(model, batch))
    assert out.shape == (3, SEQ, CFG.vocab_size)
    np.testing.assert_allclose(out[1], logits_of(model, batch[1]), atol=1e-5)


def test_kv_cached_decode_matches_full_forward(model):
    tokens = np.asarray(token_ids(3, (SEQ,), CFG.vocab_size))
    full = np.asarray(logits_of(model, tokens))
    cache = model.init_cache()
    prefix, cache = decode(model, tokens[:8], cache, 0)
    steps = []
    for t in range(8, SEQ):
        logits, cache = decode(model, tokens[t : t + 1], cache, t)
        steps.append(np.asarray(logits)[0])
    np.testing.assert_allclose(prefix, full[:8], atol=1e-5)
    np.testing.assert_allclose(np.stack(steps), full[8:], atol=1e-5)


def test_kv_cached_decode_of_a_batch_matches_each_sequence_alone(model):
    tokens = np.asarray(token_ids(4, (3, SEQ), CFG.vocab_size))
    cache = model.init_cache(batch=3)
    assert cache.k.shape == (CFG.n_layers, 3, CFG.n_heads, CFG.d_head, CFG.context_length)
    assert cache.v.shape == (CFG.n_layers, 3, CFG.n_heads, CFG.context_length, CFG.d_head)
    prefix, cache = decode(model, tokens[:, :7], cache, 0)
    last, cache = decode(model, tokens[:, 7:8], cache, 7)
    prefix, last = np.asarray(prefix), np.asarray(last)
    for row in range(3):
        # Position t's logits are those of the first t + 1 tokens alone (causality).
        alone = np.asarray(logits_of(model, tokens[row]))
        np.testing.assert_allclose(prefix[row], alone[:7], atol=1e-5)
        np.testing.assert_allclose(last[row, 0], alone[7], atol=1e-5)


def test_an_unstacked_model_is_the_same_function(model):
    unstacked = model.unstack()
    assert not unstacked.blocks.stacked and len(unstacked.blocks.layers) == CFG.n_layers
    np.testing.assert_array_equal(
        unstacked.blocks.layers[1].mlp.up.weight, np.asarray(model.blocks.layers.mlp.up.weight)[1]
    )
    tokens = np.asarray(token_ids(5, (SEQ,), CFG.vocab_size))
    np.testing.assert_allclose(logits_of(unstacked, tokens), logits_of(model, tokens), atol=1e-6)
    np.testing.assert_allclose(
        attention_weights(unstacked, tokens), attention_weights(model, tokens), atol=1e-6
    )
    dropping = gpt(DROPPING)
    key = jax.random.key(6)
    stacked = outputs_by_mode(dropping, (tokens,), key)["as built, key"]  # test_dropout_needs_a_key's program
    np.testing.assert_allclose(logits_of(dropping.unstack(), tokens, key=key), stacked, atol=1e-6)
    # Its cache is a tuple of per-layer caches, and decoding through it gives the same logits.
    cache = unstacked.init_cache()
    assert len(cache) == CFG.n_layers
    assert cache[0].k.shape == (CFG.n_heads, CFG.d_head, CFG.context_length)
    prefix, cache = decode(unstacked, tokens[:8], cache, 0)
    step, cache = decode(unstacked, tokens[8:9], cache, 8)
    full = np.asarray(logits_of(model, tokens))  # position t's: those of the first t + 1 tokens alone
    np.testing.assert_allclose(prefix, full[:8], atol=1e-5)
    np.testing.assert_allclose(np.asarray(step)[0], full[8], atol=1e-5)


def test_attention_weights_of_every_layer(model):
    w = np.asarray(attention_weights(model, jnp.arange(SEQ)))
    assert w.shape == (CFG.n_layers, CFG.n_heads, SEQ, SEQ)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_attention_pictures_are_the_weights_each_block_attends_with(norm_position):
    # Rebuild each block's output from the pictures' weights, by the definition of its placement
    # (pre-norm: x + attn(norm(x)); post-norm: norm(x + attn(x))), and compare with the block. A
    # post-norm picture drawn from norm(x) (the bug this guards) fails here.
    config = dataclasses.replace(CFG, norm_position=norm_position, norm="layer")
    rebuilt, outputs = _rebuilt_from_pictures(gpt(config, seed=3), jnp.arange(6))
    for layer in range(config.n_layers):
        np.testing.assert_allclose(rebuilt[layer], outputs[layer], atol=1e-5, err_msg=f"layer {layer}")


@eqx.filter_jit  # one program: eagerly, each operation of each layer would compile on its own
def _rebuilt_from_pictures(model, tokens):
    """Each block's output rebuilt from the pictures' weights, and the block's own output."""
    seq, d = tokens.shape[0], model.config.d_model
    pictures = model.attention_weights(tokens)
    x = model._embed(tokens, 0, seq)
    rebuilt, outputs = [], []
    for layer, block in enumerate(model.unstack().blocks.layers):

        def attend(h, block=block, weights=pictures[layer]):
            _, _, v = block.attn.project_qkv(h)  # (seq, heads, d_head)
            heads = jnp.einsum("hqk,khd->qhd", weights, v)
            return heads.reshape(seq, d) @ block.attn.out.weight

        if model.config.norm_position == "pre":
            h = x + attend(block.attn_norm(x))
            rebuilt.append(h + block.mlp(block.mlp_norm(h)))
        else:
            h = block.attn_norm(x + attend(x))
            rebuilt.append(block.mlp_norm(h + block.mlp(h)))
        x = block(x, mask=causal_mask(seq))
        outputs.append(x)
    return rebuilt, outputs


def test_layer_stack_is_scanned_so_program_size_does_not_grow_with_depth():
    def n_equations(n_layers):
        # Its shapes are enough to trace it: no weights drawn (and no programs compiled to draw them).
        m = eqx.filter_eval_shape(GPT, dataclasses.replace(CFG, n_layers=n_layers), key=jax.random.key(0))
        jaxpr = jax.make_jaxpr(lambda m, t: m(t))(m, jnp.arange(8))
        return len(jaxpr.jaxpr.eqns)

    assert n_equations(2) == n_equations(12)


@pytest.mark.parametrize("unroll", [2, 3])
def test_unrolling_the_layer_scan_changes_neither_loss_nor_gradients(unroll):
    # The presets unroll the scan for speed (shakespeare-char: all 6 layers); dropout included,
    # so each layer must still draw its own masks.
    config = dataclasses.replace(CFG, n_layers=3, dropout=0.2)
    batch = token_ids(7, (2, CFG.context_length + 1), CFG.vocab_size)
    keys = jax.random.split(jax.random.key(8), 2)

    def loss_and_grads_of(scan_unroll):
        # NumPy's weights (any weights will do): GPT's own init would compile a draw per weight shape
        # of a 3-layer stack, which no other test builds.
        return loss_and_grads(drawn_gpt(dataclasses.replace(config, scan_unroll=scan_unroll)), batch, keys)

    (loss, grads), (loss_unrolled, grads_unrolled) = loss_and_grads_of(1), loss_and_grads_of(unroll)
    np.testing.assert_allclose(loss_unrolled, loss, rtol=1e-6)
    for g, g_unrolled in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_unrolled), strict=True):
        np.testing.assert_allclose(g_unrolled, g, rtol=1e-5, atol=1e-7)


# --- wrong shapes raise readable errors at trace time, under jit too ---


def test_gpt_rejects_a_scalar_token(model):
    with pytest.raises(ValueError, match=r"GPT's tokens must hold at least one token id.*got shape \(\)"):
        model(jnp.zeros((), jnp.int32))


def test_a_batch_gives_what_vmap_over_its_sequences_gives():
    dropout_model = gpt(DROPPING)
    tokens = token_ids(1, (3, 8), CFG.vocab_size)
    keys = jax.random.split(jax.random.key(2), 3)
    inference = eqx.nn.inference_mode(dropout_model)
    outputs = outputs_by_mode(dropout_model, (tokens,), keys)  # the batch's, in one program
    np.testing.assert_allclose(outputs["inference"], vmapped(inference, tokens), rtol=0, atol=1e-5)
    # Dropout: each sequence of the batch gets the masks its own key gives it alone.
    batched = outputs["as built, key"]
    one_by_one = vmapped(dropout_model, tokens, keys)
    np.testing.assert_allclose(batched, one_by_one, rtol=0, atol=1e-5)
    assert not np.allclose(batched, outputs["inference"])


def test_gpt_rejects_float_tokens_under_jit(model):
    with pytest.raises(TypeError, match="GPT's tokens must be integer token ids .* got dtype float32"):
        logits_of(model, jnp.zeros((8,), jnp.float32))


def test_gpt_rejects_sequences_longer_than_the_context(model):
    with pytest.raises(ValueError, match="context_length=16"):
        model(jnp.zeros((17,), jnp.int32))


def test_attention_rejects_a_mask_of_the_wrong_size_under_jit():
    attn = MultiHeadAttention(16, 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"mask has shape \(6, 6\).*shape \(5, 5\)"):
        jax.jit(lambda x, m: attn(x, mask=m))(jnp.zeros((5, 16)), causal_mask(6))


def test_modules_reject_a_wrong_feature_size():
    x = jnp.zeros((4, 17))
    with pytest.raises(ValueError, match="d_model=16"):
        MultiHeadAttention(16, 2, key=jax.random.key(0))(x)
    with pytest.raises(ValueError, match="d_model=16"):
        MLP(16, 32, key=jax.random.key(0))(x)
    with pytest.raises(ValueError, match="dim=16"):
        RMSNorm(16)(x)


def test_modules_reject_a_missing_sequence_axis():
    with pytest.raises(TypeCheckError) as error:
        MLP(16, 32, key=jax.random.key(0))(jnp.zeros((16,)))
    assert str(error.value) == "MLP.__call__: x is f32[16]; pass Float[Array, '*batch seq d_model']"


def test_a_wrong_argument_type_is_one_line_naming_it_and_what_to_pass(model):
    with pytest.raises(TypeCheckError) as error:
        model(jnp.arange(4), key=5)  # an int, not a PRNG key
    message = str(error.value)
    assert len(message.splitlines()) == 1 and message.startswith(
        "GPT.__call__: key is 5; pass Key[Array, ''] |"
    )
    assert message.endswith("| None (axes so far: seq=4, batch=())")


# --- configuration ---


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"d_model": 30, "n_heads": 4}, "not divisible by n_heads"),
        ({"d_model": 33, "n_heads": 3}, "even"),
        ({"n_layers": 0}, "n_layers must be an integer in \\[1, "),
        ({"vocab_size": -1}, "vocab_size must be an integer in \\[1, "),
        ({"context_length": 2.5}, "context_length must be an integer in \\[1, "),
        ({"dropout": 1.0}, "dropout"),
        ({"compute_dtype": "int8"}, "compute_dtype"),
    ],
)
def test_config_rejects_impossible_values(changes, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CFG, **changes)


def test_config_defaults_and_round_trip():
    assert CFG.d_hidden == 4 * CFG.d_model
    assert CFG.d_head == 8
    assert GPTConfig.from_dict(CFG.to_dict()) == CFG
    with pytest.raises(ValueError, match="no field"):
        GPTConfig.from_dict({**CFG.to_dict(), "bogus": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.d_model = 64  # type: ignore[misc]


def _traces_during(call) -> int:
    """How many functions JAX traces while `call()` runs: none when every program it needs is
    compiled already (a program is traced before it is compiled, and not when its cache hits)."""
    traces = []

    def listen(event: str, duration: float, **_) -> None:
        if event.endswith("/jaxpr_trace_duration"):
            traces.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(call())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(traces)


def test_a_model_called_outside_jit_compiles_its_layer_scan_on_the_first_call_only():
    """Eagerly, every call of a GPT or Transformer traced and compiled its layer scan again (the
    scan's step was a new closure each call): half a second a call for a model of two layers."""
    # The tiny model, 3 ids and a cache of 4 (test_bad_input's and test_bad_values' eager calls): the
    # operations these calls compile first are compiled once for the family.
    model, t = gpt(TINY_GPT), transformer(TINY_TRANSFORMER)
    tokens = token_ids(0, (3,), TINY_GPT.vocab_size)
    src, tgt = token_ids(1, (1, 6), 9), token_ids(2, (1, 5), 9)
    cache, t_cache = model.init_cache(4), t.init_cache(1, TINY_TRANSFORMER.max_len)
    memory_kv = t.memory_kv(t.encode(src))
    calls = {
        "GPT forward": lambda: model(tokens),
        "GPT attention weights": lambda: model.attention_weights(tokens),
        "GPT decode at 0": lambda: model.decode(tokens[:1], cache, 0),
        "GPT decode at 3": lambda: model.decode(tokens[:1], cache, 3),  # any position: one program
        "Transformer forward": lambda: t(src, tgt),
        "Transformer decode at 0": lambda: t.decode(tgt[:, :1], t_cache, 0, memory_kv, src),
        "Transformer decode at 2": lambda: t.decode(tgt[:, :1], t_cache, 2, memory_kv, src),
        "cross-attention weights": lambda: t.cross_attention_weights(src[0], tgt[0]),
    }
    for call in calls.values():
        jax.block_until_ready(call())  # compiles what the call needs
    assert {name: _traces_during(call) for name, call in calls.items()} == dict.fromkeys(calls, 0)


def _own_layer(block, x, _, *, mask):  # at module level, as the GUIDE's model of one's own has it
    return block(x, mask=mask), None


def test_a_layer_stack_of_ones_own_run_eagerly_through_an_eqx_partial_compiles_once():
    """The GUIDE's way for a model of one's own: a module-level layer function, its mask in an
    `eqx.Partial`, gets the scan compiled on the first eager call only, as GPT's does."""
    # TINY_GPT's block sizes: the draws of its stacked weights are compiled once for the family.
    stack = LayerStack(lambda k: Block(16, 2, 64, key=k), jax.random.split(jax.random.key(0), 2))
    x = jax.device_put(np.random.default_rng(0).normal(size=(5, 16)).astype(np.float32))
    call = lambda: stack.run(eqx.Partial(_own_layer, mask=causal_mask(5)), x)[0]
    first = call()
    assert _traces_during(call) == 0
    np.testing.assert_array_equal(call(), first)
