"""`eqx-gpt serve` under concurrent streaming clients: aggregate tokens/s and time to first token.

    uv run python bench/serve.py [--models gpt2-124m,char] [--clients 1,4,16] [--rounds 2]
                                 [--batches 1,2,4,8,16] [--pp N] [--tg N] [--smoke]

For each model (random weights: GPT-2-124M's shapes with GPT-2's 50,257 ids, and the default `cpu`
preset's char model), a server with 16 slots runs on 127.0.0.1 (uvicorn in this process); N
clients (threads, httpx) each stream `--rounds` completions of `--tokens` tokens back to back.
Printed per N: aggregate completion tokens/s (all clients' tokens over the wall time), time to
first token p50/p99 (from sending the request to its first text), and the ratio of tokens/s to one
client's. Then one client on a 1-slot server: the same model decoded without batching, the
reference that shows what the slots cost a lone client. Every server is warmed first (its
programs compiled) and the CPU model is printed with the figures. Traffic stays on loopback.

Then, per model, llama.cpp's `batched-bench` table (`llama-batched-bench -npp PP -ntg TG
-npl 1,2,4,8,16`, prompt not shared), so the figures read beside the community's. It is timed at
the `Batcher`, the decode loop the server runs (the HTTP API streams a request's first token and
the rest alike, so prefill and generation cannot be told apart through it): B sequences of PP
random token ids are submitted at once to an idle 16-slot batcher (`eqx-gpt serve`'s default),
which admits them all in one step, prefills them one after another, then decodes them together.

- `PP`, `TG`, `B`: prompt tokens per sequence, tokens generated per sequence, sequences.
- `N_KV` = B*(PP+TG): the cache positions the round fills.
- `T_PP s`: from submitting the B prompts to the last of their first tokens: every prompt's
  prefill (one jitted call each, padded to its power-of-two bucket: pick PP a power of two) and
  the sampling of its first token. llama.cpp decodes the B prompts in one batch and samples none.
- `S_PP t/s` = B*PP / T_PP.
- `T_TG s`: from there to the last sequence's last token: TG decode steps, each advancing every
  slot by one token (the 16 - B free slots step too, as in the server). Each sequence asks for
  TG + 1 tokens, the first drawn by its prefill, so TG tokens come from decode steps, as in
  llama.cpp's TG loop.
- `S_TG t/s` = B*TG / T_TG; `T s` = T_PP + T_TG; `S t/s` = N_KV / T.

Sampling is the server's (temperature 1, no filters), the tokens handed back to Python per step as
the server has them; llama.cpp's tool runs the model alone. A warm-up round compiles the programs.

    uv run python bench/serve.py --clients "" --pp 128 --tg 32   # the table alone

Then, per model, what attention through the API costs (`attention` on `/v1/completions`), timed at
the `Batcher` as above: 16 sequences of PP prompt tokens drawing TG + 1 tokens each, in three
variants run in turn, `--attention-rounds` times each (the median printed):
- `before`: a batcher that never runs the attention variant of its programs (the decode step as it
  was before requests could ask; `WithoutAttention`);
- `none asks`: the server's batcher, no sequence asking (the issue's bound: within 3% of `before`);
- `1 of 16 asks`: the server's batcher, one sequence asking for the most a request may (every
  head of as many layers as `ATTENTION_MAX_PAIRS` rows allow), so every decode step runs the
  attention variant; the figure is the other 15 sequences' (the bound: at most 10% below
  `none asks`). An attention output computed at every step whoever asks would cost every request
  what this row costs the 15.
Each figure is the decode phase's tokens/s of the 15 sequences that never ask: their tokens after
the first over the time from the last prefill to the last token. Then the same through the server
(`HTTP` rows: 16 streamed completions of the first table's tokens, the asking one's attention
rounded and written as JSON in the server's process, which the others share): none asks against
1 of 16 asks, the 15 others' tokens over the time until the last of them ends.

    uv run python bench/serve.py --clients "" --batches "" --adapters 0 --attention-rounds 5   # alone

Then, per model, many LoRA adapters in one batch (`--adapters 4`, 0 for none): `--adapter-streams`
(16) streaming clients on the base alone, then as many spread over 4 random adapters (rank
`--adapter-rank`, PEFT's GPT-2 default 8, on `--adapter-targets`, default `c_attn`) served beside
it (`create_app(adapters=...)`: each slot applies its own adapter's A and B to the shared base),
with the ratio of their aggregate tokens/s (the issue's target: at least 0.8).

    uv run python bench/serve.py --models gpt2-124m --clients "" --batches "" --attention-rounds 0   # alone
"""

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import equinox as eqx
import httpx
import jax
import numpy as np
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_description  # noqa: E402

