"""How to train: every setting of a run in one frozen dataclass (`presets.py` holds named recipes)."""

from dataclasses import dataclass

from eqx_gpt._checks import INT32_MAX, SEED_MAX, is_whole
from eqx_gpt.configs import DictConfig, check_fields, described
from eqx_gpt.errors import ConfigError
from eqx_gpt.model.lora import check_lora, target_names
from eqx_gpt.training.trackers import parse_trackers

TOKENIZERS = ("char", "gpt2")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")


@dataclass(frozen=True)
class TrainConfig(DictConfig):
    """How to train (see `presets.py` for named recipes). Invalid values raise `ValueError`."""

    data: str | None = described(
        "a UTF-8 text file, a .jsonl file of records, a .parquet or .arrow table, any of the texts "
        "compressed (.gz, .xz, .zst), or a folder of them, to train on; tokenized once into the token "
        "cache (default: the bundled Tiny Shakespeare)",
        default=None,
    )
    text_field: str = described(
        "the field of .jsonl records, and the column of .parquet and .arrow tables, that holds the text",
        default="text",
    )
    split: str | None = described(
        "the split to train on of a folder of splits: a Hugging Face DatasetDict (dataset_dict.json), or "
        "a folder of train/validation/test files or folders; 'all' reads every file (default: train)",
        default=None,
    )
    tokenizer: str = described(
        "'char' (vocabulary built from the corpus) or 'gpt2' (tiktoken BPE)", default="char"
    )
    model: str | None = described(
        "train a model of your own: MODULE:FUNCTION, called as FUNCTION(vocab_size, key=key) with the "
        "tokenizer's vocabulary size (imported as uvicorn imports an app, the current folder first); the "
        "model's shape is its own, so the model settings are left out; the run records it, so that "
        "sampling, evaluation, serving and load_model rebuild the model",
        default=None,
    )
    init_from: str | None = described(
        "fine-tune: start from the Hugging Face GPT-2 directory DIR (config.json + model.safetensors); "
        "the model's shape and the gpt2 tokenizer come from it",
        default=None,
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
    )
    lora_alpha: float = described(
        "LoRA's alpha: the adapters' update is scaled by alpha / rank", default=16.0
    )
    lora_dropout: float = described(
        "LoRA dropout on the adapters' input (PEFT's lora_dropout; 0.05 is usual), in training only",
        default=0.0,
    )
    lora_targets: str = described(
        "the projections LoRA adapts, a comma list of PEFT's GPT-2 names (c_attn, c_proj: attention's "
        "and the MLP's, c_fc) or of eqx_gpt's module paths or their ends (attn.qkv, attn.out, mlp.up, "
        "mlp.down; a model of your own: any of its Linears' paths, such as qkv or blocks.0.mlp.up)",
        default="c_attn",
    )
    batch_size: int = described("sequences per optimiser step", default=32)
    grad_accum: int = described(
        "split each batch into this many micro-batches (same update, less memory)", default=1
    )
    max_steps: int = described("optimiser steps; also the length of the cosine schedule", default=3000)
    max_minutes: float = described(
        "stop after this many minutes of wall time, fitting the schedule to the steps that fit (0: no limit)",
        default=0.0,
    )
    optimizer: str = described(
        "'adamw' for every parameter, or 'muon': Muon (optax.contrib.muon) on the blocks' weight "
        "matrices and AdamW (at --adam-lr) on the embedding, head and norm scales",
        default="adamw",
    )
    lr: float = described("peak learning rate (of the Muon group under --optimizer muon)", default=1e-3)
    adam_lr: float | None = described(
        "under --optimizer muon: peak learning rate of the AdamW group (default: --lr)", default=None
    )
    adam_weight_decay: float = described(
        "under --optimizer muon: weight decay of the AdamW group (embedding and head, never norm scales)",
        default=0.0,
    )
    muon_momentum: float = described("under --optimizer muon: Muon's (Nesterov) momentum", default=0.95)
    muon_split_qkv: bool = described(
        "under --optimizer muon: orthogonalise the query, key and value projections each on its own",
        default=False,
    )
    muon_ns_steps: int = described(
        "under --optimizer muon: Newton-Schulz iterations that orthogonalise each update", default=5
    )
    min_lr: float = described("learning rate at the end of the decay", default=1e-4)
    warmup_steps: int = described("steps of linear warm-up from 0 to lr", default=100)
    schedule: str = described(
        "after the warm-up: 'cosine' (half a cosine from lr to min_lr over the rest of the run) or "
        "'wsd' (warm-up, stable: lr until the last --decay-fraction of the run, then a linear decay "
        "to min_lr)",
        default="cosine",
    )
    decay_fraction: float = described(
        "under --schedule wsd: the fraction of the run spent decaying", default=0.4
    )
    weight_decay: float = described(
        "weight decay of the weight matrices (AdamW's; under --optimizer muon, of the Muon group)",
        default=0.1,
    )
    beta1: float = described("AdamW beta1", default=0.9)
    beta2: float = described("AdamW beta2", default=0.99)
    grad_clip: float = described("clip gradients to this global norm (0: no clipping)", default=1.0)
    eval_interval: int = described("evaluate and checkpoint every this many steps", default=250)
    eval_batches: int = described(
        "fixed training batches averaged for the train loss at each evaluation, at a character "
        "vocabulary's cost: a larger head reads fewer windows at the same cost (GPT-2's 50,257 ids "
        "at the default model: 93 of 16 x 48; validation: see --eval-tokens)",
        default=8,
    )
    eval_tokens: int = described(
        "validation tokens each evaluation may read at a character vocabulary's cost: the whole split "
        "if it has no more (Tiny Shakespeare's 111,540 tokens), else the same evenly spread windows "
        "each time; a larger head reads fewer tokens at the same cost (GPT-2's 50,257 ids at the "
        "default model: 15,905); the final validation reads the whole split up to 4x this, else a "
        "sample of 4x",
        default=131_072,
    )
    log_interval: int = described("record loss, lr and tokens/s every this many steps", default=10)
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
    )

    def __post_init__(self):
        check_fields(
            self, positive=_POSITIVE, finite=_FINITE + (("adam_lr",) if self.adam_lr is not None else ())
        )
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
                raise ConfigError(f"{name} must be a path (a string) or None, got {getattr(self, name)!r}")
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
        parse_trackers(self.tracker)  # an unknown name is refused here, before the run starts
        for name in ("fsdp", "muon_split_qkv"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def _check_choices(self) -> None:
        """Settings that name one of a few things, and the ones that must agree."""
        for name, choices in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("tokenizer", TOKENIZERS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.init_from is not None and self.model is None and self.tokenizer != "gpt2":
            raise ConfigError(
                f"--init-from {self.init_from} starts from GPT-2, whose tokenizer is gpt2, not "
                f"{self.tokenizer!r}; leave out --tokenizer"
            )
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}; "
                f"each micro-batch must hold batch_size / grad_accum sequences"
            )

    def _check_ranges(self) -> None:
        """Each number in its range (`_RANGES`), named with its value: `got max_minutes=-1`."""
        for name, (accepts, description) in _RANGES.items():
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
                    "--lora-adapters continues a LoRA run: pass --init-from ADAPTER_DIR instead"
                )
            return
        check_lora(self.lora_rank, self.lora_alpha, self.lora_dropout)


