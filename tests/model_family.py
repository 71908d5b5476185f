"""What the model wing's test files share (test_gpt, test_gpt_options, test_inference_mode,
test_modules, test_embedding, test_bad_values, test_bad_input, test_linear, test_checkpoint): one
process (the xdist group `FAMILY`), the family's configs, and a cached decode step and a batched
forward pass compiled once per model structure and input shape. Models and the plain forward pass
come from tests/compiled.py, which says why."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from eqx_gpt import GPTConfig, TransformerConfig

FAMILY = "model"
in_family = pytest.mark.xdist_group(FAMILY)  # each file's `pytestmark`: one process for them all

# The family's configs: a test whose assertion does not depend on the sizes takes one of these, so
# its models' shapes, and their programs, repeat across tests and files.
SMALL_GPT = GPTConfig(vocab_size=65, context_length=16, d_model=32, n_heads=4, n_layers=2)
TINY_GPT = GPTConfig(vocab_size=9, context_length=8, d_model=16, n_heads=2, n_layers=2)
TINY_TRANSFORMER = TransformerConfig(src_vocab_size=9, tgt_vocab_size=9, max_len=8, d_model=16, n_heads=2)


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