from eqx_gpt import (  # noqa: E402
    GPT,
    PRESETS,
    CharTokenizer,
    GPT2Tokenizer,
    GPTConfig,
    LoRALinear,
    SamplingOptions,
    apply_lora,
    create_app,
)
from eqx_gpt.serve.batcher import (  # noqa: E402
    ATTENTION_MAX_PAIRS,
    Batcher,
    Failed,
    Finished,
    Sequence,
    Token,
    sample_key_data,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED_BPE = ROOT.parent / "shared" / "data" / "tiktoken-cache"
SLOTS = 16  # `eqx-gpt serve`'s default
# llama.cpp batched-bench's PP and TG per model, within its context (GPT-2 1,024, the char model 64)
COLUMNS = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"]
BATCHED_PP_TG = {"gpt2-124m": (128, 32), "char": (32, 16)}


def build(name: str):
    """`(model, tokenizer, prompt, tokens per request)` of a benched model, with random weights."""
    if name == "gpt2-124m":
        if "TIKTOKEN_CACHE_DIR" not in os.environ and SHARED_BPE.is_dir():
            os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED_BPE)
        tokenizer = GPT2Tokenizer()
        config = GPTConfig(**{**PRESETS["gpt2-124m"].model, "vocab_size": tokenizer.vocab_size})
        return GPT(config, key=jax.random.key(0)), tokenizer, "The meaning of life is", 32
    text = (ROOT / "eqx_gpt" / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    tokenizer = CharTokenizer.from_text(text)
    config = GPTConfig(**{**PRESETS["cpu"].model, "vocab_size": tokenizer.vocab_size})
    return GPT(config, key=jax.random.key(0)), tokenizer, "ROMEO:", 128


class Server:
    """uvicorn serving an app on a free loopback port, in a thread."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join()


def stream_one(url: str, prompt: str, tokens: int, seed: int, model: str = "bench") -> tuple[float, int]:
    """`(seconds to the first text, completion tokens)` of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "seed": seed,
            "temperature": 1.0, "stream_options": {"include_usage": True}}  # fmt: skip
    sent, first, used = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    return (first if first is not None else float("nan")), used


def measure(url: str, clients: int, rounds: int, prompt: str, tokens: int, models=("bench",)) -> dict:
    """Aggregate tokens/s and time to first token of `clients` streaming `rounds` completions each,
    client `i` asking for `models[i % len(models)]`."""

    def client(i):
        model = models[i % len(models)]
        return [stream_one(url, prompt, tokens, seed=i * rounds + r, model=model) for r in range(rounds)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for per_client in pool.map(client, range(clients)) for x in per_client]
    wall = time.perf_counter() - start
    ttft = np.array([t for t, _ in results])
    return {"tokens_s": sum(n for _, n in results) / wall, "p50": np.percentile(ttft, 50),
            "p99": np.percentile(ttft, 99), "wall": wall}  # fmt: skip


def bench_model(model, tokenizer, prompt: str, tokens: int, levels: list[int], rounds: int) -> None:
    print(f"{tokens} tokens per request, {rounds} per client")
    rows = []
    for slots, clients in [(SLOTS, n) for n in levels] + [(1, 1)]:
        app = create_app(model, tokenizer, name="bench", slots=slots, queue_size=64)
        with Server(app) as url:
            stream_one(url, prompt, tokens, seed=0)  # compile the prefill and decode programs
            if slots == SLOTS and not rows:
                stream_one(url, prompt * 3, 2, seed=0)  # and the next prompt bucket's, if any
            rows.append((slots, clients, measure(url, clients, rounds, prompt, tokens)))
    base = rows[0][2]["tokens_s"]
    print(f"{'slots':>5} {'clients':>7} {'tokens/s':>9} {'x 1 client':>10} {'TTFT p50':>9} {'TTFT p99':>9}")
    for slots, clients, m in rows:
        print(f"{slots:>5} {clients:>7} {m['tokens_s']:>9.1f} {m['tokens_s'] / base:>10.2f} "
              f"{m['p50'] * 1e3:>7.0f}ms {m['p99'] * 1e3:>7.0f}ms")  # fmt: skip


