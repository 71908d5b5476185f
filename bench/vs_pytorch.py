"""eqx_gpt against PyTorch on the same CPU: the same model and training step, timed side by side.

    uv run python bench/vs_pytorch.py --configs nanogpt-cpu shakespeare-char [--compile]

For each config, one set of initial weights and batches feeds both sides. The PyTorch side
(`bench/torch_gpt.py`) runs in a throwaway environment (`uv run --no-project --with torch==...`),
so torch never enters the project's dependencies or `uv.lock`; `--torch-wheel PATH` uses a local
wheel instead of the index. Both sides must agree, checked on PyTorch's first run before any
further timing: the same parameter count and the same loss on the first batch from the same
weights, to 1e-4 (a comparison of different work is worthless). The timings alternate, eqx_gpt,
PyTorch, eqx_gpt, PyTorch (`--rounds`), and each config prints one line: both median step
times, their ratio (eqx_gpt / PyTorch; below 1 is faster), the MFU of both, and the CPU model
with its AVX-512 and AMX flags. `--compile` adds `torch.compile`.

MFU: both sides do the same model FLOPs per step (`bench/common.py`'s `flops_per_token`), divided by
the rate of a 2048 x 2048 fp32 `jnp` matmul timed in this run, twice over: isolated (five matmuls
back to back before the config's timings) and interleaved (one after each timing block, so that
load on the machine hits the peak as it hits the steps). Both are printed: their spread is how
far a peak measured once can be trusted.

The eqx_gpt step is the trainer's (`make_train_steps`, `--steps-per-call` steps per dispatch; 1
times one step per call, as nanoGPT runs). Its step time is the median over calls of each call's
time per step; PyTorch's, the median over its steps. Both sides use every core (`--threads`, default all).
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

import equinox as eqx
import jax
import numpy as np
from common import (  # bench/common.py
    CONFIGS,
    SMOKE_PEAK,
    STEPS_PER_CALL,
    MatmulPeak,
    add_smoke_argument,
    count_params,
    cpu_description,
    data_mesh,
    mfu,
    replicate,
    shard_batch,
    smoke_shape,
)

from eqx_gpt import (
    GPT,
    GPTConfig,
    TrainConfig,
    init_optimizer_state,
    loss_fn,
    make_optimizer,
    make_train_steps,
    sinusoidal_positions,
)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 65

# The configs of issue 18 (`bench/common.py`) and their timed steps per side and round (~1 minute)
STEPS = {"nanogpt-cpu": 32, "shakespeare-char": 8}


def export(model: GPT, batches: np.ndarray, path: Path) -> None:
    """Our initial weights (stacked layers split per name) and the batches, for the torch side."""
    b, layers = model.blocks.layers, model.config.n_layers
    arrays = {
        "embed": model.embed, "head": model.head_weight, "final_norm": model.final_norm.scale,
        "blocks.attn_norm": b.attn_norm.scale, "blocks.w_qkv": b.attn.qkv.weight,
        "blocks.w_attn_out": b.attn.out.weight, "blocks.mlp_norm": b.mlp_norm.scale,
        "blocks.w_in": b.mlp.up.weight, "blocks.w_mlp_out": b.mlp.down.weight, "batches": batches,
        "positions": sinusoidal_positions(model.config.context_length, model.config.d_model),
    }  # fmt: skip
    assert all(np.asarray(arrays[k]).shape[0] == layers for k in arrays if k.startswith("blocks."))
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})


def jax_side(model, batches, train_config, steps_per_call: int):
    """`time_block(n_calls) -> [seconds per step of each call]` running the trainer's jitted steps.

    Each call's time counts until its results are ready, as the trainer reads each call's losses."""
    mesh = data_mesh()
    optimizer = make_optimizer(train_config)
    state = replicate((model, init_optimizer_state(optimizer, model)), mesh)
    steps_fn = make_train_steps(optimizer, train_config, dropout=model.config.dropout > 0)
    k = steps_per_call
    stack = shard_batch(np.stack([batches[i % len(batches)] for i in range(k)]), mesh, batch_axis=1)
    lrs, counter = np.full(k, train_config.lr, np.float32), [0]

    def time_block(n_calls: int) -> list[float]:
        nonlocal state
        times = []
        for _ in range(n_calls):
            start = time.perf_counter()
            steps = np.arange(counter[0], counter[0] + k, dtype=np.int32)
            model, opt_state, _ = steps_fn(*state, stack, steps, lrs, np.int32(k))
            state, counter[0] = jax.block_until_ready((model, opt_state)), counter[0] + k
            times.append((time.perf_counter() - start) / k)
        return times

    time_block(1)  # compile
    return time_block


def torch_side(spec: dict, args, workdir: Path) -> dict:
    path = workdir / "spec.json"
    path.write_text(json.dumps(spec))
    torch_req = args.torch_wheel or f"torch=={args.torch}"
    cmd = ["uv", "run", "--no-project", "--python", f"{sys.version_info.major}.{sys.version_info.minor}"]
    cmd += ["--with", torch_req, "--with", "numpy", "python"]
    if args.smoke:  # the environment this runs in has torch (the smoke test skips where it has not)
        cmd = [sys.executable]
    cmd += [str(ROOT / "bench" / "torch_gpt.py"), str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    if out.returncode != 0:
        raise SystemExit(f"the PyTorch side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_same_work(name: str, model: GPT, loss0: float, result: dict) -> None:
    """Refuse to compare models that differ in parameter count or in the loss of the same batch."""
    if result["n_params"] != count_params(model) or abs(result["loss0"] - loss0) > 1e-4:
        raise SystemExit(
            f"{name}: the two models differ (parameters {count_params(model)} vs {result['n_params']}, "
            f"first loss {loss0:.6f} vs {result['loss0']:.6f}); refusing to compare different work"
        )


def bench(name: str, args, workdir: Path, peak: MatmulPeak) -> str:
    options, batch_size = CONFIGS[name]
    if args.smoke:
        options, batch_size = smoke_shape(options), 2
    config = GPTConfig(vocab_size=VOCAB, **options)
    model = GPT(config, key=jax.random.key(0))
    train_config = TrainConfig(batch_size=batch_size, lr=1e-4, seed=0)
    rng = np.random.default_rng(0)
    batches = rng.integers(0, VOCAB, (4, batch_size, config.context_length + 1), dtype=np.int32)
    export(model, batches, workdir / "weights.npz")
    steps = args.steps or (1 if args.smoke else STEPS[name])
    spec = {
        "weights": str(workdir / "weights.npz"), "threads": args.threads, "compile": False,
        "config": {**config.to_dict(), "d_hidden": config.d_hidden}, "warmup": 2, "steps": steps,
        "train": {k: getattr(train_config, k) for k in ("lr", "beta1", "beta2", "weight_decay", "grad_clip")},
    }  # fmt: skip
    # The first batch's loss without dropout (PyTorch's side: `model.eval()`): the same weights give
    # the same number, whatever dropout the config trains with.
    loss0 = float(loss_fn(eqx.nn.inference_mode(model), jax.numpy.asarray(batches[0])))
    time_block = jax_side(model, batches, train_config, args.steps_per_call)
    calls = max(1, steps // args.steps_per_call)
    ours, theirs, compiled = [], [], []
    isolated = statistics.median(peak.sample() for _ in range(5))
    interleaved = []
    for _ in range(args.rounds):  # alternate, so that load on the machine hits both alike
        ours += time_block(calls)
        interleaved.append(peak.sample())
        result = torch_side(spec, args, workdir)
        check_same_work(name, model, loss0, result)
        theirs += result["step_s"]
        interleaved.append(peak.sample())
        if args.compile:
            compiled += torch_side({**spec, "compile": True}, args, workdir)["step_s"]
    ours_ms, theirs_ms = 1e3 * statistics.median(ours), 1e3 * statistics.median(theirs)
    line = (
        f"{name}: eqx_gpt {ours_ms:.1f} ms/step ({args.steps_per_call}/call), PyTorch {result['torch']} "
        f"eager {theirs_ms:.1f} ms/step; eqx_gpt/PyTorch {ours_ms / theirs_ms:.2f}"
    )
    if compiled:
        compiled_ms = 1e3 * statistics.median(compiled)
        line += f"; torch.compile {compiled_ms:.1f} ms/step, eqx_gpt/compiled {ours_ms / compiled_ms:.2f}"
    interleaved = statistics.median(interleaved)
    line += "; MFU eqx_gpt/PyTorch " + ", ".join(
        f"{mfu(ours_ms / 1e3, config, batch_size, p):.2f}/{mfu(theirs_ms / 1e3, config, batch_size, p):.2f} "
        f"against a {p:.0f} GFLOP/s matmul {how}"
        for p, how in ((interleaved, "interleaved"), (isolated, "isolated"))
    )
    return line + f" | {count_params(model):,} parameters, first loss {loss0:.5f} both | {cpu_description()}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=sorted(STEPS), choices=sorted(STEPS))
    p.add_argument("--compile", action="store_true", help="also time torch.compile")
    p.add_argument("--rounds", type=int, default=2, help="alternations of eqx_gpt and PyTorch timings")
    p.add_argument("--steps", type=int, help="timed steps per side and round (default: STEPS)")
    p.add_argument("--steps-per-call", type=int, default=STEPS_PER_CALL)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--torch", default="2.13.*", help="torch version for the throwaway environment")
    p.add_argument("--torch-wheel", help="a local torch wheel to use instead (path)")
    add_smoke_argument(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds = 1
    peak = MatmulPeak(SMOKE_PEAK if args.smoke else 2048)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            print(bench(name, args, Path(tmp), peak), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
