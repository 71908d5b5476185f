"""`serve`: a trained model behind an OpenAI-compatible completions API and a web page.

    eqx-gpt serve --checkpoint out/                    (or: python -m eqx_gpt serve --checkpoint out/)
    eqx-gpt serve --checkpoint gpt2/ --port 8080 --slots 8
    EQX_GPT_API_KEY=... eqx-gpt serve --checkpoint out/ --host 0.0.0.0
    eqx-gpt serve --checkpoint out/ --follow           (while out/ trains: its newest checkpoint, live)
    eqx-gpt serve --checkpoint gpt2/ --adapter poet=runs/poet --adapter lawyer=peft/lawyer

Loads a run folder (its best checkpoint, else its latest), a checkpoint file, or a Hugging Face
GPT-2 folder, and serves it with uvicorn on 127.0.0.1 (loopback: only this machine can reach it,
and only under this machine's names: a DNS-rebinding page is refused) unless `--host` says
otherwise; another address without an API key is warned about. `--follow` serves a run folder's
newest checkpoint and swaps in each new one as the run writes it (`eqx_gpt.serve.follow`). The
page is at `/`, the API at `/v1` (see the GUIDE's limits). Needs the `serve` extra (Starlette,
uvicorn, prometheus_client); without it, one line says how to install it, exit code 2.

`--adapter NAME=DIR` (repeatable) serves a LoRA adapter beside the base under NAME (a request's
`model`): DIR is a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`), a LoRA
run's folder (which holds its adapters so), or eqx_gpt's own adapter format for a model of one's
own. All decode in one batch (`eqx_gpt.serve.api`). A name given twice or the base's, a folder
that is not an adapter, or an adapter for another base is one line, exit code 2.
"""

import argparse
import importlib.util
import ipaddress
import os
import re
import sys
from pathlib import Path

from eqx_gpt.commands.cli import OneLineParser, add_checkpoint_argument, run_command, whole_number
from eqx_gpt.commands.compile_cache import enable_compilation_cache
from eqx_gpt.errors import CheckpointError, ConfigError, EqxGptError

INSTALL = "pip install 'eqx_gpt[serve]' (in a clone: uv sync --extra serve)"
API_KEY_VARIABLE = "EQX_GPT_API_KEY"  # read when --api-key is not given (a flag shows in `ps`)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")  # an id a client can send as `model`


def adapter_argument(text: str) -> tuple[str, Path]:
    """argparse type of `--adapter`: `NAME=DIR`, NAME a model id (letters, digits, `._:/-`)."""
    name, sep, directory = text.partition("=")
    if not (sep and name and directory):
        raise argparse.ArgumentTypeError(
            f"expected NAME=DIR (a name, then the adapter's folder), got {text!r}"
        )
    if not ADAPTER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"the adapter's name {name!r} must be letters, digits and . _ : / - (at most 128, starting "
            f"with a letter or digit): it is what a request's model field says"
        )
    return name, Path(directory)


def seconds(low: float, high: float):
    """argparse type: a number of seconds in `[low, high]`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not low <= value <= high:  # NaN fails this too
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds in [{low:g}, {high:g}], got {text}"
            )
        return value

    return parse


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
        "--adapter", metavar="NAME=DIR", type=adapter_argument, action="append", default=[],
        help="also serve a LoRA adapter of the checkpoint as model NAME: a PEFT adapter folder or a "
        "LoRA run's folder; repeatable, all decoded in one batch",
    )  # fmt: skip
    p.add_argument(
        "--slots", type=whole_number(1, 256), default=16, help="sequences decoded together (default 16)"
    )
    p.add_argument(
        "--queue", type=whole_number(1, 100_000), default=64,
        help="samples that may wait for a slot, and the most one request may ask for; beyond, 429 "
        "with Retry-After (default 64)",
    )  # fmt: skip
    p.add_argument(
        "--api-key", default=os.environ.get(API_KEY_VARIABLE) or None,
        help=f"require 'Authorization: Bearer KEY' on the API (default: ${API_KEY_VARIABLE}, else none)",
    )  # fmt: skip
    p.add_argument(
        "--max-body-bytes", type=whole_number(1024), default=1 << 20,
        help="the largest request body; larger ones get 413 (default 1048576)",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout", type=seconds(0.1, 3600), default=10.0,
        help="seconds a client has to send a whole request, headers and body (default 10)",
    )  # fmt: skip
    p.add_argument(
        "--follow", action="store_true",
        help="serve the run folder's newest checkpoint and reload each newer one as it lands (a run "
        "in progress: the page shows its step, losses and predictions as it learns)",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-timeout", type=seconds(0, 3600), default=5.0,
        help="seconds completions may run after SIGTERM before they end with an error event (default 5)",
    )  # fmt: skip
    return p.parse_args(argv)


def check_extra() -> None:
    """Refuse, in one line naming the install, when the `serve` extra is missing."""
    missing = [
        name
        for name in ("starlette", "uvicorn", "prometheus_client")
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise ConfigError(f"serving needs {' and '.join(missing)}, from the serve extra: {INSTALL}")


def is_loopback(host: str) -> bool:
    """Whether `host` is an address (or name) of this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> list[str]:
    """The `Host` names answered: on loopback, this machine's own (so a DNS-rebinding page is
    refused); on another address, any (the API key is the guard there)."""
    from eqx_gpt.serve.api import LOOPBACK_HOSTS

    if not is_loopback(host):
        return ["*"]
    named = f"[{host.strip('[]')}]" if ":" in host else host.lower()
    return sorted({*LOOPBACK_HOSTS, named})


