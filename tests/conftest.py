"""Shared test set-up: offline GPT-2 BPE files when ../shared is beside the checkout."""

import os
from pathlib import Path

_SHARED_TIKTOKEN = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tiktoken-cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_TIKTOKEN.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_TIKTOKEN)
