"""What the model wing's test files share (test_gpt, test_gpt_options, test_inference_mode,
test_modules, test_embedding, test_bad_values, test_bad_input, test_linear, test_checkpoint): one
process (the xdist group `FAMILY`), models built once per config, and one compiled program per
model structure and input shape for a forward pass or a cached decode step.

Why: the suite's time is XLA compiling. Run eagerly, every call of a layer-scanned model compiles
its scan again (the scan's body is a new closure each call) and every operation is a program of its
own; `jax.jit(lambda ...)` inside a test makes a new cache per test. The functions here are built
once, so a program compiled for one test serves every test, in every file of the family, that
calls it with a model of the same structure and inputs of the same shapes.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_gpt import GPT, GPTConfig, Transformer, TransformerConfig

FAMILY = "model"
in_family = pytest.mark.xdist_group(FAMILY)  # each file's `pytestmark`: one process for them all

# The family's configs: a test whose assertion does not depend on the sizes takes one of these, so
# its models' shapes, and their programs, repeat across tests and files.
SMALL_GPT = GPTConfig(vocab_size=65, context_length=16, d_model=32, n_heads=4, n_layers=2)
TINY_GPT = GPTConfig(vocab_size=9, context_length=8, d_model=16, n_heads=2, n_layers=2)
TINY_TRANSFORMER = TransformerConfig(src_vocab_size=9, tgt_vocab_size=9, max_len=8, d_model=16, n_heads=2)


def token_ids(seed: int, shape: tuple[int, ...], vocab_size: int) -> jax.Array:
    """Random token ids `shape` in `[0, vocab_size)` (int32), drawn by NumPy: `jax.random.randint`
    compiles a program for every shape it draws."""
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab_size, shape), jnp.int32)


@functools.cache
def gpt(config: GPTConfig, seed: int = 0) -> GPT:
    """`GPT(config, key=jax.random.key(seed))`, built once per process (models are immutable). A test
    that trains builds its own: a training step donates the model's arrays."""
    return GPT(config, key=jax.random.key(seed))


@functools.cache
def transformer(config: TransformerConfig, seed: int = 0) -> Transformer:
    """`Transformer(config, key=jax.random.key(seed))`, built once per process."""
    return Transformer(config, key=jax.random.key(seed))


@eqx.filter_jit
def call(module, *inputs, key=None, inference=None):
    """`module(*inputs, key=key, inference=inference)` as one compiled program (a model's logits, a
    module's output): compiled once per module structure, input shapes and whether there is a key."""
    return module(*inputs, key=key, inference=inference)


@eqx.filter_jit
def _decode(model, tokens, cache, start):
    return model.decode(tokens, cache, start)


def decode(model, tokens, cache, start: int):
    """`model.decode(tokens, cache, start)` compiled once per shape: `start` is passed as an array, so
    every position shares the program (the range check of a concrete `start` is then not made; the
    tests of that check call `model.decode` itself)."""
    return _decode(model, tokens, cache, jnp.int32(start))


@eqx.filter_jit
def vmapped(model, tokens, keys=None):
    """`jax.vmap` of `model` over the rows of `tokens` (and of `keys`, one per row) in one program."""
    if keys is None:
        return jax.vmap(model)(tokens)
    return jax.vmap(lambda t, k: model(t, key=k))(tokens, keys)
