"""Where a run's settings come from: one table of precedence, resolved once (`resolve_options`).

A setting is any `GPTConfig` field but `vocab_size` (the model), any `TrainConfig` field (the
training), or `preset`. Later sources override earlier ones:

    a fresh run     dataclass defaults  <  the preset  <  the settings given
    a resumed run   the checkpoint's values  <  the settings given that may change on resume

`eqx_gpt.train` gives as settings the fields its configs were constructed with (`given_settings`:
`TrainConfig(max_steps=40)` gives `max_steps` alone, as `train(max_steps=40)` does), then its
keywords; `train.py` gives the flags given. The preset is `settings["preset"]`: a name, or None
for none (the dataclass defaults alone). Left out, it is `cpu`, or `finetune-shakespeare` with
`init_from`. On resume, a preset named anew counts as settings for its values, and a setting that
would change what the run computes must agree with the checkpoint (only `RESUMABLE_CHANGES` may
differ). A run's first lines say which settings were laid over the preset (`RunOptions.describe`).

`train()`'s own arguments (`out_dir`, `log`, `resume`, ...) are checked here too, before anything
touches the disk (`check_train_arguments`): each mistake of a Python caller is one line naming the
argument, its value and what would be accepted.
"""

import dataclasses
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from eqx_gpt._checks import INT32_MAX, as_path, is_whole
from eqx_gpt.checkpoint import find_checkpoint, holds_run, is_own_model, read_metadata
from eqx_gpt.configs import fields_of_kind
from eqx_gpt.errors import CheckpointError, ConfigError, TrainingError
from eqx_gpt.files import resolve
from eqx_gpt.gpt2 import read_gpt2_config
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.lora import check_lora, lora_modules
from eqx_gpt.peft import adapter_targets, base_directory, is_adapter_directory, read_adapter_config
from eqx_gpt.training.config import TrainConfig, setting
from eqx_gpt.training.presets import DEFAULT_PRESET, FINETUNE_PRESET, PRESETS

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size")
TRAIN_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))
# What a resumed run may change: how long it runs, how often and where it reports, where the same
# data is (each field's kind, `resumable`).
RESUMABLE_CHANGES = fields_of_kind(TrainConfig, "resumable")
# The model settings that `init_from` (a Hugging Face GPT-2) takes; the rest are the directory's.
INIT_FROM_OPTIONS = fields_of_kind(GPTConfig, "fine_tune")


@dataclass(frozen=True)
class ModelSettings:
    """The model a run asks for before its vocabulary is known (the tokenizer's): every `GPTConfig`
    field but `vocab_size`. With `--init-from` only `INIT_FROM_OPTIONS` are the run's (`gpt2_options`);
    the GPT-2 directory gives the rest."""

    context_length: int
    d_model: int
    n_heads: int
    n_layers: int
    d_hidden: int | None
    dropout: float
    norm_eps: float
    scan_unroll: int
    compute_dtype: str
    norm: str
    norm_position: str
    positions: str
    bias: bool
    activation: str
    tie_embeddings: bool
    zero_init: bool
    logit_softcap: float | None

    @classmethod
    def from_values(cls, values: dict) -> "ModelSettings":
        """The model settings among `values` (any setting by name), `GPTConfig`'s defaults for the
        rest (a checkpoint written before a field existed ran with its default)."""
        return cls(**{k: values.get(k, DEFAULTS[k]) for k in MODEL_FIELDS})

    def config(self, vocab_size: int) -> GPTConfig:
        """The model's `GPTConfig` for a vocabulary of `vocab_size` ids."""
        return GPTConfig(vocab_size=vocab_size, **dataclasses.asdict(self))

    def gpt2_options(self) -> dict:
        """The settings a GPT-2 loaded with `--init-from` takes (`INIT_FROM_OPTIONS`)."""
        return {k: getattr(self, k) for k in INIT_FROM_OPTIONS}


