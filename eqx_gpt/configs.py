"""What the frozen config dataclasses share (`GPTConfig`, `TransformerConfig`, `TrainConfig`):
JSON-ready dicts as checkpoints store them, the checks of their numbers, and the help of each field
(`described`), which `train.py` shows for its flags."""

import dataclasses
import math
from typing import Any, ClassVar

from eqx_gpt._checks import INT32_MAX, is_whole
from eqx_gpt.errors import ConfigError

# What kind of setting a field is, beside its type, as `described` records it in the field's
# metadata: the one table that the checks, the merging of settings and the flags read.
KINDS = {
    "choices": (),  # the names it may take
    "positive": False,  # a whole number in [1, INT32_MAX]
    "finite": False,  # a finite number (NaN and infinities would poison a run)
    "bounds": None,  # (accepts(value) -> bool, "a description of its range")
    "resumable": False,  # a resumed run may change it (how long and how often it reports, where)
    "read_by_step": True,  # part of the compiled training step's identity
    "repeatable": False,  # its flag may be given more than once, the values joined into a comma list
    "fine_tune": False,  # a model setting that a run from a GPT-2 (`init_from`) may still set
}


def described(help: str, *, default: Any, **kinds: Any):
    """A dataclass field with its one-line help (shown by `train.py --help`) and its `KINDS`."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise TypeError(f"described() got unknown kind(s) {sorted(unknown)}; kinds are {sorted(KINDS)}")
    return dataclasses.field(default=default, metadata={"help": help, **kinds})


def kind(field: dataclasses.Field, name: str) -> Any:
    """What `field` says of kind `name` (`KINDS`), its default if nothing."""
    return field.metadata.get(name, KINDS[name])


def fields_of_kind(cls: type, name: str, value: Any = True) -> tuple[str, ...]:
    """The names of `cls`'s fields whose kind `name` is `value`, in field order."""
    return tuple(f.name for f in dataclasses.fields(cls) if kind(f, name) == value)


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
