"""Runtime shape checking shared by every public module.

`typechecked` wraps a function so that its jaxtyping annotations are checked by beartype. The
check runs when JAX traces the function, so inside `jit` it costs nothing at run time.
"""

import argparse
import math

from beartype import beartype
from jaxtyping import jaxtyped

typechecked = jaxtyped(typechecker=beartype)


def check_last_dim(x, expected: int, what: str, field: str) -> None:
    """Raise a one-line error when the feature axis of `x` does not match the module's size."""
    if x.shape[-1] != expected:
        raise ValueError(
            f"{what} expects a last axis of size {field}={expected}, got shape {tuple(x.shape)}; "
            f"pass shape (seq, {expected}), or (batch, seq, {expected})."
        )


class OneLineParser(argparse.ArgumentParser):
    """The CLIs' argument parser: a bad argument is one line on stderr and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def finite_float(text: str) -> float:
    """argparse type of the CLIs: a float that is neither NaN nor infinite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value
