"""The exceptions eqx_gpt raises for bad input, one per area, all under `EqxGptError`.

Each carries a one-line message that names the problem and the fix, so the command-line faces catch
`EqxGptError` in one place and print it. Each is also a `ValueError`: a bad value, a bad file or a
bad folder is bad input. Range checks on the public API's arguments (a negative rate, an id outside
the vocabulary) raise plain `ValueError`s or `TypeError`s, as Python's own functions do.
"""


class EqxGptError(ValueError):
    """The base of every eqx_gpt exception: bad input, with a one-line message naming the fix."""


class ConfigError(EqxGptError):
    """Settings that cannot make a model or a run (naming the setting and the fix)."""


class TokenizerError(EqxGptError):
    """A tokenizer cannot be built or cannot encode or decode its input."""


class DataError(EqxGptError):
    """A corpus cannot be used (naming the file and the fix)."""


class CheckpointError(EqxGptError):
    """A checkpoint is missing, unreadable, corrupt or inconsistent."""


class GPT2FormatError(CheckpointError):
    """A directory is not a loadable GPT-2, or a model cannot be written as one."""


class TrainingError(EqxGptError):
    """A run cannot start or continue, or its folder cannot be used as asked."""
