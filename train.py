"""Train a GPT on Tiny Shakespeare (or any UTF-8 text): `uv run train.py --help`.

The command is `eqx_gpt.commands.train` (also `python -m eqx_gpt train`); from Python, call
`eqx_gpt.train`.
"""

import sys

from eqx_gpt.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
