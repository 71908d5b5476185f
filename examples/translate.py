"""Train the paper's encoder-decoder Transformer to translate, with eqx_gpt's own training pieces.

    uv run python examples/translate.py                 # dates, as people write them -> ISO 8601
    uv run python examples/translate.py --attention-png cross.png
    uv run --group bleu python examples/translate.py --pairs fra.txt --minutes 30   # English -> French
    uv run python examples/translate.py --translate "3 March 2009" --translate "mardi 3 mars 2009"

With no arguments (and no network) the task is generated on the fly, so every answer is known
exactly: a date written in English or French in one of many formats ("3 March 2009",
"March 3rd, 09", "3/3/2009", "mardi 3 mars 2009"; Babel's CLDR data formats them) maps to
"2009-03-03". `--pairs FILE` trains on the tab-separated sentence pairs of the Tatoeba/Anki
English-French file (`english<TAB>french[<TAB>attribution]`) and also reports BLEU (sacrebleu).
Characters are the tokens. Batches are padded per batch, to a multiple of 16 (a few compiled
shapes). The last line printed is the exact-match rate on held-out pairs. The model is saved in
`--out-dir` (an eqx_gpt checkpoint that records its class, `Transformer`); `--translate TEXT`
reloads it and translates. Bad input prints one line and exits with code 2.
"""

import argparse
import datetime as dt
import functools
import importlib
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from matplotlib.figure import Figure

from eqx_gpt import (
    CheckpointError,
    SamplingOptions,
    TrainConfig,
    Transformer,
    TransformerConfig,
    delete_checkpoints,
    find_checkpoint,
    init_optimizer_state,
    learning_rate,
    load_model,
    make_optimizer,
    make_train_step,
    save_checkpoint,
    translate,
)

PAD, BOS, EOS = 0, 1, 2
BUCKET = 16  # sequences are padded to a multiple of this: few shapes, few compiles


class CharVocab:
    """Characters as ids, after three specials: padding 0, begin 1, end 2."""

    def __init__(self, texts):
        self.chars = sorted({ch for text in texts for ch in text})
        self.ids = {ch: i + 3 for i, ch in enumerate(self.chars)}

    @classmethod
    def from_dict(cls, d: dict) -> "CharVocab":
        """The vocabulary `to_dict` described (as a checkpoint stores it)."""
        if not isinstance(d, dict) or d.get("kind") != "char-vocab" or not isinstance(d.get("chars"), str):
            raise ValueError(f"not a translate.py vocabulary: {d!r}")
        return cls([d["chars"]])

    @property
    def size(self) -> int:
        return len(self.chars) + 3

    def encode(self, text: str, *, strict: bool = False) -> list[int]:
        """The ids of `text`'s characters. Characters the vocabulary lacks are dropped (held-out data
        may hold a few), or with `strict` refused in one line, naming them."""
        unknown = sorted({ch for ch in text if ch not in self.ids})
        if strict and unknown:
            raise ValueError(
                f"{text!r} holds {''.join(unknown)!r}, not among the {len(self.chars)} characters the model "
                f"was trained on; write it with those"
            )
        return [self.ids[ch] for ch in text if ch in self.ids]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= 3:
                out.append(self.chars[i - 3])
        return "".join(out)

    def to_dict(self) -> dict:
        return {"kind": "char-vocab", "chars": "".join(self.chars), "specials": ["<pad>", "<bos>", "<eos>"]}


# ---------------------------------------------------------------------------------------------
# Data


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 11 <= n % 100 <= 13 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


# (locale, CLDR pattern). Two-digit years read as 1950-2049, the range the dates are drawn from.
# Numeric dates are written US-style only, so that no string means two dates.
DATE_FORMATS = [
    ("en", "MMMM d, y"), ("en", "EEEE, MMMM d, y"), ("en", "MMM d, y"), ("en", "MMM d, yy"),
    ("en_GB", "d MMMM y"), ("en_GB", "d MMM y"), ("en_GB", "EEE, d MMM y"), ("en_GB", "EEEE d MMMM y"),
    ("en", "M/d/y"), ("en", "MM/dd/yy"), ("en", "M/d/yy"), ("en", "y-MM-dd"),
    ("fr", "EEEE d MMMM y"), ("fr", "d MMMM y"), ("fr", "d MMM y"), ("fr", "EEE d MMM y"),
    ("fr", "d MMMM yy"),
    ("en", "MMMM {ordinal}, yy"), ("en", "MMMM {ordinal}, y"), ("en_GB", "{ordinal} MMMM y"),
]  # fmt: skip


