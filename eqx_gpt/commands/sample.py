"""`sample`: text from a trained eqx_gpt model, streamed to stdout as it is generated.

    uv run sample.py --prompt "ROMEO:"               (or: python -m eqx_gpt sample --prompt "ROMEO:")
    uv run sample.py --checkpoint out/ --prompt-file opening.txt --max-new-tokens 300 --top-p 0.9
    uv run sample.py --prompt "ROMEO:" --max-new-tokens 0 --attention-png attention.png

Without --prompt/--prompt-file generation starts from a newline (as nanoGPT does); an explicitly
empty prompt is an error. Bad input prints one line to stderr and exits with code 2.
"""

import argparse
import sys
from pathlib import Path

from eqx_gpt.commands.cli import (
    OneLineParser,
    add_checkpoint_argument,
    finite_float,
    flag_values,
    run_command,
    seed_number,
    whole_number,
)
from eqx_gpt.commands.compile_cache import enable_compilation_cache
from eqx_gpt.errors import ConfigError


def parse_args(argv=None, prog: str = "sample.py") -> argparse.Namespace:
    p = OneLineParser(prog=prog, description="Generate text from a trained eqx_gpt checkpoint.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", metavar="TEXT", help="text to continue (default: a newline)")
    source.add_argument(
        "--prompt-file", metavar="PATH", type=Path, help="read the prompt from this UTF-8 file"
    )
    add_checkpoint_argument(p)
    p.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=whole_number(0),
        default=500,
        help="tokens to generate (default 500)",
    )
    p.add_argument(
        "--temperature", metavar="T", type=finite_float, default=0.8, help="0 means greedy (default 0.8)"
    )
    p.add_argument(
        "--top-k", metavar="K", type=whole_number(1), help="sample among the K most likely tokens only"
    )
    p.add_argument(
        "--top-p", metavar="P", type=finite_float, help="sample from the smallest set of mass >= P, in (0, 1]"
    )
    p.add_argument(
        "--num-samples",
        metavar="N",
        type=whole_number(1),
        default=1,
        help="samples, one after another (default 1)",
    )
    p.add_argument("--seed", type=seed_number, default=1337, help="same seed, same text (default 1337)")
    p.add_argument(
        "--attention-png",
        metavar="PATH",
        type=Path,
        help="draw each layer's and head's attention on the prompt",
    )
    p.add_argument(
        "--positions-png", metavar="PATH", type=Path, help="draw the model's sinusoidal position table"
    )
    return p.parse_args(argv)


def _read_prompt(args) -> str:
    if args.prompt_file is not None:
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"cannot read --prompt-file {args.prompt_file}: {getattr(e, 'strerror', None) or e}"
            ) from None
    else:
        text = "\n" if args.prompt is None else args.prompt
    if not text:
        raise ConfigError(
            "the prompt is empty; pass some text, or leave out --prompt to start from a newline"
        )
    return text


def _sampling_options(args):
    """The `SamplingOptions` of the flags (a bad value raises a one-line `ConfigError`)."""
    from eqx_gpt.generation.sampling import SamplingOptions

    with flag_values():
        return SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _check_picture_paths(args) -> None:
    """Refuse a picture path that cannot be written before any model is loaded or run."""
    if args.attention_png or args.positions_png:
        from eqx_gpt.visualize import check_figure_path

        for flag, path in (("--attention-png", args.attention_png), ("--positions-png", args.positions_png)):
            if path is not None:
                with flag_values():
                    check_figure_path(path, flag)


def main(argv=None, prog: str = "sample.py") -> int:
    """Sample with the flags `argv`; the exit code: 0, or 2 for bad input."""
    args = parse_args(argv, prog)
    return run_command(prog, lambda: _sample(args))


def _sample(args) -> int:
    enable_compilation_cache()  # the second run starts generating sooner
    import jax

    from eqx_gpt.checkpoint import load_model
    from eqx_gpt.generation.decoder import check_decoder
    from eqx_gpt.generation.generate import stream_text
    from eqx_gpt.model.gpt import GPT
    from eqx_gpt.tokenizer import UnknownCharacters

    options = _sampling_options(args)
    _check_picture_paths(args)
    prompt = _read_prompt(args)
    model, tokenizer, _ = load_model(args.checkpoint, kind="LanguageModel")
    try:
        check_decoder(model)  # a model of one's own samples if it has a KV cache (eqx_gpt.Decoder)
    except TypeError as e:
        raise ConfigError(str(e)) from None
    pictures = [flag for flag, given in (("--attention-png", args.attention_png),
                                         ("--positions-png", args.positions_png)) if given]  # fmt: skip
    if pictures and not isinstance(model, GPT):
        raise ConfigError(f"{pictures[0]} draws a GPT's, and this is a {type(model).__name__}; leave it out")
    if args.positions_png and model.config.positions != "sinusoidal":
        raise ConfigError(
            f"--positions-png draws the sinusoidal table, and this model has {model.config.positions} "
            f"positions; leave the flag out"
        )
    try:
        tokens = tokenizer.encode(prompt)
    except UnknownCharacters as e:
        raise e.naming(f"--prompt-file {args.prompt_file}" if args.prompt_file else "the prompt") from None
    if not tokens:
        raise ConfigError(f"the prompt {prompt!r} encodes to no tokens; pass some text")

    if args.attention_png or args.positions_png:
        from eqx_gpt.visualize import plot_model_attention, plot_positions

        if args.attention_png:
            pieces = [tokenizer.decode([t]) for t in tokens]
            plot_model_attention(model, tokens, pieces, args.attention_png)
            print(f"wrote {args.attention_png}", file=sys.stderr)
        if args.positions_png:
            plot_positions(model.config.context_length, model.config.d_model, args.positions_png)
            print(f"wrote {args.positions_png}", file=sys.stderr)
    if args.max_new_tokens == 0:
        return 0

    seed_key = jax.random.key(args.seed)
    for i in range(args.num_samples):
        if i:
            sys.stdout.write("\n" + "-" * 40 + "\n")
        sys.stdout.write(prompt)
        sys.stdout.flush()
        pieces = stream_text(
            model,
            tokenizer,
            tokens,
            args.max_new_tokens,
            key=jax.random.fold_in(seed_key, i),
            options=options,
        )
        for text in pieces:
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
