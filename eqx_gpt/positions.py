"""Sinusoidal position encodings (Vaswani et al. 2017, section 3.5)."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from eqx_gpt._checks import typechecked


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
