"""The logit lens (nostalgebraist's, 2020; the LLM Transparency Tool's view): what each layer would
predict. At one position, the residual stream after each block is finished by the model's own
tail, its final norm and head, as if the blocks after it were not there.

The streams are recorded during the page's prefill (`recording`: every block, found by type). The
tail is the model's own, for any model whose blocks are found: its `decode` runs once more, in its
loop form (`loop_model`: a GPT unstacked), with every block replaced by a `FixedBlock` that hands
on a recorded stream in place of its own output, so what comes out is that stream through
whatever the model does after its blocks (for a GPT: the final norm, the head, the padding ids
sliced off, the soft-cap if set). One row per layer: the layers are one batch of one-token rows.

Each layer's distribution is `next_token_distribution` at temperature 1 with no filters: the
model's own, which the page's "before filters" bars show (the last layer's lens is those bars).
Where the blocks cannot be walked, `LensLayout.absent` says why, and the page shows that.
"""

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.decoding import loop_model, prefill, prompt_bucket
from eqx_gpt.generation.sampling import next_token_distribution
from eqx_gpt.serve.recording import blocks, recorded, recording

LENS_TOP = 5  # tokens shown per layer


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


def layer_streams(cache) -> Float[Array, "layers new d_model"]:
    """The residual streams a recorded prefill's `cache` holds, one per block in the model's order."""
    return jnp.concatenate(recorded(cache, "hidden", 2))


def lens_top(
    model: Decoder, streams: Float[Array, "layers d_model"]
) -> tuple[Float[Array, "layers top"], Int[Array, "layers top"]]:
    """The `LENS_TOP` most likely next tokens of each layer's stream: probabilities and ids."""
    logits = finish(model, streams)
    probs = jax.vmap(lambda row: next_token_distribution(row, jnp.float32(1.0)))(logits)
    return jax.lax.top_k(probs, LENS_TOP)


@dataclass(frozen=True)
class LensLayout:
    """The layers the lens shows for a model (`n_layers` blocks), or why it shows none (`absent`)."""

    n_layers: int
    absent: str | None = None


def _lens_shapes(model: Decoder, padded):
    _, cache = prefill(recording(model, attention=False), padded, same_cache=False)
    found = recorded(cache, "hidden", 2)
    if not found:
        return None
    return lens_top(model, layer_streams(cache)[:, 0])


def lens_layout(model: Decoder) -> LensLayout:
    """Whether the lens can walk `model`'s blocks, from shapes alone (nothing runs)."""
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