@dataclass(frozen=True)
class RunOptions:
    """A run's settings, resolved: `model` the model's but its vocabulary (the tokenizer's, known
    once the data is read); `trackers` the names of `train.tracker`, parsed once; `schedule_steps`
    is the schedule's length to start with (`max_steps`; on resume with the same `max_steps`, the
    checkpoint's, which `--max-minutes` may have refitted); `checkpoint` is the metadata resumed
    from; `from_preset` holds the values of a fresh run that its preset set and no setting gave
    (`explain` names them); `overrides` the settings given that differ from what they override
    (the preset's values, or the checkpoint's: `describe` names them); `cropped` a preset's
    `context_length` a fine-tune's base has fewer positions for, and what it became (`describe`)."""

    model: ModelSettings
    train: TrainConfig
    preset: str | None
    schedule_steps: int
    checkpoint: dict | None = None
    from_preset: dict = dataclasses.field(default_factory=dict)
    instance: Any = None  # a model of the caller's own, passed to `train(model=...)`
    overrides: dict = dataclasses.field(default_factory=dict)
    cropped: dict = dataclasses.field(default_factory=dict)
    trackers: tuple[str, ...] = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "trackers", self.train.trackers)

    @property
    def own_model(self) -> bool:
        """Whether the run trains a model of the caller's own (passed, or `--model`), not a `GPT`."""
        return self.instance is not None or self.train.model is not None

    def explain(self, message: str) -> str:
        """`message` about an invalid value, saying which of the values it names the preset set, so
        that a refusal never leaves a flag that was not given to be guessed at."""
        return _blame_preset(message, self.preset, self.from_preset)

    def describe(self) -> str:
        """The run's `settings:` line: what its values start from and what was laid over them."""
        base = (
            "the checkpoint's" if self.checkpoint is not None
            else f"the {self.preset} preset" if self.preset is not None
            else "the dataclass defaults (no preset)"
        )  # fmt: skip
        given = ", ".join(f"{k}={v!r}" for k, v in self.overrides.items())
        cropped = "".join(
            f"; {k} {new}, the base's positions (the preset's {old} is longer)"
            for k, (old, new) in self.cropped.items()
        )
        return f"settings: {base}" + (f", with {given} given" if given else "") + cropped


def given_settings(config: TrainConfig | None, model: GPTConfig | None, options: dict) -> dict:
    """The settings `train(config, model, **options)` gives: the fields each config was constructed
    with (`DictConfig.given`; `model.vocab_size` is the tokenizer's, never given), then `options`."""
    settings: dict[str, object] = {}
    if config is not None:
        settings.update({k: getattr(config, k) for k in sorted(config.given(), key=TRAIN_FIELDS.index)})
    if model is not None:
        given = [k for k in MODEL_FIELDS if k in model.given()]
        settings.update({k: getattr(model, k) for k in given})
    return {**settings, **options}


def resolve_options(settings: dict, checkpoint: dict | None = None, *, instance: Any = None) -> RunOptions:
    """The settings of a run: fresh, or resuming the checkpoint whose metadata is `checkpoint`;
    `instance` a model of the caller's own (`train(model=...)`), whose shape no setting may give."""
    unknown = sorted(set(settings) - {*MODEL_FIELDS, *TRAIN_FIELDS, "preset"})
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; settings are GPTConfig and TrainConfig fields")
    settings = {**settings, **_paths(settings)}
    fine_tune = settings.get("init_from") is not None
    preset = settings.get("preset", FINETUNE_PRESET if fine_tune else DEFAULT_PRESET)
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    own = instance is not None or settings.get("model") is not None
    shape = [k for k in settings if k in MODEL_FIELDS]
    if own and shape:
        what = type(instance).__name__ if instance is not None else f"--model {settings['model']}"
        raise ConfigError(
            f"--{shape[0].replace('_', '-')} sets a GPT's shape, but the run trains {what}, whose shape "
            f"is its own; leave the model settings out"
        )
    if instance is not None and settings.get("model") is not None:
        raise ConfigError(
            f"train() got both a model ({type(instance).__name__}) and model={settings['model']!r}; pass one"
        )
    try:
        if checkpoint is None:
            options = _fresh(settings, preset)
        else:
            options = _resumed(settings, preset if "preset" in settings else None, checkpoint)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    return dataclasses.replace(options, instance=instance) if instance is not None else options


