"""eqx_gpt against Hugging Face `transformers` on GPT-2-124M, side by side on the same CPU.

    uv run --with torch --with transformers python bench/vs_transformers.py

torch and transformers come in a throwaway overlay (`uv run --with`), never into the project or
`uv.lock` (`--with /path/to/torch.whl` uses a local wheel). One random GPT-2 of the real 124M
shapes (`GPT2Config()`: 12 layers, 768 wide, 12 heads, 1,024 positions, 50,257 ids; no download)
is built by `transformers`, saved with `save_pretrained` and loaded by `eqx_gpt.gpt2.load_gpt2`, so
both sides hold the same weights; their logits are compared before any timing. Then, alternating
eqx_gpt and transformers for `--rounds` rounds:

- generation: batch 1, a 64-token prompt, 256 new tokens, greedy; `transformers`' KV-cached
  `generate(do_sample=False)` against `eqx_gpt.generate` (cached, jitted). Tokens per second.
  Then the same sampled as nanoGPT's `sample.py` does by default (temperature 0.8, top-k 200), where
  the tokens drawn differ but the work per token is the same.
- fine-tuning: one AdamW step (forward, backward, update) on 4 x 256 tokens; the trainer's step
  (`make_train_step`) against `loss.backward()` and `torch.optim.AdamW`. Seconds per step.

Each side runs once untimed first (eqx_gpt compiles there; its compile time is printed apart).
Both use every core (`torch.set_num_threads(os.cpu_count())`; XLA uses all cores by itself).
Figures are medians over rounds; ratios are eqx_gpt's speed over transformers' (above 1: faster).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import add_malloc_argument, add_smoke_argument, cpu_description, set_malloc  # noqa: E402

from eqx_gpt import (  # noqa: E402
    SamplingOptions,
    TrainConfig,
    generate,
    init_optimizer_state,
    load_gpt2,
    make_optimizer,
    make_train_step,
)

PROMPT, NEW_TOKENS, BATCH, SEQ, LR = 64, 256, 4, 256, 3e-5


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


SAMPLED = dict(temperature=0.8, top_k=200)  # nanoGPT sample.py's defaults


def eqx_generation(model, prompt, sampled: bool = False):
    options = SamplingOptions(**SAMPLED) if sampled else SamplingOptions(temperature=0.0)
    return lambda: generate(model, prompt, NEW_TOKENS, key=jax.random.key(0), options=options)


def hf_generation(model, prompt, sampled: bool = False, new_tokens: int | None = None):
    """`transformers`' KV-cached `generate` of `new_tokens` (default `NEW_TOKENS`, read when called:
    `--smoke` changes it) after `prompt`, on the model's device."""
    new_tokens = NEW_TOKENS if new_tokens is None else new_tokens
    ids = torch.from_numpy(prompt[None]).long().to(model.device)
    mask = torch.ones_like(ids)
    how = dict(do_sample=True, **SAMPLED) if sampled else dict(do_sample=False)

    def run():
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                use_cache=True, pad_token_id=0, **how,
            )  # fmt: skip
        return out[0, len(prompt) :].cpu().numpy()

    return run


def time_generation(gen: dict, rounds: int, what: str) -> None:
    """Alternate the two sides `rounds` times (both already run once) and print tokens per second."""
    gen_s = {name: [] for name in gen}
    for _ in range(rounds):
        for name, fn in gen.items():
            gen_s[name].append(timed(fn))
    tok_s = {name: NEW_TOKENS / statistics.median(t) for name, t in gen_s.items()}
    ratio = tok_s["eqx_gpt"] / tok_s["transformers"]
    print(f"generation, {what}, batch 1, prompt {PROMPT}, {NEW_TOKENS} new tokens: eqx_gpt "
          f"{tok_s['eqx_gpt']:.1f} tok/s, transformers {tok_s['transformers']:.1f} tok/s -> {ratio:.2f}x",
          flush=True)  # fmt: skip


