"""Checks shared by every module: shapes at trace time, and whole numbers in a range.

`typechecked` wraps a function so that its jaxtyping annotations are checked by beartype. The
check runs when JAX traces the function, so inside `jit` it costs nothing at run time.
"""

import math
import numbers

from beartype import beartype
from jax.core import Tracer
from jaxtyping import jaxtyped

typechecked = jaxtyped(typechecker=beartype)


def check_last_dim(x, expected: int, what: str, field: str) -> None:
    """Raise a one-line error when the feature axis of `x` does not match the module's size."""
    if x.shape[-1] != expected:
        raise ValueError(
            f"{what} expects a last axis of size {field}={expected}, got shape {tuple(x.shape)}; "
            f"pass shape (seq, {expected}), or (batch, seq, {expected})."
        )


# Counts and sizes become int32 arrays inside JAX, so a larger one would overflow there (or in the
# conversion) far from where it was given; seeds go to `jax.random.key`, which takes an int64.
INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1


def is_whole(value, low: int, high: int = INT32_MAX) -> bool:
    """Whether `value` is an `int` (not a `bool`) in `[low, high]`: how every count and size a user
    passes is checked before it reaches JAX (by default at most `INT32_MAX`)."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_traced(x) -> bool:
    """Whether `x` is a JAX tracer (inside `jit`, `vmap`, ...): its values are then unknown, so a
    check of them waits for a concrete call."""
    return isinstance(x, Tracer)


def is_real(value) -> bool:
    """Whether `value` is a real number (a Python or NumPy int or float, not a `bool`)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_eps(eps, what: str) -> float:
    """`eps` if it is a finite number > 0 (a norm's epsilon), else a one-line error naming it."""
    if not is_real(eps):
        raise TypeError(f"{what} eps must be a finite number > 0, got {eps!r}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{what} eps must be a finite number > 0, got {eps!r}")
    return eps


def check_size(value, what: str, low: int = 1) -> int:
    """`value` if it is a whole number in `[low, INT32_MAX]` (a module's size), else a one-line
    `ValueError` naming it and the range."""
    if not is_whole(value, low):
        raise ValueError(f"{what} must be an integer in [{low}, {INT32_MAX}], got {value!r}")
    return value
