"""Shared test set-up: offline GPT-2 BPE files when ../shared is beside the checkout; how many
test processes `-n auto` starts."""

import os
from pathlib import Path

_SHARED_TIKTOKEN = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tiktoken-cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_TIKTOKEN.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_TIKTOKEN)


def pytest_xdist_auto_num_workers(config):
    """One test process per core, at most 4: each compiles with XLA and runs JAX's own threads, so
    more processes than that only add memory."""
    return max(
        1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    )
