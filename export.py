"""Export a GPT-2-shaped checkpoint as a Hugging Face GPT-2 directory: `uv run export.py --help`.

The command is `eqx_gpt.commands.export` (also `python -m eqx_gpt export`); from Python, call
`eqx_gpt.save_gpt2`.
"""

import sys

from eqx_gpt.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
