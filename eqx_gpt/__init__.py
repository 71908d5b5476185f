"""eqx_gpt: a small, typed decoder-only GPT in JAX + Equinox.

Every module is an `eqx.Module` acting on one example or on a whole batch passed at once, with
jaxtyping shape annotations checked by beartype when JAX traces the call.
"""

from eqx_gpt.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, load_model, save_checkpoint
from eqx_gpt.generation.generate import generate, generate_batch, stream_batch, stream_text
from eqx_gpt.generation.sampling import SamplingOptions, sample_next_token, top_k_filter, top_p_filter
from eqx_gpt.generation.translate import translate
from eqx_gpt.model.attention import (
    KVCache,
    MultiHeadAttention,
    attention_weights,
    causal_mask,
    head_attention,
    multi_head_attention,
    padding_mask,
)
from eqx_gpt.model.block import Block
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.dropout import dropout
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.mlp import MLP
from eqx_gpt.model.norm import LayerNorm, RMSNorm
from eqx_gpt.model.positions import rotary_embedding, sinusoidal_positions
from eqx_gpt.model.stack import LayerStack
from eqx_gpt.model.transformer import Transformer, TransformerConfig
from eqx_gpt.model.vocab import pad_vocab
from eqx_gpt.tokenizer import CharTokenizer, GPT2Tokenizer, TokenizerError, tokenizer_from_dict
from eqx_gpt.training.evaluate import Evaluation, evaluate, evaluate_text

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CharTokenizer",
    "CheckpointError",
    "GPT2Tokenizer",
    "TokenizerError",
    "find_checkpoint",
    "load_checkpoint",
    "load_model",
    "save_checkpoint",
    "tokenizer_from_dict",
    "GPTConfig",
    "KVCache",
    "MultiHeadAttention",
    "RMSNorm",
    "LayerNorm",
    "LayerStack",
    "Transformer",
    "TransformerConfig",
    "translate",
    "padding_mask",
    "head_attention",
    "multi_head_attention",
    "attention_weights",
    "causal_mask",
    "dropout",
    "Evaluation",
    "evaluate",
    "evaluate_text",
    "pad_vocab",
    "sinusoidal_positions",
    "rotary_embedding",
    "generate",
    "generate_batch",
    "stream_batch",
    "stream_text",
    "SamplingOptions",
    "sample_next_token",
    "top_k_filter",
    "top_p_filter",
]
