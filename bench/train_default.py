"""The default `uv run train.py`, end to end: wall minutes (compile included) and final val loss.

    uv run python bench/train_default.py [--out-dir bench/results/default] [extra train.py flags]

Target (issue 17): at most 10 minutes on a 2-core CPU like CI's, final validation loss (the whole
split, overlapping windows: the run's last metrics line) <= 1.50, stretch 1.45. Prints the CPU
model, the core count and load average before and after, since on a shared machine the same run
can be much slower; run it on an idle machine for a figure to report.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_MINUTES, TARGET_VAL = 10.0, 1.50
SMOKE_FLAGS = [
    "--max-steps", "2", "--eval-interval", "2", "--sample-tokens", "0", "--max-minutes", "0",
    "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--context-length", "16", "--batch-size", "2",
    "--scan-unroll", "1", "--eval-batches", "1", "--eval-tokens", "256",
]  # fmt: skip


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results" / "default"))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, 2 steps: checks that the bench runs; no figures",
    )
    args, extra = parser.parse_known_args()
    if args.smoke:
        extra = [*SMOKE_FLAGS, *extra]
    out = Path(args.out_dir)
    cmd = [sys.executable, str(ROOT / "train.py"), "--out-dir", str(out), *extra]
    print(f"CPU: {cpu_model()}; cores: {os.cpu_count()}, load average before: {os.getloadavg()}")
    print("running:", " ".join(cmd), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    minutes = (time.perf_counter() - start) / 60
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = usage.ru_utime + usage.ru_stime
    print(f"load average after: {os.getloadavg()}")
    # On a shared machine the run gets less than all cores; its CPU seconds say how much it had.
    print(
        f"train.py used {cpu_s / 60:.2f} CPU-minutes in {minutes:.2f} wall minutes: on average "
        f"{cpu_s / 60 / minutes:.2f} of {os.cpu_count()} cores"
    )
    if rc != 0:
        print(f"train.py exited with {rc}")
        return rc
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    final, best = records[-1], min(r["val_loss"] for r in evals)
    tokens_per_s = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # first: compiling
    median_tps = sorted(tokens_per_s)[len(tokens_per_s) // 2] if tokens_per_s else float("nan")
    print(
        f"wall {minutes:.2f} min (target <= {TARGET_MINUTES:g}); steps {final['step']}; final val loss "
        f"{final['final_val_loss']:.4f} over {final['val_tokens']:,} tokens (target <= {TARGET_VAL:.2f}); "
        f"periodic val {evals[-1]['val_loss']:.4f}, best {best:.4f}; median {median_tps:,.0f} tokens/s"
    )
    ok = minutes <= TARGET_MINUTES and final["final_val_loss"] <= TARGET_VAL
    print("target met" if ok else "target NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
