"""`evaluate`: a checkpoint's mean next-token loss over the validation split its run trained beside,
or over a text of your own.

    uv run evaluate.py                                  # out/'s best checkpoint, as the final validation
    uv run evaluate.py --whole-split                    # every token of the validation split predicted once
    uv run evaluate.py --data /new/place/corpus.txt     # the run's corpus, moved or copied (same bytes)
    uv run evaluate.py --checkpoint out/latest.json --text my.txt --stride 64
    uv run evaluate.py --split test                     # every token of the test split of the run's folder

By default it reads the windows the run's own final validation read (`final_plan` with the run's
`--eval-tokens`): the whole split, in windows every `context_length // 2`, where it is at most
`FINAL_EVAL_FACTOR` times `--eval-tokens`, else an even sample of that many tokens. So its figure
is the run's final val loss (for the same checkpoint), at a bounded cost whatever the corpus size.
`--whole-split` predicts every token of the split instead. `--data` must hold the same bytes as the
corpus the run trained on (its recorded sha256); any other corpus is refused: score it with `--text`.
`--split NAME` scores every token of another split of the run's folder of splits (a Hugging Face
`DatasetDict`, or train/validation/test files), such as its held-out `test`, or of `--data PATH`'s.

The corpus is prepared by the code and with the report `train.py` has (`training.data.load_corpus`):
its lines (a damaged cache entry prepared again, a corpus prepared and cached) go to stdout before
the figure.

Progress (with an ETA) shows on stderr once the work takes more than a moment, on a terminal only:
off one, stdout holds the lines above and the figure, stderr nothing but errors. Bad input (a
missing checkpoint or corpus, unreadable text, characters the tokenizer does not know, flags that
do not go together) prints one line to stderr and exits with code 2; Ctrl-C exits with code 130.
"""

import argparse
import os
import sys
from pathlib import Path

from eqx_gpt.commands.cli import OneLineParser, add_checkpoint_argument, run_command, whole_number
from eqx_gpt.errors import ConfigError, DataError


def parse_args(argv=None, prog: str = "evaluate.py") -> argparse.Namespace:
    p = OneLineParser(prog=prog, description="Mean next-token loss of a checkpoint on its validation split.")
    add_checkpoint_argument(p)
    p.add_argument(
        "--whole-split", action="store_true", help="predict every token of the validation split once "
        "(default: the windows the run's final validation read, so the run's latest checkpoint scores its "
        "final val loss: all of a split up to 4x the run's --eval-tokens, else an even sample of that many "
        "tokens)"
    )  # fmt: skip
    p.add_argument(
        "--data", metavar="PATH", help="where the run's corpus is now, if moved or copied (the same bytes: "
        "its sha256 must be the one the run recorded; default: the path the run recorded)"
    )  # fmt: skip
    p.add_argument(
        "--text", metavar="PATH", type=Path, help="score this UTF-8 text instead, whole (any text: it is "
        "not checked against the run's corpus)"
    )  # fmt: skip
    p.add_argument(
        "--split", metavar="NAME", help="score every token of the split NAME (such as test) of the run's "
        "folder of splits, or of --data PATH's (any folder of splits: it is not checked against the run's "
        "corpus)"
    )  # fmt: skip
    p.add_argument(
        "--stride", type=whole_number(1), help="with --whole-split, --text or --split: tokens between window "
        "starts (default: context_length // 2; context_length gives non-overlapping windows)"
    )  # fmt: skip
    args = p.parse_args(argv)
    for own in ("text", "split"):
        if getattr(args, own) is not None and (args.whole_split or (own == "text" and args.data is not None)):
            flag = "--whole-split" if args.whole_split else "--data"
            p.error(f"--{own} scores a text of its own, {flag} the run's validation split; pass one of them")
    if args.text is not None and args.split is not None:
        p.error("--text scores a file, --split a split of the run's folder of splits; pass one of them")
    if args.stride is not None and not (args.whole_split or args.text is not None or args.split is not None):
        p.error(
            "--stride sets the windows of --whole-split or --text, or of --split; add one (the default reads "
            "the windows the run's final validation read)"
        )
    return args


