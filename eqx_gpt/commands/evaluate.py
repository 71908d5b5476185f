"""`evaluate`: a checkpoint's mean loss over a whole text, every token predicted once.

    uv run evaluate.py                                  # out/'s best checkpoint on the validation split
    uv run evaluate.py --checkpoint out/latest.json --text my.txt --stride 64

Bad input (a missing checkpoint, unreadable text, characters the tokenizer does not know) prints
one line to stderr and exits with code 2.
"""

import argparse
from pathlib import Path

from eqx_gpt.commands.cli import OneLineParser, add_checkpoint_argument, run_command, whole_number
from eqx_gpt.errors import ConfigError, DataError


def parse_args(argv=None, prog: str = "evaluate.py") -> argparse.Namespace:
    p = OneLineParser(prog=prog, description="Mean next-token loss of a checkpoint over a whole text.")
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


def main(argv=None, prog: str = "evaluate.py") -> int:
    """Evaluate with the flags `argv`; the exit code: 0, or 2 for bad input."""
    args = parse_args(argv, prog)
    return run_command(prog, lambda: _evaluate(args))


def _evaluate(args) -> int:
    from eqx_gpt.checkpoint import load_model
    from eqx_gpt.evaluation import evaluate_text
    from eqx_gpt.model.gpt import GPT
    from eqx_gpt.training.data import load_text

    model, tokenizer, meta = load_model(args.checkpoint, kind="GPT")
    assert isinstance(model, GPT) and tokenizer is not None  # kind="GPT" refuses anything else
    context = model.config.context_length
    if args.stride is not None and args.stride > context:
        raise ConfigError(
            f"--stride {args.stride} is over the model's context_length {context}; pass at most that"
        )
    if args.text is not None:
        result = evaluate_text(model, tokenizer, load_text(args.text), stride=args.stride)
        name = f"all of {args.text}"
    else:
        result, name = _validation_split(model, tokenizer, meta, args.stride)
    print(
        f"{name}: loss {result.loss:.4f} nats/token over {result.n_predicted:,} predicted tokens "
        f"(windows of {context}, every {result.stride})"
    )
    return 0


def _validation_split(model, tokenizer, meta: dict, stride: int | None):
    """The loss over the validation split of the corpus the run recorded (its `--data`, or the
    bundled Tiny Shakespeare), read from the same token shards training read, and its name."""
    from eqx_gpt.evaluation import evaluate
    from eqx_gpt.training.data import BUNDLED, load_corpus

    train_config = meta.get("train_config") or {}
    if "data_sha256" not in meta:  # a Hugging Face GPT-2, or a checkpoint of no recorded corpus
        raise DataError(f"{meta['path']} records no training corpus; pass --text PATH to score")
    data = train_config.get("data")
    # Tokenized as training did: a char run's vocabulary is its corpus's characters (same cache entry).
    wanted = {"kind": "char"} if tokenizer.name == "char" else tokenizer.to_dict()
    corpus = load_corpus(data, wanted, resumes=meta)
    return evaluate(model, corpus.val, stride=stride), f"the validation split of {data or BUNDLED}"
