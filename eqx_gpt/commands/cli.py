"""What the commands share: the one place their errors are caught (`run_command`), an opt-in
for the host's memory (`reuse_host_memory`), an argument parser whose errors are one line and exit
code 2, the number types their flags parse with (every number is range-checked where it enters),
and the `--checkpoint` argument of sample, evaluate and export."""

import argparse
import contextlib
import ctypes
import math
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from eqx_gpt._checks import INT32_MAX, SEED_MAX, is_whole
from eqx_gpt.errors import ConfigError, EqxGptError

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_MALLOC_ENVIRONMENT = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def reuse_host_memory() -> bool:
    """Have glibc's malloc keep the memory that XLA's CPU programs free, for the next call to reuse;
    return whether it was set (glibc only, and only where the environment sets no allocator of its own).
    An opt-in for a whole program, called before JAX starts its threads; no command calls it.

    Each call of a compiled program allocates its scratch as one buffer (164 MB for 8 steps of the
    default model) from one of XLA's worker threads. glibc maps a buffer that large afresh from the
    kernel in every call and unmaps it at the end, so every call zero-fills it again, page by page:
    42,000 page faults and about 100 ms of system time per call of the default step on a 2-core
    EPYC. One arena for every thread, no mmap for large buffers and no trimming of the heap keep a
    freed buffer for the next call: one step a call then ran as fast as eight.

    The costs, measured there: the process keeps its peak memory until it exits, and every thread
    allocates from one arena, which slowed GPT-2-124M's batch-1 generation by 11-20% and its
    training step by 9-24%. So the training loop amortises the faults instead, with up to 8
    steps a call (`training.run.SECONDS_PER_CALL`); `bench/vs_transformers.py --reuse-host-memory`
    shows that torch's CPU allocator gains more from it than XLA does.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(os.environ.get(name) for name in _MALLOC_ENVIRONMENT):  # the user's own choice stands
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(
        mallopt(param, value)
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    )


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