# Every setting's dataclass default, and the settings that name files.
DEFAULTS = {f.name: f.default for cls in (GPTConfig, TrainConfig) for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}  # fmt: skip
PATH_SETTINGS = ("init_from", "data", "lora_adapters")
LORA_FROM_ADAPTERS = ("lora_rank", "lora_alpha", "lora_targets")  # what a PEFT folder's config sets


def _paths(settings: dict) -> dict:
    """The settings that name files, each a `str` (a `Path` given becomes one); another type is
    refused in one line naming the setting, before any is read as a path."""
    paths = {}
    for name in PATH_SETTINGS:
        value = settings.get(name)
        if isinstance(value, os.PathLike):
            paths[name] = os.fspath(value)
        elif value is not None and not isinstance(value, str):
            raise ConfigError(f"{name} must be a path (a str or a Path) or None, got {value!r}")
    return paths


def preset_values(name: str | None, *, gpu: bool = False) -> dict:
    """Every `GPTConfig` (but `vocab_size`) and `TrainConfig` field's value under preset `name`
    (None: no preset): the dataclass default, overridden by the preset (with its GPU values if `gpu`)."""
    return {**DEFAULTS, **(PRESETS[name].values(gpu=gpu) if name is not None else {})}


def on_gpu() -> bool:
    """Whether this run's device is a GPU (JAX's default backend), for a preset's GPU values. It
    starts JAX's backends: `train` calls it after JAX's set-up (`parallel.start_jax`: multi-host)."""
    return jax.default_backend() == "gpu"


def _fresh(settings: dict, preset: str | None) -> RunOptions:
    shape = [k for k in settings if k in MODEL_FIELDS and k not in INIT_FROM_OPTIONS]
    if settings.get("init_from") is not None and shape:
        raise ConfigError(
            f"{setting(shape[0])} sets the model's shape, which comes from "
            f"{setting('init_from', settings['init_from'])}; leave it out (only "
            f"{', '.join(setting(k) for k in INIT_FROM_OPTIONS)} apply)"
        )
    gpu = on_gpu()
    from_preset = {
        k: v for k, v in (PRESETS[preset].values(gpu=gpu) if preset else {}).items() if k not in settings
    }
    values, cropped = {**preset_values(preset, gpu=gpu), **settings}, {}
    if values.get("init_from") is not None:  # recorded absolute, so the run resumes from anywhere
        values["init_from"] = str(resolved_path("init_from", values["init_from"]))
        own_run = _own_run(values["init_from"], settings)
        values.update(own_run or _from_adapters(values["init_from"], settings))
        if own_run is None:  # a GPT-2's context
            cropped = _cropped_context(values, settings)
            values.update({k: new for k, (_, new) in cropped.items()})
        if own_run is not None:
            from_preset.pop("tokenizer", None)
        elif "tokenizer" not in settings:  # a fine-tune's tokenizer is GPT-2's, whatever the preset's
            values["tokenizer"] = "gpt2"
            from_preset.pop("tokenizer", None)
    # A fine-tune's shape is the GPT-2 directory's: only INIT_FROM_OPTIONS are the run's to set.
    try:
        model = ModelSettings.from_values(values)
        train = TrainConfig(**{k: values[k] for k in TRAIN_FIELDS if k in values})
        if train.init_from is None and train.model is None:  # checked now, before any corpus is read
            model.config(vocab_size=1)
    except (TypeError, ValueError) as e:
        raise ConfigError(_blame_preset(str(e), preset, from_preset)) from None
    if train.lora_rank is not None:
        if train.init_from is None:
            raise ConfigError(
                f"{setting('lora_rank')} trains adapters on a pretrained model: pass {setting('init_from')} "
                f"GPT2_DIR (or a PEFT adapter folder) too"
            )
        if train.optimizer != "adamw":
            raise ConfigError(
                _blame_preset(
                    f"LoRA adapters train with AdamW; drop {setting('optimizer', 'muon')}",
                    preset,
                    from_preset,
                )
            )
        if train.model is None:  # a GPT-2's (a model of one's own is checked when it is built)
            width = read_gpt2_config(train.init_from).d_model  # the rank's bound
            check_lora(train.lora_rank, train.lora_alpha, train.lora_dropout, width)
            lora_modules(train.lora_targets)  # PEFT's names or a GPT block's
        if train.lora_adapters is not None:
            _check_adapters_match(train)
    if settings.get("model") is not None and settings.get("init_from") is not None:
        raise ConfigError(
            f"--model {settings['model']} builds a fresh model and --init-from {settings['init_from']} "
            f"starts from one; pass one of them"
        )
    if preset == FINETUNE_PRESET and train.init_from is None:
        raise ConfigError(f"the {preset} preset fine-tunes a GPT-2; pass {setting('init_from')} DIR")
    before = preset_values(preset)
    overrides = {k: v for k, v in settings.items() if k != "preset" and v != before.get(k)}
    return RunOptions(
        model, train, preset, train.max_steps, from_preset=from_preset, overrides=overrides,
        cropped=cropped,
    )  # fmt: skip


