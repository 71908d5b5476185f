"""Score a checkpoint: its mean loss over its run's validation split (by default the windows the
run's final validation read, so the figure is the run's; `--whole-split` for all of it), or over a
text of your own: `uv run evaluate.py --help`.

The command is `eqx_gpt.commands.evaluate` (also `python -m eqx_gpt evaluate`); from Python, call
`eqx_gpt.evaluate` or `eqx_gpt.evaluate_text`.
"""

import sys

from eqx_gpt.commands.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
