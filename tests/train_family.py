"""What the training family's test files share: they run in one xdist group (`FAMILY`), so one
process, and a program compiled here for one of them serves every other.

A model called op by op (eagerly) compiles its layer scan afresh on every call (its body is a new
closure each time); called through `forward`, a model of one structure and input shape compiles
once for the whole family.
"""

import equinox as eqx
import pytest

FAMILY = pytest.mark.xdist_group("train")  # the files' `pytestmark`


@eqx.filter_jit
def forward(model, tokens, **kwargs):
    """`model(tokens, **kwargs)`, compiled whole: arrays among `kwargs` (a key) are traced, the
    rest (`inference=True`) are static."""
    return model(tokens, **kwargs)