def _cropped_context(values: dict, settings: dict) -> dict:
    """`{"context_length": (the preset's, the base's positions)}` where a fine-tune's preset asks
    for more positions than its GPT-2 base has (the base's table is cropped, as nanoGPT's
    `crop_block_size` does, never extended); {} where it fits, or where the context was given (a
    longer one given is refused, naming the base's)."""
    if "context_length" in settings:
        return {}
    try:
        positions = read_gpt2_config(values["init_from"]).context_length
    except CheckpointError:  # not a GPT-2 folder: refused, in its own words, when it is read
        return {}
    wanted = values.get("context_length")
    return {"context_length": (wanted, positions)} if isinstance(wanted, int) and wanted > positions else {}


def _own_run(init_from: str, settings: dict) -> dict | None:
    """With `--init-from` a run of a model of one's own (`--model MODULE:FUNCTION`): the run's
    function becomes the run's `model`, and its tokenizer kind the run's; None for any other folder.
    A run of a model passed from Python, which the command line cannot rebuild, is one line."""
    if not holds_run(init_from):
        return None
    meta = read_metadata(find_checkpoint(init_from))
    if not is_own_model(meta):
        raise ConfigError(
            f"--init-from {init_from} is a run of a GPT; start from its checkpoint with --resume, or from "
            f"a Hugging Face GPT-2 folder (export.py writes one)"
        )
    spec = meta["train_config"].get("model")
    if not isinstance(spec, str):
        raise ConfigError(
            f"--init-from {init_from} holds a {meta['model']} passed to train() from Python, which the run "
            f"cannot rebuild; in Python: load_model(run, like=...), then train(model=...)"
        )
    return {"model": spec, "tokenizer": meta["tokenizer"].get("kind", "char")}


def _from_adapters(init_from: str, settings: dict) -> dict:
    """With `--init-from` a PEFT adapter folder: the GPT-2 it names as its base becomes `init_from`,
    the folder `lora_adapters`, and its rank, alpha and targets the run's (none may be given too)."""
    if not is_adapter_directory(init_from):
        return {}
    given = [k for k in LORA_FROM_ADAPTERS if k in settings]
    if given:
        raise ConfigError(
            f"--{given[0].replace('_', '-')} comes from the adapter folder {init_from}/ (its "
            f"adapter_config.json); leave it out to continue those adapters"
        )
    config = read_adapter_config(init_from)
    # Its dropout too, unless the run gives its own (a training setting, not the adapters' shape).
    dropout = {} if "lora_dropout" in settings else {"lora_dropout": float(config.get("lora_dropout", 0.0))}
    return {
        "init_from": str(base_directory(init_from)), "lora_adapters": init_from,
        "lora_rank": int(config["r"]), "lora_alpha": float(config["lora_alpha"]),
        "lora_targets": ",".join(adapter_targets(init_from)), **dropout,
    }  # fmt: skip


