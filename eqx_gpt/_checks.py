"""Checks shared by every module: shapes at trace time, and whole numbers in a range.

`typechecked` wraps a function so that its jaxtyping annotations are checked by beartype. The
check runs when JAX traces the function, so inside `jit` it costs nothing at run time.
"""

import functools
import inspect
import math
import numbers
import os
import re
import typing
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax.core import Tracer
from jaxtyping import TypeCheckError, jaxtyped

_F = typing.TypeVar("_F", bound=Callable)


def typechecked(function: _F) -> _F:
    """`function` with its jaxtyping annotations checked by beartype (`jaxtyped`), a failed check
    raised as a one-line `TypeCheckError`: which argument, what it was, what to pass, and the axis
    sizes bound so far. (jaxtyping's own message is a dozen lines; one that does not read as
    expected, from another jaxtyping version say, is raised as it is.)"""
    checked = jaxtyped(typechecker=beartype)(function)

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return checked(*args, **kwargs)
        except TypeCheckError as error:
            line = _one_line(str(error))
            if line is None:
                raise
            raise TypeCheckError(line) from None

    return typing.cast(_F, call)


def _one_line(message: str) -> str | None:
    """jaxtyping's message of a failed parameter check as one line, or None if it reads otherwise."""
    where = re.search(r"checking the parameters of ([\w.<>]+?)\.?$", message, re.M)
    name = re.search(r"typechecking parameter '(\w+)'", message)
    actual = re.search(r"^Actual value: (.*)$", message, re.M)
    expected = re.search(r"^Expected type: (.*?)\.?$", message, re.M)
    if not (where and name and actual and expected):
        return None
    owner = ".".join(where[1].split(".")[-2:])  # Class.method
    wanted = re.sub(r"<class '(.*?)'>", r"\1", expected[1])
    wanted = re.sub(r"\b(jaxlib\._jax|jax|jaxtyping|typing)\.", "", wanted).replace("NoneType", "None")
    union = re.fullmatch(r"Union\[(.*)\]", wanted)
    if union:  # its members, split at the commas outside brackets
        members, depth, part = [], 0, ""
        for char in union[1] + ",":
            depth += (char == "[") - (char == "]")
            if char == "," and depth == 0:
                members, part = [*members, part.strip()], ""
            else:
                part += char
        wanted = " | ".join(members)
    axes = message.split("are as follows.", 1)[1].split() if "are as follows." in message else []
    bound = f" (axes so far: {', '.join(axes)})" if axes else ""
    return f"{owner}: {name[1]} is {actual[1]}; pass {wanted}{bound}"


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


def as_path(value, what: str):
    """`value` as a `pathlib.Path` if it is a path (a `str` or an `os.PathLike`, not bytes or
    empty), else a one-line `TypeError` naming `what`: not pathlib's own, which names neither."""
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike) or str(value) == "":
        raise TypeError(f"{what} must be a path (a non-empty str or pathlib.Path), got {value!r}")
    return Path(value)


def check_size(value, what: str, low: int = 1) -> int:
    """`value` if it is a whole number in `[low, INT32_MAX]` (a module's size), else a one-line
    `ValueError` naming it and the range."""
    if not is_whole(value, low):
        raise ValueError(f"{what} must be an integer in [{low}, {INT32_MAX}], got {value!r}")
    return value


def as_token_ids(tokens, what: str, vocab: tuple[str, int] | None = None):
    """`tokens` as a JAX integer array of token ids, or a one-line error naming `what` and what it
    would accept.

    Accepted: a JAX array of any integer dtype (as given), and what converts to one exactly: a
    NumPy array or a (nested) list of integers, of any integer dtype, unsigned ones (`uint8`)
    included, since every id they hold is a whole number >= 0. Refused: bool, float or complex
    ids, strings, a 0-d id and an empty sequence (the last axis is `seq`). `vocab` is
    `(field, size)`: ids that are known (not traced) must lie in `[0, size)`; NumPy ids are
    checked before the conversion to int32, so none wraps around into range.
    """
    if isinstance(tokens, jax.Array):  # tracers included: their dtype and shape are known
        ids = tokens
    elif isinstance(tokens, np.ndarray | np.generic | list | tuple):
        try:
            ids = np.asarray(tokens)
        except ValueError:  # a ragged list
            raise ValueError(f"{what} must be a rectangular array of token ids, got a ragged list") from None
    else:
        raise TypeError(
            f"{what} must be an array of integer token ids, shape (seq,) or (batch, seq), got "
            f"{type(tokens).__name__}"
        )
    if ids.ndim == 0 or ids.shape[-1] == 0:
        raise ValueError(
            f"{what} must hold at least one token id on its last axis, shape (seq,) or (batch, seq), "
            f"got shape {tuple(ids.shape)}"
        )
    if not np.issubdtype(ids.dtype, np.integer):  # bool is not an integer dtype to NumPy
        raise TypeError(
            f"{what} must be integer token ids (any int or uint dtype), got dtype {ids.dtype}; "
            f"encode text with the model's tokenizer"
        )
    if vocab is not None and not is_traced(ids) and ids.size:
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab[1]:
            raise ValueError(
                f"{what}: token ids from {low} to {high} are outside [0, {vocab[0]}={vocab[1]}); "
                f"encode text with the model's tokenizer"
            )
    if isinstance(ids, jax.Array):  # unsigned ids as int32, the type the model's annotations name
        return ids.astype(jnp.int32) if np.issubdtype(ids.dtype, np.unsignedinteger) else ids
    return jnp.asarray(ids.astype(np.int32))


def takes_token_ids(**vocab_fields: str | None):
    """Decorate a model's method whose arguments named in `vocab_fields` are token ids: each is
    converted or refused by `as_token_ids` (in one line, naming the argument) before the method,
    and its shape check, sees it. A field names the `self.config` attribute that bounds the ids
    (None: no bound checked here)."""

    def decorate(method):
        signature = inspect.signature(method)

        @functools.wraps(method)
        def checked(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            for name, field in vocab_fields.items():
                if name in bound.arguments:
                    where = type(self).__name__
                    if method.__name__ != "__call__":
                        where += f".{method.__name__}"
                    what = f"{where}'s {name}"
                    vocab = None if field is None else (field, getattr(self.config, field))
                    bound.arguments[name] = as_token_ids(bound.arguments[name], what, vocab)
            return method(*bound.args, **bound.kwargs)

        return checked

    return decorate
