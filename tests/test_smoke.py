import equinox as eqx
import jax
import jax.numpy as jnp
from runs_family import GROUP, MODEL

import eqx_gpt

pytestmark = GROUP


def test_gpt_returns_logits_for_a_sequence():
    cfg = eqx_gpt.GPTConfig(vocab_size=65, **MODEL)
    model = eqx_gpt.GPT(cfg, key=jax.random.key(0))
    logits = eqx.filter_jit(model)(jnp.arange(10) % 65)  # one program, not one per eager operation
    assert logits.shape == (10, 65)
    assert bool(jnp.all(jnp.isfinite(logits)))
