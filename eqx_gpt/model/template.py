"""The model a config describes, as shapes only: what a checkpoint's or a GPT-2 folder's arrays
are read into (`eqx.tree_deserialise_leaves`, `eqx.tree_at`)."""

from typing import overload

import equinox as eqx
import jax

from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.transformer import Transformer, TransformerConfig


@overload
def model_template(config: GPTConfig) -> GPT: ...
@overload
def model_template(config: TransformerConfig) -> Transformer: ...
def model_template(config: GPTConfig | TransformerConfig) -> GPT | Transformer:
    """The `GPT` (or `Transformer`) of `config` with arrays that are shapes only (no memory, no
    compute)."""
    if not isinstance(config, GPTConfig | TransformerConfig):
        raise TypeError(
            f"model_template takes a GPTConfig or a TransformerConfig, got {type(config).__name__}"
        )
    model_class = GPT if isinstance(config, GPTConfig) else Transformer
    return eqx.filter_eval_shape(model_class, config, key=jax.random.key(0))
