"""What the command-line faces share: an argument parser whose errors are one line and exit code
2, and the number type their float flags parse with."""

import argparse
import math


class OneLineParser(argparse.ArgumentParser):
    """The CLIs' argument parser: a bad argument is one line on stderr and exit code 2."""

    def error(self, message):
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