# The checks of `TrainConfig.__post_init__`: whole numbers >= 1, finite numbers, and each number's range.
_POSITIVE = (
    "batch_size", "grad_accum", "max_steps", "eval_interval", "muon_ns_steps", "eval_batches",
    "eval_tokens", "log_interval",
)  # fmt: skip
_FINITE = (
    "max_minutes", "lr", "min_lr", "weight_decay", "beta1", "beta2", "grad_clip", "adam_weight_decay",
    "muon_momentum", "decay_fraction", "lora_alpha", "lora_dropout",
)  # fmt: skip
_RANGES = {
    "max_minutes": (lambda v: v >= 0, ">= 0 (0: no limit)"),
    "lr": (lambda v: v > 0, "> 0"),
    "adam_lr": (lambda v: v > 0, "> 0 (or None: --lr)"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "adam_weight_decay": (lambda v: v >= 0, ">= 0"),
    "grad_clip": (lambda v: v >= 0, ">= 0 (0: no clipping)"),
    "beta1": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "muon_momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "decay_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
}


def _check_corpus_fields(text_field, split) -> None:
    """Refuse a `text_field` or `split` that names no field or split."""
    if not isinstance(text_field, str) or not text_field:
        raise ConfigError(f"text_field must be a field name (a non-empty string), got {text_field!r}")
    if split is not None and (not isinstance(split, str) or not split or "/" in split):
        raise ConfigError(f"split must be a split's name such as 'train' or 'test', or None, got {split!r}")