def _check_adapters_match(train: TrainConfig) -> None:
    """A one-line `ConfigError` unless the PEFT folder `lora_adapters` holds adapters of the run's
    rank, alpha and targets (the checkpoints are read back by those), as `--init-from ADAPTER_DIR`
    sets them."""
    config = read_adapter_config(str(train.lora_adapters))
    theirs = (
        int(config["r"]),
        float(config["lora_alpha"]),
        lora_modules(adapter_targets(str(train.lora_adapters))),
    )
    ours = (train.lora_rank, float(train.lora_alpha), lora_modules(train.lora_targets))
    if theirs != ours:
        raise ConfigError(
            f"the adapters in {train.lora_adapters}/ are rank {theirs[0]}, alpha {theirs[1]:g} on "
            f"{','.join(theirs[2])}, but the run asks for rank {ours[0]}, alpha {ours[1]:g} on "
            f"{','.join(ours[2])}; pass {setting('init_from', train.lora_adapters)} alone to continue them"
        )


def _blame_preset(message: str, preset: str | None, from_preset: dict) -> str:
    """`message`, and which of the values it names (`name=value`, `name value`) are the preset's."""
    named = [f"{k}={v!r}" for k, v in from_preset.items()
             if re.search(rf"\b{k}\W{{1,3}}{re.escape(str(v))}\b", message)]  # fmt: skip
    return f"{message} ({', '.join(named)} from the {preset} preset)" if named else message


