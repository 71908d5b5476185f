"""KV-cached decoding for the encoder-decoder `Transformer`: `translate`.

The source is encoded once; each decoder layer projects the memory's keys and values once (cross-
attention reads them at every step); then every new target token costs one position of the decoder,
through each layer's self-attention `KVCache`, inside one jitted `fori_loop`. Sampling and its
per-row randomness are `generate`'s (`sample_rows`, `sampling_arrays`), so the same key and
settings mean the same thing in both loops. Like `generate`, it runs the model in inference mode
(`eqx.nn.inference_mode`): no dropout.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from eqx_gpt._checks import is_whole
from eqx_gpt.generation.sampling import (
    DEFAULT_SAMPLING,
    SamplingOptions,
    sample_rows,
    sampling_arrays,
    with_settings,
)
from eqx_gpt.model.transformer import Transformer


@eqx.filter_jit
def _translate(model: Transformer, src, bos_id, eos_id, key, temperature, top_k, top_p, n_steps: int):
    """The cached decoding loop: encode once, project each layer's cross keys/values once, then
    one position per token. Returns `(batch, n_steps)` ids; after `eos_id` a row emits `pad_id`."""
    pad_id, batch = model.config.pad_id, src.shape[0]
    memory_kv = model.memory_kv(model.encode(src))

    def step(i, carry):
        cache, token, done, out = carry
        logits, cache = model.decode(token[:, None], cache, i, memory_kv, src)
        token = jnp.where(done, pad_id, sample_rows(logits[:, 0], key, i, temperature, top_k, top_p))
        return cache, token, done | (token == eos_id), out.at[:, i].set(token)

    start = (
        model.init_cache(batch, n_steps),
        jnp.full((batch,), bos_id, jnp.int32),
        jnp.zeros((batch,), bool),
    )
    out = jnp.full((batch, n_steps), pad_id, jnp.int32)
    return jax.lax.fori_loop(0, n_steps, step, (*start, out))[3]


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
    out = _translate(
        eqx.nn.inference_mode(model), jnp.asarray(src, jnp.int32), jnp.int32(bos_id), jnp.int32(eos_id),
        key, n_steps=max_new_tokens,
        **sampling_arrays(options),
    )  # fmt: skip
    return np.asarray(out)
