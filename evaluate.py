"""Score a checkpoint: its mean loss over a whole text, every token predicted once:
`uv run evaluate.py --help`.

The command is `eqx_gpt.commands.evaluate` (also `python -m eqx_gpt evaluate`); from Python, call
`eqx_gpt.evaluate` or `eqx_gpt.evaluate_text`.
"""

import sys

from eqx_gpt.commands.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
