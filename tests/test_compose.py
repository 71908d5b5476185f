"""The modules compose in another project's model: a small non-causal (encoder) classifier.

Only the public API is imported, the way a downstream Equinox project would use it.
"""

import equinox as eqx
import jax
import numpy as np
import optax
from train_family import FAMILY

from eqx_gpt import MLP, MultiHeadAttention, RMSNorm, sinusoidal_positions

pytestmark = FAMILY  # one process for the family: programs compiled once


class TinyEncoderClassifier(eqx.Module):
    embed: jax.Array
    norm1: RMSNorm
    attn: MultiHeadAttention
    norm2: RMSNorm
    mlp: MLP
    readout: jax.Array

    def __init__(self, vocab: int, d_model: int, n_classes: int, *, key):
        k_attn, k_mlp = jax.random.split(key)
        # The model's own arrays drawn by NumPy: `jax.random.normal` and the scaling compile a
        # program for every shape.
        rng = np.random.default_rng(0)
        self.embed = jax.device_put(0.5 * rng.standard_normal((vocab, d_model), np.float32))
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.attn = MultiHeadAttention(d_model, 2, key=k_attn, init_std=0.2)
        self.mlp = MLP(d_model, 2 * d_model, key=k_mlp, init_std=0.2)
        self.readout = jax.device_put(0.1 * rng.standard_normal((d_model, n_classes), np.float32))

    def __call__(self, tokens):
        x = self.embed[tokens] + sinusoidal_positions(tokens.shape[0], self.embed.shape[1])
        x = x + self.attn(self.norm1(x))  # no mask: every position sees every other
        x = x + self.mlp(self.norm2(x))
        return x.mean(0) @ self.readout


def make_data(seed, n=64, seq=8, vocab=6):
    # In NumPy: `jax.random.randint` and the label's operations would each compile a program.
    tokens = np.random.default_rng(seed).integers(0, vocab, (n, seq)).astype(np.int32)
    labels = np.any(tokens == 3, axis=1).astype(np.int32)  # needs to look at the whole sequence
    return jax.device_put(tokens), jax.device_put(labels)


def test_public_modules_train_and_round_trip_through_serialisation(tmp_path):
    model = TinyEncoderClassifier(6, 16, 2, key=jax.random.key(0))
    tokens, labels = make_data(1)
    optim = optax.adam(3e-2)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    def loss_fn(model, tokens, labels):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @eqx.filter_jit
    def step(model, opt_state, tokens, labels):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, labels)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(40):
        model, opt_state, loss = step(model, opt_state, tokens, labels)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses

    path = tmp_path / "encoder.eqx"
    eqx.tree_serialise_leaves(path, model)
    like = eqx.filter_eval_shape(TinyEncoderClassifier, 6, 16, 2, key=jax.random.key(9))
    restored = eqx.tree_deserialise_leaves(path, like)
    logits = eqx.filter_jit(lambda model, tokens: jax.vmap(model)(tokens))  # one program for both
    np.testing.assert_array_equal(logits(restored, tokens), logits(model, tokens))