def eqx_training(model, batch):
    """The trainer's AdamW step (gradient clipping off, as on the torch side)."""
    config = TrainConfig(
        optimizer="adamw", lr=LR, min_lr=LR, weight_decay=0.1, beta2=0.95, grad_clip=0.0, batch_size=BATCH
    )
    optimizer = make_optimizer(config)
    step = make_train_step(optimizer, config, dropout=False)
    state = {"model": model, "opt": init_optimizer_state(optimizer, model), "i": 0}
    batch = jnp.asarray(batch)

    def run():
        state["model"], state["opt"], loss = step(
            state["model"], state["opt"], batch, jnp.int32(state["i"]), jnp.float32(LR)
        )
        state["i"] += 1
        return float(loss)

    return run


def hf_training(model, batch, autocast: str | None = None):
    """One AdamW step of `model` on `batch`, on the model's device; `autocast` ("bfloat16") runs the
    forward under `torch.autocast`, as nanoGPT trains on a GPU."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.from_numpy(batch).long().to(model.device)
    dtype = getattr(torch, autocast) if autocast else None

    def run():
        with torch.autocast(model.device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(ids[:, :-1], labels=ids[:, :-1]).loss  # transformers shifts the labels itself
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per task (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    add_malloc_argument(p)
    add_smoke_argument(p)
    args = p.parse_args()
    global PROMPT, NEW_TOKENS, BATCH, SEQ
    shape = {}
    if args.smoke:  # a one-layer GPT-2 of GPT-2's vocabulary, a few tokens, one round
        PROMPT, NEW_TOKENS, BATCH, SEQ, args.rounds = 4, 4, 2, 8, 1
        shape = dict(n_layer=1, n_embd=32, n_head=2, n_positions=64)
    malloc = set_malloc(args)  # one process: torch's buffers come from the same malloc as XLA's
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; torch {torch.__version__} ({args.threads} threads), transformers "
          f"{transformers.__version__}, jax {jax.__version__}; {malloc}")  # fmt: skip

    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape)).eval()
    with tempfile.TemporaryDirectory() as directory:
        reference.save_pretrained(directory, safe_serialization=True)
        model = load_gpt2(directory)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50257, PROMPT).astype(np.int32)
    with torch.no_grad():
        expected = reference(torch.from_numpy(prompt[None]).long()).logits[0].numpy()
    diff = float(np.abs(np.asarray(model(jnp.asarray(prompt))) - expected).max())
    what = "a one-layer GPT-2 (--smoke)" if args.smoke else "GPT-2-124M shapes"
    print(f"{what}, random weights: logits max |diff| {diff:.1e} (eqx_gpt vs transformers)")
    if diff > 1e-3:
        raise SystemExit("the two models disagree; timing them would compare different work")

    gen = {"eqx_gpt": eqx_generation(model, prompt), "transformers": hf_generation(reference, prompt)}
    compile_s = timed(gen["eqx_gpt"])
    hf_tokens = gen["transformers"]()
    same = np.array_equal(np.asarray(gen["eqx_gpt"]()), hf_tokens)
    print(f"generation: eqx_gpt's first call (compiles) {compile_s:.1f} s; greedy tokens "
          f"{'equal' if same else 'differ (near-ties of random weights)'}")  # fmt: skip
    time_generation(gen, args.rounds, "greedy")
    gen = {"eqx_gpt": eqx_generation(model, prompt, sampled=True)}
    gen["transformers"] = hf_generation(reference, prompt, sampled=True)
    for fn in gen.values():
        fn()  # eqx_gpt compiles the sampled program here
    time_generation(gen, args.rounds, "temperature 0.8, top-k 200")

    batch = rng.integers(0, 50257, (BATCH, SEQ + 1)).astype(np.int32)
    train = {"eqx_gpt": eqx_training(model, batch), "transformers": hf_training(reference, batch)}
    compile_s = timed(train["eqx_gpt"])
    train["transformers"]()
    step_s = {name: [] for name in train}
    for _ in range(args.rounds):
        for name, fn in train.items():
            step_s[name].append(timed(fn))
    step = {name: statistics.median(t) for name, t in step_s.items()}
    print(f"fine-tuning step, AdamW, {BATCH} x {SEQ} tokens: eqx_gpt {step['eqx_gpt']:.2f} s "
          f"(first call, compiling: {compile_s:.1f} s), transformers {step['transformers']:.2f} s -> "
          f"{step['transformers'] / step['eqx_gpt']:.2f}x")  # fmt: skip

    return 0


if __name__ == "__main__":
    sys.exit(main())
