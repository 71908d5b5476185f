"""eqx_gpt: a small, typed decoder-only GPT in JAX + Equinox.

Every module is an `eqx.Module` acting on one example or on a whole batch passed at once, with
jaxtyping shape annotations checked by beartype when JAX traces the call. Every public name is
importable from here (module paths are not API); `__all__` lists them by what they are for.
"""

from eqx_gpt.checkpoint import (
    delete_checkpoints,
    find_checkpoint,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from eqx_gpt.data.prepare import Corpus, prepare
from eqx_gpt.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    EqxGptError,
    GPT2FormatError,
    TokenizerError,
    TrainingError,
)
from eqx_gpt.evaluation import Evaluation, evaluate, evaluate_text
from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.generate import generate, generate_batch, stream_batch, stream_text
from eqx_gpt.generation.sampling import SamplingOptions, sample_next_token, top_k_filter, top_p_filter
from eqx_gpt.generation.translate import translate
from eqx_gpt.gpt2 import load_gpt2, save_gpt2
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
from eqx_gpt.model.language_model import LanguageModel
from eqx_gpt.model.linear import Linear
from eqx_gpt.model.lora import LoRALinear, apply_lora, lora_trainable, merge_lora
from eqx_gpt.model.loss import chunked_cross_entropy
from eqx_gpt.model.mlp import MLP
from eqx_gpt.model.multi_lora import MultiLoRALinear, choose_adapter, stack_adapters
from eqx_gpt.model.norm import LayerNorm, RMSNorm
from eqx_gpt.model.positions import rotary_embedding, sinusoidal_positions
from eqx_gpt.model.stack import LayerStack
from eqx_gpt.model.transformer import Transformer, TransformerConfig
from eqx_gpt.model.vocab import pad_vocab
from eqx_gpt.peft import load_adapters, save_adapters
from eqx_gpt.serve import Batcher, create_app
from eqx_gpt.tokenizer import CharTokenizer, GPT2Tokenizer, tokenizer_from_dict
from eqx_gpt.training.callbacks import Callback, EarlyStopping, RunView, SampleText, StopTraining, every
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.presets import PRESETS
from eqx_gpt.training.records import EvaluationRecord, FinalRecord, StepRecord, TrainResult
from eqx_gpt.training.run import train
from eqx_gpt.training.step import (
    init_optimizer_state,
    learning_rate,
    loss_fn,
    make_optimizer,
    make_train_step,
    make_train_steps,
)
from eqx_gpt.training.trackers import TensorBoardTracker, WandbTracker

__all__ = [
    # Models and their modules
    "GPT",
    "GPTConfig",
    "Transformer",
    "TransformerConfig",
    "Block",
    "LayerStack",
    "MultiHeadAttention",
    "KVCache",
    "Linear",
    "MLP",
    "LayerNorm",
    "RMSNorm",
    "attention_weights",
    "causal_mask",
    "head_attention",
    "multi_head_attention",
    "padding_mask",
    "dropout",
    "pad_vocab",
    "rotary_embedding",
    "sinusoidal_positions",
    # Tokenizers
    "CharTokenizer",
    "GPT2Tokenizer",
    "tokenizer_from_dict",
    # Generation: from a GPT or any model that follows the Decoder protocol
    "Decoder",
    "generate",
    "generate_batch",
    "stream_batch",
    "stream_text",
    "translate",
    "SamplingOptions",
    "sample_next_token",
    "top_k_filter",
    "top_p_filter",
    # LoRA: low-rank adapters on a frozen model, and PEFT's adapter folders
    "LoRALinear",
    "apply_lora",
    "merge_lora",
    "lora_trainable",
    "load_adapters",
    "MultiLoRALinear",
    "stack_adapters",
    "choose_adapter",
    "save_adapters",
    # Training: a whole run (of a GPT or any LanguageModel), and the parts of a loop of your own
    "LanguageModel",
    "train",
    "TrainConfig",
    "TrainResult",
    "PRESETS",
    "Callback",
    "RunView",
    "every",
    "StopTraining",
    "EarlyStopping",
    "SampleText",
    "TensorBoardTracker",
    "WandbTracker",
    "StepRecord",
    "EvaluationRecord",
    "FinalRecord",
    "make_optimizer",
    "init_optimizer_state",
    "make_train_step",
    "make_train_steps",
    "loss_fn",
    "chunked_cross_entropy",
    "learning_rate",
    # Evaluation
    "evaluate",
    "evaluate_text",
    "Evaluation",
    # Checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "load_model",
    "find_checkpoint",
    "delete_checkpoints",
    # Serving (`eqx-gpt serve`): the OpenAI-compatible app (needs the `serve` extra) and its batcher
    "create_app",
    "Batcher",
    # Hugging Face GPT-2 folders
    "load_gpt2",
    "save_gpt2",
    # Corpus preparation
    "prepare",
    "Corpus",
    # Errors: every eqx_gpt exception derives from EqxGptError (a ValueError)
    "EqxGptError",
    "ConfigError",
    "TokenizerError",
    "DataError",
    "CheckpointError",
    "GPT2FormatError",
    "TrainingError",
]