def random_adapters(model, count: int, rank: int, targets: str) -> dict:
    """`count` LoRA adapters of `model` with random A and B (a fresh B is zero), named a1, a2, ..."""
    is_lora = lambda n: isinstance(n, LoRALinear)
    where = lambda m: [n.lora_b for n in jax.tree.leaves(m, is_leaf=is_lora) if is_lora(n)]
    adapters = {}
    for i in range(count):
        adapted = apply_lora(model, rank, targets=targets, key=jax.random.key(100 + i))
        keys = jax.random.split(jax.random.key(200 + i), len(where(adapted)))
        new = [0.02 * jax.random.normal(k, b.shape) for k, b in zip(keys, where(adapted), strict=True)]
        adapters[f"a{i + 1}"] = eqx.tree_at(where, adapted, new)
    return adapters


def bench_adapters(
    model, tokenizer, prompt: str, tokens: int, rounds: int, streams: int, adapters: dict
) -> None:
    """`streams` clients on the base alone, then spread over `adapters` served beside it: the table
    and the ratio of aggregate tokens/s."""
    rows = []
    for label, served in (("base", {}), (f"{len(adapters)} adapters", adapters)):
        app = create_app(model, tokenizer, name="bench", slots=SLOTS, queue_size=64, adapters=served)
        names = tuple(served) or ("bench",)
        with Server(app) as url:
            for name in names:  # compile the programs (one per model structure, not per adapter)
                stream_one(url, prompt, tokens, seed=0, model=name)
            rows.append((label, measure(url, streams, rounds, prompt, tokens, names)))
    print(f"\nmany adapters, one batch: {streams} streams, {tokens} tokens per request, {rounds} per client")
    print(f"{'served':>12} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p99':>9}")
    for label, m in rows:
        print(f"{label:>12} {m['tokens_s']:>9.1f} {m['p50'] * 1e3:>7.0f}ms {m['p99'] * 1e3:>7.0f}ms")
    print(f"adapters / base aggregate tokens/s: {rows[1][1]['tokens_s'] / rows[0][1]['tokens_s']:.2f}x")


def token_times(batcher: Batcher, prompts: list[list[int]], tg: int, rows: np.ndarray | None = None):
    """Submit `prompts` at once, each drawing TG + 1 tokens (the first by its prefill), sequence 0
    asking for attention `rows` (None: nobody asks); wait for all. Returns each sequence's token
    times (`time.perf_counter()` as each token reached its emitter)."""
    times: list[list[float]] = [[] for _ in prompts]
    failures, ended = [], threading.Semaphore(0)

    def emitter(i):
        def emit(event):  # called from the batcher's thread
            if isinstance(event, Token):
                times[i].append(time.perf_counter())
                return
            if isinstance(event, Failed) or (isinstance(event, Finished) and event.reason != "length"):
                failures.append(str(event))
            ended.release()

        return emit

    options = SamplingOptions(temperature=1.0)
    sequences = [
        Sequence(p, tg + 1, options, sample_key_data(0, i), emitter(i), attention_rows=None if i else rows)
        for i, p in enumerate(prompts)
    ]
    batcher.submit(sequences)
    for _ in sequences:
        ended.acquire()
    if failures:
        raise SystemExit(f"bench round failed: {failures}")
    return times


def batched_round(batcher: Batcher, prompts: list[list[int]], tg: int) -> tuple[float, float]:
    """`(T_PP, T_TG)` in seconds of one llama.cpp batched-bench round: `prompts` submitted at once,
    each drawing TG + 1 tokens (the first by its prefill)."""
    start = time.perf_counter()
    times = token_times(batcher, prompts, tg)
    prefilled = max(t[0] for t in times)
    return prefilled - start, max(t[-1] for t in times) - prefilled


