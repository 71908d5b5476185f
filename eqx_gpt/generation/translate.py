"""KV-cached decoding for the encoder-decoder `Transformer`: `translate`, through `generate`'s loop.

The sources are encoded once and each decoder layer's cross keys and values projected once
(`Transformer.bind`: the decoder side bound to the sources, a `Decoder`); then `stream_batch`, the
loop `generate` runs, decodes every target row from `bos_id`, one position per token through each
layer's self-attention `KVCache`. So sampling, its per-row randomness and its refusal of logits with
no distribution are `generate`'s. The loop stops early once every row has drawn `eos_id`. Like
`generate`, it runs the model in inference mode (`eqx.nn.inference_mode`): no dropout.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from eqx_gpt._checks import is_whole
from eqx_gpt.generation.generate import stream_batch
from eqx_gpt.generation.sampling import DEFAULT_SAMPLING, SamplingOptions, with_settings
from eqx_gpt.model.transformer import Transformer

_bind = eqx.filter_jit(lambda model, src: model.bind(src))


def translate(
    model: Transformer,
    src: Int[Array, "batch src_seq"] | np.ndarray,
    max_new_tokens: int,
    *,
    bos_id: int,
    eos_id: int,
    key: PRNGKeyArray | None = None,
    options: SamplingOptions = DEFAULT_SAMPLING,
    **settings,
) -> np.ndarray:
    """`(batch, max_new_tokens)` target ids for each source row (padded with `pad_id`), starting
    after `bos_id` and stopping (then padding) after `eos_id`; the `eos_id` itself is included.

    KV-cached (see the module docstring); `temperature=0` is greedy and equals rerunning
    `model(src, target so far)` for every token. `key` is needed unless greedy. Sampling settings
    come in `options` or as keywords (`temperature=`, `top_k=`, `top_p=`), as in `generate`.
    """
    options = with_settings(options, settings)
    if not isinstance(model, Transformer):
        raise TypeError(f"translate takes a Transformer, got {type(model).__name__}")
    c = model.config
    src = np.asarray(src)
    if src.ndim != 2 or 0 in src.shape:
        raise ValueError(f"translate takes sources of shape (batch, src_seq), neither 0, got {src.shape}")
    if src.dtype == bool or not np.issubdtype(src.dtype, np.integer):
        raise ValueError(f"source ids must be integers in [0, src_vocab_size), got dtype {src.dtype}")
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if not is_whole(value, 0, c.tgt_vocab_size - 1):
            raise ValueError(
                f"{name} must be a target id in [0, tgt_vocab_size={c.tgt_vocab_size}), got {value!r}"
            )
    if not is_whole(max_new_tokens, 1, c.max_len):
        raise ValueError(
            f"max_new_tokens must be an integer in [1, max_len={c.max_len}], got {max_new_tokens!r}"
        )
    if src.min() < 0 or src.max() >= c.src_vocab_size:
        raise ValueError(
            f"source ids must be in [0, src_vocab_size={c.src_vocab_size}), got {src.min()} to {src.max()}"
        )
    greedy = options.temperature == 0
    if key is None and not greedy:
        raise ValueError("translate needs a key= to sample (or SamplingOptions(temperature=0) for greedy)")
    key = jax.random.key(0) if key is None else key
    decoder = _bind(model, jnp.asarray(src, jnp.int32))
    out = np.full((src.shape[0], max_new_tokens), c.pad_id, np.int32)
    done, at = np.zeros(src.shape[0], bool), 0
    starts = np.full((src.shape[0], 1), bos_id, np.int32)
    for chunk in stream_batch(decoder, starts, max_new_tokens, key=key, options=options):
        # After its `eos_id` a row emits `pad_id`: what it draws there is discarded.
        for j in range(chunk.shape[1]):
            out[:, at + j] = np.where(done, c.pad_id, chunk[:, j])
            done |= chunk[:, j] == eos_id
        at += chunk.shape[1]
        if done.all():
            break
    return out
