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
        "--text", metavar="PATH", type=Path, help="a UTF-8 text to score whole (default: the validation "
        "split of the corpus the run trained on, as the run reported it)"
    )  # fmt: skip
    p.add_argument(
        "--stride", type=whole_number(1), help="tokens between window starts (default: context_length // 2; "
        "context_length gives non-overlapping windows)"
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from eqx_gpt.checkpoint import load_model
    from eqx_gpt.training.corpus import load_text
    from eqx_gpt.training.evaluate import evaluate_text

    try:
        model, tokenizer, meta = load_model(args.checkpoint, kind="GPT")
        if args.text is not None:
            result = evaluate_text(model, tokenizer, load_text(args.text), stride=args.stride)
            name = f"all of {args.text}"
        else:
            result, name = _validation_split(model, tokenizer, meta, args.stride)
    except ValueError as e:  # CheckpointError, DataError and TokenizerError are ValueErrors
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    context = model.config.context_length
    print(
        f"{name}: loss {result.loss:.4f} nats/token over {result.n_predicted:,} predicted tokens "
        f"(windows of {context}, every {result.stride})"
    )
    return 0


def _validation_split(model, tokenizer, meta: dict, stride: int | None):
    """The loss over the validation split of the corpus the run recorded (its `--data`, or the
    bundled Tiny Shakespeare), read from the same token shards training read, and its name."""
    from eqx_gpt.training.corpus import BUNDLED, load_corpus
    from eqx_gpt.training.evaluate import evaluate

    train_config = meta.get("train_config") or {}
    if "data_sha256" not in meta:  # a Hugging Face GPT-2, or a checkpoint of no recorded corpus
        raise ValueError(f"{meta['path']} records no training corpus; pass --text PATH to score")
    data = train_config.get("data")
    # Tokenized as training did: a char run's vocabulary is its corpus's characters (same cache entry).
    wanted = {"kind": "char"} if tokenizer.name == "char" else tokenizer.to_dict()
    corpus = load_corpus(data, wanted, resumes=meta)
    return evaluate(model, corpus.val, stride=stride), f"the validation split of {data or BUNDLED}"


if __name__ == "__main__":
    sys.exit(main())
