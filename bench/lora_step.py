"""A LoRA fine-tuning step against a full fine-tuning step, at GPT-2-124M's shapes, side by side.

    uv run python bench/lora_step.py [--rounds 2] [--steps 3] [--batch-size 4] [--context 256]

A random GPT-2 of the real 124M shapes (12 layers, 768 wide, 12 heads, 50,257 ids; learned
positions, biases, LayerNorm; no download) takes one AdamW training step (`make_train_step`:
forward, backward, update) on `batch x context` tokens, two ways:
- "full": every weight trained (`train.py --init-from DIR`);
- "lora": rank-`--rank` adapters on `--targets` (`train.py --init-from DIR --lora-rank 8`); the
  base is frozen: no gradient of it is computed, and the optimiser holds no state for it.
Each side runs in its own process (so that its peak resident memory, `ru_maxrss`, is its own),
alternating for `--rounds` rounds; each process compiles, runs one untimed step, then times
`--steps` steps. Printed: the CPU model, median seconds per step and their ratio, peak RSS, the
optimiser state's bytes, and the forward pass
alone (the loss, no gradient): the floor under a LoRA step, which still runs the forward and
carries the gradient back through every layer's activations (the input gradients), is about
forward + backward-through-activations, i.e. 2 forwards; the full step adds each weight's gradient
(another ~1 forward) and the update of 124M weights and their two moments.
Imports only names `eqx_gpt` exports.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SMOKE_SHAPE, add_smoke_argument, cpu_description  # noqa: E402

from eqx_gpt import (  # noqa: E402
    GPT,
    GPTConfig,
    TrainConfig,
    apply_lora,
    init_optimizer_state,
    loss_fn,
    make_optimizer,
    make_train_step,
)

GPT2_124M = dict(
    vocab_size=50257, d_model=768, n_heads=12, n_layers=12, positions="learned", bias=True, norm="layer",
    dropout=0.0,
)  # fmt: skip


def one_side(args) -> dict:
    """Build, compile and time one side's step in this process; its figures as a dict."""
    config = TrainConfig(batch_size=args.batch_size, grad_clip=1.0, weight_decay=0.1)
    shape = {**GPT2_124M, **SMOKE_SHAPE, "vocab_size": 512} if args.smoke else GPT2_124M
    model = GPT(GPTConfig(**{"context_length": args.context, **shape}), key=jax.random.key(0))
    if args.side == "lora":
        model = apply_lora(
            model, args.rank, alpha=2.0 * args.rank, targets=args.targets, key=jax.random.key(1)
        )
    optimizer = make_optimizer(config)
    opt_state = init_optimizer_state(optimizer, model)
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(opt_state) if eqx.is_array(x))
    step_fn = make_train_step(optimizer, config, dropout=False)
    context = model.config.context_length
    batch = jax.random.randint(jax.random.key(2), (args.batch_size, context + 1), 0, model.config.vocab_size)
    step, lr = np.int32(0), np.float32(1e-4)
    t0 = time.perf_counter()
    model, opt_state, loss = step_fn(model, opt_state, batch, step, lr)
    float(loss)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        model, opt_state, loss = step_fn(model, opt_state, batch, step, lr)
        float(loss)
        times.append(time.perf_counter() - t0)
    forward = eqx.filter_jit(loss_fn)
    float(forward(model, batch))
    t0 = time.perf_counter()
    float(forward(model, batch))
    forward_s = time.perf_counter() - t0
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "side": args.side, "step_s": statistics.median(times), "first_s": first, "forward_s": forward_s,
        "peak_rss_mb": peak_rss_mb, "opt_state_mb": opt_bytes / 1e6, "loss": float(loss),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="c_attn,c_proj,c_fc")
    p.add_argument("--side", choices=("full", "lora"), help=argparse.SUPPRESS)  # one side, in a child process
    add_smoke_argument(p)
    args = p.parse_args()
    if args.smoke:  # a tiny GPT-2-shaped model, one round of one step: checks that the bench runs
        args.rounds, args.steps, args.batch_size, args.rank = 1, 1, 2, 2
    if args.side:
        print(json.dumps(one_side(args)))
        return
    print(f"CPU: {cpu_description()}; GPT-2-124M shapes, batch {args.batch_size} x {args.context} tokens, "
          f"AdamW; LoRA rank {args.rank} on {args.targets}")  # fmt: skip
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    for r in range(args.rounds):
        for side in ("full", "lora"):
            cmd = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
            results[side].append(json.loads(out.strip().splitlines()[-1]))
            f = results[side][-1]
            print(f"round {r + 1} {side:4}: {f['step_s']:.2f} s/step (first: {f['first_s']:.1f} s), "
                  f"forward {f['forward_s']:.2f} s, peak RSS {f['peak_rss_mb']:.0f} MB, "
                  f"optimiser state {f['opt_state_mb']:.1f} MB, loss {f['loss']:.4f}")  # fmt: skip
    med = {s: statistics.median(f["step_s"] for f in results[s]) for s in results}
    fwd = statistics.median(f["forward_s"] for f in results["lora"])
    rss = {s: max(f["peak_rss_mb"] for f in results[s]) for s in results}
    opt = {s: results[s][0]["opt_state_mb"] for s in results}
    print(f"median step: full {med['full']:.2f} s, LoRA {med['lora']:.2f} s: LoRA "
          f"{med['full'] / med['lora']:.2f}x faster; forward alone {fwd:.2f} s "
          f"(LoRA step = {med['lora'] / fwd:.2f} forwards)")  # fmt: skip
    print(f"peak RSS: full {rss['full']:.0f} MB, LoRA {rss['lora']:.0f} MB; optimiser state: full "
          f"{opt['full']:.0f} MB, LoRA {opt['lora']:.2f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
