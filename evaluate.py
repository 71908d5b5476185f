"""Score a checkpoint: its mean loss over a whole text, every token predicted once.

    uv run evaluate.py                                  # out/'s best checkpoint on the validation split
    uv run evaluate.py --checkpoint out/latest.json --text my.txt --stride 64

Bad input (a missing checkpoint, unreadable text, characters the tokenizer does not know) prints
one line to stderr and exits with code 2.
"""

import argparse
import sys
from pathlib import Path

from eqx_gpt.cli import OneLineParser, add_checkpoint_argument, whole_number


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(
        prog="evaluate.py", description="Mean next-token loss of a checkpoint over a whole text."
    )
    add_checkpoint_argument(p)
    p.add_argument(
        "--text", metavar="PATH", type=Path, help="UTF-8 text to score (default: the validation split of the "
        "corpus the checkpoint was trained on, when that is the bundled Tiny Shakespeare)"
    )  # fmt: skip
    p.add_argument(
        "--stride", type=whole_number(1), help="tokens between window starts (default: context_length // 2; "
        "context_length gives non-overlapping windows)"
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from eqx_gpt.checkpoint import load_model
    from eqx_gpt.training.corpus import SHAKESPEARE_SHA256, load_text, split_text
    from eqx_gpt.training.evaluate import evaluate_text

    try:
        model, tokenizer, meta = load_model(args.checkpoint, kind="GPT")
        if args.text is not None:
            text, name = load_text(args.text), str(args.text)
        elif meta.get("data_sha256") == SHAKESPEARE_SHA256:
            text, name = split_text(load_text())[1], "the Tiny Shakespeare validation split"
        else:
            raise ValueError("the checkpoint was not trained on the bundled corpus; pass --text PATH")
        result = evaluate_text(model, tokenizer, text, stride=args.stride)
    except ValueError as e:  # CheckpointError, DataError and TokenizerError are ValueErrors
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    context = model.config.context_length
    print(
        f"{name}: loss {result.loss:.4f} nats/token over {result.n_predicted:,} predicted tokens "
        f"(windows of {context}, every {result.stride})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