def batched_bench(model, pp: int, tg: int, batches: list[int]) -> None:
    """Print llama.cpp's batched-bench table for `batches` sequences of `pp` prompt tokens, `tg` generated."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    batcher = Batcher(model, slots=SLOTS, queue_size=SLOTS).start()
    try:
        batched_round(batcher, [rng.integers(0, vocab, pp).tolist()], 2)  # compile prefill and decode
        print(f"\nbatched-bench: PP {pp}, TG {tg}, prompt not shared, {SLOTS}-slot Batcher, temperature 1")
        widths = [5, 6, 4, 6, 8, 8, 8, 8, 8, 8]  # llama.cpp's columns, their names and widths
        print("| " + " | ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, widths, strict=True)) + " |")
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for b in batches:
            t_pp, t_tg = batched_round(batcher, [rng.integers(0, vocab, pp).tolist() for _ in range(b)], tg)
            n_kv, total = b * (pp + tg), t_pp + t_tg
            print(f"| {pp:5d} | {tg:6d} | {b:4d} | {n_kv:6d} | {t_pp:8.3f} | {b * pp / t_pp:8.2f} | "
                  f"{t_tg:8.3f} | {b * tg / t_tg:8.2f} | {total:8.3f} | {n_kv / total:8.2f} |")  # fmt: skip
    finally:
        batcher.stop()


class WithoutAttention(Batcher):
    """The batcher as it was before a request could ask for attention: no step runs the attention
    variant of the programs (the bench's baseline; nothing here asks)."""

    def _attention_rows(self):
        return None


def attention_round(batcher: Batcher, prompts: list[list[int]], tg: int, rows: np.ndarray | None) -> float:
    """The decode-phase tokens/s of sequences 1.. of `prompts` (each drawing TG + 1 tokens) while
    sequence 0 asks for attention `rows` (None: nobody asks)."""
    times = token_times(batcher, prompts, tg, rows)
    prefilled = max(t[0] for t in times)
    return (len(prompts) - 1) * tg / (max(t[-1] for t in times[1:]) - prefilled)


def asked_attention(config) -> dict:
    """The most a request may ask: every head of as many layers as `ATTENTION_MAX_PAIRS` allows."""
    heads = list(range(min(config.n_heads, ATTENTION_MAX_PAIRS)))
    return {"layers": list(range(min(config.n_layers, ATTENTION_MAX_PAIRS // len(heads)))), "heads": heads}


def batcher_rows(model, pp: int, tg: int, rounds: int, asked: dict) -> dict[str, float]:
    """The three batcher variants' medians (see the module's docstring), run in turn."""
    rng, c = np.random.default_rng(0), model.config
    rows = np.array([layer * c.n_heads + h for layer in asked["layers"] for h in asked["heads"]], np.int32)
    variants = {
        "before": (WithoutAttention, None),
        "none asks": (Batcher, None),
        "1 of 16 asks": (Batcher, rows),
    }
    batchers = {name: kind(model, slots=SLOTS, queue_size=SLOTS) for name, (kind, _) in variants.items()}
    for batcher in batchers.values():
        batcher.start()
    figures: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for name, (_, ask) in variants.items():  # compile every program each variant runs
            attention_round(batchers[name], [rng.integers(0, c.vocab_size, pp).tolist()] * SLOTS, 2, ask)
        for _ in range(rounds):
            for name, (_, ask) in variants.items():
                prompts = [rng.integers(0, c.vocab_size, pp).tolist() for _ in range(SLOTS)]
                figures[name].append(attention_round(batchers[name], prompts, tg, ask))
    finally:
        for batcher in batchers.values():
            batcher.stop()
    return {name: float(np.median(values)) for name, values in figures.items()}


def stream_tokens(url: str, prompt: str, tokens: int, seed: int, attention: dict | None) -> int:
    """The completion tokens of one streamed completion (asking for `attention`, if given)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "stream": True, "seed": seed,
            "temperature": 1.0, "stream_options": {"include_usage": True}}  # fmt: skip
    if attention is not None:
        body["attention"] = attention
    used = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                used = json.loads(line[6:]).get("usage", {}).get("completion_tokens", used)
    return used


def http_rows(model, tokenizer, prompt: str, tokens: int, rounds: int, asked: dict) -> dict[str, float]:
    """Over HTTP (the attention's JSON included): 16 streams, none or the first asking; the medians
    of the other 15's tokens/s (their tokens over the time until the last of them ends)."""
    figures: dict[str, list[float]] = {"none asks": [], "1 of 16 asks": []}
    with Server(create_app(model, tokenizer, name="bench", slots=SLOTS, queue_size=64)) as url:

        def one_round(ask) -> float:
            start = time.perf_counter()
            with ThreadPoolExecutor(SLOTS) as pool:
                asking = pool.submit(stream_tokens, url, prompt, tokens, 0, ask)
                others = [pool.submit(stream_tokens, url, prompt, tokens, i, None) for i in range(1, SLOTS)]
                used = sum(f.result() for f in others)
                wall = time.perf_counter() - start
                asking.result()
            return used / wall

        for ask in (None, asked):  # compile every program a round runs (a sliding window's prefill too)
            one_round(ask)
        for _ in range(rounds):
            for name, ask in (("none asks", None), ("1 of 16 asks", asked)):
                figures[name].append(one_round(ask))
    return {name: float(np.median(values)) for name, values in figures.items()}


def attention_bench(model, tokenizer, prompt: str, tokens: int, pp: int, tg: int, rounds: int) -> None:
    """Print the cost of attention through the API: see the module's docstring."""
    asked = asked_attention(model.config)
    pairs = len(asked["layers"]) * len(asked["heads"])
    at_batcher = batcher_rows(model, pp, tg, rounds, asked)
    over_http = http_rows(model, tokenizer, prompt, tokens, rounds, asked)
    print(f"\nattention through the API: {SLOTS} sequences, the asking one asks for layers "
          f"{asked['layers']} x heads {asked['heads']} ({pairs} rows); tokens/s of the 15 that never ask, "
          f"median of {rounds}")  # fmt: skip
    header = f"| {'where':<22} | {'variant':<12} | {'tokens/s':>9} | {'x before':>8} | {'x none asks':>11} |"
    print(header + " bound |")
    print(f"|{'-' * 24}|{'-' * 14}|{'-' * 11}|{'-' * 10}|{'-' * 13}|-------|")
    bounds = {"before": "", "none asks": ">= 0.97 x before", "1 of 16 asks": ">= 0.90 x none asks"}
    for where, median in ((f"Batcher, PP {pp} TG {tg}", at_batcher), (f"HTTP, {tokens} tokens", over_http)):
        for name, value in median.items():
            before = f"{value / median['before']:8.3f}" if "before" in median else f"{'':8}"
            bound = bounds[name] if "before" in median or name != "none asks" else ""
            print(f"| {where:<22} | {name:<12} | {value:9.1f} | {before} | "
                  f"{value / median['none asks']:11.3f} | {bound} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-124m,char")
    p.add_argument("--clients", default="1,4,16", help='streaming clients per row ("": no streaming table)')
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batches", default="1,2,4,8,16", help='batched-bench B ("": no batched-bench table)')
    p.add_argument("--pp", type=int, help="batched-bench prompt tokens (default: 128 for GPT-2, 32 for char)")
    p.add_argument(
        "--tg", type=int, help="batched-bench generated tokens (default: 32 for GPT-2, 16 for char)"
    )
    p.add_argument("--adapters", type=int, default=4, help="LoRA adapters of the adapter case (0: no case)")
    p.add_argument("--adapter-streams", type=int, default=SLOTS, help="streams of the adapter case")
    p.add_argument("--adapter-rank", type=int, default=8, help="the adapters' rank (PEFT's default 8)")
    p.add_argument("--adapter-targets", default="c_attn", help="the adapted projections (PEFT's names)")
    p.add_argument(
        "--attention-rounds", type=int, default=3, help="rounds per variant of the attention table (0: none)"
    )
    p.add_argument(
        "--smoke", action="store_true",
        help="tiny and fast: the char model, 1 client, PP 16, TG 4, 4 adapter streams",
    )  # fmt: skip
    args = p.parse_args()
    if args.smoke:
        args.models, args.clients, args.rounds, args.pp, args.tg = "char", "1", 1, 16, 4
        args.adapter_streams, args.attention_rounds = 4, 1
    levels = [int(n) for n in args.clients.split(",") if n]
    batches = [int(n) for n in args.batches.split(",") if n]
    print(f"CPU: {cpu_description()}")
    for name in args.models.split(","):
        model, tokenizer, prompt, tokens = build(name)
        print(f"\n{name}: {model.config.n_layers} layers, d_model {model.config.d_model}, "
              f"vocab {model.config.vocab_size}, context {model.config.context_length}")  # fmt: skip
        if levels:
            bench_model(model, tokenizer, prompt, tokens, levels, args.rounds)
        default_pp, default_tg = BATCHED_PP_TG.get(name, BATCHED_PP_TG["char"])
        pp = default_pp if args.pp is None else args.pp
        tg, context = default_tg if args.tg is None else args.tg, model.config.context_length
        sizes = batches or [1]
        if (batches or args.attention_rounds) and (
            pp < 1 or tg < 1 or pp + tg > context or not 1 <= min(sizes) <= max(sizes) <= SLOTS
        ):
            p.error(
                f"batched-bench needs PP, TG >= 1 with PP + TG <= context ({context}) and B in "
                f"[1, {SLOTS}]; got PP {pp}, TG {tg}, B {batches}: change --pp, --tg or --batches"
            )
        if batches:
            batched_bench(model, pp, tg, batches)
        if args.attention_rounds > 0:
            attention_bench(model, tokenizer, prompt, tokens, pp, tg, args.attention_rounds)
        if args.adapters > 0:
            adapters = random_adapters(model, args.adapters, args.adapter_rank, args.adapter_targets)
            bench_adapters(model, tokenizer, prompt, tokens, args.rounds, args.adapter_streams, adapters)


if __name__ == "__main__":
    main()
