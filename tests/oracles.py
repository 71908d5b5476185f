"""Test oracles: the slow, obviously right versions that the library's fast paths must match."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from eqx_gpt import GPT, SamplingOptions
from eqx_gpt.generation.generate import check_generation_args, prompt_bucket
from eqx_gpt.generation.sampling import DEFAULT_SAMPLING, sample_rows, sampling_arrays, with_settings


def np_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The softmax of `x` over `axis`, in NumPy, in `x`'s dtype (the largest value subtracted first,
    so that no exponential overflows)."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@eqx.filter_jit
def naive_step(model, window, length, key, index, temperature, top_k, top_p):
    """Token `index`, sampled from the logits of position `length - 1` of the whole `window`."""
    logits = model(window)[length - 1]
    return sample_rows(logits[None], key, index, temperature, top_k, top_p)[0]


def naive_generate(
    model: GPT,
    prompt_tokens: Int[Array, " seq"] | np.ndarray | list[int],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    options: SamplingOptions = DEFAULT_SAMPLING,
    **settings,
) -> np.ndarray:
    """`generate`'s reference: rerun the model on the whole window for every token (as nanoGPT does).

    Same sliding policy and per-token randomness as `generate`, so within float rounding the two
    give the same tokens. The window is padded to a power-of-two bucket (causal attention makes
    the padding invisible), so the cost tracks the window length with a few compiled shapes.
    """
    options = with_settings(options, settings)
    prompts, keep = check_generation_args(model, np.asarray(prompt_tokens)[None], max_new_tokens, options)
    model = eqx.nn.inference_mode(model)
    context = model.config.context_length
    window = list(prompts[0])
    sampling = sampling_arrays(options)
    out = []
    for i in range(max_new_tokens):
        padded = np.zeros(prompt_bucket(len(window), context), np.int32)
        padded[: len(window)] = window
        length = jnp.asarray(len(window), jnp.int32)
        token = int(naive_step(model, jnp.asarray(padded), length, key, jnp.asarray(i), **sampling))
        out.append(token)
        window.append(token)
        if len(window) > context:
            window = window[-keep:]
    return np.asarray(out, np.int32)
