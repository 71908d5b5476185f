"""eqx_gpt: a small, typed decoder-only GPT in JAX + Equinox.

Every module is an `eqx.Module` acting on one example or on a whole batch passed at once, with
jaxtyping shape annotations checked by beartype when JAX traces the call.
"""

from eqx_gpt.attention import (
    KVCache,
    MultiHeadAttention,
    attention_weights,
    causal_mask,
    head_attention,
    multi_head_attention,
    padding_mask,
)
from eqx_gpt.block import Block
from eqx_gpt.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, load_model, save_checkpoint
from eqx_gpt.config import GPTConfig
from eqx_gpt.dropout import dropout
from eqx_gpt.evaluate import Evaluation, evaluate, evaluate_text
from eqx_gpt.generate import generate, generate_batch, naive_generate, stream_batch, stream_text
from eqx_gpt.gpt import GPT
from eqx_gpt.mlp import MLP
from eqx_gpt.norm import LayerNorm, RMSNorm
from eqx_gpt.positions import rotary_embedding, sinusoidal_positions
from eqx_gpt.sampling import SamplingOptions, sample_next_token, top_k_filter, top_p_filter
from eqx_gpt.stack import LayerStack
from eqx_gpt.tokenizer import CharTokenizer, GPT2Tokenizer, TokenizerError, tokenizer_from_dict
from eqx_gpt.transformer import Transformer, TransformerConfig, translate
from eqx_gpt.vocab import pad_vocab

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
    "naive_generate",
    "stream_batch",
    "stream_text",
    "SamplingOptions",
    "sample_next_token",
    "top_k_filter",
    "top_p_filter",
]
