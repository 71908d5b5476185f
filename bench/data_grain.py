"""Grain against a memory map and against plain reads, for the training batches (ARCHITECTURE "Data").

Each reads batches of 32 random windows of 65 tokens from a 100M-token uint16 file on disk (200 MB,
in the page cache after a first pass): a numpy gather from `np.memmap`, one `os.pread` per window
(what `ShardFile` does), and Grain's `MapDataset` (shuffled indices, mapped to slices, batched).
It also prints the process's resident memory after each, since a map's pages count there.
Grain is not a dependency; run it in a throwaway environment:

    uv run --no-project --with grain --with numpy python bench/data_grain.py
"""

import argparse
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

N_TOKENS, BATCH, WINDOW, BATCHES = 100_000_000, 32, 65, 2000


def rss_mb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) // 1024


def main() -> None:
    import grain

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="a 1M-token file and 20 batches: runs, no figures"
    )
    global N_TOKENS, BATCHES
    if parser.parse_args().smoke:
        N_TOKENS, BATCHES = 1_000_000, 20
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.bin"
        np.random.default_rng(0).integers(0, 65, N_TOKENS, dtype=np.uint16).tofile(path)
        tokens = np.memmap(path, np.uint16, mode="r")
        rng = np.random.default_rng(1)
        tokens[::4096].sum()  # touch every page once: both read from the page cache

        t0 = time.perf_counter()
        for _ in range(BATCHES):
            starts = rng.integers(0, N_TOKENS - WINDOW + 1, BATCH)
            batch = tokens[starts[:, None] + np.arange(WINDOW)].astype(np.int32)
        memmap_us = (time.perf_counter() - t0) / BATCHES * 1e6
        memmap_rss = rss_mb()

        fd = os.open(path, os.O_RDONLY)
        t0 = time.perf_counter()
        for _ in range(BATCHES):
            starts = rng.integers(0, N_TOKENS - WINDOW + 1, BATCH)
            batch = np.stack([np.frombuffer(os.pread(fd, 2 * WINDOW, 2 * int(s)), np.uint16) for s in starts])
        pread_us = (time.perf_counter() - t0) / BATCHES * 1e6
        os.close(fd)

        dataset = (
            grain.MapDataset.range(N_TOKENS - WINDOW + 1)
            .shuffle(seed=1)
            .map(lambda i: np.asarray(tokens[i : i + WINDOW], np.int32))
            .batch(BATCH)
        )
        iterator = iter(dataset)
        next(iterator)
        t0 = time.perf_counter()
        for _ in range(BATCHES):
            batch = next(iterator)
        grain_us = (time.perf_counter() - t0) / BATCHES * 1e6
        assert batch.shape == (BATCH, WINDOW)
    print(
        f"per batch of {BATCH} x {WINDOW}: np.memmap gather {memmap_us:.0f} us (resident memory then "
        f"{memmap_rss} MB), os.pread per window {pread_us:.0f} us, Grain MapDataset {grain_us:.0f} us"
    )


if __name__ == "__main__":
    main()
