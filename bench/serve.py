"""`eqx-gpt serve` under concurrent streaming clients: aggregate tokens/s and time to first token.

    uv run python bench/serve.py [--models gpt2-124m,char] [--clients 1,4,16] [--rounds 2]

For each model (random weights: GPT-2-124M's shapes with GPT-2's 50,257 ids, and the default `cpu`
preset's char model), a server with 16 slots runs on 127.0.0.1 (uvicorn in this process); N
clients (threads, httpx) each stream `--rounds` completions of `--tokens` tokens back to back.
Printed per N: aggregate completion tokens/s (all clients' tokens over the wall time), time to
first token p50/p99 (from sending the request to its first text), and the ratio of tokens/s to one
client's. Then one client on a 1-slot server: the same model decoded without batching, the
reference that shows what the slots cost a lone client. Every server is warmed first (its
programs compiled) and the CPU model is printed with the figures. Traffic stays on loopback.
"""

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import numpy as np
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_description  # noqa: E402

from eqx_gpt import GPT, PRESETS, CharTokenizer, GPT2Tokenizer, GPTConfig, create_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_BPE = ROOT.parent / "shared" / "data" / "tiktoken-cache"


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


def stream_one(url: str, prompt: str, tokens: int, seed: int) -> tuple[float, int]:
    """`(seconds to the first text, completion tokens)` of one streamed completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "stream": True, "seed": seed,
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


def measure(url: str, clients: int, rounds: int, prompt: str, tokens: int) -> dict:
    def client(i):
        return [stream_one(url, prompt, tokens, seed=i * rounds + r) for r in range(rounds)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for per_client in pool.map(client, range(clients)) for x in per_client]
    wall = time.perf_counter() - start
    ttft = np.array([t for t, _ in results])
    return {"tokens_s": sum(n for _, n in results) / wall, "p50": np.percentile(ttft, 50),
            "p99": np.percentile(ttft, 99), "wall": wall}  # fmt: skip


def bench_model(name: str, levels: list[int], rounds: int) -> None:
    model, tokenizer, prompt, tokens = build(name)
    print(f"\n{name}: {model.config.n_layers} layers, d_model {model.config.d_model}, "
          f"vocab {model.config.vocab_size}, {tokens} tokens per request, {rounds} per client")  # fmt: skip
    rows = []
    for slots, clients in [(16, n) for n in levels] + [(1, 1)]:
        app = create_app(model, tokenizer, name="bench", slots=slots, queue_size=64)
        with Server(app) as url:
            stream_one(url, prompt, tokens, seed=0)  # compile the prefill and decode programs
            if slots == 16 and not rows:
                stream_one(url, prompt * 3, 2, seed=0)  # and the next prompt bucket's, if any
            rows.append((slots, clients, measure(url, clients, rounds, prompt, tokens)))
    base = rows[0][2]["tokens_s"]
    print(f"{'slots':>5} {'clients':>7} {'tokens/s':>9} {'x 1 client':>10} {'TTFT p50':>9} {'TTFT p99':>9}")
    for slots, clients, m in rows:
        print(f"{slots:>5} {clients:>7} {m['tokens_s']:>9.1f} {m['tokens_s'] / base:>10.2f} "
              f"{m['p50'] * 1e3:>7.0f}ms {m['p99'] * 1e3:>7.0f}ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-124m,char")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(f"CPU: {cpu_description()}")
    for name in args.models.split(","):
        bench_model(name, [int(n) for n in args.clients.split(",")], args.rounds)


if __name__ == "__main__":
    main()
