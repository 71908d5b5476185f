"""Attention weights recorded while a model decodes, for any `Decoder` built of eqx_gpt's attention.

The attention layers are found by type: `recording(model)` swaps every eqx_gpt `MultiHeadAttention`
for a `RecordingAttention` (the same weights) whose `decode` also records the weights it attends
with (`MultiHeadAttention.decode_weights`) into the cache it returns (`RecordedCache`). So the
layers are the recorded caches in the order of the cache the model hands back, whether its layers
run in a Python loop or a `scan`, and nothing of the model's own code changes. The page's
`/v1/inspect` reads them from one prefill (`recorded`); the server's batcher from each prefill and
decode step of a request that asks for them (`take_recorded`: one query row, the chosen layers and
heads, and the cache in its own form again, which the batcher carries to the next step).

A layer and head are one row of `(layers * heads, capacity)`: row `layer * heads + head`.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from eqx_gpt.model.attention import KVCache, MultiHeadAttention


class RecordedCache(KVCache):
    """A `KVCache` that also carries the attention weights of the `decode` that wrote it:
    `(*lead, heads, new, capacity)` (`new` 1 where one query row was kept)."""

    weights: Float[Array, "*lead heads new capacity"]


class RecordingAttention(MultiHeadAttention):
    """A `MultiHeadAttention` (the same weights) whose `decode` returns a `RecordedCache`: the
    weights of every new position, or of the one at index `row` among them (None: all)."""

    row: Int[Array, ""] | None

    def __init__(self, attention: MultiHeadAttention, row: Int[Array, ""] | None = None):
        for f in dataclasses.fields(attention):
            setattr(self, f.name, getattr(attention, f.name))
        self.row = row

    def decode(self, x, cache, start):
        out, updated = super().decode(x, cache, start)
        weights = self.decode_weights(x, cache, start)
        if self.row is not None:  # one query row: a prompt's last, not the prompt x capacity of them
            weights = jax.lax.dynamic_slice_in_dim(weights, self.row, 1, axis=-2)
        return out, RecordedCache(updated.k, updated.v, weights)


def _is_attention(node) -> bool:
    return isinstance(node, MultiHeadAttention)


def attention_layers(model) -> list[MultiHeadAttention]:
    """Every eqx_gpt `MultiHeadAttention` in `model`, in the order of its leaves."""
    return [n for n in jax.tree.leaves(model, is_leaf=_is_attention) if _is_attention(n)]


def recording(model, row: Int[Array, ""] | None = None):
    """`model` with every `MultiHeadAttention` recording its decoding weights (found by type): of
    every new position, or of the one at index `row` (a traced scalar is fine)."""
    found = attention_layers(model)
    if not found:
        return model
    return eqx.tree_at(attention_layers, model, [RecordingAttention(a, row) for a in found])


def _is_recorded(node) -> bool:
    return isinstance(node, RecordedCache)


def recorded(cache: PyTree) -> list[Float[Array, "layers heads new capacity"]]:
    """The weights of every `RecordedCache` in `cache`, in its order, each `(layers, heads, new,
    capacity)` (a stacked cache's layer axis kept, one row's batch axis dropped)."""
    found = [leaf.weights for leaf in jax.tree.leaves(cache, is_leaf=_is_recorded) if _is_recorded(leaf)]
    return [w.reshape(-1, *w.shape[-3:]) for w in found]


def take_recorded(cache: PyTree, rows: Int[Array, " pairs"]) -> tuple[Float[Array, "pairs capacity"], PyTree]:
    """The weights of the last query recorded in `cache` (one sequence's, or a batch of one's) for
    `rows` (`layer * heads + head` each), and `cache` as the model's own again (every
    `RecordedCache` a plain `KVCache`)."""
    weights = jnp.concatenate(recorded(cache))  # (layers, heads, new, capacity)
    flat = weights[:, :, -1].reshape(-1, weights.shape[-1])
    plain = lambda n: KVCache(n.k, n.v) if _is_recorded(n) else n
    return flat[rows], jax.tree.map(plain, cache, is_leaf=_is_recorded)
