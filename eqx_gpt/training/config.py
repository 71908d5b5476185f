"""How to train: every setting of a run in one frozen dataclass (`presets.py` holds named recipes).

Each field says what kind of setting it is in its metadata (`eqx_gpt.configs.KINDS`): its choices,
its range, whether a resumed run may change it, whether the compiled step reads it, whether its
flag repeats. The class body is the one table the checks here, the merging of settings
(`options.py`), the step's cache (`setup.py`) and the flags (`commands/train.py`) read.
"""

import contextlib
import contextvars
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

from eqx_gpt._checks import INT32_MAX, SEED_MAX, is_whole
from eqx_gpt.configs import DictConfig, check_fields, described, fields_of_kind, kind
from eqx_gpt.errors import ConfigError
from eqx_gpt.model.lora import check_lora, target_names

TOKENIZERS = ("char", "gpt2")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")
TRACKERS = ("tensorboard", "wandb")  # the names `tracker` takes (`trackers.py`)
# Each number's range, as `described(..., bounds=...)` records it: what it accepts, and its words.
AT_LEAST_0 = (lambda v: v >= 0, ">= 0")
ABOVE_0 = (lambda v: v > 0, "> 0")
A_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")


@dataclass(frozen=True)
class TrainConfig(DictConfig):
    """How to train (see `presets.py` for named recipes). Invalid values raise `ValueError`."""

    _trackers: ClassVar[tuple[str, ...]]  # `tracker` parsed, set on each config when it is checked

    data: str | None = described(
        "a UTF-8 text file, a .jsonl file of records, a .parquet or .arrow table, any of the texts "
        "compressed (.gz, .xz, .zst), or a folder of them, to train on; tokenized once into the token "
        "cache (default: the bundled Tiny Shakespeare)",
        default=None,
        resumable=True,
        read_by_step=False,
    )
    text_field: str = described(
        "the field of .jsonl records, and the column of .parquet and .arrow tables, that holds the text",
        default="text",
        read_by_step=False,
    )
    split: str | None = described(
        "the split to train on of a folder of splits: a Hugging Face DatasetDict (dataset_dict.json), or "
        "a folder of train/validation/test files or folders; 'all' reads every file (default: train)",
        default=None,
        read_by_step=False,
    )
    tokenizer: str = described(
        "'char' (vocabulary built from the corpus) or 'gpt2' (tiktoken BPE)",
        default="char",
        choices=TOKENIZERS,
        read_by_step=False,
    )
    model: str | None = described(
        "train a model of your own: MODULE:FUNCTION, called as FUNCTION(vocab_size, key=key) with the "
        "tokenizer's vocabulary size (imported as uvicorn imports an app, the current folder first); the "
        "model's shape is its own, so the model settings are left out; the run records it, so that "
        "sampling, evaluation, serving and load_model rebuild the model",
        default=None,
        read_by_step=False,
    )
    init_from: str | None = described(
        "fine-tune: start from the Hugging Face GPT-2 directory DIR (config.json + model.safetensors); "
        "the model's shape and the gpt2 tokenizer come from it",
        default=None,
        read_by_step=False,
    )
    lora_rank: int | None = described(
        "with --init-from: train LoRA adapters of this rank on the frozen GPT-2 instead of every weight "
        "(default: full fine-tuning); the run folder then also holds them in PEFT's format",
        default=None,
    )
    lora_adapters: str | None = described(
        "with --lora-rank: start the adapters from this PEFT adapter folder instead of afresh (--init-from "
        "ADAPTER_DIR sets it, and the rest, from the folder's adapter_config.json)",
        default=None,
        read_by_step=False,
    )
    lora_alpha: float = described(
        "LoRA's alpha: the adapters' update is scaled by alpha / rank", default=16.0, finite=True
    )
    lora_dropout: float = described(
        "LoRA dropout on the adapters' input (PEFT's lora_dropout; 0.05 is usual), in training only",
        default=0.0,
        finite=True,
    )
    lora_targets: str = described(
        "the projections LoRA adapts, a comma list of PEFT's GPT-2 names (c_attn, c_proj: attention's "
        "and the MLP's, c_fc) or of eqx_gpt's module paths or their ends (attn.qkv, attn.out, mlp.up, "
        "mlp.down; a model of your own: any of its Linears' paths, such as qkv or blocks.0.mlp.up)",
        default="c_attn",
    )
    batch_size: int = described("sequences per optimiser step", default=32, positive=True)
    grad_accum: int = described(
        "split each batch into this many micro-batches (same update, less memory)", default=1, positive=True
    )
    max_steps: int = described(
        "optimiser steps; also the length of the cosine schedule",
        default=3000,
        positive=True,
        resumable=True,
        read_by_step=False,
    )
    max_minutes: float = described(
        "stop after this many minutes of wall time, fitting the schedule to the steps that fit (0: no limit)",
        default=0.0,
        finite=True,
        bounds=(AT_LEAST_0[0], ">= 0 (0: no limit)"),
        resumable=True,
        read_by_step=False,
    )
    optimizer: str = described(
        "'adamw' for every parameter, or 'muon': Muon (optax.contrib.muon) on the blocks' weight "
        "matrices and AdamW (at --adam-lr) on the embedding, head and norm scales",
        default="adamw",
        choices=OPTIMIZERS,
    )
    lr: float = described(
        "peak learning rate (of the Muon group under --optimizer muon)",
        default=1e-3,
        finite=True,
        bounds=ABOVE_0,
    )
    adam_lr: float | None = described(
        "under --optimizer muon: peak learning rate of the AdamW group (default: --lr)",
        default=None,
        finite=True,
        bounds=(ABOVE_0[0], "> 0 (or None: --lr)"),
    )
    adam_weight_decay: float = described(
        "under --optimizer muon: weight decay of the AdamW group (embedding and head, never norm scales)",
        default=0.0,
        finite=True,
        bounds=AT_LEAST_0,
    )
    muon_momentum: float = described(
        "under --optimizer muon: Muon's (Nesterov) momentum", default=0.95, finite=True, bounds=A_FRACTION
    )
    muon_split_qkv: bool = described(
        "under --optimizer muon: orthogonalise the query, key and value projections each on its own",
        default=False,
    )
    muon_ns_steps: int = described(
        "under --optimizer muon: Newton-Schulz iterations that orthogonalise each update",
        default=5,
        positive=True,
    )
    min_lr: float = described("learning rate at the end of the decay", default=1e-4, finite=True)
    warmup_steps: int = described("steps of linear warm-up from 0 to lr", default=100, read_by_step=False)
    schedule: str = described(
        "after the warm-up: 'cosine' (half a cosine from lr to min_lr over the rest of the run) or "
        "'wsd' (warm-up, stable: lr until the last --decay-fraction of the run, then a linear decay "
        "to min_lr)",
        default="cosine",
        choices=SCHEDULES,
        read_by_step=False,
    )
    decay_fraction: float = described(
        "under --schedule wsd: the fraction of the run spent decaying",
        default=0.4,
        finite=True,
        bounds=(lambda v: 0 < v <= 1, "in (0, 1]"),
        read_by_step=False,
    )
    weight_decay: float = described(
        "weight decay of the weight matrices (AdamW's; under --optimizer muon, of the Muon group)",
        default=0.1,
        finite=True,
        bounds=AT_LEAST_0,
    )
    beta1: float = described("AdamW beta1", default=0.9, finite=True, bounds=A_FRACTION)
    beta2: float = described("AdamW beta2", default=0.99, finite=True, bounds=A_FRACTION)
    grad_clip: float = described(
        "clip gradients to this global norm (0: no clipping)",
        default=1.0,
        finite=True,
        bounds=(AT_LEAST_0[0], ">= 0 (0: no clipping)"),
    )
    eval_interval: int = described(
        "evaluate and checkpoint every this many steps",
        default=250,
        positive=True,
        resumable=True,
        read_by_step=False,
    )
    eval_batches: int = described(
        "fixed training batches averaged for the train loss at each evaluation, at a character "
        "vocabulary's cost: a larger head reads fewer windows at the same cost (GPT-2's 50,257 ids "
        "at the default model: 93 of 16 x 48; validation: see --eval-tokens)",
        default=8,
        positive=True,
        read_by_step=False,
    )
    eval_tokens: int = described(
        "validation tokens each evaluation may read at a character vocabulary's cost: the whole split "
        "if it has no more (Tiny Shakespeare's 111,540 tokens), else the same evenly spread windows "
        "each time; a larger head reads fewer tokens at the same cost (GPT-2's 50,257 ids at the "
        "default model: 15,905); the final validation reads the whole split up to 4x this, else a "
        "sample of 4x",
        default=131_072,
        positive=True,
        resumable=True,
        read_by_step=False,
    )
    log_interval: int = described(
        "record loss, lr and tokens/s every this many steps",
        default=10,
        positive=True,
        resumable=True,
        read_by_step=False,
    )
    seed: int = described("seed of initialisation, batches and dropout", default=0)
    fsdp: bool = described(
        "split parameters and optimiser state over the devices too (FSDP), not only the batch",
        default=False,
    )
    tracker: str | None = described(
        "also send metrics.jsonl's records to 'tensorboard' (event files in out_dir/tensorboard/) or "
        "'wandb' (Weights & Biases; offline with WANDB_MODE=offline): repeat the flag or give a comma "
        "list; each is an optional extra (uv sync --extra NAME); on resume, 'none' drops them",
        default=None,
        resumable=True,
        repeatable=True,
        choices=TRACKERS,
        read_by_step=False,
    )

    def __post_init__(self):
        for name in ("data", "init_from", "lora_adapters"):  # a path as a `Path` too, held as a str
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        finite = [name for name in fields_of_kind(TrainConfig, "finite") if getattr(self, name) is not None]
        check_fields(self, positive=fields_of_kind(TrainConfig, "positive"), finite=tuple(finite))
        self._check_kinds()
        self._check_choices()
        self._check_ranges()
        self._check_fine_tuning()

    def _check_kinds(self) -> None:
        """Whole numbers, paths, names and switches: each of the type its field says."""
        if not is_whole(self.seed, 0, SEED_MAX):
            raise ConfigError(f"seed must be an integer in [0, {SEED_MAX}], got {self.seed!r}")
        if not is_whole(self.warmup_steps, 0):
            raise ConfigError(
                f"warmup_steps must be an integer in [0, {INT32_MAX}], got {self.warmup_steps!r}"
            )
        for name in ("data", "init_from", "lora_adapters"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(
                    f"{name} must be a path (a str or a Path) or None, got {getattr(self, name)!r}"
                )
        if self.model is not None and (not isinstance(self.model, str) or ":" not in self.model):
            raise ConfigError(
                f"model must be MODULE:FUNCTION (such as mydec:make_decoder), got {self.model!r}"
            )
        _check_corpus_fields(self.text_field, self.split)
        if self.tracker is not None and not isinstance(self.tracker, str):
            raise ConfigError(
                f"tracker must be a comma list of names such as 'tensorboard,wandb', or None, "
                f"got {self.tracker!r}"
            )
        # Parsed once, here: an unknown name is refused before the run starts (`trackers` reads it).
        object.__setattr__(self, "_trackers", parse_trackers(self.tracker))
        for name in ("fsdp", "muon_split_qkv"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_choices(self) -> None:
        """Settings that name one of a few things, and the ones that must agree."""
        for name in ("optimizer", "schedule", "tokenizer"):  # `tracker`, a list of names: `parse_trackers`
            choices = kind(_FIELDS[name], "choices")
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.init_from is not None and self.model is None and self.tokenizer != "gpt2":
            raise ConfigError(
                f"{setting('init_from', self.init_from)} starts from GPT-2, whose tokenizer is gpt2, not "
                f"{self.tokenizer!r}; leave out {setting('tokenizer')}"
            )
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}; "
                f"each micro-batch must hold batch_size / grad_accum sequences"
            )

    @property
    def trackers(self) -> tuple[str, ...]:
        """The tracker names of `tracker`, parsed when the config was made (`parse_trackers`)."""
        return self._trackers

    def _check_ranges(self) -> None:
        """Each number in its range (its field's `bounds`), named with its value: `got max_minutes=-1`."""
        for name in _BOUNDED:
            accepts, description = kind(_FIELDS[name], "bounds")
            value = getattr(self, name)
            if value is not None and not accepts(value):
                raise ConfigError(f"{name} must be {description}, got {name}={value!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr must be in [0, lr={self.lr!r}], got min_lr={self.min_lr!r}")

    def _check_fine_tuning(self) -> None:
        """LoRA's settings. That LoRA needs `init_from`, and the rank's
        bound by the model's width, are checked with the run's options (`resolve_options`): the
        step's config leaves out `init_from` (it is not the step's to read)."""
        if not isinstance(self.lora_targets, str):
            raise ConfigError(f"lora_targets must be a comma list of names, got {self.lora_targets!r}")
        target_names(self.lora_targets)  # an empty one is refused whether or not LoRA is on; an unknown
        # name is, against the model's paths, when the model is built
        if self.lora_rank is None:
            if self.lora_adapters is not None:
                raise ConfigError(
                    f"{setting('lora_adapters')} continues a LoRA run: pass {setting('init_from')} "
                    f"ADAPTER_DIR instead"
                )
            return
        check_lora(self.lora_rank, self.lora_alpha, self.lora_dropout)


