"""Generation speed: KV-cached `generate` against the naive rerun-the-window method, side by side.

    uv run python bench/sample.py [--new-tokens 500] [--json PATH]
    uv run python bench/sample.py --first-token out/      # time sample.py's first token (cold, warm)
    uv run python bench/sample.py --choice                # one token's choice among 50,257 ids

Throughput: for random-weight character models (vocab 65) of the 6-layer/384/context-256 shape
and of the default preset's shape, both methods generate `--new-tokens` tokens with the same key
and settings (temperature 1, batch 1). The naive method is nanoGPT's `generate`: rerun the model
on the last `context_length` tokens for every new token. Two prompts: one that fills the context
(so the naive window is always exactly `context_length`, nanoGPT's work token for token), and an
8-token prompt (the naive window grows first; it is padded to a power-of-two bucket so that only a
few shapes compile, which can cost it up to 2x while the window is short). Both are compiled
first; compile seconds are reported separately. The ratio is cached / naive tokens per second.
The cached method slides its window differently (see `eqx_gpt.generation.generate`), so the two agree
token for token only until the first slide.

Floor: a cached token must at least read every weight matrix once. Each repetition also times a bare
jitted chain of the model's matrix-vector products (each layer's `attn.qkv`, `attn.out`, MLP `up`,
`down`, then the head; no attention, norms or sampling) and prints the ratio that such a
decode step would reach against the naive timing above: the ceiling for this machine.

Choice (`--choice`): one token's choice from GPT-2's 50,257 logits, jitted, per setting
(temperature, top-k, top-p), this library's `sample_next_token` (filters by bisection on the values,
a two-stage draw) against the sort-based filters and one Gumbel number per id that it replaced,
kept here as the baseline (`sorted_choice`). Interleaved, medians of 5 repetitions.

First token (`--first-token CHECKPOINT`): starts `python sample.py` in a fresh process and times
until the first generated character reaches its stdout (the prompt is echoed before generation
and is not counted): once with an empty compilation cache (cold) and then again (warm).
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
import jax.numpy as jnp
import numpy as np

from eqx_gpt import GPT, PRESETS, GPTConfig, SamplingOptions, generate, sample_next_token

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from oracles import naive_generate, naive_step, prompt_bucket  # noqa: E402  (the tests' oracle)

sys.path.insert(0, str(ROOT / "bench"))
from common import DEFAULT_PRESET, add_smoke_argument, cpu_description, smoke_shape  # noqa: E402

SHAPES = {
    "6L-384-ctx256": dict(context_length=256, d_model=384, n_heads=6, n_layers=6),
    f"preset {DEFAULT_PRESET}": {k: v for k, v in PRESETS[DEFAULT_PRESET].model.items() if k != "dropout"},
}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def compile_naive(model, key):
    """Compile the naive step for every window bucket it will meet (so timing excludes compiles)."""
    context = model.config.context_length
    model = eqx.nn.inference_mode(model)  # as naive_generate runs it
    sizes = sorted({prompt_bucket(n, context) for n in range(1, context + 1)})
    for size in sizes:
        naive_step(
            model, jnp.zeros(size, jnp.int32), jnp.int32(1), key, jnp.int32(0), jnp.float32(1.0), None, None
        ).block_until_ready()
    return sizes


def matvec_chain(model: GPT, tokens: int):
    """A jitted function running `tokens` steps of the model's weight matrix-vector products alone."""
    layers = model.unstack().blocks.layers
    layer_matrices = [
        w for b in layers for w in (b.attn.qkv.weight, b.attn.out.weight, b.mlp.up.weight, b.mlp.down.weight)
    ]

    def run(x, layer_matrices, head):
        def one_token(_, h):
            for w in layer_matrices:  # each product feeds the next, as in the model
                h = h[: w.shape[0]] @ w
            return h + (h @ head)[0]  # the head too; the carry keeps the chain dependent

        return jax.lax.fori_loop(0, tokens, one_token, x)

    chain = jax.jit(run)
    x = jnp.ones(model.config.d_model) * 1e-3
    return lambda: chain(x, layer_matrices, model.head_weight).block_until_ready()


