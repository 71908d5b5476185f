import jax
import jax.numpy as jnp

import eqx_gpt


def test_gpt_returns_logits_for_a_sequence():
    cfg = eqx_gpt.GPTConfig(vocab_size=65, context_length=16, d_model=32, n_heads=4, n_layers=2)
    model = eqx_gpt.GPT(cfg, key=jax.random.key(0))
    logits = model(jnp.arange(10) % 65)
    assert logits.shape == (10, 65)
    assert bool(jnp.all(jnp.isfinite(logits)))