_FIELDS = {f.name: f for f in fields(TrainConfig)}
_BOUNDED = tuple(name for name, f in _FIELDS.items() if kind(f, "bounds") is not None)


def parse_trackers(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """The tracker names in `spec` ("tensorboard,wandb", a list of such; None, "" or "none" for
    none, as a resumed run may drop them), each once, in order; an unknown name raises `ConfigError`."""
    if spec is None:
        return ()
    parts = [spec] if isinstance(spec, str) else list(spec)
    names = [n.strip().lower() for part in parts for n in part.split(",")]
    names = [n for n in names if n and n != "none"]
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"--tracker {name!r} is not a tracker; choose from {', '.join(TRACKERS)}")
    return tuple(dict.fromkeys(names))


def _check_corpus_fields(text_field, split) -> None:
    """Refuse a `text_field` or `split` that names no field or split."""
    if not isinstance(text_field, str) or not text_field:
        raise ConfigError(f"text_field must be a field name (a non-empty string), got {text_field!r}")
    if split is not None and (not isinstance(split, str) or not split or "/" in split):
        raise ConfigError(f"split must be a split's name such as 'train' or 'test', or None, got {split!r}")


# Who started the run, so that a message names a setting as its reader passed it: a command's flag
# (`--max-steps 5`) or `train()`'s keyword (`max_steps=5`). None: a Python caller.
_COMMAND: contextvars.ContextVar[str | None] = contextvars.ContextVar("eqx_gpt_command", default=None)
_UNSAID = object()


@contextlib.contextmanager
def spoken_as_command(prog: str) -> Iterator[None]:
    """Within it, a run's messages name settings as the command `prog`'s flags (`train.py` enters it)."""
    token = _COMMAND.set(prog)
    try:
        yield
    finally:
        _COMMAND.reset(token)


def setting(name: str, value: object = _UNSAID) -> str:
    """Setting `name` (with `value`) as the run's caller gave it: `--max-steps 5` to a command's
    user, `max_steps=5` to a Python caller; a switch is `--resume` or `resume=True`."""
    if _COMMAND.get() is None:
        return name if value is _UNSAID else f"{name}={value!r}"
    flag = "--" + name.replace("_", "-")
    return flag if value is _UNSAID or value is True else f"{flag} {value}"


def resume_command(out_dir: Path) -> str:
    """How the run's caller resumes the run in `out_dir` (what an interrupted run says)."""
    prog = _COMMAND.get()
    if prog is None:
        return f"train(..., out_dir={str(out_dir)!r}, resume=True)"
    again = "uv run train.py" if prog == "train.py" else prog
    return f"{again} --resume --out-dir {out_dir}"
