"""The logit lens (nostalgebraist's, 2020; the LLM Transparency Tool's view): what each layer would
predict. At one position, the residual stream after each block is finished by the model's own
tail, its final norm and head, as if the blocks after it were not there.

The blocks are found by type, for a `GPT` or a decoder of your own: a **block** is a module with a
`decode` method that holds an eqx_gpt `MultiHeadAttention` as one of its own fields (eqx_gpt's
`Block`, or a block of your own built around one), other than the model. The streams are recorded
by a prefill of the text with each block swapped for a `RecordingBlock`, whose `decode` also puts
its output in the cache it hands back (`StreamCache`), so the streams come out as the model's own
cache does, whether its blocks run in a Python loop or a `scan`. The tail is the model's own: its
`decode` runs once more, in its loop form (`loop_model`: a GPT unstacked), with every block
replaced by a `FixedBlock` that hands on a recorded stream in place of its own output, so what
comes out is that stream through whatever the model does after its blocks (for a GPT: the final
norm, the head, the padding ids sliced off, the soft-cap if set). One row per layer: the layers
are one batch of one-token rows.

Each layer's distribution is `next_token_distribution` at temperature 1 with no filters: the
model's own, which the page's "before filters" bars show (the last layer's lens is those bars).
Where the blocks cannot be walked, `LensLayout.absent` says why, and the page shows that.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.decoding import loop_model, prefill, prompt_bucket
from eqx_gpt.generation.sampling import next_token_distribution
from eqx_gpt.model.attention import KVCache, MultiHeadAttention

LENS_TOP = 5  # tokens shown per layer


def is_block(node) -> bool:
    """Whether `node` is a block: a module with `decode` that holds a `MultiHeadAttention` itself."""
    if not isinstance(node, eqx.Module) or isinstance(node, MultiHeadAttention):
        return False
    if not callable(getattr(node, "decode", None)):
        return False
    return any(isinstance(getattr(node, f.name, None), MultiHeadAttention) for f in dataclasses.fields(node))


def blocks(model) -> list:
    """The blocks of `model` (see the module docstring), in the order of its pytree."""
    inner = lambda n: n is not model and is_block(n)
    return [n for n in jax.tree.leaves(model, is_leaf=inner) if inner(n)]


class StreamCache(KVCache):
    """A block's `KVCache` that also carries the block's output, the residual stream after it:
    `(*lead, new, d_model)`."""

    hidden: Float[Array, "*lead new d_model"]


class RecordingBlock(eqx.Module):
    """A block whose `decode` also puts its output in the `StreamCache` it hands back; its other
    attributes are the block's."""

    block: Any

    def decode(self, x, cache, start, *args, **kwargs):
        out, updated = self.block.decode(x, cache, start, *args, **kwargs)
        if not isinstance(updated, KVCache):
            raise TypeError(
                f"{type(self.block).__name__}.decode hands back a {type(updated).__name__}, not a KVCache"
            )
        return out, StreamCache(updated.k, updated.v, out)

    def __getattr__(self, name: str):  # only for names the wrapper lacks
        if name == "block":  # not set yet (while the module is built)
            raise AttributeError(name)
        return getattr(self.block, name)


def recorded_streams(model: Decoder, padded: Int[Array, "1 bucket"]) -> list:
    """The residual stream after every block for the text `padded`, one `(layers, bucket,
    d_model)` array per `StreamCache` in the cache the model hands back (a stacked cache's layer
    axis kept; none if the model hands back other caches than its blocks')."""
    recorder = eqx.tree_at(blocks, model, [RecordingBlock(b) for b in blocks(model)])
    _, cache = prefill(recorder, padded, same_cache=False)
    found = [n.hidden for n in jax.tree.leaves(cache, is_leaf=_is_stream) if _is_stream(n)]
    return [h.reshape(-1, *h.shape[-2:]) for h in found]


def _is_stream(node) -> bool:
    return isinstance(node, StreamCache)


class FixedBlock(eqx.Module):
    """A block whose `decode` hands on `hidden` `(rows, new, d_model)` whatever it is given, and
    the cache as it came."""

    hidden: Float[Array, "rows new d_model"]

    def decode(self, x, cache, start, *args, **kwargs):
        return self.hidden.astype(x.dtype), cache


def finish(model: Decoder, streams: Float[Array, "layers d_model"]) -> Float[Array, "layers vocab"]:
    """Each row of `streams` (a residual stream after a block) through the model's tail: the
    logits it would give if that stream left its last block."""
    loop = loop_model(model)
    rows = streams[:, None, :]
    fixed = eqx.tree_at(blocks, loop, [FixedBlock(rows) for _ in blocks(loop)])
    logits, _ = prefill(fixed, jnp.zeros((rows.shape[0], 1), jnp.int32))
    return logits[:, 0]


def lens_top(
    model: Decoder, padded: Int[Array, "1 bucket"], position: Int[Array, ""] | int
) -> tuple[Float[Array, "layers top"], Int[Array, "layers top"]]:
    """The `LENS_TOP` most likely next tokens after `position` of the text `padded`, as each
    layer's residual stream would have them: probabilities and ids, one row per layer."""
    return _top_of_streams(model, recorded_streams(model, padded), position)


def _top_of_streams(model: Decoder, streams: list, position: Int[Array, ""] | int):
    """`lens_top` of the streams `recorded_streams` gave."""
    logits = finish(model, jnp.concatenate(streams)[:, position])
    probs = jax.vmap(lambda row: next_token_distribution(row, jnp.float32(1.0)))(logits)
    return jax.lax.top_k(probs, LENS_TOP)


@dataclass(frozen=True)
class LensLayout:
    """The layers the lens shows for a model (`n_layers` blocks), or why it shows none (`absent`)."""

    n_layers: int
    absent: str | None = None


@eqx.filter_jit  # only traced (by `lens_layout`), jitted so that JAX keeps the trace per structure
def _lens_shapes(model: Decoder, padded):
    streams = recorded_streams(model, padded)  # traced once: both the test and the lens's input
    return _top_of_streams(model, streams, 0) if streams else None


def lens_layout(model: Decoder) -> LensLayout:
    """Whether the lens can walk `model`'s blocks, from shapes alone (nothing runs; a model of a
    structure seen before in this process is not even traced again)."""
    name = type(model).__name__
    if not blocks(model):
        return LensLayout(
            0, f"{name} has no block the lens can walk (a module with a decode method holding an eqx_gpt "
            f"MultiHeadAttention)",
        )  # fmt: skip
    padded = jax.ShapeDtypeStruct((1, prompt_bucket(1, model.context_length)), jnp.int32)
    try:
        shapes = eqx.filter_eval_shape(_lens_shapes, model, padded)
    except Exception as e:  # a model of one's own may do anything with its blocks: say what broke
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return LensLayout(
            0, f"{name}'s blocks cannot be finished by its own tail ({type(e).__name__}: {why}); the lens "
            f"needs blocks whose decode returns (x, KVCache), run as separate modules",
        )  # fmt: skip
    if shapes is None:
        return LensLayout(0, f"{name}.decode does not hand back the caches its blocks return")
    return LensLayout(shapes[0].shape[0])