def _check_checkpoint(checkpoint: dict) -> None:
    """Refuse a checkpoint that is not a GPT's (the encoder-decoder of examples/translate.py), or
    whose model config is not one, before anything is compared with it or read for it."""
    if checkpoint.get("model", "GPT") == "Transformer":
        raise ConfigError(
            f"{Path(checkpoint['path']).parent}/ holds a {checkpoint['model']} run, not a GPT's: train.py "
            f"cannot resume it; resume it with the script that trained it (examples/translate.py)"
        )
    try:
        if checkpoint.get("model", "GPT") == "GPT":  # else a model of the user's own: its sizes
            GPTConfig(**checkpoint["model_config"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {checkpoint['path']} has an invalid model config: {e}") from None


def _resumed(settings: dict, preset: str | None, checkpoint: dict) -> RunOptions:
    _check_checkpoint(checkpoint)
    preset_given = PRESETS[preset].values(gpu=on_gpu()) if preset else {}
    given = {**preset_given, **settings}
    saved_model = {k: v for k, v in checkpoint["model_config"].items() if k != "vocab_size"}
    saved_train = checkpoint["train_config"]
    for name, value in given.items():
        if name == "preset" or name in RESUMABLE_CHANGES:
            continue
        saved = saved_model if name in MODEL_FIELDS else saved_train
        # A checkpoint written before a setting existed ran with its default.
        saved_value = saved.get(name, DEFAULTS.get(name))
        if _same_setting(name, value, saved_value):
            continue
        culprit = (
            setting(name, value)
            if name in settings
            else f"{setting('preset', preset)} (it sets {name}={value!r})"
        )
        older = "" if name in saved else f", the default of a checkpoint older than {setting(name)}"
        raise ConfigError(
            f"{culprit} contradicts the checkpoint in {Path(checkpoint['path']).parent} ({name}="
            f"{saved_value!r}{older}); drop it to resume, or pass another {setting('out_dir')} to start "
            f"afresh"
        )
    train = {**saved_train, **{k: v for k, v in given.items() if k in RESUMABLE_CHANGES}}
    try:
        train_config = TrainConfig.from_dict(train)
    except ValueError as e:
        raise ConfigError(f"checkpoint {checkpoint['path']} has an invalid train config: {e}") from None
    # The schedule goes on as the checkpoint had it (refitted to --max-minutes, say) unless the run
    # is given another length.
    steps = train_config.max_steps
    if saved_train.get("max_steps") == steps:
        steps = checkpoint.get("schedule_steps", steps)
    if not is_whole(steps, 1):
        raise ConfigError(
            f"checkpoint {checkpoint['path']} has schedule_steps={steps!r}, not an integer in "
            f"[1, {INT32_MAX}]; the file is corrupt: pass another {setting('max_steps')} to set the "
            f"schedule anew"
        )
    saved = {**saved_model, **saved_train}
    overrides = {
        k: v for k, v in given.items() if k in RESUMABLE_CHANGES and v != saved.get(k, DEFAULTS.get(k))
    }
    return RunOptions(
        ModelSettings.from_values(saved_model), train_config, preset or checkpoint.get("preset"), steps,
        checkpoint, overrides=overrides,
    )  # fmt: skip


def _same_setting(name: str, value, saved) -> bool:
    """Whether a setting given on resume is the checkpoint's: paths compare resolved (the checkpoint
    records them absolute, a flag gives them as typed)."""
    if name in PATH_SETTINGS and value is not None and saved is not None:
        return resolved_path(name, value) == resolved_path(name, saved)
    return value == saved


def resolved_path(name: str, value) -> Path:
    """Setting `name`'s path made absolute, symlinks followed; a loop of symlinks (or a path the
    system refuses) is a one-line `ConfigError`, not Python's traceback."""
    try:
        return resolve(Path(value).expanduser())
    except OSError as e:
        cause = e.strerror or str(e)
        raise ConfigError(f"--{name.replace('_', '-')} {value}: {cause}; pass a path that resolves") from None


def check_printable(paths: dict) -> None:
    """Refuse, before any work, a path that the run's log (standard output) cannot print: a name
    that is not valid in the terminal's encoding (Python holds its bytes as lone surrogates) under
    a locale whose output is strict. Left alone, the run would fail at its first line naming it,
    perhaps at its very end. `paths` maps a setting's name to its value (None: not given)."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    errors = getattr(sys.stdout, "errors", None) or "strict"
    for name, value in paths.items():
        if value is None:
            continue
        try:
            str(value).encode(encoding, errors)
        except UnicodeEncodeError:
            raise ConfigError(
                f"--{name.replace('_', '-')} {ascii(str(value))}: its name is not valid {encoding}, so the "
                f"run's log cannot print it; rename it (or set PYTHONIOENCODING={encoding}:surrogateescape)"
            ) from None


def check_train_arguments(
    *,
    out_dir: object,
    resume: object,
    overwrite: object,
    sample_tokens: object,
    log: object,
    progress: object,
    now: object,
) -> Path:
    """Refuse a wrong `train()` argument in one line (a `TypeError` for a wrong type, a
    `TrainingError` for a wrong value); return `out_dir` as a `Path`."""
    out_path = as_path(out_dir, "out_dir")
    if "\0" in str(out_dir):
        raise TrainingError(f"out_dir must be a folder's path, without NUL, got {out_dir!r}")
    for name, value in (("resume", resume), ("overwrite", overwrite), ("progress", progress)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if not is_whole(sample_tokens, 0):  # checked here, not after the run when the sample is drawn
        raise TrainingError(f"sample_tokens must be an integer in [0, {INT32_MAX}], got {sample_tokens!r}")
    if resume and overwrite:
        raise TrainingError(
            f"{setting('resume', True)} continues the run in {setting('out_dir')} and "
            f"{setting('overwrite', True)} deletes it; pass one"
        )
    for name, value, takes in (("log", log, "a line (str)"), ("now", now, "nothing and returns seconds")):
        if not callable(value):
            raise TypeError(f"{name} must be a function that takes {takes}, got {value!r}")
    return out_path
