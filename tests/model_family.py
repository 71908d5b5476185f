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


@eqx.filter_jit
def outputs_by_mode(module, inputs: tuple, key) -> dict:
    """`module(*inputs)` in each mode and per-call override, by name, the keyed calls with `key`: one
    compiled program per module structure and shapes. As separate programs, each mode and override
    compiles the whole module again; in one, XLA compiles the calls that compute the same thing (the
    deterministic ones; the dropping ones with the same key) once. Calls that differ stay apart, so
    a mode that changed what a call computes still shows in its values."""
    inference = eqx.nn.inference_mode(module)
    training = eqx.nn.inference_mode(inference, False)  # switched back: the same flags as built?
    return {
        "inference": inference(*inputs),
        "inference, key": inference(*inputs, key=key),
        "training, key": training(*inputs, key=key),
        "as built, key": module(*inputs, key=key),
        "as built, key, inference=True": module(*inputs, key=key, inference=True),
        "as built, inference=True": module(*inputs, inference=True),
        "inference, key, inference=False": inference(*inputs, key=key, inference=False),
    }