def bench_shape(name, shape, new_tokens, reps, prompt_len):
    config = GPTConfig(vocab_size=65, **shape)
    context = config.context_length
    model = GPT(config, key=jax.random.key(0))
    prompt = np.asarray(jax.random.randint(jax.random.key(1), (prompt_len or context,), 0, 65))
    key = jax.random.key(2)
    run_cached = lambda: generate(model, prompt, new_tokens, key=key)
    # nanoGPT's policy: the window is always the last `context` tokens (keep = context).
    run_naive = lambda: naive_generate(
        model, prompt, new_tokens, key=key, options=SamplingOptions(keep=context)
    )

    # 40 tokens: the prefill, a slide (for a full prompt) and the decode loop all compile here.
    _, cached_compile = timed(lambda: generate(model, prompt, 40, key=key))
    _, naive_compile = timed(lambda: compile_naive(model, key))
    run_floor = matvec_chain(model, new_tokens)
    run_floor()
    cached_times, naive_times, floor_times = [], [], []
    for _ in range(reps):  # interleaved, so machine load hits all alike
        cached, t = timed(run_cached)
        cached_times.append(t)
        naive, t = timed(run_naive)
        naive_times.append(t)
        floor_times.append(timed(run_floor)[1])
    cached_s, naive_s, floor_s = min(cached_times), min(naive_times), min(floor_times)
    same = int(np.argmin(np.append(cached == naive, False)))  # length of the common prefix
    result = dict(
        model=name,
        prompt_tokens=len(prompt),
        config=config.to_dict(),
        new_tokens=new_tokens,
        cached_tokens_per_s=new_tokens / cached_s,
        naive_tokens_per_s=new_tokens / naive_s,
        ratio=naive_s / cached_s,
        matvec_floor_ms_per_token=floor_s / new_tokens * 1e3,
        ratio_ceiling=naive_s / floor_s,
        cached_compile_s=cached_compile,
        naive_compile_s=naive_compile,
        cached_seconds=cached_times,
        naive_seconds=naive_times,
        same_tokens_before_first_slide=same,
        load_average=os.getloadavg()[0],
    )
    print(
        f"{name:>14} prompt {len(prompt):3d}: cached {result['cached_tokens_per_s']:6.1f} tok/s | naive "
        f"{result['naive_tokens_per_s']:5.1f} tok/s | ratio {result['ratio']:5.1f}x (matvec floor "
        f"{result['matvec_floor_ms_per_token']:.2f} ms/token: ceiling {result['ratio_ceiling']:4.1f}x) | "
        f"compile cached "
        f"{cached_compile:.1f} s, naive {naive_compile:.1f} s (all buckets) | "
        f"load {result['load_average']:.1f}",
        flush=True,
    )
    return result


def sorted_choice(logits, key, temperature, top_k, top_p):
    """The baseline: rank every id by a stable sort, filter on ranks, draw with one Gumbel per id."""
    scaled = logits / temperature
    order = jnp.argsort(-scaled, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(scaled.shape[0]))
    if top_k is not None:
        scaled = jnp.where(rank < top_k, scaled, -jnp.inf)
    if top_p is not None:
        probs = jax.nn.softmax(scaled)[order]
        scaled = jnp.where(((jnp.cumsum(probs) - probs) < top_p)[rank], scaled, -jnp.inf)
    return jnp.where(temperature > 0, jax.random.categorical(key, scaled), jnp.argmax(logits))


