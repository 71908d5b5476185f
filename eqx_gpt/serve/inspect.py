"""The page's own endpoint (eqx_gpt's, not OpenAI's): what the model attends to and predicts.

`inspect_text` runs a text through the model once and returns, for one layer and head, the
attention weights over the text (`sample.py --attention-png`'s picture, as numbers), and, at one
position, the 10 most likely next tokens twice: under the model's own distribution (`before`:
temperature 1, no filters) and under the one a sample is drawn from (`after`: the logits divided
by the temperature, then top-k, then top-p, as `sample_next_token` does; temperature 0 puts all
the mass on the argmax). The text is cropped to its last `context_length` tokens and padded to a
`prompt_bucket` (the causal mask keeps padding out of every real position), so few shapes compile.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqx_gpt.generation.generate import prompt_bucket
from eqx_gpt.generation.sampling import top_k_filter, top_p_filter
from eqx_gpt.model.gpt import GPT

TOP = 10  # bars shown


@eqx.filter_jit
def _attention_and_logits(model: GPT, padded, layer, head):
    weights = model.attention_weights(padded)
    return weights[layer, head], model(padded)


@eqx.filter_jit
def _sampled_distribution(logits, temperature, top_k, top_p):
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    if top_k is not None:
        scaled = top_k_filter(scaled, top_k)
    if top_p is not None:
        scaled = top_p_filter(scaled, top_p)
    greedy = jax.nn.one_hot(jnp.argmax(logits), logits.shape[-1])
    return jnp.where(temperature > 0, jax.nn.softmax(scaled), greedy)


def _top(probs: np.ndarray, tokenizer) -> list[dict]:
    ids = np.argsort(-probs, kind="stable")[:TOP]
    return [
        {"id": int(i), "token": tokenizer.decode([int(i)]), "prob": round(float(probs[i]), 6)} for i in ids
    ]


def inspect_text(
    model: GPT, tokenizer, tokens: list[int], *, layer: int, head: int, position: int | None,
    temperature: float, top_k: int | None, top_p: float | None,
) -> dict[str, Any]:  # fmt: skip
    """The attention of `layer`/`head` over `tokens` (cropped to the context) and the next-token top
    10 before and after the filters at `position` (None: the last). Arguments are checked by the
    caller (`parse_inspect`)."""
    context = model.config.context_length
    cropped = len(tokens) - min(len(tokens), context)
    tokens = tokens[cropped:]
    n = len(tokens)
    padded = np.zeros(prompt_bucket(n, context), np.int32)
    padded[:n] = tokens
    weights, logits = _attention_and_logits(model, jnp.asarray(padded), jnp.int32(layer), jnp.int32(head))
    position = n - 1 if position is None else min(position, n - 1)
    at = logits[position]
    after = _sampled_distribution(
        at, jnp.float32(temperature),
        None if top_k is None else jnp.int32(top_k), None if top_p is None else jnp.float32(top_p),
    )  # fmt: skip
    return {
        "tokens": [tokenizer.decode([t]) for t in tokens],
        "ids": tokens,
        "cropped": cropped,
        "position": position,
        "layer": layer,
        "head": head,
        "attention": np.round(np.asarray(weights)[:n, :n], 4).tolist(),
        "next_token": {
            "before": _top(np.asarray(jax.nn.softmax(at)), tokenizer),
            "after": _top(np.asarray(after), tokenizer),
        },
    }
