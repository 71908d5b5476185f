"""The gpt2-124m preset: GPT-2 small's shape and nanoGPT's AdamW recipe for it (resolved, not trained)."""

import math

import equinox as eqx
import jax

from eqx_gpt import GPT
from eqx_gpt.tokenizer import GPT2_VOCAB_SIZE
from eqx_gpt.training.options import resolve_options
from eqx_gpt.training.step import decay_mask, describe_optimizer, learning_rate


def test_gpt2_124m_unrolls_its_layers_on_a_gpu_only(monkeypatch):
    assert resolve_options({"preset": "gpt2-124m"}).model.scan_unroll == 1  # this suite runs on a CPU
    monkeypatch.setattr("eqx_gpt.training.options.on_gpu", lambda: True)
    assert resolve_options({"preset": "gpt2-124m"}).model.scan_unroll == 12
    assert resolve_options({"preset": "gpt2-124m", "scan_unroll": 2}).model.scan_unroll == 2  # a flag wins


def test_the_gpu_recipes_run_in_bfloat16_on_a_gpu_only(monkeypatch):
    gpu_recipes = ("shakespeare-char", "shakespeare-char-muon", "gpt2-124m")
    for preset in (*gpu_recipes, "cpu"):  # this suite runs on a CPU
        assert resolve_options({"preset": preset}).model.compute_dtype == "float32"
    monkeypatch.setattr("eqx_gpt.training.options.on_gpu", lambda: True)
    for preset in gpu_recipes:  # as nanoGPT's, whose `dtype` is bfloat16 where the GPU has it
        assert resolve_options({"preset": preset}).model.compute_dtype == "bfloat16"
        given = {"preset": preset, "compute_dtype": "float32"}
        assert resolve_options(given).model.compute_dtype == "float32"  # a flag wins
    assert resolve_options({"preset": "cpu"}).model.compute_dtype == "float32"


def test_gpt2_124m_resolves_to_gpt2_small_and_nanogpts_adamw():
    options = resolve_options({"preset": "gpt2-124m"})
    c = options.train
    assert c.tokenizer == "gpt2" and c.optimizer == "adamw"
    config = options.model.config(GPT2_VOCAB_SIZE)
    shape = (config.n_layers, config.n_heads, config.d_model, config.context_length, config.d_hidden)
    assert shape == (12, 12, 768, 1024, 3072)
    assert (config.positions, config.activation, config.norm) == ("learned", "gelu_tanh", "layer")
    assert config.bias and config.tie_embeddings and config.dropout == 0.0
    model = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    # GPT-2 small's 124,439,808 parameters, plus the 47 padding rows of the tied embedding.
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(model) if hasattr(x, "shape"))
    assert n_params == 124_439_808 + 47 * 768
    assert (c.lr, c.min_lr, c.warmup_steps, c.schedule) == (6e-4, 6e-5, 2_000, "cosine")
    assert (c.beta1, c.beta2, c.weight_decay, c.grad_clip) == (0.9, 0.95, 0.1, 1.0)
    assert learning_rate(2_000, c, c.max_steps) == 6e-4 and learning_rate(c.max_steps, c, c.max_steps) == 6e-5
    # Weight decay on the matrices and the (tied) embedding, not on biases and LayerNorms.
    mask = decay_mask(model)
    assert mask.embed and not mask.blocks.layers.attn.qkv.bias and not mask.final_norm.scale
    assert describe_optimizer(c, c.max_steps).startswith("AdamW, lr warm-up 0 -> 0.0006 over 2000 steps")
