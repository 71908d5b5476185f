"""What the generation family of test files shares (test_generate, test_sampling, test_own_decoder,
test_own_model, test_toolkit, test_gpt2, test_evaluate, one xdist group: `GROUP`): its GPT and
encoder-decoder, built once per process by tests/compiled.py (whose `forward` the files call), and
the encoder run in one program. Where a test's assertion does not depend on a model's size it uses
these, so the shapes, and the programs, repeat."""

import dataclasses

import compiled
import equinox as eqx
from jaxtyping import Array, Int

from eqx_gpt import GPT, GPTConfig, Transformer, TransformerConfig
from eqx_gpt.model.transformer import BoundDecoder

GROUP = "gen"  # the xdist group of every file of the family: one process, one set of caches

GPT_CONFIG = GPTConfig(vocab_size=65, context_length=16, d_model=32, n_heads=4, n_layers=2)
TRANSFORMER_CONFIG = TransformerConfig(src_vocab_size=13, tgt_vocab_size=9, max_len=12, d_model=32, n_heads=4)


def gpt(seed: int = 0) -> GPT:
    """A character-sized GPT of `GPT_CONFIG`, random weights from `seed` (built once per process)."""
    return compiled.gpt(GPT_CONFIG, seed)


def transformer(seed: int = 0, norm_position: str = "post") -> Transformer:
    """An encoder-decoder of `TRANSFORMER_CONFIG` (post-norm by default, as its config's)."""
    return compiled.transformer(dataclasses.replace(TRANSFORMER_CONFIG, norm_position=norm_position), seed)


@eqx.filter_jit
def bind(model: Transformer, src: Int[Array, "batch src_seq"]) -> BoundDecoder:
    """`model.bind(src)`, jitted: the encoder runs in one program, not primitive by primitive."""
    return model.bind(src)
