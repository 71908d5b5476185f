"""What the serving tests share: a tiny run folder and a server on a loopback port."""

import json
import socket
import threading
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from eqx_gpt import GPT, CharTokenizer, GPTConfig, load_model, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = (ROOT / "eqx_gpt" / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
CONTEXT = 32  # small, so that a 60-token answer slides the window twice


def make_run(out: Path) -> Path:
    """A run folder: a random-weight character model's `best` checkpoint and a short metrics.jsonl."""
    tokenizer = CharTokenizer.from_text(SHAKESPEARE)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size, context_length=CONTEXT, d_model=32, n_heads=4, n_layers=2
    )
    model = GPT(config, key=jax.random.key(0))
    save_checkpoint(out, "best", model, None, step=20, tokenizer=tokenizer, train_config={})
    records = [
        {"step": 10, "loss": 3.9},
        {"step": 10, "val_loss": 3.8, "train_loss": 3.85},
        {"step": 20, "loss": 3.5},
        {"step": 20, "val_loss": 3.4, "train_loss": 3.45},
        {"step": 20, "final_val_loss": 3.41},
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def zero_gpt(config: GPTConfig) -> GPT:
    """A GPT of `config` whose weights are NumPy zeros, built from its shapes alone: for a test that
    needs a model of another shape, not its values (nothing is compiled to make it)."""
    shapes = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    zeros = lambda s: np.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s
    return jax.tree.map(zeros, shapes)


@eqx.filter_jit
def _attention_weights(model, tokens):
    return model.attention_weights(tokens)


def query_rows(model, tokens: list[int], start: int, query: int) -> np.ndarray:
    """`(layers, heads, query - start + 1)`: what a full forward pass over `tokens[start : query + 1]`
    attends with at its last position. Computed as row `query - start` of a pass over the window
    padded to the model's context with token 0, which a causal model's earlier rows never see: one
    compiled program for every window, where each window's own length would compile its own."""
    window = tokens[start : query + 1]
    padded = jax.device_put(np.asarray(window + [0] * (model.context_length - len(window)), np.int32))
    return np.asarray(_attention_weights(model, padded))[:, :, len(window) - 1, : len(window)]


def app_for(run: Path, **options):
    from eqx_gpt import create_app

    model, tokenizer, meta = load_model(run, kind="GPT")
    return create_app(model, tokenizer, meta=meta, name="tiny", **options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a thread, for the `with` block, with
    the settings `eqx-gpt serve` gives it (`limits`: an `eqx_gpt.serve.http_server.Limits`)."""

    def __init__(self, app, limits=None):
        import uvicorn

        from eqx_gpt.serve.http_server import Limits, uvicorn_config

        self.app = app
        self.port = free_port()
        config = uvicorn_config(app, host="127.0.0.1", port=self.port, limits=limits or Limits())
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        for _ in range(600):  # bounded: 60 s
            if self.server.started:
                return self
            time.sleep(0.1)
        raise RuntimeError("uvicorn did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
