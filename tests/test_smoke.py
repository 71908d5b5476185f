import equinox as eqx
import jax
import numpy as np
from runs_family import GROUP, MODEL

import eqx_gpt

pytestmark = GROUP


def test_gpt_returns_logits_for_a_sequence():
    cfg = eqx_gpt.GPTConfig(vocab_size=65, **MODEL)
    model = eqx_gpt.GPT(cfg, key=jax.random.key(0))
    tokens = np.arange(10, dtype=np.int32) % 65  # NumPy's: jnp's arithmetic compiles a program an operation
    logits = eqx.filter_jit(model)(tokens)  # one program, not one per eager operation
    assert logits.shape == (10, 65)
    assert np.isfinite(np.asarray(logits)).all()