def load_served_adapters(base, base_name: str, given: list[tuple[str, Path]]) -> dict:
    """`{name: base with that adapter}` of the `--adapter NAME=DIR`s, in order, each refused in one
    line naming it: a name twice or the base's, a folder that is not an adapter, an adapter for
    another base (its layers or shapes), and every check `load_adapters` makes."""
    from eqx_gpt.checkpoint import holds_run
    from eqx_gpt.model.multi_lora import stack_adapters
    from eqx_gpt.peft import is_adapter_directory, load_adapters

    adapters: dict = {}
    for name, directory in given:
        flag = f"--adapter {name}={directory}"
        if name == base_name or name in adapters:
            which = "the base model's name (--name)" if name == base_name else "given twice"
            raise ConfigError(f"{flag}: the name {name!r} is {which}; give each adapter its own name")
        if not is_adapter_directory(directory):
            what = "a run without LoRA adapters" if holds_run(directory) else "not an adapter folder"
            raise ConfigError(
                f"{flag}: {directory} is {what} (no adapter_config.json); pass a PEFT adapter folder or "
                f"a LoRA run's folder (train.py --lora-rank)"
            )
        try:
            adapted = load_adapters(base, directory, dropout=0.0)
            stack_adapters(base, [adapted], [name])  # another base's adapter: refused now, in one line
        except EqxGptError as e:
            raise CheckpointError(f"{flag}: {e}") from None
        adapters[name] = adapted
    return adapters


def main(argv=None, prog: str = "eqx-gpt serve") -> int:
    """Serve with the flags `argv` until interrupted; the exit code: 0, or 2 for bad input."""
    args = parse_args(argv, prog)
    return run_command(prog, lambda: _serve(args, prog))


def _serve(args, prog: str) -> int:
    check_extra()
    if args.api_key is not None and not (args.api_key.strip() and args.api_key.isprintable()):
        raise ConfigError(f"--api-key (or ${API_KEY_VARIABLE}) must be printable characters, not blank")
    enable_compilation_cache()  # a restarted server compiles its prefill and decode programs no more
    from eqx_gpt.checkpoint import holds_run, load_model
    from eqx_gpt.generation.decoder import check_decoder
    from eqx_gpt.serve.api import create_app
    from eqx_gpt.serve.follow import newest_checkpoint
    from eqx_gpt.serve.http_server import Limits, serve

    path = args.checkpoint
    if args.follow:
        if args.adapter:
            raise ConfigError(
                "--follow swaps in a run's own checkpoints and takes no --adapter (a new base would leave "
                "the adapters on the old one); serve the adapters from a server that does not follow"
            )
        if not (path.is_dir() and holds_run(path)):
            raise ConfigError(
                f"--follow follows a run folder that holds a checkpoint (train.py --out-dir, after its first "
                f"evaluation); {path} is not one"
            )
        path = newest_checkpoint(path) or path
    # A GPT, or a run of a model of one's own (rebuilt by the function its run records) that decodes.
    model, tokenizer, meta = load_model(path, kind="LanguageModel")
    try:
        check_decoder(model)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    name = args.name or args.checkpoint.resolve().name
    adapters = load_served_adapters(model, name, args.adapter)
    app = create_app(
        model, tokenizer, meta=meta, name=name, slots=args.slots, queue_size=args.queue,
        max_body_bytes=args.max_body_bytes, api_key=args.api_key, allowed_hosts=allowed_hosts(args.host),
        follow=args.checkpoint if args.follow else None,
        adapters=adapters,
    )  # fmt: skip
    if not is_loopback(args.host) and args.api_key is None:
        print(
            f"{prog}: warning: listening on {args.host} without an API key: anyone who can reach this "
            f"port can run the model; pass --api-key (or set ${API_KEY_VARIABLE})",
            file=sys.stderr,
        )  # fmt: skip
    print(f"serving {name!r} at http://{args.host}:{args.port}/ (API at /v1)", file=sys.stderr)
    limits = Limits(request_timeout_s=args.request_timeout, shutdown_timeout_s=args.shutdown_timeout)
    serve(app, host=args.host, port=args.port, limits=limits)
    return 0
