"""Speed of the real training step, against the speed of a big matmul timed in the same process.

    uv run python bench/train.py                              # the three standard configs
    uv run python bench/train.py --configs shakespeare-char --json out/bench.json
    uv run python bench/train.py --compile-layers             # compile seconds, 12 vs 2 layers

For each config it prints one line: compile seconds (first call minus a steady step), median
step time after warm-up, tokens/s, model FLOPs per token, achieved GFLOP/s and MFU. MFU divides
the achieved rate by the rate of a dense fp32 `jnp` matmul (`--peak-size`, 2048 by default)
timed *in this process, interleaved with the steps*, so a busy or throttled machine slows both
alike and the ratio stays meaningful; there is no datasheet number anywhere.

Model FLOPs per token and the peak are `bench/common.py`'s (see its docstring for what is counted).

The timed steps are `train.py`'s: `eqx_gpt.make_train_steps`, `--steps-per-call` steps per
dispatch (default: the trainer's `STEPS_PER_CALL`), with AdamW, the schedule's lr as an argument,
buffer donation, and the batches placed over the devices as the trainer places them. `--steps-per-call 1`
times one step per dispatch (`make_train_step`), to show what several per call buy.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from common import (  # bench/common.py
    CONFIGS,
    OPTIMIZERS,
    SMOKE_PEAK,
    STEPS_PER_CALL,
    MatmulPeak,
    add_malloc_argument,
    add_smoke_argument,
    check_batch,
    data_mesh,
    flops_per_token,
    replicate,
    set_malloc,
    shard_batch,
    smoke_shape,
)

from eqx_gpt import (
    GPT,
    GPTConfig,
    TrainConfig,
    init_optimizer_state,
    make_optimizer,
    make_train_step,
    make_train_steps,
)

VOCAB = 65  # Tiny Shakespeare's characters


def make_step(model_options: dict, batch_size: int, args, seed: int = 0):
    """Model, optimiser state, and `advance(model, opt_state, first) -> (model, opt_state, loss)`
    running `args.steps_per_call` real jitted training steps in one dispatch (on sharded batches)."""
    config = GPTConfig(vocab_size=VOCAB, **model_options)
    train_config = TrainConfig(
        batch_size=batch_size, grad_accum=args.grad_accum, seed=seed, optimizer=args.optimizer_now,
        muon_ns_steps=args.muon_ns_steps,
    )  # fmt: skip
    mesh = data_mesh()
    check_batch(mesh, batch_size, args.grad_accum)
    optimizer = make_optimizer(train_config)
    model = GPT(config, key=jax.random.key(seed))
    model, opt_state = replicate((model, init_optimizer_state(optimizer, model)), mesh)
    k, dropout = args.steps_per_call, config.dropout > 0
    window = config.context_length + 1
    batches = jax.random.randint(jax.random.key(seed + 1), (k, batch_size, window), 0, VOCAB)
    lr = np.float32(1e-4)  # small, so that many steps of the same batches stay well-behaved
    if k == 1:
        step_fn = make_train_step(optimizer, train_config, dropout=dropout)
        batch = shard_batch(batches[0], mesh)

        def advance(model, opt_state, first):
            return step_fn(model, opt_state, batch, np.int32(first), lr)
    else:
        steps_fn = make_train_steps(optimizer, train_config, dropout=dropout)
        batches = shard_batch(batches, mesh, batch_axis=1)

        def advance(model, opt_state, first):
            steps = np.arange(first, first + k, dtype=np.int32)
            model, opt_state, out = steps_fn(model, opt_state, batches, steps, np.full(k, lr), np.int32(k))
            return model, opt_state, out["loss"][-1]

    return config, model, opt_state, advance


def bench_config(name: str, model_options: dict, batch_size: int, args, peak: MatmulPeak) -> dict:
    config, model, opt_state, advance = make_step(model_options, batch_size, args)
    k = args.steps_per_call

    def run(calls: int, first: int):
        nonlocal model, opt_state
        for i in range(calls):
            model, opt_state, loss = advance(model, opt_state, first + i * k)
        jax.block_until_ready((model, opt_state, loss))
        return loss

    start = time.perf_counter()
    run(1, 0)
    first_call = time.perf_counter() - start
    start = time.perf_counter()
    run(args.warmup, k)
    warm = (time.perf_counter() - start) / max(1, args.warmup)  # seconds per call
    # Dispatch groups of calls back to back (as the trainer does), one matmul between groups.
    group = max(1, int(args.group_seconds / max(warm, 1e-6)))
    times: list[float] = []
    step_no = k * (1 + args.warmup)
    budget_end = time.perf_counter() + args.seconds
    while len(times) < args.min_samples or (time.perf_counter() < budget_end and len(times) < 200):
        peak.sample()
        start = time.perf_counter()
        loss = run(group, step_no)
        times.append((time.perf_counter() - start) / (group * k))
        step_no += group * k
    peak.sample()
    step_s = statistics.median(times)
    peak_gflops = statistics.median(peak.rates[-len(times) - 1 :])
    tokens = batch_size * config.context_length
    fpt = flops_per_token(config)
    gflops = fpt * tokens / step_s / 1e9
    return {
        "config": name,
        "n_layers": config.n_layers,
        "d_model": config.d_model,
        "n_heads": config.n_heads,
        "context_length": config.context_length,
        "batch_size": batch_size,
        "dropout": config.dropout,
        "compute_dtype": config.compute_dtype,
        "scan_unroll": config.scan_unroll,
        "grad_accum": args.grad_accum,
        "steps_per_call": k,
        "compile_s": round(max(0.0, first_call - k * step_s), 2),
        "step_ms": round(step_s * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "samples": len(times),
        "steps_per_sample": group * k,
        "tokens_per_s": round(tokens / step_s, 1),
        "flops_per_token": fpt,
        "gflops": round(gflops, 2),
        "peak_gflops": round(peak_gflops, 2),
        "mfu": round(gflops / peak_gflops, 3),
        "final_loss": float(loss),
    }


def compile_seconds(n_layers: int, args) -> float:
    """Seconds to trace and compile the training step of the shakespeare-char widths with `n_layers`,
    its layers scanned (not unrolled, as the preset runs them): what scanning keeps constant."""
    widths = smoke_shape(CONFIGS["shakespeare-char"][0]) if args.smoke else CONFIGS["shakespeare-char"][0]
    options = dict(widths, n_layers=n_layers, scan_unroll=1)
    _, model, opt_state, advance = make_step(options, args.compile_batch, args)
    lowered_at = time.perf_counter()
    out = advance(model, opt_state, 0)
    jax.block_until_ready(out)
    first = time.perf_counter() - lowered_at
    model, opt_state, _ = out
    start = time.perf_counter()
    jax.block_until_ready(advance(model, opt_state, args.steps_per_call))
    return first - (time.perf_counter() - start)


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "load_average": [round(x, 2) for x in load] if load else None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _print_result(name: str, r: dict) -> None:
    print(
        f"{name:17s} {r['optimizer']:5s} L{r['n_layers']} d{r['d_model']} h{r['n_heads']} "
        f"T{r['context_length']} B{r['batch_size']} {r['compute_dtype']} {r['steps_per_call']}/call: "
        f"compile {r['compile_s']:.1f} s | step {r['step_ms']:.1f} ms | {r['tokens_per_s']:,.0f} tok/s | "
        f"{r['flops_per_token'] / 1e6:.2f} MFLOP/tok | {r['gflops']:.1f} GFLOP/s | "
        f"peak {r['peak_gflops']:.1f} | MFU {r['mfu']:.2f}",
        flush=True,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["default", "nanogpt-cpu", "shakespeare-char"],
                   choices=sorted(CONFIGS))  # fmt: skip
    p.add_argument("--batch-size", type=int, help="override every config's batch size")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--scan-unroll", type=int, help="override GPTConfig.scan_unroll")
    p.add_argument("--dropout", type=float, help="override the configs' dropout")
    p.add_argument(
        "--steps-per-call", type=int, default=STEPS_PER_CALL, help="optimiser steps per dispatch (1: one)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls after the compiling one")
    p.add_argument("--seconds", type=float, default=20.0, help="time budget per config")
    p.add_argument("--min-samples", type=int, default=5, help="timed groups of steps, at least")
    p.add_argument("--group-seconds", type=float, default=0.5, help="steps dispatched per timed group")
    p.add_argument("--peak-size", type=int, default=2048, help="n of the n x n fp32 matmul (>= 2048)")
    p.add_argument("--compile-layers", action="store_true", help="also time compiles of 2 vs 12 layers")
    p.add_argument("--compile-only", action="store_true", help="only time compiles of 2 vs 12 layers")
    p.add_argument("--compile-batch", type=int, default=8)
    p.add_argument("--compile-reps", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument(
        "--optimizer", nargs="+", default=["adamw"], choices=OPTIMIZERS,
        help="optimisers to time; with several, each config is timed with each in turn, --rounds times "
        "in alternating order, and the step-time ratio to the first is printed",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="rounds per optimiser when several are timed")
    p.add_argument("--muon-ns-steps", type=int, default=5, help="Newton-Schulz iterations under Muon")
    add_malloc_argument(p)
    add_smoke_argument(p)
    args = p.parse_args(argv)
    malloc = set_malloc(args)  # before JAX starts its threads
    args.optimizer_now = args.optimizer[0]  # what make_step builds (compile timings use the first)
    if args.smoke:  # every config tiny, one group of 2 steps each; the compile comparison too
        args.steps_per_call, args.warmup, args.min_samples = 2, 1, 1
        args.seconds = args.group_seconds = 0.0
        args.compile_layers, args.compile_reps, args.compile_batch, args.peak_size = True, 1, 2, SMOKE_PEAK
    elif args.peak_size < 2048:
        p.error("--peak-size must be at least 2048 (a small matmul underestimates the peak)")

    info = machine()
    print(f"# {info['backend']} x{len(info['devices'])}, {info['cpu_count']} CPUs, jax {info['jax']}, "
          f"load average {info['load_average']}; {malloc}", flush=True)  # fmt: skip
    peak = MatmulPeak(args.peak_size)
    results = []
    if not args.compile_only:
        for name in args.configs:
            options, batch = CONFIGS[name]
            options = smoke_shape(options) if args.smoke else dict(options)
            batch = 2 if args.smoke else batch
            for field, value in (("compute_dtype", args.compute_dtype), ("scan_unroll", args.scan_unroll),
                                 ("dropout", args.dropout)):  # fmt: skip
                if value is not None:
                    options[field] = value
            rounds = args.rounds if len(args.optimizer) > 1 else 1
            order = [
                o for i in range(rounds) for o in (args.optimizer if i % 2 == 0 else args.optimizer[::-1])
            ]
            per_optimizer = {opt: [] for opt in args.optimizer}
            for opt in order:
                args.optimizer_now = opt
                try:
                    r = bench_config(name, options, args.batch_size or batch, args, peak)
                except ValueError as e:
                    print(f"error: {name}: {e}", file=sys.stderr)
                    return 2
                r["optimizer"] = opt
                results.append(r)
                per_optimizer[opt].append(r["step_ms"])
                _print_result(name, r)
            if len(args.optimizer) > 1:
                med = {opt: statistics.median(ms) for opt, ms in per_optimizer.items()}
                first = args.optimizer[0]
                steps = ", ".join(f"{opt} {m:.1f} ms" for opt, m in med.items())
                ratios = ", ".join(
                    f"{opt}/{first} {m / med[first]:.3f}" for opt, m in med.items() if opt != first
                )
                print(f"{name}: median step {steps}; {ratios}", flush=True)
    compile_result = None
    if args.compile_layers or args.compile_only:
        compile_seconds(1, args)  # one-time costs (first traces of helpers) land on neither depth
        times = {2: [], 12: []}
        for rep in range(args.compile_reps):  # interleaved, in alternating order: load hits both alike
            for n_layers in (2, 12) if rep % 2 == 0 else (12, 2):
                times[n_layers].append(compile_seconds(n_layers, args))
        med = {n: statistics.median(t) for n, t in times.items()}
        compile_result = {"compile_s_2_layers": round(med[2], 2), "compile_s_12_layers": round(med[12], 2),
                          "ratio": round(med[12] / med[2], 2)}  # fmt: skip
        print(
            f"train-step compile (shakespeare-char widths, batch {args.compile_batch}): 2 layers "
            f"{med[2]:.2f} s, 12 layers {med[12]:.2f} s, ratio {med[12] / med[2]:.2f} (target <= 1.5)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": info, "matmul_peak_size": args.peak_size, "results": results,
                   "compile_layers": compile_result}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
