"""The chunked cross-entropy: the plain loss's values and gradients, without a [tokens, vocab] buffer."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from compiled import drawn_gpt, token_ids
from train_family import FAMILY

from eqx_gpt import GPT, GPTConfig
from eqx_gpt.model.loss import (
    CPU_LIMITS,
    GPU_LIMITS,
    chunk_limits,
    chunked_cross_entropy,
    chunks_pay,
    default_block,
    next_token_loss,
)
from eqx_gpt.training.presets import PRESETS

pytestmark = FAMILY  # one process for the family: programs compiled once

# 300 ids padded to 320: the padding columns must take no probability.
BASE = GPTConfig(vocab_size=300, context_length=16, d_model=32, n_heads=4, n_layers=2)
CASES = {
    "untied": BASE,
    "tied": dataclasses.replace(BASE, tie_embeddings=True, positions="learned", bias=True, norm="layer"),
    "softcap": dataclasses.replace(BASE, logit_softcap=3.0),
}


def _batch(seed, n=3, config=BASE):
    return token_ids(seed, (n, config.context_length + 1), config.vocab_size)


def _plain(model, batch, weight=None):
    losses = optax.losses.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:])
    return losses.mean() if weight is None else jnp.sum(losses * weight)


def _chunked(model, batch, weight=None, block=7):
    c, targets = model.config, batch[:, 1:]
    total = chunked_cross_entropy(
        model.features(batch[:, :-1]), model.head_weight, targets, weight,
        vocab_size=c.vocab_size, logit_softcap=c.logit_softcap, block=block,
    )  # fmt: skip
    return total / targets.size if weight is None else total


@eqx.filter_jit
def _plain_and_chunked(model, batch):
    """`((plain, its gradient), (chunked, its gradient))` in one program: run op by op, each of their
    dozens of operations compiles on its own per shape; compiled apart, the model's forward pass is
    traced, lowered and compiled twice (one program cost about 0.7 of the two)."""
    return eqx.filter_value_and_grad(_plain)(model, batch), eqx.filter_value_and_grad(_chunked)(model, batch)


def _close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_loss_and_gradients_equal_the_plain_ones(name):
    # Weights of scale 1 (the head's too: `embed * 8` once left an untied head as it was), so that
    # the softmax is far from uniform and the softcap bites.
    model = drawn_gpt(CASES[name], 1, scale=1.0)
    batch = _batch(2, config=CASES[name])
    (plain, g_plain), (chunked, g_chunked) = _plain_and_chunked(model, batch)
    assert abs(float(plain) - float(chunked)) < 1e-5 * float(plain)
    _close(g_chunked, g_plain, 2e-5)
    # Gradients are not all zero (the comparison would be empty).
    assert np.abs(np.asarray(g_plain.embed)).max() > 1e-4


def _plain_summed(features, head, targets, weight):
    """The plain weighted loss of `features @ head` over the model's 300 ids (`GPT.__call__`'s
    slice), for `_close` against `chunked_cross_entropy` on the same inputs."""
    logits = (features @ head)[..., : BASE.vocab_size]
    return jnp.sum(optax.losses.softmax_cross_entropy_with_integer_labels(logits, targets) * weight)


def _chunked_summed(features, head, targets, weight, block):
    return chunked_cross_entropy(features, head, targets, weight, vocab_size=BASE.vocab_size, block=block)


# One column per block (319 padding-free blocks, then one), uneven blocks, and the whole head.
BLOCKS = (1, 16, 57, 1000)


@jax.jit
def _plain_and_blocks(features, head, targets, weight):
    """The plain weighted loss and its gradient, then the chunked one's at each of `BLOCKS`, in one
    program (five compiled apart). Differentiated in the features and the head, the loss's own
    inputs: a model before them would add its forward and backward pass and check nothing more
    (the model's features into the loss are the test above's)."""
    grad = lambda loss, *static: jax.value_and_grad(loss, argnums=(0, 1))(
        features, head, targets, weight, *static
    )
    return grad(_plain_summed), [grad(_chunked_summed, block) for block in BLOCKS]


def test_weighted_sum_and_blocks_of_any_width():
    rng = np.random.default_rng(3)
    features = rng.standard_normal((3, 16, BASE.d_model), np.float32)
    head = rng.standard_normal((BASE.d_model, BASE.padded_vocab_size), np.float32)  # 300 ids, 320 columns
    targets = np.asarray(_batch(4))[:, 1:]
    weight = rng.uniform(size=targets.shape).astype(np.float32)
    (plain, g_plain), by_block = _plain_and_blocks(features, head, targets, weight)
    for chunked, g_chunked in by_block:
        assert abs(float(plain) - float(chunked)) < 1e-5 * float(plain)
        _close(g_chunked, g_plain, 2e-5)


def test_bfloat16_compute_stays_close_to_the_plain_bfloat16_loss():
    model = drawn_gpt(dataclasses.replace(BASE, compute_dtype="bfloat16"), 6)
    batch = _batch(7)
    (plain, g_plain), (chunked, g_chunked) = _plain_and_chunked(model, batch)
    assert abs(float(plain) - float(chunked)) < 1e-2 * float(plain)
    assert g_chunked.embed.dtype == jnp.float32
    chunked_embed, plain_embed = np.asarray(g_chunked.embed), np.asarray(g_plain.embed)
    assert np.abs(chunked_embed - plain_embed).max() < 0.05 * np.abs(plain_embed).max()


def _largest(jaxpr) -> int:
    """The most elements of any value a jaxpr (and every jaxpr inside it: scan bodies, custom
    rules) computes."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    largest = max(largest, _largest(inner))
    return largest


