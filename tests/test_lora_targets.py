"""LoRA on any model: `apply_lora` finds its targets by type, by name (a path's end, PEFT's rule),
by regex or by predicate; keeps the model's type; refuses in one line what it cannot adapt."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import forward, normal_weights
from jaxtyping import Array, Float, Int
from train_family import CONFIG, FAMILY

from eqx_gpt import (
    GPT,
    Block,
    ConfigError,
    Linear,
    LoRALinear,
    RMSNorm,
    Transformer,
    TransformerConfig,
    apply_lora,
    causal_mask,
    lora_trainable,
    merge_lora,
)

pytestmark = FAMILY  # one process for the family: programs compiled once


class SmallDecoder(eqx.Module):
    """Two RoPE + SwiGLU blocks in a tuple and a head `Linear`: paths `blocks.0.attn.qkv`, ..., `head`."""

    embed: Float[Array, "vocab d"]
    blocks: tuple[Block, ...]
    norm: RMSNorm
    head: Linear

    def __init__(self, vocab: int, d: int, *, key):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = jax.random.normal(k_embed, (vocab, d))
        keys = jax.random.split(k_blocks, 2)
        self.blocks = tuple(Block(d, 2, 2 * d, key=k, rope=True, activation="swiglu") for k in keys)
        self.norm = RMSNorm(d)
        self.head = Linear(d, vocab, key=k_head)

    def __call__(self, tokens: Int[Array, " seq"], *, key=None) -> Float[Array, "seq vocab"]:
        x = self.embed[tokens]
        for block in self.blocks:
            x = block(x, mask=causal_mask(tokens.shape[0]))
        return self.head(self.norm(x), key=key)


PROJECTIONS = ("attn.qkv", "attn.out", "mlp.up", "mlp.down")
ALL = [f"blocks.{i}.{p}" for i in range(2) for p in PROJECTIONS] + ["head"]
TOKENS = jax.device_put(np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32))  # jnp.array compiles a conversion


def _model() -> SmallDecoder:
    # Built by its initialiser only as a skeleton, its weights drawn by NumPy (`normal_weights`): run, the
    # initialiser compiles a program per weight shape, and what is checked holds for any weights.
    return normal_weights(eqx.filter_eval_shape(SmallDecoder, 16, 8, key=jax.random.key(0)))


def _adapted_paths(model) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda n: isinstance(n, Linear))
    return [jax.tree_util.keystr(p, simple=True, separator=".") for p, n in flat if isinstance(n, LoRALinear)]


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (None, ALL),  # every Linear of a model that is not a GPT
        (Linear, ALL),
        ("qkv", ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]),
        (
            "attn.out, mlp.up",
            ["blocks.0.attn.out", "blocks.0.mlp.up", "blocks.1.attn.out", "blocks.1.mlp.up"],
        ),
        (["head"], ["head"]),
        ("c_attn", ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]),  # PEFT's GPT-2 name stands for attn.qkv
        ("c_proj", ["blocks.0.attn.out", "blocks.0.mlp.down", "blocks.1.attn.out", "blocks.1.mlp.down"]),
        (re.compile(r"blocks\.1\..*"), [f"blocks.1.{p}" for p in PROJECTIONS]),
        (lambda path, linear: linear.out_features == 16, ["head"]),
    ],
)
def test_targets_by_type_name_regex_or_predicate_on_a_model_of_ones_own(targets, expected):
    base = _model()
    model = apply_lora(base, 2, targets=targets, key=jax.random.key(1))
    assert type(model) is SmallDecoder  # the model's type, kept
    assert _adapted_paths(model) == expected
    # B starts at zero: the adapted model computes what the base did.
    np.testing.assert_allclose(model(TOKENS), base(TOKENS), rtol=1e-6, atol=1e-6)
    n_trainable = sum(x.size for x in jax.tree.leaves(eqx.filter(model, lora_trainable(model))))
    assert n_trainable == sum(2 * (m.in_features + m.out_features) for m in _linears(base, expected))


def _linears(model, paths):
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda n: isinstance(n, Linear))
    found = {jax.tree_util.keystr(p, simple=True, separator="."): n for p, n in flat}
    return [found[p] for p in paths]


def test_the_adapters_train_and_merge_back_to_the_models_type():
    model = apply_lora(_model(), 2, alpha=4.0, key=jax.random.key(1))
    bs = lambda m: [n.lora_b for n in jax.tree.leaves(m, is_leaf=lambda n: isinstance(n, LoRALinear))
                    if isinstance(n, LoRALinear)]  # fmt: skip
    model = eqx.tree_at(bs, model, [jax.device_put(np.full(b.shape, 0.1, np.float32)) for b in bs(model)])
    merged = merge_lora(model)
    assert type(merged) is SmallDecoder and not _adapted_paths(merged)
    np.testing.assert_allclose(merged(TOKENS), model(TOKENS), atol=2e-5)


def test_a_gpt_keeps_pefts_default_and_a_transformer_adapts_every_linear():
    # Which paths are adapted is the structure's alone: traced (`filter_eval_shape`), nothing compiled.
    gpt = eqx.filter_eval_shape(GPT, CONFIG, key=jax.random.key(0))
    adapted_gpt = eqx.filter_eval_shape(apply_lora, gpt, 2, key=jax.random.key(1))
    assert _adapted_paths(adapted_gpt) == ["blocks.layers.attn.qkv"]
    t_config = TransformerConfig(src_vocab_size=12, tgt_vocab_size=14, max_len=8, d_model=16, n_heads=2,
                               n_encoder_layers=1, n_decoder_layers=1)  # fmt: skip
    # Its weights drawn by NumPy (`normal_weights`): built by its initialiser, a Transformer compiles about
    # 25 programs (a random draw per weight shape, its layer stacks' slicing), and any weights do.
    base = normal_weights(eqx.filter_eval_shape(Transformer, t_config, key=jax.random.key(0)))
    model = apply_lora(base, 2, key=jax.random.key(1))
    assert type(model) is Transformer
    adapted = _adapted_paths(model)
    assert any("cross_attn" in p for p in adapted) and len(adapted) == len(_linears_of(base))
    src, tgt = (jax.device_put(np.array(t, np.int32)) for t in ([1, 2, 3, 4], [1, 5, 6]))
    # Each call compiled whole: op by op, a Transformer's call is dozens of programs (its scans too).
    np.testing.assert_allclose(forward(model, src, tgt), forward(base, src, tgt), rtol=1e-6, atol=1e-6)


def _linears_of(model) -> list:
    return [
        n for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, Linear)) if isinstance(n, Linear)
    ]


class NoLinears(eqx.Module):
    weight: Array


class TorchStyle(eqx.Module):
    proj: eqx.nn.Linear


@pytest.mark.parametrize(
    ("make_model", "targets", "message"),
    [
        (lambda: NoLinears(jnp.ones(3)), None, "the NoLinears holds no eqx_gpt.Linear to adapt"),
        (lambda: TorchStyle(eqx.nn.Linear(2, 2, key=jax.random.key(0))), None,
         "its eqx.nn.Linear (proj) are not: build them as eqx_gpt.Linear"),
        (_model, "qkv,wte", "unknown LoRA target 'wte': no Linear of the SmallDecoder has that name"),
        (_model, [], "LoRA targets must name at least one module, got []"),
        (_model, "qkv,", "LoRA targets must name at least one module"),
        (_model, re.compile("nothing"), "choose none of the SmallDecoder's Linears (blocks.0.attn.qkv"),
        (lambda: apply_lora(_model(), 2, key=jax.random.key(1)), None,
         "already holds LoRA adapters (at blocks.0.attn.qkv); adapt the base, or merge_lora"),
    ],
)  # fmt: skip
def test_what_cannot_be_adapted_is_one_line(make_model, targets, message):
    model = make_model()  # built when the test runs, not when every process collects the tests
    with pytest.raises(ConfigError) as info:
        apply_lora(model, 2, targets=targets, key=jax.random.key(1))
    assert message in str(info.value) and "\n" not in str(info.value)
    assert "''" not in str(info.value)  # an empty target list does not name an unknown target ''


def test_a_rank_wider_than_a_target_is_refused():
    with pytest.raises(ConfigError, match="lora_rank 9 is larger than the model's width 8"):
        apply_lora(_model(), 9, targets="qkv", key=jax.random.key(1))
