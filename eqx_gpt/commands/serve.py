"""`serve`: a trained model behind an OpenAI-compatible completions API and a web page.

    eqx-gpt serve --checkpoint out/                    (or: python -m eqx_gpt serve --checkpoint out/)
    eqx-gpt serve --checkpoint gpt2/ --port 8080 --slots 8

Loads a run folder (its best checkpoint, else its latest), a checkpoint file, or a Hugging Face
GPT-2 folder, and serves it with uvicorn on 127.0.0.1 (loopback: only this machine can reach it)
unless `--host` says otherwise. The page is at `/`, the API at `/v1` (see the GUIDE). Needs the
`serve` extra (Starlette, uvicorn); without it, one line says how to install it, exit code 2.
"""

import argparse
import importlib.util
import sys

from eqx_gpt.commands.cli import OneLineParser, add_checkpoint_argument, run_command, whole_number
from eqx_gpt.errors import ConfigError

INSTALL = "pip install 'eqx_gpt[serve]' (in a clone: uv sync --extra serve)"


def parse_args(argv=None, prog: str = "eqx-gpt serve") -> argparse.Namespace:
    p = OneLineParser(
        prog=prog, description="Serve a trained eqx_gpt model: OpenAI's completions API and a page."
    )
    add_checkpoint_argument(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    p.add_argument(
        "--port", type=whole_number(0, 65535), default=8000, help="port (default 8000; 0: any free)"
    )
    p.add_argument("--name", help="the model's id in the API (default: the checkpoint folder's name)")
    p.add_argument(
        "--slots", type=whole_number(1, 256), default=16, help="sequences decoded together (default 16)"
    )
    p.add_argument(
        "--queue", type=whole_number(1, 100_000), default=64,
        help="samples that may wait for a slot; beyond, 429 with Retry-After (default 64)",
    )  # fmt: skip
    return p.parse_args(argv)


def check_extra() -> None:
    """Refuse, in one line naming the install, when the `serve` extra is missing."""
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"serving needs {' and '.join(missing)}, from the serve extra: {INSTALL}")


def main(argv=None, prog: str = "eqx-gpt serve") -> int:
    """Serve with the flags `argv` until interrupted; the exit code: 0, or 2 for bad input."""
    args = parse_args(argv, prog)
    return run_command(prog, lambda: _serve(args))


def _serve(args) -> int:
    check_extra()
    import uvicorn

    from eqx_gpt.checkpoint import load_model
    from eqx_gpt.serve.api import create_app

    model, tokenizer, meta = load_model(args.checkpoint, kind="GPT")
    name = args.name or args.checkpoint.resolve().name
    app = create_app(model, tokenizer, meta=meta, name=name, slots=args.slots, queue_size=args.queue)
    print(f"serving {name!r} at http://{args.host}:{args.port}/ (API at /v1)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