def _gradient_jaxpr(loss, *args):
    return jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(*args).jaxpr


def test_the_chunked_gradient_holds_no_tokens_by_vocabulary_buffer():
    tokens, d_model, vocab = 512, 32, 4032  # 2M logits
    # Traced only (no program compiled): NumPy inputs.
    rng = np.random.default_rng(8)
    features = rng.standard_normal((tokens, d_model), np.float32)
    head = rng.standard_normal((d_model, vocab), np.float32)
    targets = rng.integers(0, 4000, tokens).astype(np.int32)

    def chunked(f, h):
        return chunked_cross_entropy(f, h, targets, vocab_size=4000, block=96)

    def plain(f, h):
        return optax.losses.softmax_cross_entropy_with_integer_labels(f @ h, targets).sum()

    assert (
        _largest(jax.make_jaxpr(jax.value_and_grad(plain, argnums=(0, 1)))(features, head).jaxpr)
        >= tokens * vocab
    )
    # The largest values: one block's logits (512 tokens x 96 columns), or the head and its
    # gradient (42 blocks of 96 columns).
    assert _largest(_gradient_jaxpr(chunked, features, head)) == max(tokens * 96, d_model * vocab)


def test_blocks_cover_a_few_mib_of_logits():
    cpu = CPU_LIMITS  # (on a GPU the suite runs too: gpu_check.sh)
    assert default_block(48 * 64, 50_304, cpu) == 341  # the default body's batch: 340 after evening out
    assert default_block(1, 50_304, cpu) == 50_304  # one token: the whole head in one block
    assert default_block(1 << 20, 50_304, cpu) == 128  # a million tokens: never narrower than 128


def test_a_gpu_keeps_gpt2_steps_plain_and_chunks_in_wide_blocks():
    # On a GPU the CPU's bounds made GPT-2's loss over 8 x 1,024 tokens 393 narrow blocks.
    assert chunk_limits() is (GPU_LIMITS if jax.default_backend() == "gpu" else CPU_LIMITS)
    assert chunks_pay(8 * 1024, 50_304, 768, gradient=True, limits=CPU_LIMITS)
    assert not chunks_pay(8 * 1024, 50_304, 768, gradient=True, limits=GPU_LIMITS)
    assert not chunks_pay(16 * 1024, 50_304, 768, gradient=True, limits=GPU_LIMITS)
    assert chunks_pay(32 * 1024, 50_304, 768, gradient=True, limits=GPU_LIMITS)
    assert default_block(32 * 1024, 50_304, GPU_LIMITS) == 2048
    assert default_block(8 * 1024, 50_304, CPU_LIMITS) == 128


