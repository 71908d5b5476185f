"""`python -m eqx_gpt train|sample|evaluate|export [flags]` (or the `eqx-gpt` console script): the
commands of a clone's root scripts, from any folder, with the bundled corpus."""

import importlib
import sys

from eqx_gpt.commands import COMMANDS

USAGE = f"usage: python -m eqx_gpt {{{','.join(COMMANDS)}}} [--help | flags]"


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv[0]` with the flags after it; returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, flags = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{USAGE}\npython -m eqx_gpt: error: unknown command {name!r}", file=sys.stderr)
        return 2
    command = importlib.import_module(f"eqx_gpt.commands.{name}")
    try:
        return command.main(flags, prog=f"python -m eqx_gpt {name}")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `| head`: the reader left, nothing more to say
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
