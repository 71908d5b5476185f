"""What the generation family of test files shares (test_generate, test_sampling, test_own_decoder,
test_own_model, test_toolkit, test_gpt2, test_evaluate, one xdist group: `GROUP`): models built
once per process, and one jitted forward pass.

The tests' time is JAX compiling, one program per function and shapes. A model of the same shapes
as another's compiles nothing new, so where a test's assertion does not depend on a model's size it
uses these; an eager call of a layer-scanned model compiles its scan afresh every time, where
`forward` compiles once per model structure and argument shapes."""

import dataclasses
import functools

import equinox as eqx
import jax
from jaxtyping import Array, Int

from eqx_gpt import GPT, GPTConfig, Transformer, TransformerConfig
from eqx_gpt.model.transformer import BoundDecoder

GROUP = "gen"  # the xdist group of every file of the family: one process, one set of caches

GPT_CONFIG = GPTConfig(vocab_size=65, context_length=16, d_model=32, n_heads=4, n_layers=2)
TRANSFORMER_CONFIG = TransformerConfig(src_vocab_size=13, tgt_vocab_size=9, max_len=12, d_model=32, n_heads=4)


@functools.cache
def gpt(seed: int = 0) -> GPT:
    """A character-sized GPT of `GPT_CONFIG`, random weights from `seed`."""
    return GPT(GPT_CONFIG, key=jax.random.key(seed))


@functools.cache
def transformer(seed: int = 0, norm_position: str = "post") -> Transformer:
    """An encoder-decoder of `TRANSFORMER_CONFIG` (post-norm by default, as its config's)."""
    config = dataclasses.replace(TRANSFORMER_CONFIG, norm_position=norm_position)
    return Transformer(config, key=jax.random.key(seed))


@eqx.filter_jit
def forward(model, *args, **kwargs):
    """`model(*args, **kwargs)`, jitted: one program per model structure and argument shapes."""
    return model(*args, **kwargs)


@eqx.filter_jit
def bind(model: Transformer, src: Int[Array, "batch src_seq"]) -> BoundDecoder:
    """`model.bind(src)`, jitted: the encoder runs in one program, not primitive by primitive."""
    return model.bind(src)
