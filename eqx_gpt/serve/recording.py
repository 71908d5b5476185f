"""What a model computes on the way to its logits, recorded during one prefill: the attention
weights of every eqx_gpt `MultiHeadAttention` and the residual stream after every block.

Both are found by type, for a `GPT` or a decoder of your own:
- an **attention layer** is an eqx_gpt `MultiHeadAttention` anywhere in the model;
- a **block** is a module with a `decode` method that holds a `MultiHeadAttention` as one of its
  own fields (eqx_gpt's `Block`, or a block of your own built around one), other than the model.

`recording(model)` swaps each for a copy that records what its `decode` computes into the cache it
hands back (`RecordedCache`, a `KVCache` with the attention `weights` and the block's output
`hidden`), so the records come out as the model's own cache does, whether its layers run in a
Python loop or a `scan` (a stacked cache's layer axis kept). A model whose `decode` does not hand
back the caches its layers return records nothing, and the page says so.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.model.attention import KVCache, MultiHeadAttention


class RecordedCache(KVCache):
    """A `KVCache` that also carries what the `decode` that wrote it computed: the attention
    weights `(*lead, heads, new, capacity)` and a block's output `(*lead, new, d_model)` (None
    where not recorded)."""

    weights: Float[Array, "*lead heads new capacity"] | None = None
    hidden: Float[Array, "*lead new d_model"] | None = None


class RecordingAttention(MultiHeadAttention):
    """A `MultiHeadAttention` (the same weights) whose `decode` returns a `RecordedCache`."""

    def __init__(self, attention: MultiHeadAttention):
        for f in dataclasses.fields(attention):
            setattr(self, f.name, getattr(attention, f.name))

    def decode(self, x, cache, start):
        out, updated = super().decode(x, cache, start)
        return out, RecordedCache(updated.k, updated.v, self.decode_weights(x, cache, start))


class RecordingBlock(eqx.Module):
    """A block whose `decode` also records its output (the residual stream after it) in the
    `RecordedCache` it hands back; its other attributes are the block's."""

    block: Any

    def decode(self, x, cache, start, *args, **kwargs):
        out, updated = self.block.decode(x, cache, start, *args, **kwargs)
        if not isinstance(updated, KVCache):
            raise TypeError(
                f"{type(self.block).__name__}.decode hands back a {type(updated).__name__}, not a KVCache"
            )
        return out, RecordedCache(updated.k, updated.v, getattr(updated, "weights", None), out)

    def __getattr__(self, name: str):  # only for names the wrapper lacks
        if name == "block":  # not set yet (while the module is built)
            raise AttributeError(name)
        return getattr(self.block, name)


def is_attention(node) -> bool:
    return isinstance(node, MultiHeadAttention)


def attentions(model) -> list[MultiHeadAttention]:
    """Every eqx_gpt `MultiHeadAttention` in `model`, in the order of its pytree."""
    return [n for n in jax.tree.leaves(model, is_leaf=is_attention) if is_attention(n)]


def is_block(node) -> bool:
    """Whether `node` is a block: a module with `decode` that holds a `MultiHeadAttention` itself."""
    if not isinstance(node, eqx.Module) or is_attention(node) or not callable(getattr(node, "decode", None)):
        return False
    return any(is_attention(getattr(node, f.name, None)) for f in dataclasses.fields(node))


def blocks(model) -> list:
    """The blocks of `model` (see the module docstring), in the order of its pytree."""
    inner = lambda n: n is not model and is_block(n)
    return [n for n in jax.tree.leaves(model, is_leaf=inner) if inner(n)]


def recording(model: Decoder, *, attention: bool = True, hidden: bool = True) -> Decoder:
    """`model` with every attention layer recording its weights (`attention`) and every block its
    output (`hidden`); a model with neither is returned as it is."""
    if hidden and blocks(model):
        model = eqx.tree_at(blocks, model, [RecordingBlock(b) for b in blocks(model)])
    if attention and attentions(model):
        model = eqx.tree_at(attentions, model, [RecordingAttention(a) for a in attentions(model)])
    return model


def recorded(cache, field: str, trailing: int) -> list:
    """The `field` ("weights" or "hidden") of every `RecordedCache` in `cache`, in its order, each
    with its `trailing` last axes kept and every axis before them merged into one (a stacked
    cache's layers; a one-row batch)."""
    leaves = jax.tree.leaves(cache, is_leaf=lambda n: isinstance(n, RecordedCache))
    found = [getattr(leaf, field) for leaf in leaves if isinstance(leaf, RecordedCache)]
    return [a.reshape(-1, *a.shape[-trailing:]) for a in found if a is not None]
