"""`train`: train a GPT on Tiny Shakespeare (or any UTF-8 text); `python -m eqx_gpt train --help`.

Every field of `GPTConfig` (model) and `TrainConfig` (training) is a flag, its choices and whether
it repeats read from the field's metadata (`eqx_gpt.configs.KINDS`). This parses the command line
and calls `eqx_gpt.train` with the flags given as settings by name, its messages naming settings
as this command's flags (`spoken_as_command`); where each value comes from (defaults, `--preset`,
flags, and on `--resume` the checkpoint) is decided in one place,
`eqx_gpt.training.options.resolve_options`. Bad input exits with one line on stderr and code 2.
"""

import argparse
import dataclasses
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

from eqx_gpt.checkpoint import checkpoint_paths
from eqx_gpt.commands.cli import OneLineParser, finite_float, run_command, whole_number
from eqx_gpt.commands.compile_cache import enable_compilation_cache
from eqx_gpt.configs import kind
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.training.config import TrainConfig, resume_command, spoken_as_command
from eqx_gpt.training.options import MODEL_FIELDS, TRAIN_FIELDS, preset_values
from eqx_gpt.training.presets import DEFAULT_PRESET, PRESETS
from eqx_gpt.training.run import AUTO, train


def _flag_type(annotation):
    """`int`, `finite_float`, `str` or `bool` from a field annotation such as `int | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return finite_float if annotation is float else annotation


class _CommaList(argparse.Action):
    """A repeatable flag whose values join into one comma list (`--tracker a --tracker b` is "a,b"),
    the form its `TrainConfig` field takes."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, values if previous is None else f"{previous},{values}")


def build_parser(preset: str = DEFAULT_PRESET, prog: str = "train.py") -> OneLineParser:
    """The parser. Parsed options hold only what was given explicitly (absent ones are left out);
    `--help` shows the values of `preset` as defaults (`--help --preset NAME` shows NAME's)."""
    shown = preset_values(preset if preset in PRESETS else DEFAULT_PRESET)
    p = OneLineParser(
        prog=prog,
        description="Train a GPT on characters (or GPT-2 BPE); writes checkpoints, metrics.jsonl, loss.png.",
        argument_default=argparse.SUPPRESS,
    )
    run = p.add_argument_group("run")
    run.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"named recipe (default {DEFAULT_PRESET}); it sets the defaults below, and `--help --preset "
        f"NAME` shows them: " + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()),
    )
    run.add_argument("--out-dir", help="folder for checkpoints, metrics and plots (default: out)")
    run.add_argument("--resume", action="store_true", help="continue the run in --out-dir")
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run already in --out-dir and start afresh (without it, such a folder is refused)",
    )
    run.add_argument("--sample-tokens", type=whole_number(0), help="tokens sampled at the end (default: 300)")
    title = f"{{}} (defaults: the {preset if preset in PRESETS else DEFAULT_PRESET} preset)"
    for cls, names, group in (
        (GPTConfig, MODEL_FIELDS, p.add_argument_group(title.format("model"))),
        (TrainConfig, TRAIN_FIELDS, p.add_argument_group(title.format("training"))),
    ):
        for f in dataclasses.fields(cls):
            if f.name not in names:
                continue
            flag_type = _flag_type(f.type)
            action: dict[str, Any] = (
                {"action": argparse.BooleanOptionalAction} if flag_type is bool else {"type": flag_type}
            )
            choices: dict[str, Any] = {"choices": kind(f, "choices")} if kind(f, "choices") else {}
            if kind(f, "repeatable"):  # a comma list, whose names are checked where it enters
                action, choices = {"action": _CommaList, "metavar": "NAME[,NAME]"}, {}
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                **action,
                **choices,
                help=f"{f.metadata['help']} (default: {shown[f.name]})",
            )
    return p


def parse(argv: list[str] | None, prog: str = "train.py") -> dict:
    """The options given explicitly on the command line (a preset's help shown for `--help --preset`)."""
    argv = sys.argv[1:] if argv is None else argv
    return vars(build_parser(_preset_in(argv), prog).parse_args(argv))


def _preset_in(argv: list[str]) -> str:
    """The `--preset` named in `argv` (last one wins), for the defaults `--help` shows."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default=DEFAULT_PRESET)
    return pre.parse_known_args(argv)[0].preset


def main(argv: list[str] | None = None, prog: str = "train.py") -> int:
    """Train with the flags `argv`; the exit code: 0, 2 for bad input, 130 when interrupted."""
    settings = parse(argv, prog)
    out_dir = settings.pop("out_dir", "out")
    preset = settings.pop("preset", AUTO)
    resume, overwrite = settings.pop("resume", False), settings.pop("overwrite", False)
    sample_tokens = settings.pop("sample_tokens", 300)

    def body() -> int:
        # On a GPU a resumed run then compiles the step to the same kernels, so trains on the same bits.
        enable_compilation_cache()
        try:
            with spoken_as_command(prog):  # messages name this command's flags
                result = train(
                    preset=preset, out_dir=Path(out_dir), resume=resume, overwrite=overwrite,
                    sample_tokens=sample_tokens, log=print, progress=True, now=time.monotonic, **settings,
                )  # fmt: skip
        except KeyboardInterrupt:  # a Ctrl-C during start-up, or a second one during the run
            if any(p.suffix == ".json" for p in checkpoint_paths(out_dir)):
                with spoken_as_command(prog):
                    hint = f"resume from the last checkpoint with: {resume_command(Path(out_dir))}"
            else:
                hint = f"no checkpoint was saved in {out_dir}, nothing to resume: run the command again"
            print(f"{prog}: aborted; {hint}", file=sys.stderr)
            return 130
        return 130 if result.interrupted else 0

    return run_command(prog, body)
