"""`export`: an eqx_gpt checkpoint of a GPT-2-shaped model as a Hugging Face GPT-2 directory.

    uv run export.py --checkpoint out/ --out-dir gpt2-shakespeare/

writes `config.json` and `model.safetensors`, which `transformers.GPT2LMHeadModel.from_pretrained`
loads (and `sample.py --checkpoint` too). A LoRA run (`train.py --lora-rank`) is written merged
(`weight + alpha / r * A @ B`, exact to float32 rounding), or with `--adapters-only` as a PEFT
adapter folder (`adapter_config.json`, `adapter_model.safetensors`) for its base. A GPT-2-shaped
model is one fine-tuned from GPT-2 (`train.py --init-from DIR`) or built with its options
(`--positions learned --bias --norm layer`). A folder that already holds files is refused unless
`--overwrite`. Bad input prints one line to stderr and exits with code 2.
"""

import argparse
from pathlib import Path

from eqx_gpt.commands.cli import OneLineParser, add_checkpoint_argument, run_command
from eqx_gpt.errors import ConfigError, GPT2FormatError


def parse_args(argv=None, prog: str = "export.py") -> argparse.Namespace:
    p = OneLineParser(prog=prog, description="Write a checkpoint as a Hugging Face GPT-2 directory.")
    add_checkpoint_argument(p)
    p.add_argument("--out-dir", metavar="DIR", type=Path, required=True, help="the directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out-dir")
    p.add_argument(
        "--adapters-only",
        action="store_true",
        help="of a LoRA run: write its adapters alone, as a PEFT folder (default: the merged GPT-2)",
    )
    return p.parse_args(argv)


def main(argv=None, prog: str = "export.py") -> int:
    """Export with the flags `argv`; the exit code: 0, or 2 for bad input."""
    args = parse_args(argv, prog)

    def body() -> int:
        meta = export(
            args.checkpoint, args.out_dir, overwrite=args.overwrite, adapters_only=args.adapters_only
        )
        files = (
            "adapter_config.json, adapter_model.safetensors"
            if args.adapters_only
            else "config.json, model.safetensors"
        )
        print(f"wrote {args.out_dir}/ ({files}) from {meta['path']}")
        return 0

    return run_command(prog, body)


def export(checkpoint: Path, out_dir: Path, *, overwrite: bool, adapters_only: bool = False) -> dict:
    """Write the GPT-2-shaped model of `checkpoint` into `out_dir` (a LoRA run's merged, or its
    adapters alone as a PEFT folder); returns the checkpoint's metadata. Everything is checked
    before anything is written."""
    from eqx_gpt.checkpoint import holds_run, load_model
    from eqx_gpt.gpt2 import gpt2_config_dict, save_gpt2
    from eqx_gpt.model.gpt import GPT
    from eqx_gpt.tokenizer import GPT2Tokenizer

    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out-dir {out_dir} is a file; pass a folder")
    if out_dir.is_dir() and holds_run(out_dir):
        raise ConfigError(f"{out_dir}/ holds a training run; export into another folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir}/ already holds files; pass --overwrite to replace them")
    model, tokenizer, meta = load_model(
        checkpoint, kind="GPT", lora="separate" if adapters_only else "merged"
    )
    if adapters_only:
        return _export_adapters(model, meta, out_dir)
    assert isinstance(model, GPT) and tokenizer is not None  # kind="GPT" refuses anything else
    gpt2_config_dict(model.config)  # refuse another shape before writing anything
    if not isinstance(tokenizer, GPT2Tokenizer):
        raise GPT2FormatError(
            f"{meta['path']} was trained with the {tokenizer.name} tokenizer, not GPT-2's BPE, so a GPT-2 "
            f"folder would read its ids as other tokens; export only models trained with --tokenizer gpt2"
        )
    try:
        save_gpt2(model, out_dir)
    except OSError as e:
        raise ConfigError(f"cannot write {out_dir}/: {e.strerror or e}") from None
    return meta


def _export_adapters(model, meta: dict, out_dir: Path) -> dict:
    """Write a LoRA run's adapters as a PEFT folder for its base GPT-2."""
    from eqx_gpt.model.lora import has_lora
    from eqx_gpt.peft import save_adapters

    if not has_lora(model):
        raise ConfigError(f"{meta['path']} is not a LoRA run (train.py --lora-rank); drop --adapters-only")
    try:
        # The base load_model found and checked (sha256), named relative to the folder written.
        base = (meta.get("lora_base") or {}).get("path") or meta["train_config"]["init_from"]
        save_adapters(model, out_dir, base=base)
    except OSError as e:
        raise ConfigError(f"cannot write {out_dir}/: {e.strerror or e}") from None
    return meta
