"""Where a token is: sinusoidal encodings (Vaswani et al. 2017, section 3.5), added to the token
vectors, and rotary embeddings (RoPE, Su et al. 2021), applied to each head's queries and keys.

(GPT-2's third kind, a learned table of position vectors, is a parameter of `GPT`.)
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from eqx_gpt._checks import typechecked

ROPE_BASE = 10000.0


@typechecked
def sinusoidal_positions(seq_len: int, d_model: int) -> Float[Array, "{seq_len} {d_model}"]:
    """The paper's table of position encodings, shape `(seq_len, d_model)`.

    `PE[pos, 2i] = sin(pos / 10000^(2i/d_model))` and `PE[pos, 2i+1] = cos(...)` with the same
    frequency, so each pair of features is a rotating phasor and relative offsets are linear maps.
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal_positions needs an even d_model (sin/cos pairs), got {d_model}")
    if seq_len < 0:
        raise ValueError(f"sinusoidal_positions needs seq_len >= 0, got {seq_len}")
    pos = jnp.arange(seq_len, dtype=jnp.float32)[:, None]
    inv_freq = jnp.power(10000.0, -jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)
    angles = pos * inv_freq  # (seq_len, d_model / 2)
    # Interleave so that sin lands on even features and cos on odd ones.
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(seq_len, d_model)


@typechecked
def rotary_embedding(
    x: Float[Array, "*batch seq heads d_head"], positions: Int[Array, " seq"]
) -> Float[Array, "*batch seq heads d_head"]:
    """Rotate each head's vector `x[..., t, h, :]` by angles proportional to its position `positions[t]`.

    Features `i` and `i + d_head/2` form a pair rotated by `positions[t] * 10000^(-2i/d_head)`
    (the "half-split" pairing of GPT-NeoX and Llama). Rotating queries and keys this way makes
    `q_t . k_s` depend on their positions only through `t - s`: attention sees relative positions
    and nothing is added to the residual stream. Computed in float32, returned in `x`'s dtype.
    """
    d_head = x.shape[-1]
    if d_head % 2:
        raise ValueError(f"rotary_embedding needs an even d_head (feature pairs), got {d_head}")
    inv_freq = jnp.power(ROPE_BASE, -jnp.arange(0, d_head, 2, dtype=jnp.float32) / d_head)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # (seq, d_head / 2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # broadcast over heads
    x32 = x.astype(jnp.float32)
    first, second = x32[..., : d_head // 2], x32[..., d_head // 2 :]
    rotated = jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return rotated.astype(x.dtype)
