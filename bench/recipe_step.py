"""What each change of the speedrun recipe costs per training step, timed side by side.

    uv run python bench/recipe_step.py [--rounds 3] [--seconds 4]

Builds the real step of `train.py` (`make_optimizer` and `make_train_steps`, several steps per
dispatch) for the `cpu` preset and for the preset with one
change undone at a time, then times them in interleaved rounds so that a busy or throttled machine
slows all alike. Prints the CPU model, each variant's median ms per step and tokens/s, and their
ratios to the preset's. Loss is not measured here: see docs/PERFORMANCE.md for the runs.
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import STEPS_PER_CALL, add_smoke_argument, preset_configs, smoke_config  # noqa: E402 (bench/common.py)

from eqx_gpt import GPT, GPTConfig, TrainConfig, init_optimizer_state, make_optimizer, make_train_steps  # noqa: E402

VOCAB = 65
# Each variant: the preset with these values instead (issue 33's changes undone one at a time, then
# all together: the preset before issue 33). Compare tokens/s: a batch of 48 takes longer per step
# than one of 32 but not per token, and a time-fitted run is priced in tokens.
VARIANTS = {
    "cpu preset": {},
    "batch 32": dict(batch_size=32),
    "fused qkv in Muon": dict(muon_split_qkv=False),
    "gradient clipping at 1": dict(grad_clip=1.0),
    "5 Newton-Schulz steps": dict(muon_ns_steps=5),
    "before issue 33": dict(
        batch_size=32, muon_split_qkv=False, grad_clip=1.0, lr=0.03, beta1=0.9, beta2=0.99
    ),
}  # fmt: skip


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def make_advance(model_config: GPTConfig, config: TrainConfig):
    """`advance()`: one dispatch of STEPS_PER_CALL real training steps of these configs."""
    optimizer = make_optimizer(config)
    steps_fn = make_train_steps(optimizer, config, dropout=model_config.dropout > 0)
    state = [GPT(model_config, key=jax.random.key(0))]
    state.append(init_optimizer_state(optimizer, state[0]))
    k, window = STEPS_PER_CALL, model_config.context_length + 1
    batches = jax.random.randint(jax.random.key(1), (k, config.batch_size, window), 0, VOCAB)
    steps, lrs = np.arange(k, dtype=np.int32), np.full(k, 1e-4, np.float32)

    def advance():
        state[0], state[1], losses = steps_fn(state[0], state[1], batches, steps, lrs, np.int32(k))
        jax.block_until_ready(losses)

    return advance, config.batch_size * model_config.context_length


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants")
    p.add_argument("--seconds", type=float, default=4.0, help="timed seconds per variant per round")
    add_smoke_argument(p)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.seconds = 1, 0.0
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; load {os.getloadavg()}; jax {jax.__version__}")
    model_config, train_config = preset_configs("cpu", VOCAB)
    if args.smoke:
        model_config = smoke_config(model_config)
    runs = {}
    # The smoke run builds two variants: the preset and the one that undoes every change.
    variants = {k: VARIANTS[k] for k in ("cpu preset", "before issue 33")} if args.smoke else VARIANTS
    for name, change in variants.items():
        advance, tokens = make_advance(model_config, dataclasses.replace(train_config, **change))
        advance(), advance()  # compile, then one warm call
        runs[name] = (advance, tokens, [])
    for _ in range(args.rounds):
        for advance, _, times in runs.values():
            end = time.perf_counter() + args.seconds
            while not times or time.perf_counter() < end:  # one call at least
                start = time.perf_counter()
                advance()
                times.append((time.perf_counter() - start) / STEPS_PER_CALL)
    base_tokens, base_times = runs["cpu preset"][1:]
    base_step = statistics.median(base_times)
    for name, (_, tokens, times) in runs.items():
        step = statistics.median(times)
        print(
            f"{name:24s} {step * 1e3:6.2f} ms/step ({step / base_step:5.3f}x the preset's)  "
            f"{tokens / step:8,.0f} tok/s ({tokens / step / (base_tokens / base_step):5.3f}x)"
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
