"""The page's own endpoint (eqx_gpt's, not OpenAI's): what the model attends to and predicts.

`inspect_text` runs a text through the model once, as `generate`'s prefill does (`prefill`: the
decoder's own `decode` at position 0, so it works for any `Decoder`), and returns at one position
the 10 most likely next tokens twice: under the model's own distribution (`before`: temperature 1,
no filters) and under the one a sample is drawn from (`after`: `next_token_distribution`, the very
distribution `sample_next_token` draws from; temperature 0 puts all the mass on the argmax).

And for one layer, the attention weights over the text of one head, or of all its heads
(`sample.py --attention-png`'s picture, as numbers), over the `window` tokens up to the position
if asked. The
attention layers are found by type: every eqx_gpt `MultiHeadAttention` in the model
records, during that prefill, the weights its `decode` attends with into the cache it returns
(`eqx_gpt.serve.recording`), so
the layers are the recorded caches in the order of the cache the model hands back, whether its
layers run in a Python loop or a `scan`. A model without one (or whose `decode` does not hand back
the cache its attention returned) gets `attention: null` and `attention_absent`, the reason, which
the page shows in place of the heatmap.

At the same position, the logit lens (`lens.py`, a prefill of its own with every block recording
its output): each layer's top 5 next tokens, or `lens: null` and `lens_absent`, why.

The text is cropped to its last `context_length` tokens and padded to a `prompt_bucket` (the
causal mask keeps padding out of every real position), so few shapes compile.
"""

from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.decoding import prefill, prompt_bucket
from eqx_gpt.generation.sampling import next_token_distribution, usable
from eqx_gpt.serve.lens import LensLayout, lens_layout, lens_top
from eqx_gpt.serve.recording import attention_layers, recorded, recording
from eqx_gpt.serve.requests import RequestError

TOP = 10  # bars shown


@dataclass(frozen=True)
class AttentionLayout:
    """What the page may ask for: the attention layers found (`n_layers`, each with `n_heads`),
    or why there are none (`absent`; then one layer and head, 0, are accepted and ignored)."""

    n_layers: int
    n_heads: int
    absent: str | None = None


@eqx.filter_jit  # only traced (by `attention_layout`), jitted so that JAX keeps the trace per structure
def _recorded_weights(model: Decoder, padded: Int[Array, "1 bucket"]) -> list[Array]:
    return recorded(prefill(recording(model), padded, same_cache=False)[1])


def attention_layout(model: Decoder) -> AttentionLayout:
    """The layers and heads the page can show for `model` (from shapes alone: nothing runs; a model
    of a structure seen before in this process is not even traced again)."""
    name = type(model).__name__
    if not attention_layers(model):
        return AttentionLayout(
            1, 1, f"{name} has no eqx_gpt MultiHeadAttention, whose weights the page draws"
        )
    padded = jax.ShapeDtypeStruct((1, prompt_bucket(1, model.context_length)), jnp.int32)
    shapes = [s.shape for s in eqx.filter_eval_shape(_recorded_weights, model, padded)]
    if not shapes:
        return AttentionLayout(
            1, 1, f"{name}.decode does not hand back the caches its MultiHeadAttention layers return"
        )
    if len({s[1:] for s in shapes}) > 1:
        return AttentionLayout(
            1, 1, f"{name}'s attention layers differ in heads or shape: {sorted(set(shapes))}"
        )
    return AttentionLayout(sum(s[0] for s in shapes), shapes[0][1])


@eqx.filter_jit
def _inspect_pass(model: Decoder, padded, layer, position, with_attention: bool, with_lens: bool):
    """One prefill of `padded` `(bucket,)`: the logits of every position, every head's attention
    of `layer` `(heads, bucket, bucket)` and the lens's top tokens at `position`."""
    logits, cache = prefill(
        recording(model) if with_attention else model, padded[None], same_cache=not with_attention
    )
    weights = jnp.concatenate(recorded(cache))[layer] if with_attention else None
    lens = lens_top(model, padded[None], position) if with_lens else None
    return weights, logits[0], lens


