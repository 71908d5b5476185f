"""`eqx-gpt train|sample|evaluate|export [flags]` (the console script) or `python -m eqx_gpt ...`:
the commands of a clone's root scripts, from any folder, with the bundled corpus. `--help` lists
the commands (`eqx_gpt.commands.COMMANDS`), `--version` prints the installed version."""

import importlib
import sys
from importlib import metadata
from pathlib import Path

from eqx_gpt.commands import COMMANDS


def program_name(argv0: str | None = None) -> str:
    """How the user called this: `eqx-gpt` (the console script, named by `argv[0]`) or
    `python -m eqx_gpt` (where `argv[0]` is this file)."""
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    return "python -m eqx_gpt" if name in ("__main__.py", "") else name


def usage(prog: str) -> str:
    return f"usage: {prog} [--version] [--help] <command> [flags]"


def help_text(prog: str) -> str:
    """What `--help` prints: the usage, then each command with its line, as `git --help` does."""
    width = max(len(name) for name in COMMANDS) + 3
    commands = "\n".join(f"  {name:<{width}}{line}" for name, line in COMMANDS.items())
    return (
        f"{usage(prog)}\n\nTrain, sample, evaluate and export GPTs in JAX + Equinox.\n\n"
        f"commands:\n{commands}\n\noptions:\n  {'-h, --help':<15}show this help and exit\n"
        f"  {'-V, --version':<15}print eqx_gpt's version and exit\n\n"
        f"'{prog} <command> --help' lists a command's flags."
    )


def version() -> str:
    try:
        return metadata.version("eqx_gpt")
    except metadata.PackageNotFoundError:  # a checkout on the path, not installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the command `argv[0]` with the flags after it; returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    prog = program_name() if prog is None else prog
    if not argv:
        print(
            f"{usage(prog)}\n{prog}: error: name a command: {', '.join(COMMANDS)} (see --help)",
            file=sys.stderr,
        )
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(help_text(prog))
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"eqx_gpt {version()}")
        return 0
    name, flags = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{prog}: error: unknown command {name!r}; choose one of {', '.join(COMMANDS)} (see --help)",
              file=sys.stderr)  # fmt: skip
        return 2
    command = importlib.import_module(f"eqx_gpt.commands.{name}")
    try:
        return command.main(flags, prog=f"{prog} {name}")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `| head`: the reader left, nothing more to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m eqx_gpt"))
