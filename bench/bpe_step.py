"""The default body's training step with GPT-2's 50,257 ids: the plain loss against the chunked one.

    uv run python bench/bpe_step.py [--rounds 3] [--seconds 10] [--batch-size 48]

Builds the `cpu` preset's model and optimiser with `--tokenizer gpt2`'s vocabulary and times one
jitted training step (`make_train_step`) per variant, in interleaved rounds so that a busy machine
slows all alike:
- "plain loss": every logit at once (`model(inputs)`, then optax's cross-entropy), the loss before
  `eqx_gpt.model.loss`;
- "chunked loss": `train.py`'s loss (`next_token_loss`: `chunked_cross_entropy` at this vocabulary),
  at its default block of columns and at `--blocks` others.
Prints the CPU model, each variant's median ms per step and tokens/s, and their ratios to the plain
loss's; then two figures a loaded machine does not disturb: the scratch memory XLA plans for the
loss and its gradient, and the minor page faults per step (fresh buffers mapped and zero-filled).
The first step's loss is printed too: the variants train the same model from the same state.
"""

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GPT2_VOCAB_SIZE,
    add_malloc_argument,
    add_smoke_argument,
    cpu_description,
    preset_configs,
    set_malloc,
    smoke_config,
)

from eqx_gpt import (  # noqa: E402
    GPT,
    GPTConfig,
    TrainConfig,
    chunked_cross_entropy,
    init_optimizer_state,
    loss_fn,
    make_optimizer,
    make_train_step,
)


def plain_loss(model, batch, keys=None):
    """The loss before chunking: all `[tokens, vocab]` logits, then optax's cross-entropy."""
    logits = model(batch[:, :-1], key=keys)
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def chunked_loss(block: int):
    def loss(model, batch, keys=None):
        c, targets = model.config, batch[:, 1:]
        total = chunked_cross_entropy(
            model.features(batch[:, :-1], key=keys), model.head_weight, targets,
            vocab_size=c.vocab_size, logit_softcap=c.logit_softcap, block=block,
        )  # fmt: skip
        return total / targets.size

    return loss


def gradient_memory_mb(model: GPT, batch, loss) -> float:
    """The scratch memory (MB) XLA plans for `loss`'s value and gradient: its compiled temp buffer."""
    compiled = eqx.filter_jit(eqx.filter_value_and_grad(loss)).lower(model, batch).compile()
    analysis = compiled.compiled.memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 1e6


def make_advance(model_config: GPTConfig, config: TrainConfig, loss):
    """`advance() -> loss`: one real training step of the preset's configs, with `loss`."""
    optimizer = make_optimizer(config)
    step_fn = make_train_step(optimizer, config, dropout=model_config.dropout > 0, loss=loss)
    state = [GPT(model_config, key=jax.random.key(0))]
    state.append(init_optimizer_state(optimizer, state[0]))
    window = model_config.context_length + 1
    batch = jax.random.randint(jax.random.key(1), (config.batch_size, window), 0, GPT2_VOCAB_SIZE)
    step, lr = np.int32(0), np.float32(1e-4)

    def advance():
        state[0], state[1], value = step_fn(state[0], state[1], batch, step, lr)
        return float(value)

    memory = gradient_memory_mb(state[0], batch, loss)
    return advance, config.batch_size * model_config.context_length, memory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants")
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per variant per round")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--blocks", type=int, nargs="*", default=[], help="other block widths (columns) to time")
    add_malloc_argument(p)
    add_smoke_argument(p)
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.seconds, args.batch_size = 1, 0.0, 2
    print(f"CPU: {cpu_description()}; load {os.getloadavg()}; jax {jax.__version__}; {set_malloc(args)}")
    model_config, config = preset_configs("cpu", GPT2_VOCAB_SIZE)
    if args.smoke:
        model_config = smoke_config(model_config)
    if args.batch_size is not None:
        config = dataclasses.replace(config, batch_size=args.batch_size)
    variants = {"plain loss": plain_loss, "chunked loss (default block)": loss_fn}
    variants |= {f"chunked loss ({c} columns)": chunked_loss(c) for c in args.blocks}
    runs = {}
    for name, loss in variants.items():
        advance, tokens, memory = make_advance(model_config, config, loss)
        start = time.perf_counter()
        value = advance()  # compiles
        print(
            f"{name}: first step (compiling) {time.perf_counter() - start:.1f} s, loss {value:.4f}; "
            f"the loss and its gradient plan {memory:,.0f} MB of scratch memory"
        )
        runs[name] = (advance, tokens, [], [0])
    for _ in range(args.rounds):
        for advance, _, times, faults in runs.values():
            end = time.perf_counter() + args.seconds
            while not times or time.perf_counter() < end:  # one step at least
                start, faulted = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                advance()
                times.append(time.perf_counter() - start)
                faults[0] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted
    base_step = statistics.median(runs["plain loss"][2])
    for name, (_, tokens, times, faults) in runs.items():
        step = statistics.median(times)
        print(
            f"{name:28s} {step * 1e3:8.1f} ms/step ({step / base_step:5.3f}x the plain loss's)  "
            f"{tokens / step:8,.0f} tok/s  {faults[0] / len(times):10,.0f} page faults/step  "
            f"({len(times)} steps)"
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
