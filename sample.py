"""Sample text from a trained eqx_gpt model, streaming it to stdout: `uv run sample.py --help`.

The command is `eqx_gpt.commands.sample` (also `python -m eqx_gpt sample`); from Python, call
`eqx_gpt.generate` or `eqx_gpt.stream_text`.
"""

import sys

from eqx_gpt.commands.sample import main, parse_args

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # e.g. `| head`: the reader left, nothing more to say
        sys.stderr.close()
        sys.exit(0)
