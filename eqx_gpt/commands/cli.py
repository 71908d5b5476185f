"""What the commands share: the one place their errors are caught (`run_command`), an argument
parser whose errors are one line and exit code 2, the number types their flags parse with (every
number is range-checked where it enters), and the `--checkpoint` argument of sample, evaluate and
export."""

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from eqx_gpt._checks import INT32_MAX, SEED_MAX, is_whole
from eqx_gpt.errors import ConfigError, EqxGptError


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command's `body` and return its exit code: bad input of any kind (an `EqxGptError`) is
    one line on stderr naming the fix, and exit code 2."""
    try:
        return body()
    except EqxGptError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def flag_values() -> Iterator[None]:
    """The library's public range checks raise plain `ValueError`s; given a command's flags, they
    are bad input (`ConfigError`)."""
    try:
        yield
    except EqxGptError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


class OneLineParser(argparse.ArgumentParser):
    """The commands' argument parser: a bad argument is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
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


def whole_number(low: int, high: int = INT32_MAX):
    """argparse type of the CLIs' integer flags: an integer in `[low, high]` (counts and sizes become
    int32 arrays in JAX, so `high` is at most `INT32_MAX` by default)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not is_whole(value, low, high):
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text}")
        return value

    return parse


seed_number = whole_number(0, SEED_MAX)


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """`--checkpoint PATH` (default `out`): a run directory, whose best checkpoint is read (else its
    latest), or a checkpoint file; sample.py and evaluate.py also take a Hugging Face GPT-2 folder."""
    parser.add_argument(
        "--checkpoint", metavar="PATH", type=Path, default=Path("out"),
        help="run directory (its best checkpoint, else latest), checkpoint file, or Hugging Face GPT-2 "
        "folder (default: out/)",
    )  # fmt: skip