_distribution = eqx.filter_jit(next_token_distribution)


def _entry(i, p, tokenizer) -> dict:
    return {"id": int(i), "token": tokenizer.decode([int(i)]), "prob": round(float(p), 6)}


def _top(probs: np.ndarray, tokenizer) -> list[dict]:
    ids = np.argsort(-probs, kind="stable")[:TOP]
    return [_entry(i, probs[i], tokenizer) for i in ids]


def _lens(lens, tokenizer) -> list[dict] | None:
    if lens is None:
        return None
    probs, ids = (np.asarray(a) for a in lens)
    probs = np.nan_to_num(probs)  # a layer with no distribution shows none (JSON has no NaN)
    return [
        {
            "layer": layer,
            "top": [_entry(i, p, tokenizer) for i, p in zip(ids[layer], probs[layer], strict=True)],
        }
        for layer in range(len(ids))
    ]


def _window(matrix: np.ndarray, start: int, end: int) -> list:
    """The rows and columns `start .. end - 1` of an attention matrix (`[..., bucket, bucket]`)."""
    return np.round(matrix[..., start:end, start:end], 4).tolist()


def inspect_text(
    model: Decoder, tokenizer, tokens: list[int], *, layer: int, head: int, position: int | None,
    temperature: float, top_k: int | None, top_p: float | None, all_heads: bool = False,
    window: int | None = None, layout: AttentionLayout | None = None, lens: LensLayout | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The attention of `layer`/`head` over `tokens` (cropped to the context), with every head of
    `layer` if `all_heads`, over the `window` tokens up to `position` (None: all); the next-token
    top 10 before and after the filters at `position` (None: the last), and there the logit lens
    (`lens.py`).
    Arguments are checked by the caller (`parse_inspect` against `layout`,
    `attention_layout(model)`), save `position`, which must fall in the cropped text (a
    `RequestError` otherwise). `lens` is `lens_layout(model)` (computed when not given)."""
    layout = attention_layout(model) if layout is None else layout
    lens = lens_layout(model) if lens is None else lens
    model = eqx.nn.inference_mode(model)
    context = model.context_length
    cropped = len(tokens) - min(len(tokens), context)
    tokens = tokens[cropped:]
    n = len(tokens)
    if position is not None and position >= n:
        raise RequestError(
            f"position must be in [0, {n - 1}] (the text's {n} tokens), got {position}", "position"
        )
    position = n - 1 if position is None else position
    padded = np.zeros(prompt_bucket(n, context), np.int32)
    padded[:n] = tokens
    with_attention = layout.absent is None
    weights, logits, top = _inspect_pass(
        model, jax.device_put(padded), jnp.int32(layer), jnp.int32(position), with_attention,
        lens.absent is None,
    )  # fmt: skip
    at = logits[position]
    if not bool(usable(at)):
        raise ValueError(
            f"the model's logits at position {position} hold NaN or +inf, or are all -inf: no distribution "
            f"to show (a diverged or broken model)"
        )
    after = _distribution(
        at, jnp.float32(temperature),
        None if top_k is None else jnp.int32(top_k), None if top_p is None else jnp.float32(top_p),
    )  # fmt: skip
    start, end = (0, n) if window is None else (max(0, position + 1 - window), position + 1)
    heads = None if weights is None else np.asarray(weights)
    return {
        "tokens": [tokenizer.decode([t]) for t in tokens],
        "ids": tokens,
        "cropped": cropped,
        "position": position,
        "layer": layer,
        "head": head,
        "window_start": start,
        "attention": None if heads is None else _window(heads[head], start, end),
        "heads": None if heads is None or not all_heads else _window(heads, start, end),
        "attention_absent": layout.absent,
        "next_token": {
            "before": _top(np.asarray(_distribution(at, jnp.float32(1.0), None, None)), tokenizer),
            "after": _top(np.asarray(after), tokenizer),
        },
        "lens": _lens(top, tokenizer),
        "lens_absent": lens.absent,
    }