def main(argv=None, prog: str = "evaluate.py") -> int:
    """Evaluate with the flags `argv`; the exit code: 0, 2 for bad input, 130 on Ctrl-C."""
    args = parse_args(argv, prog)
    try:
        return run_command(prog, lambda: _evaluate(args))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; nothing was written", file=sys.stderr)
        return 130


def _evaluate(args) -> int:
    from eqx_gpt.checkpoint import load_model
    from eqx_gpt.evaluation import Shown, evaluate_text
    from eqx_gpt.model.gpt import GPT
    from eqx_gpt.model.language_model import ModelShape
    from eqx_gpt.tokenizer import UnknownCharacters
    from eqx_gpt.training.data import load_text

    model, tokenizer, meta = load_model(args.checkpoint, kind="LanguageModel")
    model_config = model.config if isinstance(model, GPT) else ModelShape.of(model)
    context = model.context_length
    if args.stride is not None and args.stride > context:
        raise ConfigError(
            f"--stride {args.stride} is over the model's context_length {context}; pass at most that"
        )
    if args.text is not None:
        shown = Shown(_progress(), f"evaluating {args.text}")
        try:
            result = evaluate_text(model, tokenizer, load_text(args.text), stride=args.stride, shown=shown)
        except UnknownCharacters as e:
            raise e.naming(f"--text {args.text}") from None
        said = f"all of {args.text}: loss {result.loss:.4f} nats/token over {result.n_predicted:,} predicted "
        print(f"{said}tokens (windows of {context}, every {result.stride})")
        return 0
    if args.split is not None:
        return _evaluate_split(model, tokenizer, meta, args)
    corpus = _run_corpus(meta, tokenizer, args.data)
    try:
        plan, covers = _plan(meta, len(corpus.val), model_config, args)
        label = "evaluating the whole split" if args.whole_split else "evaluating"
        result = _evaluate_plan(model, corpus.val, plan, Shown(_progress(), label))
    finally:
        corpus.close()
    step = f"; the checkpoint of step {meta['step']}" if "step" in meta else ""
    print(
        f"{covers}: loss {result.loss:.4f} nats/token over {result.n_predicted:,} predicted tokens "
        f"{_windows(plan)}{step}"
    )
    return 0


def _evaluate_plan(model, tokens, plan, shown):
    from eqx_gpt.evaluation import evaluate_plan

    result = evaluate_plan(model, tokens, plan, shown=shown)
    assert result is not None  # only a `stop` (none here) ends an evaluation early
    return result


