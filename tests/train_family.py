"""What the training family's test files share: they run in one xdist group (`FAMILY`), so one
process, and a program compiled here for one of them serves every other.

A model called op by op (eagerly) compiles its layer scan afresh on every call (its body is a new
closure each time); called through `compiled.forward` (tests/compiled.py), a model of one structure
and input shape compiles once for the whole family.
"""

import functools

import equinox as eqx
import jax
import optax
import pytest

from eqx_gpt import GPTConfig
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.step import make_optimizer, make_train_step, make_train_steps

FAMILY = pytest.mark.xdist_group("train")  # the files' `pytestmark`

# The family's small GPT, for tests whose assertions do not depend on its size: one set of weight
# shapes, so one set of initialising programs (and steps, and forwards) for all of them.
CONFIG = GPTConfig(vocab_size=11, context_length=16, d_model=32, n_heads=2, n_layers=2)


# Muon at the speedrun's rates, no weight decay: what the files' Muon steps train with. Clipped to
# 0.01, far below the gradient's norm (test_training.py reads the norm before clipping from these
# steps), which changes the update hardly at all: Newton-Schulz divides each matrix's scale out, and
# Adam the AdamW group's.
MUON = TrainConfig(
    batch_size=8, optimizer="muon", lr=0.02, min_lr=0.002, adam_lr=3e-3, weight_decay=0.0, grad_clip=0.01,
    warmup_steps=0,
)  # fmt: skip


@functools.cache
def optimizer_of(config: TrainConfig) -> optax.GradientTransformation:
    """`make_optimizer(config)`, built once per process: its compiled `update` is shared."""
    return make_optimizer(config)


@functools.cache
def train_step(config: TrainConfig, *, dropout: bool):
    """`make_train_step` for `config` (and its optimiser), built once per process, so that every
    test stepping alike shares one compiled step."""
    return make_train_step(optimizer_of(config), config, dropout=dropout)


@functools.cache
def train_steps(config: TrainConfig, *, dropout: bool):
    """`make_train_steps` for `config` (and its optimiser), built once per process: one compiled
    program for every test stepping alike, several steps per call."""
    return make_train_steps(optimizer_of(config), config, dropout=dropout)


@eqx.filter_jit
def update(optimizer: optax.GradientTransformation, grads, state, params):
    """`optimizer.update(grads, state, params)` compiled whole (one program per optimiser and
    tree): run op by op, Muon's Newton-Schulz loops compile afresh on every call."""
    return optimizer.update(grads, state, params)


@eqx.filter_jit
def loss_logits_and_grads(model, tokens):
    """`((loss, logits), grads)` of `model` on `tokens` `(batch, seq + 1)`: the mean next-token
    cross-entropy (optax's, of the logits), the logits `(batch, seq, vocab)` and the loss's gradient
    in the model, as one program per model structure and shape (test_training.py's and
    test_mixed_precision.py's float32 GPT on `(8, 17)` tokens share one)."""

    def loss(model):
        logits = jax.vmap(model)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits

    return eqx.filter_value_and_grad(loss, has_aux=True)(model)
