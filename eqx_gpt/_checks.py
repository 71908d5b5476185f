"""Checks shared by every module: shapes at trace time, and whole numbers in a range.

`typechecked` wraps a function so that its jaxtyping annotations are checked by beartype. The
check runs when JAX traces the function, so inside `jit` it costs nothing at run time.
"""

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


def is_whole(value, low: int, high: float = float("inf")) -> bool:
    """Whether `value` is an `int` (not a `bool`) in `[low, high]`: how every count and size a user
    passes is checked before it reaches JAX."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
