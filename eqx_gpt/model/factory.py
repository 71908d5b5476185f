"""A model of the user's own, built by a function named `MODULE:FUNCTION` (`train.py --model`), as
uvicorn finds an app: the module is imported with the current folder first on `sys.path`."""

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import jax

from eqx_gpt.errors import ConfigError
from eqx_gpt.model.language_model import check_language_model


def import_factory(spec: str) -> Callable[..., Any]:
    """The function `spec` names (`"mydec:make_decoder"`, `"pkg.models:build"`), imported with the
    current folder first on `sys.path`. A spec that is not `MODULE:FUNCTION`, a module that cannot be
    imported or a name it lacks is a one-line `ConfigError` naming it."""
    module_name, _, function_name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not function_name.isidentifier():
        raise ConfigError(f"--model takes MODULE:FUNCTION (such as mydec:make_decoder), got {spec!r}")
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error in it is theirs to see, in one line
        raise ConfigError(
            f"--model {spec}: module {module_name!r} cannot be imported from {here} or the installed "
            f"packages ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError(
            f"--model {spec}: {module_name} ({module.__file__}) has no function {function_name!r}"
        )
    return function


def build_model(spec: str, vocab_size: int, *, key: jax.Array) -> Any:
    """The model `spec`'s function builds, called as `function(vocab_size, key=key)`; checked to be a
    `LanguageModel` of `vocab_size` ids (each a one-line `ConfigError`)."""
    function = import_factory(spec)
    try:
        model = function(vocab_size, key=key)
    except Exception as e:
        raise ConfigError(
            f"--model {spec}: calling {spec.partition(':')[2]}({vocab_size}, key=...) raised "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    try:
        check_language_model(model, f"--model {spec}: what {spec.partition(':')[2]} returns")
    except TypeError as e:
        raise ConfigError(str(e)) from None
    if model.vocab_size != vocab_size:
        raise ConfigError(
            f"--model {spec}: the model has vocab_size {model.vocab_size}, but the tokenizer has "
            f"{vocab_size} ids; build it with the vocab_size the function is given"
        )
    return model
