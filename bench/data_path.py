"""The data path at scale (issue 30): a 1 GB text, prepared and trained on, against Tiny Shakespeare.

    uv run python bench/data_path.py [--mb 1100] [--gpt2-mb 100] [--steps 20]

Builds the text at run time in a temporary folder (Tiny Shakespeare repeated; never committed)
and reports, each in a child process with its own cache folder:
  1. preparation throughput in MB/s, char tokenizer (the whole text) and GPT-2 BPE (a slice of
     `--gpt2-mb`, since BPE is slower), with each child's peak RSS;
  2. the issue's check: `train.py --data F --max-steps 20 --max-minutes 0 --sample-tokens 0`,
     first run (preparing) and a second run into another folder: wall time, time to the first
     step, peak RSS (`wait4` of the child: the largest process);
  3. steps/s of the same model on the 1 GB corpus read from its shards and on the bundled corpus,
     interleaved in one process, from the runs' own tokens/s records.
The machine may be shared: run it under `nice` on an idle one for figures to report.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import SMOKE_SHAPE, add_smoke_argument  # noqa: E402
from train_default import cpu_model  # noqa: E402

# `--smoke`: a tiny model in every run (its figures mean nothing), and batches of 2.
SMOKE_SETTINGS = {**SMOKE_SHAPE, "batch_size": 2, "scan_unroll": 1, "eval_batches": 1}

PREPARE = """
import sys, time
from eqx_gpt import GPT2Tokenizer, prepare
kind = sys.argv[2]
t0 = time.perf_counter()
c = prepare(sys.argv[1], {"kind": "char"} if kind == "char" else GPT2Tokenizer().to_dict())
print(time.perf_counter() - t0, len(c.tokens))
"""


def run_child(command: list[str], env: dict, first_line: str | None = None) -> dict:
    """Run `command`; its wall time, the time until a line containing `first_line`, its peak RSS."""
    t0 = time.perf_counter()
    child = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first, lines = None, []
    for line in child.stdout:
        lines.append(line)
        if first is None and first_line and first_line in line:
            first = time.perf_counter() - t0
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        sys.exit(f"{command} failed:\n{''.join(lines[-20:])}")
    return {
        "wall_s": time.perf_counter() - t0,
        "first_s": first,
        "rss_gb": usage.ru_maxrss / 2**20,
        "out": lines,
    }


def make_text(folder: Path, mb: int) -> Path:
    """Tiny Shakespeare repeated to about `mb` MB, written in pieces."""
    one = (ROOT / "eqx_gpt" / "data" / "tinyshakespeare.txt").read_bytes()
    path = folder / f"shakespeare-{mb}mb.txt"
    with open(path, "wb") as f:
        for _ in range(max(1, mb * 10**6 // len(one))):
            f.write(one)
    return path


def preparation(text: Path, gpt2_mb: int, tmp: Path, env: dict, kinds=("char", "gpt2")) -> None:
    for kind, source in (("char", text), ("gpt2", None)):
        if kind not in kinds:
            continue
        if source is None:
            source = tmp / f"slice-{gpt2_mb}mb.txt"
            with open(text, "rb") as f:
                source.write_bytes(f.read(gpt2_mb * 10**6).rsplit(b"\n", 1)[0] + b"\n")
        child_env = {**env, "EQX_GPT_DATA_CACHE": str(tmp / f"cache-prepare-{kind}")}
        result = run_child([sys.executable, "-c", PREPARE, str(source), kind], child_env)
        seconds, n_tokens = result["out"][-1].split()
        mb = source.stat().st_size / 1e6
        print(
            f"prepare {kind}: {mb:,.0f} MB -> {int(n_tokens):,} tokens in {float(seconds):.1f} s = "
            f"{mb / float(seconds):.1f} MB/s; peak RSS {result['rss_gb']:.2f} GB"
        )


def issue_check(text: Path, steps: int, tmp: Path, env: dict, smoke: bool = False) -> None:
    env = {**env, "EQX_GPT_DATA_CACHE": str(tmp / "cache-check")}
    for name in ("first run (prepares)", "second run (reads the cache)"):
        out = tmp / f"run-{name.split()[0]}"
        argv = ["--data", str(text), "--out-dir", str(out), "--max-steps", str(steps), "--max-minutes", "0"]
        if smoke:
            argv += [f"--{k.replace('_', '-')}={v}" for k, v in SMOKE_SETTINGS.items()]
        result = run_child(
            [sys.executable, "train.py", *argv, "--sample-tokens", "0"],
            env,
            first_line="compiled the training step",
        )
        final = next(line for line in result["out"] if line.startswith("final validation"))
        print(
            f"train.py --data ({name}), {steps} steps: {result['wall_s']:.1f} s wall, first step at "
            f"{result['first_s']:.1f} s, peak RSS {result['rss_gb']:.2f} GB; {final.strip()}"
        )


def steps_per_second(text: Path, tmp: Path, rounds: int = 2, steps: int = 300, smoke: bool = False) -> None:
    after = 0 if smoke else 40  # the steps whose rate counts (past the compiling ones)
    os.environ["EQX_GPT_DATA_CACHE"] = str(tmp / "cache-check")  # prepared by the check above
    from eqx_gpt import train

    rates = {"1 GB corpus read from its shards": [], "bundled corpus in memory": []}
    for r in range(rounds):
        for name, data in (
            ("1 GB corpus read from its shards", str(text)),
            ("bundled corpus in memory", None),
        ):
            out = tmp / f"speed-{r}-{name.split()[0]}"
            settings = {
                "data": data,
                "max_steps": steps,
                "max_minutes": 0,
                "eval_interval": steps,
                "eval_tokens": 4096,
                **(SMOKE_SETTINGS if smoke else {}),
            }
            train(out_dir=out, sample_tokens=0, log=lambda _: None, progress=False, **settings)
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            rates[name] += [x["tokens_per_s"] for x in records if "tokens_per_s" in x and x["step"] > after]
    for name, values in rates.items():
        print(
            f"steps: {name}: median {statistics.median(values) / 1e3:.2f}k tokens/s over {len(values)} logs"
        )
    a, b = (statistics.median(v) for v in rates.values())
    print(f"read from the shards / in memory: {a / b:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=1100, help="size of the text to build, MB")
    parser.add_argument("--gpt2-mb", type=int, default=100, help="slice of it that GPT-2 BPE prepares, MB")
    parser.add_argument("--steps", type=int, default=20, help="steps of the issue's check")
    parser.add_argument("--parts", default="prepare,check,speed", help="which of prepare,check,speed to run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the speed comparison")
    add_smoke_argument(parser)
    args = parser.parse_args()
    # The smoke run prepares with GPT-2's BPE only where its files are at hand (never the network).
    kinds = ("char", "gpt2") if not args.smoke or os.environ.get("TIKTOKEN_CACHE_DIR") else ("char",)
    if args.smoke:
        args.mb, args.gpt2_mb, args.steps, args.rounds = 1, 1, 2, 1
    print(f"CPU: {cpu_model()}, {len(os.sched_getaffinity(0))} cores; load {os.getloadavg()[0]:.1f}")
    env = {**os.environ}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = make_text(tmp, args.mb)
        print(f"text: {text.stat().st_size / 1e6:,.0f} MB (Tiny Shakespeare repeated)")
        parts = args.parts.split(",")
        if "prepare" in parts:
            preparation(text, args.gpt2_mb, tmp, env, kinds)
        if "check" in parts or "speed" in parts:  # the speed comparison reads the check's cache
            issue_check(text, args.steps, tmp, env, args.smoke)
        if "speed" in parts:
            steps_per_second(text, tmp, rounds=args.rounds, steps=12 if args.smoke else 300, smoke=args.smoke)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
