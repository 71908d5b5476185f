"""What the frozen config dataclasses share (`GPTConfig`, `TransformerConfig`, `TrainConfig`):
JSON-ready dicts as checkpoints store them, the checks of their numbers, and the help of each field
(`described`), which `train.py` shows for its flags."""

import dataclasses
import math
from typing import Any, ClassVar

from eqx_gpt._checks import INT32_MAX, is_whole
from eqx_gpt.errors import ConfigError


def described(help: str, **kwargs):
    """A dataclass field with its one-line help (shown by `train.py --help`)."""
    return dataclasses.field(metadata={"help": help}, **kwargs)


class DictConfig:
    """`to_dict` and `from_dict` for the frozen config dataclasses: JSON-ready dicts; and `given()`,
    the fields a config was constructed with."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # set by @dataclass on each subclass

    def __new__(cls, *args: Any, **kwargs: Any):
        # Which fields the caller gave, by position or name, kept beside the fields (not one of
        # them: equality, hashing and `to_dict` never see it), so that `train(config)` can lay
        # them over a preset as it does settings passed by name.
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        object.__setattr__(self, "_given", frozenset(names[: len(args)]) | frozenset(kwargs))
        return self

    def given(self) -> frozenset[str]:
        """The fields given to the constructor, by position or name, whatever their values (the
        rest hold their defaults). `dataclasses.replace` and `from_dict` give every field."""
        return getattr(self, "_given", frozenset(f.name for f in dataclasses.fields(self)))  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        """Build the config from `to_dict`'s output; unknown keys are an error."""
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        return cls(**d)


def check_fields(config, *, positive: tuple[str, ...] = (), finite: tuple[str, ...] = ()) -> None:
    """Raise a one-line `ValueError` unless each `positive` field of the dataclass `config` is an
    integer in `[1, INT32_MAX]` and each `finite` field a finite number (NaN and infinities would
    poison a run)."""
    name = type(config).__name__
    for field in positive:
        value = getattr(config, field)
        if not is_whole(value, 1):
            raise ConfigError(f"{name}.{field} must be an integer in [1, {INT32_MAX}], got {value!r}")
    for field in finite:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(f"{name}.{field} must be a finite number, got {value!r}")