def _plan(meta: dict, n_tokens: int, model_config, args):
    """The windows to read in a validation split of `n_tokens`, and what they cover, in words."""
    from eqx_gpt.evaluation import FINAL_EVAL_FACTOR, final_plan, plan_whole
    from eqx_gpt.training.options import DEFAULTS
    from eqx_gpt.training.time_plan import eval_budget

    context = model_config.context_length

    name = _corpus_name(meta, args.data)
    if args.whole_split:
        stride = max(1, context // 2) if args.stride is None else args.stride
        return plan_whole(n_tokens, context, stride), f"all of the validation split of {name}"
    eval_tokens = (meta.get("train_config") or {}).get("eval_tokens", DEFAULTS["eval_tokens"])
    budget = eval_budget(eval_tokens, model_config)  # what the run read: fewer tokens for a dear head
    plan = final_plan(n_tokens, context, budget)
    if plan.whole:
        return plan, f"the validation split of {name}, all of it, as the run's final validation read it"
    return plan, (
        f"the validation split of {name}, as the run's final validation read it: an even sample of "
        f"{len(plan):,} windows of its {n_tokens:,} tokens (it is over {FINAL_EVAL_FACTOR}x the run's "
        f"evaluation budget, {budget:,} tokens for --eval-tokens {eval_tokens:,} at this head; "
        f"--whole-split reads all of it)"
    )


def _progress():
    """Progress on stderr on a terminal; none off one (a pipe or a file), where stdout holds the
    figures alone and stderr errors alone."""
    from eqx_gpt.training.report import Progress

    return Progress(enabled=sys.stderr.isatty(), stream=sys.stderr)


def _windows(plan) -> str:
    if plan.whole:
        return f"(windows of {plan.context}, every {plan.stride})"
    return f"({len(plan):,} windows of {plan.context})"


def _corpus_name(meta: dict, data: str | None) -> str:
    from eqx_gpt.training.data import BUNDLED

    recorded = (meta.get("train_config") or {}).get("data") or BUNDLED
    return recorded if data is None else f"{data} (the run trained on {recorded})"


def _evaluate_split(model, tokenizer, meta: dict, args) -> int:
    """Score every token of the split `args.split` of the run's folder of splits (or `--data`'s),
    tokenized by the checkpoint's tokenizer."""
    from eqx_gpt.evaluation import Shown, plan_whole
    from eqx_gpt.training.data import load_corpus

    train_config = meta.get("train_config") or {}
    folder = args.data if args.data is not None else train_config.get("data")
    if folder is None:
        what = (
            "was trained on the bundled Tiny Shakespeare, one corpus with no splits"
            if "data_sha256" in meta
            else "records no training corpus"  # a format-1 checkpoint, or a Hugging Face GPT-2
        )
        raise DataError(
            f"{meta['path']} {what}; pass --data PATH to a folder of splits, or --text PATH to score a text"
        )
    corpus = load_corpus(
        folder, tokenizer.to_dict(), text_field=train_config.get("text_field", "text"), split=args.split,
        check_identity=lambda sha: None, log=print, progress=_progress(),
    )  # fmt: skip
    try:
        context = model.context_length
        plan = plan_whole(len(corpus.tokens), context, args.stride or max(1, context // 2))
        result = _evaluate_plan(
            model, corpus.tokens, plan, Shown(_progress(), f"evaluating split {args.split}")
        )
    finally:
        corpus.close()
    print(
        f"all of split {args.split} of {folder}: loss {result.loss:.4f} nats/token over "
        f"{result.n_predicted:,} predicted tokens {_windows(plan)}"
    )
    return 0


def _run_corpus(meta: dict, tokenizer, data: str | None):
    """The corpus the run trained on, tokenized as it was (read from the same token shards): at the
    path the run recorded, or at `data`, which must hold the same bytes (its sha256, checked before
    anything is tokenized), with the run's text field and split."""
    from eqx_gpt.training.data import BUNDLED, load_corpus

    if "data_sha256" not in meta:  # a Hugging Face GPT-2, or a checkpoint of no recorded corpus
        raise DataError(f"{meta['path']} records no training corpus; pass --text PATH to score a text")
    train_config = meta.get("train_config") or {}
    recorded = train_config.get("data")
    # Tokenized as training did: a char run's vocabulary is its corpus's characters (same cache entry).
    wanted = {"kind": "char"} if tokenizer.name == "char" else tokenizer.to_dict()
    expected = meta["data_sha256"]

    def check(sha: str) -> None:
        if sha != expected:
            raise DataError(
                f"--data {data} is not the corpus the run trained on ({recorded or BUNDLED}): its sha256 "
                f"is {sha[:12]}..., the run's {expected[:12]}...; pass a copy of that corpus, or --text "
                f"PATH to score another text whole"
            )

    if data is None and recorded is not None and not os.path.lexists(recorded):
        raise DataError(
            f"the run's corpus {recorded} is not there (moved or deleted?); pass --data PATH to where "
            f"it is now, or --text PATH to score another text"
        )
    corpus = load_corpus(
        recorded if data is None else data, wanted, text_field=train_config.get("text_field", "text"),
        split=train_config.get("split"), resumes=meta, check_identity=None if data is None else check,
        log=print, progress=_progress(),
    )  # fmt: skip
    if corpus.tokenizer != tokenizer:  # the same bytes: only a damaged cache entry tokenizes them otherwise
        corpus.close()
        raise DataError(
            f"the token cache {corpus.folder} holds other tokens ({corpus.tokenizer!r}) than the "
            f"checkpoint's ({tokenizer!r}); delete that folder and evaluate again"
        )
    return corpus
