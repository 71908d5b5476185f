"""Export an eqx_gpt checkpoint of a GPT-2-shaped model as a Hugging Face GPT-2 directory.

    uv run export.py --checkpoint out/ --out-dir gpt2-shakespeare/

writes `config.json` and `model.safetensors`, which `transformers.GPT2LMHeadModel.from_pretrained`
loads (and `sample.py --checkpoint` too). A GPT-2-shaped model is one fine-tuned from GPT-2
(`train.py --init-from DIR`) or built with its options (`--positions learned --bias --norm layer`).
A folder that already holds files is refused unless `--overwrite`. Bad input prints one line to
stderr and exits with code 2.
"""

import argparse
import sys
from pathlib import Path

from eqx_gpt.cli import OneLineParser


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="export.py", description="Write a checkpoint as a Hugging Face GPT-2 directory.")
    p.add_argument(
        "--checkpoint", metavar="PATH", type=Path, default=Path("out"),
        help="run directory (its best checkpoint, else latest) or checkpoint file (default: out/)",
    )  # fmt: skip
    p.add_argument("--out-dir", metavar="DIR", type=Path, required=True, help="the directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace the files of a non-empty --out-dir")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from eqx_gpt.checkpoint import load_model
    from eqx_gpt.gpt2 import gpt2_config_dict, save_gpt2

    try:
        if args.out_dir.exists() and any(args.out_dir.iterdir()) and not args.overwrite:
            raise ValueError(f"{args.out_dir}/ already holds files; pass --overwrite to replace them")
        model, _, meta = load_model(args.checkpoint)
        gpt2_config_dict(model.config)  # refuse another shape before writing anything
        save_gpt2(model, args.out_dir)
    except (ValueError, OSError) as e:  # CheckpointError, GPT2FormatError are ValueErrors
        print(f"export.py: error: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}/ (config.json, model.safetensors) from {meta['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
