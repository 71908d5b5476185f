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


# Counts and sizes become int32 arrays inside JAX, so a larger one would overflow there (or in the
# conversion) far from where it was given; seeds go to `jax.random.key`, which takes an int64.
INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1


def is_whole(value, low: int, high: int = INT32_MAX) -> bool:
    """Whether `value` is an `int` (not a `bool`) in `[low, high]`: how every count and size a user
    passes is checked before it reaches JAX (by default at most `INT32_MAX`)."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
