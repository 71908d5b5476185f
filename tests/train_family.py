"""What the training family's test files share: they run in one xdist group (`FAMILY`), so one
process, and a program compiled here for one of them serves every other.

A model called op by op (eagerly) compiles its layer scan afresh on every call (its body is a new
closure each time); called through `forward`, a model of one structure and input shape compiles
once for the whole family.
"""

import equinox as eqx
import pytest

from eqx_gpt import GPTConfig

FAMILY = pytest.mark.xdist_group("train")  # the files' `pytestmark`

# The family's small GPT, for tests whose assertions do not depend on its size: one set of weight
# shapes, so one set of initialising programs (and steps, and forwards) for all of them.
CONFIG = GPTConfig(vocab_size=11, context_length=16, d_model=32, n_heads=2, n_layers=2)


@eqx.filter_jit
def forward(model, tokens, **kwargs):
    """`model(tokens, **kwargs)`, compiled whole: arrays among `kwargs` (a key) are traced, the
    rest (`inference=True`) are static."""
    return model(tokens, **kwargs)
