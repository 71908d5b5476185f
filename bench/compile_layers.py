"""Compile time of the GPT forward pass for 2 vs 12 layers, measured side by side.

    uv run python bench/compile_layers.py [--reps 3]

Layers are stacked and run with `jax.lax.scan`, so the compiled program (and its compile time)
should not grow with depth. Prints the median compile seconds for each depth and their ratio.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from common import add_smoke_argument, smoke_shape  # bench/common.py

from eqx_gpt import GPT, GPTConfig


def compile_seconds(n_layers: int, batch: int, smoke: bool = False) -> float:
    shape = dict(context_length=256, d_model=384, n_heads=6)
    config = GPTConfig(vocab_size=65, **{**(smoke_shape(shape) if smoke else shape), "n_layers": n_layers})
    model = GPT(config, key=jax.random.key(0))
    tokens = jnp.zeros((batch, config.context_length), jnp.int32)

    def loss(model, tokens):
        return jax.vmap(model)(tokens).mean()

    # A fresh function object each time, so nothing is reused from a previous compile.
    fn = eqx.filter_jit(lambda m, t: eqx.filter_value_and_grad(loss)(m, t))
    start = time.perf_counter()
    fn.lower(model, tokens).compile()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.reps, args.batch = 1, 1
    times = {2: [], 12: []}
    for _ in range(args.reps):  # interleaved, so machine load hits both depths alike
        for n_layers in times:
            times[n_layers].append(compile_seconds(n_layers, args.batch, args.smoke))
    med = {n: statistics.median(t) for n, t in times.items()}
    for n, t in med.items():
        print(f"n_layers={n:2d}: compile {t:.2f} s (forward + backward, median of {args.reps})")
    print(f"ratio 12 / 2 layers: {med[12] / med[2]:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