def write_date(date: dt.date, rng: random.Random) -> str:
    from babel.dates import format_date  # the examples dependency group (`uv run` installs it)

    locale, pattern = rng.choice(DATE_FORMATS)
    text = format_date(date, pattern.replace("{ordinal}", "'#'"), locale=locale)
    text = text.replace("#", _ordinal(date.day))
    return text.lower() if rng.random() < 0.2 else text


FIRST_DAY, N_DAYS = dt.date(1950, 1, 1), (dt.date(2049, 12, 31) - dt.date(1950, 1, 1)).days + 1
N_DATE_PAIRS = 50_000  # training pairs of the dates task


def date_pairs(n_train: int, n_held_out: int, seed: int) -> tuple[list, list]:
    """(written date, ISO date) pairs between 1950 and 2049: `n_train` for training, written in
    random formats, and `n_held_out` of other dates, never seen in training."""
    rng = random.Random(seed)
    first, n_days = FIRST_DAY, N_DAYS
    days = rng.sample(range(n_days), n_days)
    held, rest = days[:n_held_out], days[n_held_out:]
    pair = lambda d: (write_date(first + dt.timedelta(d), rng), (first + dt.timedelta(d)).isoformat())
    return [pair(rest[i % len(rest)]) for i in range(n_train)], [pair(d) for d in held]


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """(English, French) pairs of a Tatoeba/Anki file; one-line `ValueError`s for bad files."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"cannot read --pairs {path} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--pairs {path} is not UTF-8 (byte {e.start}); convert it with iconv -t UTF-8"
        ) from None
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise ValueError(f"--pairs {path}, line {number}: no tab; each line must be english<TAB>french")
        if fields[0] and fields[1]:
            pairs.append((fields[0], fields[1]))
    if not pairs:
        raise ValueError(f"--pairs {path} holds no pairs")
    return list(dict.fromkeys(pairs))  # no pair twice, so none is in both training and held-out data


def fitting(pairs: list, max_len: int, what: str) -> list[tuple[str, str]]:
    """The pairs whose source and target both fit `--max-len` (at most `max_len - 2` characters a
    side: the target also holds its begin and end marks). Every task is filtered so, never cut: a
    cut pair teaches a wrong answer. Says how many were left out; none left is a one-line error."""
    limit = max_len - 2
    kept = [(s, t) for s, t in pairs if len(s) <= limit and len(t) <= limit]
    if not kept:
        longest = min(max(len(s), len(t)) for s, t in pairs)
        raise ValueError(
            f"--max-len {max_len} fits none of the {len(pairs):,} {what} (a side may hold --max-len - 2 = "
            f"{limit} characters; the shortest pair needs {longest}); pass --max-len {longest + 2} or more"
        )
    if len(kept) < len(pairs):
        print(f"--max-len {max_len}: {len(kept):,} of {len(pairs):,} {what} fit ({limit} characters a side)")
    return kept


def _padded(rows: list[list[int]], length: int | None = None, cap: int | None = None) -> np.ndarray:
    """`rows` padded with `PAD` to `length`, or to a multiple of `BUCKET`, but not past `cap`."""
    length = length or min(-(-max(len(r) for r in rows) // BUCKET) * BUCKET, cap or 1 << 62)
    out = np.full((len(rows), length), PAD, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def make_batch(pairs, src_vocab, tgt_vocab, max_len: int) -> tuple[np.ndarray, int]:
    """`(batch, src_len)`: each row the padded source then `BOS target EOS` padded, as one array
    (the training step takes one array; the loss splits it at `src_len`)."""
    src = _padded([src_vocab.encode(s)[:max_len] for s, _ in pairs], cap=max_len)
    tgt = _padded([[BOS, *tgt_vocab.encode(t)[: max_len - 1], EOS] for _, t in pairs], cap=max_len + 1)
    return np.concatenate([src, tgt], axis=1), src.shape[1]


def translation_loss(model: Transformer, batch, keys=None, *, src_len: int):
    """Mean cross-entropy of the next target token over real (non-padding) target positions."""
    src, tgt = batch[:, :src_len], batch[:, src_len:]
    logits = model(src, tgt[:, :-1], key=keys)
    losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, tgt[:, 1:])
    real = tgt[:, 1:] != PAD
    return jnp.sum(losses * real) / jnp.maximum(jnp.sum(real), 1)


# ---------------------------------------------------------------------------------------------
# Training and evaluation


def clock(seconds: float) -> str:
    """`m:ss` of a duration in seconds."""
    seconds = int(max(0, seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def show_progress(text: str) -> None:
    """One line of progress on stderr, redrawn in place on a terminal (left out elsewhere); an
    empty `text` clears it."""
    if sys.stderr.isatty():
        print("\r" + text.ljust(80) + ("" if text else "\r"), end="", file=sys.stderr, flush=True)


def steps_that_fit(step: int, since_first: float, left: float, max_steps: int) -> int:
    """The run's length at the pace so far: `step` steps took `since_first` seconds after the first
    (which compiled), and `left` seconds remain; never past `max_steps`, never before `step + 1`."""
    per_step = since_first / max(step, 1)
    return max(step + 1, min(max_steps, step + int(left / max(per_step, 1e-9))))


def train(model, pairs, vocabs, args, log=print, now=time.monotonic):
    """Train under eqx_gpt's AdamW, schedule and jitted step, the schedule fitted to --minutes as
    measured by the clock `now`: refitted every 100 steps, so that its cosine ends with the time."""
    config = TrainConfig(
        batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10, warmup_steps=100, weight_decay=0.01,
        max_steps=args.max_steps, max_minutes=args.minutes, beta2=0.98, seed=args.seed,
    )  # fmt: skip
    optimizer = make_optimizer(config)
    opt_state = init_optimizer_state(optimizer, model)
    steps_for = functools.lru_cache(maxsize=None)(
        lambda src_len: make_train_step(
            optimizer, config, dropout=model.config.dropout > 0,
            loss=functools.partial(translation_loss, src_len=src_len),
        )
    )  # fmt: skip
    rng, t_start = random.Random(args.seed), now()
    # The time budget, less what translating the held-out set takes afterwards: 10 s (less in a short run).
    deadline = t_start + 60 * args.minutes - min(10.0, 6 * args.minutes) if args.minutes > 0 else math.inf
    horizon, t_first, loss = config.max_steps, t_start, jnp.zeros(())
    src_vocab, tgt_vocab = vocabs
    for step in range(config.max_steps):
        if step >= horizon:
            break
        chosen = rng.sample(pairs, config.batch_size)
        batch, src_len = make_batch(chosen, src_vocab, tgt_vocab, model.config.max_len)
        lr = np.float32(learning_rate(step, config, horizon))
        model, opt_state, loss = steps_for(src_len)(model, opt_state, batch, np.int32(step), lr)
        if step == 0:
            loss.block_until_ready()
            t_first = now()
        elif step % 100 == 0:
            float(loss)  # wait for the step, so the pace counts computing, not dispatching
            t = now()
            if deadline < math.inf:
                horizon = steps_that_fit(step, t - t_first, deadline - t, config.max_steps)
            show_progress(f"step {step}/{horizon} | loss {float(loss):.4f} | {clock(t - t_start)}")
        if now() >= deadline:
            horizon = step + 1
    show_progress("")
    log(f"trained {horizon} steps in {clock(now() - t_start)}; last batch loss {float(loss):.4f}")
    return model, opt_state, horizon


def translate_all(model, sources, vocabs, max_len: int, batch: int = 500) -> list[str]:
    """Greedy translations of `sources` (`translate`: generate's KV-cached loop, the model bound to them)."""
    src_vocab, tgt_vocab = vocabs
    out = []
    for i in range(0, len(sources), batch):
        chunk = sources[i : i + batch]
        src = _padded([src_vocab.encode(s)[:max_len] for s in chunk], length=max_len)
        ids = translate(model, src, max_len, bos_id=BOS, eos_id=EOS, options=SamplingOptions(temperature=0))
        out.extend(tgt_vocab.decode(row) for row in ids)
    return out


def draw_cross_attention(model, source: str, target: str, vocabs, path: Path) -> None:
    """One heatmap per decoder layer and head: target characters down, source characters across."""
    src_vocab, tgt_vocab = vocabs
    src, tgt = src_vocab.encode(source), [BOS, *tgt_vocab.encode(target)]
    weights = jax.jit(Transformer.cross_attention_weights)(model, jnp.asarray(src), jnp.asarray(tgt))
    weights = np.asarray(weights)  # (layers, heads, target, source)
    n_layers, n_heads = weights.shape[:2]
    visible = lambda text: [{" ": "␣"}.get(ch, ch) for ch in text]
    fig = Figure(figsize=(3.2 * n_heads + 0.8, 3.2 * n_layers + 0.6), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    images = []
    for (layer, head), ax in np.ndenumerate(axes):
        image = ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"layer {layer} head {head}", fontsize=8)
        ax.set_xticks(range(len(src)), visible(source), fontsize=6)
        ax.set_yticks(range(len(tgt)), ["<bos>", *visible(target)], fontsize=6)
        ax.tick_params(length=0, labeltop=True, labelbottom=False)
        images.append(image)
    fig.colorbar(images[-1], ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle("cross-attention (target ↓, source →)")
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# The command


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line on stderr and exit code 2 (argparse would print the usage too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def whole_number(low: int, high: int = 2**31 - 1):
    """An integer in `[low, high]` (JAX holds counts and sizes as int32)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got {text}")
        return value

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog="translate.py", description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--pairs", type=Path, help="Tatoeba/Anki english<TAB>french file (default: the dates task)"
    )
    p.add_argument(
        "--minutes",
        type=finite_float,
        default=2.4,
        help="training time, compile included (schedule fitted); 0: no limit, train --max-steps",
    )
    p.add_argument("--max-steps", type=whole_number(1), default=20_000)
    p.add_argument("--batch-size", type=whole_number(1), default=64)
    p.add_argument("--lr", type=finite_float, default=1e-3)
    p.add_argument("--d-model", type=whole_number(1), default=128, help="a multiple of 8 (4 heads, even)")
    p.add_argument("--layers", type=whole_number(1), default=2, help="encoder and decoder layers each")
    p.add_argument(
        "--max-len", type=whole_number(3), default=48, help="longest source or target, in characters"
    )
    p.add_argument(
        "--held-out", type=whole_number(1), default=1000, help="pairs kept out of training and scored"
    )
    p.add_argument("--seed", type=whole_number(0, 2**63 - 1), default=0)
    p.add_argument("--out-dir", type=Path, default=Path("out-translate"), help="its checkpoint goes here")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the run already in --out-dir (else it is refused)"
    )
    p.add_argument("--attention-png", type=Path, help="draw the cross-attention of one held-out example")
    p.add_argument(
        "--translate", metavar="TEXT", action="append",
        help="translate TEXT with the model saved in --out-dir instead of training (repeatable)",
    )  # fmt: skip
    return p.parse_args(argv)


def translate_saved(out_dir: Path, sources: list[str]) -> list[str]:
    """Greedy translations of `sources` by the model a training run saved in `out_dir`; a source
    that is empty, too long or holds characters the model never saw is refused in one line."""
    model, _, meta = load_model(out_dir, kind="Transformer")
    vocabs = CharVocab.from_dict(meta["tokenizer"]), CharVocab.from_dict(meta["target_tokenizer"])
    for source in sources:
        if not source.strip():
            raise ValueError("--translate got an empty text; pass the text to translate")
        if len(source) > model.config.max_len:
            raise ValueError(
                f"--translate {source!r} has {len(source)} characters; the model reads at most "
                f"{model.config.max_len}"
            )
        vocabs[0].encode(source, strict=True)
    return translate_all(model, sources, vocabs, model.config.max_len)


def check_settings(args) -> None:
    """Refuse settings that cannot make a run, and an --out-dir holding a run, before any work."""
    TransformerConfig(
        src_vocab_size=4, tgt_vocab_size=4, max_len=args.max_len, d_model=args.d_model, n_heads=4,
        n_encoder_layers=args.layers, n_decoder_layers=args.layers, pad_id=PAD,
    )  # fmt: skip
    if args.minutes < 0 or not args.lr > 0:
        raise ValueError(f"need --minutes >= 0 and --lr > 0, got {args.minutes} and {args.lr}")
    check_out_dir(args.out_dir)
    if args.pairs is None and args.held_out >= N_DAYS:
        raise ValueError(
            f"--held-out {args.held_out} leaves none of the {N_DAYS:,} dates of 1950-2049 for training; "
            f"pass at most {N_DAYS - 1:,}"
        )
    if args.out_dir.is_dir() and any(args.out_dir.iterdir()):
        if not args.overwrite or not holds_run(args.out_dir):
            raise ValueError(
                f"{args.out_dir}/ already holds a model or other files; pass another --out-dir, or "
                f"--overwrite to replace the eqx_gpt run there"
            )


def holds_run(folder: Path) -> bool:
    """Whether `folder` holds an eqx_gpt run (its checkpoints), which --overwrite may replace."""
    try:
        find_checkpoint(folder)
    except CheckpointError:
        return False
    return True


def check_out_dir(out_dir: Path) -> None:
    """Refuse an `--out-dir` that cannot become a writable folder, before any work (nothing is
    created: the folder is made when the model is saved)."""
    try:  # strict: a loop raises on every Python (3.13's lenient resolve() returns it as it is)
        path = out_dir.expanduser().resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):  # a folder to be made, or a file (said below)
        path = out_dir.expanduser().resolve()
    except (OSError, RuntimeError):  # Python 3.11 raises RuntimeError("Symlink loop ...")
        raise ValueError(f"--out-dir {out_dir} is a loop of symbolic links; pass a folder") from None
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--out-dir {out_dir}: {existing} is a file, not a folder; pass a folder")
    try:  # a folder made and removed: the only sure test of writing there (root passes os.access)
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".translate-probe-"))
    except OSError as e:
        raise ValueError(
            f"--out-dir {out_dir}: {existing} cannot be written ({e.strerror or e}); pass another folder"
        ) from None


def check_batch(args, n_train: int) -> None:
    if args.batch_size > n_train:
        raise ValueError(
            f"--batch-size {args.batch_size} is more than the {n_train:,} training pairs; pass at most "
            f"{n_train:,}"
        )


def load_data(args) -> tuple[list, list]:
    """`(training pairs, held-out pairs)`; held-out sources never occur in training."""
    if args.pairs is None:
        train_pairs, held_out = date_pairs(N_DATE_PAIRS, args.held_out, args.seed)
        return fitting(train_pairs, args.max_len, "training dates"), fitting(
            held_out, args.max_len, "held-out dates"
        )
    pairs = fitting(read_pairs(args.pairs), args.max_len, f"pairs of --pairs {args.pairs}")
    random.Random(args.seed).shuffle(pairs)
    if len(pairs) <= args.held_out:
        raise ValueError(f"only {len(pairs)} pairs: fewer than --held-out {args.held_out} plus training data")
    return pairs[args.held_out :], pairs[: args.held_out]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.translate:
        try:
            translations = translate_saved(args.out_dir, args.translate)
        except ValueError as e:  # CheckpointError included
            print(f"translate.py: error: {e}", file=sys.stderr)
            return 2
        for source, guess in zip(args.translate, translations, strict=True):
            print(f"{source!r} -> {guess!r}")
        return 0
    try:
        check_settings(args)
        if args.attention_png is not None and not (
            args.attention_png.suffix == ".png" and args.attention_png.parent.is_dir()
        ):
            raise ValueError(f"--attention-png {args.attention_png}: pass a .png file in an existing folder")
        train_pairs, held_out = load_data(args)
        check_batch(args, len(train_pairs))
        if args.pairs is not None:
            importlib.import_module("sacrebleu")  # checked before training, which would be wasted
    except ModuleNotFoundError as e:
        print(
            f"translate.py: error: {e.name} is needed for --pairs; run with `uv run --group bleu`",
            file=sys.stderr,
        )
        return 2
    except ValueError as e:
        print(f"translate.py: error: {e}", file=sys.stderr)
        return 2
    vocabs = CharVocab(s for s, _ in train_pairs), CharVocab(t for _, t in train_pairs)
    config = TransformerConfig(
        src_vocab_size=vocabs[0].size, tgt_vocab_size=vocabs[1].size, max_len=args.max_len,
        d_model=args.d_model, n_heads=4, n_encoder_layers=args.layers, n_decoder_layers=args.layers,
        pad_id=PAD,
    )  # fmt: skip
    model = Transformer(config, key=jax.random.key(args.seed))
    layers = f"{args.layers}+{args.layers} layers, d_model {args.d_model}"
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    size = f"{n_params / 1e6:.2f}M parameters ({layers})"
    print(
        f"{len(train_pairs):,} training pairs, {len(held_out):,} held out; model {size}, post-norm LayerNorm"
    )
    model, opt_state, steps = train(model, train_pairs, vocabs, args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    delete_checkpoints(args.out_dir)  # --overwrite: the run there is replaced whole
    save_checkpoint(
        args.out_dir, "latest", model, opt_state, step=steps, tokenizer=vocabs[0], train_config={},
        target_tokenizer=vocabs[1].to_dict(),
    )  # fmt: skip
    predictions = translate_all(model, [s for s, _ in held_out], vocabs, args.max_len)
    for (source, target), guess in list(zip(held_out, predictions, strict=True))[:3]:
        print(f"  {source!r} -> {guess!r} (expected {target!r})")
    if args.attention_png is not None:
        draw_cross_attention(model, held_out[0][0], predictions[0], vocabs, args.attention_png)
        print(f"wrote {args.attention_png}")
    if args.pairs is not None:
        sacrebleu = importlib.import_module("sacrebleu")  # an optional group: `uv run --group bleu`
        bleu = sacrebleu.corpus_bleu(predictions, [[t for _, t in held_out]])
        print(f"held-out BLEU {bleu.score:.1f} (sacrebleu, n={len(held_out)})")
    exact = np.mean([guess == target for (_, target), guess in zip(held_out, predictions, strict=True)])
    print(f"held-out exact match {exact:.3f} (n={len(held_out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