def bench_choice(reps: int = 5, calls: int = 100) -> dict:
    """ms per token choice among GPT-2's 50,257 ids: `sample_next_token` against `sorted_choice`."""
    logits = 3 * jax.random.normal(jax.random.key(0), (50257,))
    settings = {
        "temperature 0.8": (0.8, None, None),
        "top-k 200": (0.8, 200, None),
        "top-p 0.9": (0.8, None, 0.9),
        "top-k 200, top-p 0.9": (0.8, 200, 0.9),
    }
    results = {}
    for name, (t, k, p) in settings.items():
        args = [jnp.float32(t), None if k is None else jnp.int32(k), None if p is None else jnp.float32(p)]
        ours = jax.jit(lambda lg, key, t, k, p: sample_next_token(lg, key, temperature=t, top_k=k, top_p=p))
        methods = {"eqx_gpt": ours, "sorted": jax.jit(sorted_choice)}
        times = {m: [] for m in methods}
        for fn in methods.values():
            fn(logits, jax.random.key(1), *args).block_until_ready()
        for _ in range(reps):
            for m, fn in methods.items():
                start = time.perf_counter()
                for i in range(calls):
                    out = fn(logits, jax.random.key(i), *args)
                out.block_until_ready()
                times[m].append((time.perf_counter() - start) / calls * 1e3)
        ms = {m: statistics.median(v) for m, v in times.items()}
        results[name] = ms
        print(f"{name:>22}: eqx_gpt {ms['eqx_gpt']:6.3f} ms, sorted {ms['sorted']:6.3f} ms -> "
              f"{ms['sorted'] / ms['eqx_gpt']:5.1f}x", flush=True)  # fmt: skip
    return results


def first_token_seconds(checkpoint: Path, cache_home: Path, max_new_tokens: int = 64) -> float:
    """Seconds from starting `python sample.py` to the first generated character on its stdout."""
    prompt = "ROMEO:"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    cmd = [sys.executable, str(ROOT / "sample.py"), "--checkpoint", str(checkpoint), "--prompt", prompt]
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "--max-new-tokens", str(max_new_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    seen = b""
    while len(seen) <= len(prompt):
        byte = proc.stdout.read(1)
        if not byte:
            raise RuntimeError(f"sample.py ended before generating: {proc.stderr.read().decode()}")
        seen += byte
    elapsed = time.perf_counter() - start
    proc.communicate()
    return elapsed


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new-tokens", type=int, default=500)
    parser.add_argument("--reps", type=int, default=2, help="timed runs of each method (best is kept)")
    parser.add_argument(
        "--first-token", type=Path, help="checkpoint or run dir: time sample.py's first token"
    )
    parser.add_argument("--choice", action="store_true", help="time one token's choice among 50,257 ids")
    parser.add_argument("--json", type=Path, help="also write the results here")
    add_smoke_argument(parser)
    args = parser.parse_args()
    shapes = SHAPES
    if args.smoke:  # one shape, tiny, with both prompts: a full window that slides and one that grows
        shapes = {name: smoke_shape(shape) for name, shape in list(SHAPES.items())[-1:]}
    if args.smoke:  # the throughput of tiny models, then the choice, each as briefly as it runs
        args.new_tokens, args.reps = 4, 1
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPU cores", flush=True)

    if args.choice:
        print(f"CPU: {cpu_description()}; one token's choice among GPT-2's 50,257 ids", flush=True)
        results = bench_choice(**({"reps": 1, "calls": 2} if args.smoke else {}))
    elif args.first_token:
        with tempfile.TemporaryDirectory() as cache_home:
            cold = first_token_seconds(args.first_token, Path(cache_home))
            warm = [first_token_seconds(args.first_token, Path(cache_home)) for _ in range(3)]
        results = dict(checkpoint=str(args.first_token), first_token_cold_s=cold, first_token_warm_s=warm)
        print(
            f"first token after {cold:.2f} s cold (empty compile cache), "
            f"warm: {', '.join(f'{w:.2f}' for w in warm)} s"
        )
    else:
        results = [
            bench_shape(name, shape, args.new_tokens, args.reps, prompt_len)
            for prompt_len in (0, 8)
            for name, shape in shapes.items()
        ]
        if args.smoke:
            bench_choice(reps=1, calls=2)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