@eqx.filter_jit
def _loss_and_plain(model, batch):
    """`next_token_loss` and the plain loss in one program (one compile, not two): the same
    computation gives the same bits, the chunked one would not."""
    return next_token_loss(model, batch[:, :-1], batch[:, 1:]), _plain(model, batch)


def test_the_character_presets_keep_the_plain_loss_bit_for_bit():
    # The default run's numerics are the plain loss's: no chunking at a character vocabulary.
    for name in ("cpu", "cpu-adamw", "shakespeare-char"):
        preset = PRESETS[name]
        tokens = preset.train["batch_size"] * preset.model["context_length"]
        assert not chunks_pay(tokens, GPTConfig(vocab_size=65).padded_vocab_size), name
    # A character vocabulary of 11 (the training family's GPT's: 64 columns, as its embedding and
    # head, so their initialising programs serve here too).
    model = GPT(dataclasses.replace(BASE, vocab_size=11), key=jax.random.key(10))
    batch = _batch(11, config=model.config)
    loss, plain = _loss_and_plain(model, batch)
    assert float(loss) == float(plain)


def test_gpt2_sized_vocabularies_are_chunked_in_the_loss():
    cpu = CPU_LIMITS  # a CPU's bounds (on a GPU the suite runs too: gpu_check.sh)
    assert chunks_pay(48 * 64, 50_304, 128, gradient=True, limits=cpu)  # the default body's training step
    # GPT-2-124M's width: its evaluations are chunked, a fine-tuning step on 4 x 256 tokens is not
    # (the second pass would cost more than it saves), the gpt2-124m preset's 4 x 1,024 is.
    assert chunks_pay(4 * 256, 50_304, 768, limits=cpu) and not chunks_pay(
        4 * 256, 50_304, 768, gradient=True, limits=cpu
    )
    assert chunks_pay(4 * 1024, 50_304, 768, gradient=True, limits=cpu)
    # Tied, as GPT-2 is (one 20,032 x 32 weight to draw), and built by GPT's initialiser: drawn
    # weights (`_gpt`) give logits so small that a wrong chunked logit would hide in the rounding.
    config = dataclasses.replace(BASE, vocab_size=20_000, tie_embeddings=True)
    model = GPT(config, key=jax.random.key(12))
    batch = _batch(13, n=16, config=config)  # 256 tokens x 20,032 columns: past LOGITS_AT_ONCE
    assert chunks_pay(256, config.padded_vocab_size, limits=cpu)
    loss, plain = _loss_and_plain(model, batch)
    assert abs(float(loss) - float(plain)) < 1e-5 * float(loss)


def test_features_then_logits_is_the_call():
    model = drawn_gpt(CASES["tied"], 14)
    inputs = np.asarray(_batch(15, config=model.config))[:, :-1]
    # Both in one program (run op by op, each op would compile on its own): the same computation
    # gives the same bits; another (a call that is not features then logits) would not.
    both = eqx.filter_jit(lambda model, batch: (model.logits(model.features(batch)), model(batch)))
    assert np.array_equal(*both(model, inputs))


def test_bad_shapes_and_vocab_size_are_refused():
    # NumPy arrays: refused on their shapes before any computation (nothing to compile).
    head, features = np.zeros((4, 64), np.float32), np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="vocab_size must be in"):
        chunked_cross_entropy(features, head, np.zeros((2, 3), np.int32), vocab_size=65)
    with pytest.raises(ValueError, match="do not fit a head"):
        chunked_cross_entropy(features, head, np.zeros((2, 4), np.int32))
