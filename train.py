"""Train a GPT on Tiny Shakespeare (or any UTF-8 text): `uv run train.py --help`.

Every field of `GPTConfig` (model) and `TrainConfig` (training) is a flag; `--preset` picks a named
recipe whose values the flags override. Bad input exits with one line on stderr and code 2.
"""

import argparse
import dataclasses
import sys
import types
import typing

from eqx_gpt.checkpoint import CheckpointError
from eqx_gpt.config import COMPUTE_DTYPES, GPTConfig
from eqx_gpt.data import DataError
from eqx_gpt.parallel import initialize_distributed
from eqx_gpt.presets import DEFAULT_PRESET, PRESETS
from eqx_gpt.tokenizer import TokenizerError
from eqx_gpt.trainer import TrainingError, train
from eqx_gpt.training import TOKENIZERS, TrainConfig

MODEL_HELP = {
    "context_length": "tokens the model sees at once",
    "d_model": "width of the residual stream (even, divisible by n_heads)",
    "n_heads": "attention heads",
    "n_layers": "decoder blocks",
    "d_hidden": "MLP width (default: 4 * d_model)",
    "dropout": "dropout rate while training",
    "norm_eps": "RMSNorm epsilon",
    "scan_unroll": "layers per iteration of the layer scan (speed vs compile time)",
    "compute_dtype": "dtype of activations and matmuls; parameters stay float32",
}
CHOICES = {"compute_dtype": COMPUTE_DTYPES, "tokenizer": TOKENIZERS}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: None)" says nothing; the help text explains
        return action.help if action.default is None else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _flag_type(annotation):
    """`int`, `float`, `str` or `bool` from a field annotation such as `int | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _field_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def build_parser(show_defaults: bool = True) -> Parser:
    """The parser; with `show_defaults=False` absent options are left out of the result entirely."""
    preset = PRESETS[DEFAULT_PRESET]
    defaults = {**_field_defaults(GPTConfig), **preset.model, **_field_defaults(TrainConfig), **preset.train}
    p = Parser(
        prog="train.py",
        description="Train a GPT on characters (or GPT-2 BPE); writes checkpoints, metrics.jsonl, loss.png.",
        formatter_class=HelpFormatter,
        argument_default=None if show_defaults else argparse.SUPPRESS,
    )

    def default(value):
        return value if show_defaults else argparse.SUPPRESS

    run = p.add_argument_group("run")
    run.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=default(DEFAULT_PRESET),
        help="named recipe: " + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()),
    )
    run.add_argument("--out-dir", default=default("out"), help="folder for checkpoints, metrics and plots")
    run.add_argument(
        "--resume", action="store_true", default=default(False), help="continue the run in --out-dir"
    )
    run.add_argument("--sample-tokens", type=int, default=default(300), help="tokens sampled at the end")
    for cls, group, helps in (
        (GPTConfig, p.add_argument_group(f"model (defaults: the {DEFAULT_PRESET} preset)"), MODEL_HELP),
        (TrainConfig, p.add_argument_group(f"training (defaults: the {DEFAULT_PRESET} preset)"), None),
    ):
        for f in dataclasses.fields(cls):
            if f.name == "vocab_size":  # set by the tokenizer
                continue
            kind = _flag_type(f.type)
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                **({"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}),
                choices=CHOICES.get(f.name),
                default=default(defaults.get(f.name)),
                help=helps[f.name] if helps else f.metadata["help"],
            )
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict]:
    """The parsed options, and the options given explicitly on the command line."""
    args = build_parser().parse_args(argv)
    explicit = vars(build_parser(show_defaults=False).parse_args(argv))
    return args, explicit


def main(argv: list[str] | None = None) -> int:
    args, explicit = parse(argv)
    try:
        initialize_distributed()  # one process of a multi-host run (README: "Scaling out")
    except ValueError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    model_names = {f.name for f in dataclasses.fields(GPTConfig)} - {"vocab_size"}
    train_names = {f.name for f in dataclasses.fields(TrainConfig)}
    preset = PRESETS[args.preset]
    if args.resume:
        model_flags = {k: v for k, v in explicit.items() if k in model_names}
        train_flags = {k: v for k, v in explicit.items() if k in train_names}
        if "preset" in explicit:  # a preset given with --resume counts as flags for its values
            model_flags = {**preset.model, **model_flags}
            train_flags = {**preset.train, **train_flags}
        model_options, config, resume_flags = {}, TrainConfig(), (model_flags, train_flags)
    else:
        model_options = {name: getattr(args, name) for name in model_names}
        try:
            config = TrainConfig(**{name: getattr(args, name) for name in train_names})
            GPTConfig(vocab_size=1, **model_options)  # report bad sizes before loading any data
        except ValueError as e:
            print(f"train.py: error: {e}", file=sys.stderr)
            return 2
        resume_flags = None
    try:
        result = train(
            model_options,
            config,
            args.out_dir,
            resume=args.resume,
            resume_flags=resume_flags,
            sample_tokens=args.sample_tokens,
            # A resumed run keeps the preset its checkpoint records unless one is given.
            extra_metadata={"preset": args.preset} if "preset" in explicit or not args.resume else None,
        )
    except (DataError, TokenizerError, CheckpointError, TrainingError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "train.py: aborted; resume from the last checkpoint with: "
            f"uv run train.py --resume --out-dir {args.out_dir}",
            file=sys.stderr,
        )
        return 130
    return 130 if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
