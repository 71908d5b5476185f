"""Checkpoints: weights and optimiser state in Equinox's serialisation, the rest in JSON.

A checkpoint named `latest` (or `best`) in a run directory is a pair of files:

    latest.json             metadata, written LAST: step, the model's class and config, the
                            training config, tokenizer, losses, and the name and sha256 of the
                            weights file below
    latest-<sha256[:16]>.eqx  `eqx.tree_serialise_leaves` of the model's arrays, then the
                            optimiser state

A LoRA run's checkpoint (format version 3, `"weights_hold": "adapters"`) holds its adapters alone
(`lora_a`, `lora_b`) and their optimiser state: its frozen base is the GPT-2 folder the metadata
identifies (`lora_base`: path, the path from the run folder, and each file's size and sha256),
read back from there (or from the same place relative to a moved run folder) and checked
unchanged, so a GPT-2-124M run writes megabytes per checkpoint rather than the whole model again.

The model's `inference` flags (see `eqx.nn.inference_mode`) are a mode, not weights: they are not
stored, and a model always loads in training mode, as built. Format version 2 records the model's
class (`"model"`); version 1, whose weights files are the same, may lack it, and then holds a GPT
(the only model there was).

Every file is written to a temporary file in the same directory, fsynced and `os.replace`d into
place, so a crash at any moment leaves either the old or the new JSON, and the JSON always names a
complete weights file whose hash it records. Weights files no longer named by a JSON are deleted
after the JSON is replaced. Nothing is pickled: the weights are `.npy` arrays read with
`allow_pickle=False` into templates built by `eqx.filter_eval_shape`, and the rest is JSON, so
loading a checkpoint cannot run code.
"""

import contextlib
import errno
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, overload

import equinox as eqx
import jax
from jax.experimental import multihost_utils

from eqx_gpt._checks import as_path
from eqx_gpt.errors import CheckpointError
from eqx_gpt.files import atomic_write_bytes, resolve
from eqx_gpt.gpt2 import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    gpt2_changed,
    gpt2_tokenizer,
    is_gpt2_directory,
    load_gpt2,
)
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.factory import build_model
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.language_model import LanguageModel, ModelShape, check_language_model
from eqx_gpt.model.lora import (
    apply_lora,
    has_lora,
    lora_options,
    lora_record,
    lora_template,
    lora_trainable,
    merge_lora,
)
from eqx_gpt.model.template import model_template
from eqx_gpt.model.transformer import Transformer, TransformerConfig
from eqx_gpt.tokenizer import Tokenizer, TokenizerError, tokenizer_from_dict

FORMAT = "eqx_gpt-checkpoint"
VERSION = 2  # what `save_checkpoint` writes
ADAPTERS_VERSION = 3  # ... for a LoRA model with its base named: the adapters alone (`ADAPTERS`)
ADAPTERS = "adapters"  # `weights_hold` of such a checkpoint
READABLE_VERSIONS = (1, 2, 3)
# A run directory's two checkpoints; `find_checkpoint` prefers them in the order of NAMES.
BEST, LATEST = "best", "latest"
NAMES = (BEST, LATEST)
# The models a checkpoint can hold, by the class name it records, with their config classes. Any
# other name is a model of the user's own (a `LanguageModel`), recorded by its sizes (`ModelShape`),
# rebuilt by the factory its run records (`train_config["model"]`) or read into a model passed.
MODELS = {"GPT": (GPT, GPTConfig), "Transformer": (Transformer, TransformerConfig)}
Model = TypeVar("Model")
WHAT = {"GPT": "a decoder-only GPT", "Transformer": "an encoder-decoder (examples/translate.py)"}


# What each metadata field must be (JSON gives ints, floats, strings and dicts): checked on reading,
# so a hand-edited or damaged file is one line, never a TypeError deep in a run.
METADATA_TYPES = {"step": int, "weights": str, "sha256": str, "model": str, "model_config": dict,
                  "train_config": dict, "tokenizer": dict}  # fmt: skip
OPTIONAL_TYPES = {"val_loss": float, "best_val_loss": float, "val_loss_step": int, "schedule_steps": int,
                  "data_sha256": str, "lora_base": dict, "weights_hold": str, "lora": dict}  # fmt: skip


def _is_of(value: Any, kind: type) -> bool:
    """Whether a JSON value is a `kind` (an int counts as a float; a bool is neither)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def _on_this_host(x: Any) -> Any:
    """`x`, with an array split over other processes' devices (FSDP on several hosts) gathered
    whole to this one first. Every process must call this for the same arrays (a collective)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        return multihost_utils.process_allgather(x, tiled=True)
    return x


def _write_model_leaf(f, x: Any) -> None:
    """Equinox's default serialisation of a leaf, except the model's Python bools (its
    `inference` flags), which are a mode, not weights: files then hold arrays only, as they did
    before the flags existed."""
    if not isinstance(x, bool):
        eqx.default_serialise_filter_spec(f, x)


def _read_model_leaf(f, x: Any) -> Any:
    """The inverse of `_write_model_leaf`: a flag keeps the template's value (training mode)."""
    return x if isinstance(x, bool) else eqx.default_deserialise_filter_spec(f, x)


def _serialise(model: Any, opt_state: Any) -> bytes:
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, jax.tree.map(_on_this_host, model), filter_spec=_write_model_leaf)
    eqx.tree_serialise_leaves(buffer, jax.tree.map(_on_this_host, opt_state))
    return buffer.getvalue()


class Describable(Protocol):
    """What `save_checkpoint` needs of a tokenizer: its JSON-ready description."""

    def to_dict(self) -> dict: ...


def save_checkpoint(
    out_dir: str | Path,
    name: str,
    model: GPT | Transformer | LanguageModel,
    opt_state: Any,
    *,
    step: int,
    tokenizer: Tokenizer | Describable,
    train_config: dict,
    **metadata: Any,
) -> Path:
    """Write checkpoint `name` ("latest", "best") of a run into `out_dir`; return its JSON path.

    `model` is a `GPT` or a `Transformer` (its class and config are recorded), or a model of your
    own, a `LanguageModel` (its class name and sizes are recorded, and its LoRA adapters' places,
    `"lora"`, if it holds any: it is read back into a model its factory builds or one passed, see
    `load_model`); its mode (`inference`) is not recorded. `tokenizer` is eqx_gpt's
    (`CharTokenizer`, `GPT2Tokenizer`) or, for a `Transformer`, any object whose `to_dict()`
    describes it (`load_model` then returns None for it, and its description as
    `metadata["tokenizer"]`). `metadata` holds any further JSON-ready
    values (losses, the schedule length, ...). A LoRA model whose `metadata` names its base GPT-2
    folder (`lora_base=eqx_gpt.gpt2.gpt2_identity(folder)`) is saved as its adapters alone, and
    read back on that base (see the module's docstring).
    """
    if isinstance(model, GPT | Transformer):
        model_config, lora = model.config.to_dict(), None
    else:
        check_language_model(model, "save_checkpoint's model")
        model_config, lora = ModelShape.of(model).to_dict(), lora_record(model)
    out_dir = as_path(out_dir, "out_dir")
    adapters_only = has_lora(model) and metadata.get("lora_base") is not None
    if adapters_only and isinstance(metadata["lora_base"].get("path"), str):
        # Where the base is from the run folder too, so that the two moved together load anywhere.
        base, here = resolve(metadata["lora_base"]["path"]), resolve(out_dir)
        with contextlib.suppress(ValueError):  # no relative path (another drive): the absolute one alone
            relative = Path(os.path.relpath(base, here)).as_posix()
            metadata = {**metadata, "lora_base": {**metadata["lora_base"], "relative_path": relative}}
    stored = eqx.filter(model, lora_trainable(model)) if adapters_only else model
    weights = _serialise(stored, opt_state)
    digest = hashlib.sha256(weights).hexdigest()
    weights_name = f"{name}-{digest[:16]}.eqx"
    meta = {
        "format": FORMAT,
        "version": ADAPTERS_VERSION if adapters_only else VERSION,
        **({"weights_hold": ADAPTERS} if adapters_only else {}),
        "step": int(step),
        "weights": weights_name,
        "sha256": digest,
        "model": type(model).__name__,
        "model_config": model_config,
        **({"lora": lora} if lora is not None else {}),
        "train_config": train_config,
        "tokenizer": tokenizer.to_dict(),
        **metadata,
    }
    atomic_write_bytes(out_dir / weights_name, weights)
    json_path = checkpoint_file(out_dir, name)
    atomic_write_bytes(json_path, (json.dumps(meta, indent=1) + "\n").encode())
    for stale in out_dir.glob(f"{name}-*.eqx"):
        if stale.name != weights_name:
            stale.unlink(missing_ok=True)
    return json_path


def checkpoint_file(out_dir: str | Path, name: str) -> Path:
    """The metadata file of checkpoint `name` (`LATEST` or `BEST`) in the run directory `out_dir`."""
    return Path(out_dir) / f"{name}.json"


def checkpoint_paths(out_dir: str | Path) -> list[Path]:
    """Every checkpoint file (metadata and weights) in the run directory `out_dir`."""
    out_dir = Path(out_dir)
    return sorted(
        p
        for name in NAMES
        for p in (checkpoint_file(out_dir, name), *out_dir.glob(f"{name}-*.eqx"))
        if p.exists()
    )


def delete_checkpoints(out_dir: str | Path) -> None:
    """Delete every checkpoint in `out_dir` (metadata first, so no JSON names a missing file)."""
    for path in sorted(checkpoint_paths(out_dir), key=lambda p: p.suffix != ".json"):
        path.unlink(missing_ok=True)


def holds_run(directory: str | Path) -> bool:
    """Whether `directory` holds an eqx_gpt run: its marker is a checkpoint's metadata file."""
    return any(checkpoint_file(directory, name).is_file() for name in NAMES)


def find_checkpoint(path: str | Path) -> Path:
    """The metadata (`.json`) path of a checkpoint.

    `path` is a run directory (its best checkpoint, else its latest) or a checkpoint's `.json` or
    `.eqx` file.
    """
    path = as_path(path, "a checkpoint's path")
    try:
        resolve(path)
    except OSError as e:  # a loop of links, named as train.py names it, not as a missing run
        why = (
            "is a loop of symbolic links" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or e})"
        )
        raise CheckpointError(
            f"checkpoint path {path} {why}; pass a run folder or a checkpoint's .json"
        ) from None
    if path.is_dir():
        for name in NAMES:
            if checkpoint_file(path, name).is_file():
                return checkpoint_file(path, name)
        if (path / WEIGHTS_NAME).exists() and not (path / CONFIG_NAME).exists():
            raise CheckpointError(
                f"{path}/ has {WEIGHTS_NAME} but no {CONFIG_NAME}; a Hugging Face GPT-2 folder needs both: "
                f"download {CONFIG_NAME} too"
            )
        raise CheckpointError(
            f"no checkpoint in {path}/ (neither an eqx_gpt run's {BEST}.json or {LATEST}.json nor a Hugging "
            f"Face GPT-2's {CONFIG_NAME}): run `uv run train.py --out-dir {path}` first"
        )
    if path.suffix == ".eqx":  # a weights file: its JSON is `<name>.json` beside it
        path = path.with_name(path.name.rsplit("-", 1)[0] + ".json")
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: run `uv run train.py` first")
    return path


def read_metadata(path: str | Path) -> dict:
    """The metadata of the checkpoint at `path` (see `find_checkpoint`), checked for consistency."""
    path = find_checkpoint(path)
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path} is unreadable or corrupt ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an eqx_gpt checkpoint")
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {path} has format version {meta.get('version')!r}; this eqx_gpt reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    if meta["version"] == 1:
        meta.setdefault("model", "GPT")  # the only model there was when version 1 lacked the record
    for key, kind in METADATA_TYPES.items():
        if key not in meta:
            raise CheckpointError(f"checkpoint {path} lacks {key!r}; it is corrupt")
        if not _is_of(meta[key], kind):
            raise CheckpointError(
                f"checkpoint {path}: {key!r} is {meta[key]!r}, not {kind.__name__}; the file is corrupt"
            )
    for key, kind in OPTIONAL_TYPES.items():
        if meta.get(key) is not None and not _is_of(meta[key], kind):
            raise CheckpointError(
                f"checkpoint {path}: {key!r} is {meta[key]!r}, not {kind.__name__}; the file is corrupt"
            )
    if meta["step"] < 0:
        raise CheckpointError(f"checkpoint {path}: 'step' is {meta['step']}, below 0; the file is corrupt")
    if Path(meta["weights"]).name != meta["weights"]:
        raise CheckpointError(f"checkpoint {path} names a weights file outside its directory")
    meta["path"] = str(path)
    return meta


def _read_weights(meta: dict) -> io.BytesIO:
    path = Path(meta["path"]).with_name(meta["weights"])
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint weights {path} cannot be read ({e.strerror or e})") from None
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise CheckpointError(
            f"checkpoint weights {path} do not match their recorded sha256; the file is corrupt"
        )
    return io.BytesIO(data)


def _model_kind(meta: dict, kind: str | None) -> str:
    """The class name the checkpoint records, checked against the `kind` the caller wants."""
    name = meta["model"]
    if name not in MODELS:
        wanted = WHAT.get(kind or "", "a GPT or a Transformer")
        raise CheckpointError(
            f"checkpoint {meta['path']} holds a {name} (a model of one's own), not {wanted}"
        )
    if kind is not None and name != kind:
        raise CheckpointError(
            f"checkpoint {meta['path']} holds {WHAT[name]}, not {WHAT[kind]}; use a checkpoint of the latter"
        )
    return name


def _model_config(meta: dict, kind: str | None = None) -> GPTConfig | TransformerConfig:
    config_class = MODELS[_model_kind(meta, kind)][1]
    try:
        return config_class.from_dict(meta["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {meta['path']} has an invalid model config: {e}") from None


def _tokenizer(meta: dict, config: GPTConfig | TransformerConfig) -> Tokenizer | None:
    """The checkpoint's tokenizer. A `Transformer`'s may be its own kind (the translate example's
    vocabularies): then None, and the caller rebuilds it from `meta["tokenizer"]`."""
    try:
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
    except TokenizerError as e:
        if not isinstance(config, GPTConfig):
            return None
        raise CheckpointError(f"checkpoint {meta['path']}: {e}") from None
    if isinstance(config, GPTConfig) and tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(
            f"checkpoint {meta['path']}: tokenizer has {tokenizer.vocab_size} ids but the model "
            f"config says vocab_size={config.vocab_size}"
        )
    return tokenizer


def run_template(config: GPTConfig | TransformerConfig, train_config: dict) -> GPT | Transformer:
    """The model a run of `config` trains, as shapes: with the LoRA adapters its `train_config`
    (a dict, as checkpoints record it) asks for."""
    template = model_template(config)
    lora = lora_options(train_config)
    return template if lora is None else lora_template(template, **lora)


def _deserialise(
    f: io.BytesIO, like: Any, meta: dict, filter_spec=eqx.default_deserialise_filter_spec
) -> Any:
    try:
        return eqx.tree_deserialise_leaves(f, like, filter_spec=filter_spec)
    except Exception as e:  # truncated/garbled .npy data raises several exception types
        raise CheckpointError(
            f"checkpoint weights for {meta['path']} do not fit its config ({type(e).__name__}); "
            f"the file is corrupt or from another version"
        ) from None


def _read_model(f: io.BytesIO, meta: dict, like: Any) -> Any:
    """The checkpoint's model from its weights file `f`, read into `like`: whole, or its adapters on
    its base."""
    if meta.get("weights_hold") != ADAPTERS:
        return _deserialise(f, like, meta, _read_model_leaf)
    adapters = _deserialise(f, eqx.filter(like, lora_trainable(like)), meta)
    return eqx.combine(adapters, _frozen_base(meta, _model_config(meta, "GPT")))


def _frozen_base(meta: dict, config: GPTConfig | TransformerConfig) -> Any:
    """The frozen part of an adapters-only checkpoint's model: its base GPT-2 folder, checked to
    be the one the run started from, loaded as the run loaded it, with the adapters' places empty."""
    recorded, lora = meta.get("lora_base"), lora_options(meta["train_config"])
    if recorded is None or lora is None or not isinstance(config, GPTConfig):
        raise CheckpointError(
            f"checkpoint {meta['path']} holds LoRA adapters alone but does not name their base; it is corrupt"
        )
    recorded = _found_base(meta, recorded)
    options = {k: getattr(config, k) for k in ("context_length", "dropout", "compute_dtype", "scan_unroll")}
    base = load_gpt2(recorded["path"], **options)
    if base.config != config:
        raise CheckpointError(
            f"checkpoint {meta['path']}: the GPT-2 in {recorded['path']}/ loads as another model than the "
            f"run's; the checkpoint is corrupt"
        )
    adapted = apply_lora(base, **lora, key=jax.random.key(0))
    return eqx.filter(adapted, lora_trainable(adapted), inverse=True)


def _found_base(meta: dict, recorded: dict) -> dict:
    """The identity of an adapters-only checkpoint's base where its files are now, the same bytes
    (sha256) as when the run started: at the path the run recorded, or, moved with the run folder,
    at the same place relative to it (`relative_path`)."""
    changed = gpt2_changed(recorded)
    relative = recorded.get("relative_path")
    if changed is not None and isinstance(relative, str):
        moved = {**recorded, "path": str(Path(meta["path"]).parent / relative)}
        if gpt2_changed(moved) is None:
            return moved
    if changed is not None:
        raise CheckpointError(
            f"checkpoint {meta['path']} holds LoRA adapters for the GPT-2 in {recorded.get('path')}/, which "
            f"{changed}; restore that folder (the adapters alone are beside the checkpoint, in PEFT's format)"
        )
    return recorded


def is_own_model(meta: dict) -> bool:
    """Whether a checkpoint holds a model of the user's own (not a `GPT` or a `Transformer`)."""
    return meta.get("model", "GPT") not in MODELS


def own_template(meta: dict, like: Any = None) -> Any:
    """The model a checkpoint of a model of one's own is read into: `like` (a model of the class
    it records, its weights ignored), else the one its run's factory (`train_config["model"]`,
    `MODULE:FUNCTION`) builds, as shapes; with the LoRA adapters it recorded. One line when neither."""
    name, sizes = meta["model"], meta["model_config"]
    if like is None:
        spec = meta["train_config"].get("model")
        if not isinstance(spec, str):
            raise CheckpointError(
                f"checkpoint {meta['path']} holds a {name} passed to train() from Python, which it cannot "
                f"rebuild; pass one as the skeleton: load_model(run, like={name}(...))"
            )
        like = eqx.filter_eval_shape(build_model, spec, sizes.get("vocab_size"), key=jax.random.key(0))
    elif type(like).__name__ != name:
        raise CheckpointError(
            f"checkpoint {meta['path']} holds a {name}, not a {type(like).__name__}; pass a {name}"
        )
    lora = meta.get("lora") or lora_options(meta["train_config"])
    if lora is not None and not has_lora(like):
        like = lora_template(like, **lora)
    return like


def _template(meta: dict, config: GPTConfig | TransformerConfig | None, like: Any) -> Any:
    """What a checkpoint's weights are read into: its model of one's own (`own_template`), or its
    `GPT` or `Transformer` of `config`, with the adapters its run trained."""
    if config is None:
        return own_template(meta, like)
    return run_template(config, meta["train_config"])


def _own_tokenizer(meta: dict) -> Tokenizer:
    """A checkpoint of a model of one's own: its tokenizer, of the model's vocabulary."""
    try:
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
    except TokenizerError as e:
        raise CheckpointError(f"checkpoint {meta['path']}: {e}") from None
    if tokenizer.vocab_size != meta["model_config"].get("vocab_size"):
        raise CheckpointError(
            f"checkpoint {meta['path']}: tokenizer has {tokenizer.vocab_size} ids but the model has "
            f"vocab_size={meta['model_config'].get('vocab_size')!r}"
        )
    return tokenizer


@overload
def load_model(
    path: str | Path, *, kind: Literal["GPT"], lora: str = "merged", like: None = None
) -> tuple[GPT, Tokenizer, dict]: ...
@overload
def load_model(
    path: str | Path, *, kind: Literal["Transformer"], lora: str = "merged", like: None = None
) -> tuple[Transformer, Tokenizer | None, dict]: ...
@overload
def load_model(
    path: str | Path, *, kind: Literal["LanguageModel"], lora: str = "merged", like: Any = None
) -> tuple[Any, Tokenizer, dict]: ...
@overload
def load_model(
    path: str | Path, *, kind: None = None, lora: str = "merged", like: Model
) -> tuple[Model, Tokenizer, dict]: ...
@overload
def load_model(
    path: str | Path, *, kind: None = None, lora: str = "merged", like: None = None
) -> tuple[Any, Tokenizer | None, dict]: ...
def load_model(
    path: str | Path, *, kind: str | None = None, lora: str = "merged", like: Any = None
) -> tuple[Any, Tokenizer | None, dict]:
    """`(model, tokenizer, metadata)` from a checkpoint, for sampling (the optimiser state is skipped).

    The model is the class the checkpoint records (`GPT` or `Transformer`); `kind="GPT"` (or
    `"Transformer"`) refuses the other with a one-line `CheckpointError`, `kind="LanguageModel"` a
    `Transformer` (it takes a `GPT` or a model of your own). A run of a model of your
    own is rebuilt by the function its run records (`train.py --model MODULE:FUNCTION`, imported
    with the current folder first), or read into `like`, a model of its class whose weights are
    ignored (what a run of a model passed to `train(model=...)` needs). `path` may also be a
    Hugging Face GPT-2 directory (`config.json` saying `"model_type": "gpt2"`, and
    `model.safetensors`; see `eqx_gpt.gpt2`); its metadata is then the model config and the
    directory. A folder is told apart by its marker: a run's own checkpoints come first, so a stray
    `config.json` in a run folder is never read as a GPT-2. The model is in training mode, as
    built: `eqx.nn.inference_mode(model)` for evaluation (sampling does it itself).

    A LoRA run's model is given merged (`lora="merged"`: plain `Linear`s, the base's structure), or
    with its adapters kept apart (`lora="separate"`: `LoRALinear`s; see `eqx_gpt.merge_lora`).
    """
    if kind is not None and (not isinstance(kind, str) or kind not in (*MODELS, "LanguageModel")):
        raise ValueError(
            f"kind must be {' or '.join(map(repr, MODELS))} (a model's class name), 'LanguageModel' (a GPT "
            f"or a model of one's own) or None, got {kind!r}"
        )
    if lora not in ("merged", "separate"):
        raise ValueError(f"lora must be 'merged' or 'separate', got {lora!r}")
    path = as_path(path, "a checkpoint's path")
    if (
        path.is_dir()
        and not holds_run(path)
        and is_gpt2_directory(path)
        and kind in (None, "GPT", "LanguageModel")
    ):
        model = load_gpt2(path)
        tokenizer = gpt2_tokenizer(model.config)
        meta = {"path": str(path), "format": "huggingface-gpt2", "model_config": model.config.to_dict()}
        return model, tokenizer, {**meta, "tokenizer": tokenizer.to_dict()}
    meta = read_metadata(path)
    if is_own_model(meta) and kind in (None, "LanguageModel"):
        config, tokenizer = None, _own_tokenizer(meta)
    else:
        config = _model_config(meta, "GPT" if kind == "LanguageModel" else kind)
        tokenizer = _tokenizer(meta, config)
    model = _read_model(_read_weights(meta), meta, _template(meta, config, like))
    if lora == "merged":
        model = merge_lora(model)
    return model, tokenizer, meta


def load_checkpoint(
    path: str | Path | dict, opt_state_like: Any, *, like: Any = None
) -> tuple[Any, Any, Tokenizer, dict]:
    """`(model, opt_state, tokenizer, metadata)` to resume training.

    `path` as in `find_checkpoint`, or the metadata `read_metadata` already returned (it is not
    read again). `opt_state_like` is a template of the optimiser state (e.g. from
    `eqx.filter_eval_shape`); `like` the model's (a model of one's own: see `load_model`; a `GPT`'s
    is built from its config). The model is in training mode, as built.
    """
    meta = path if isinstance(path, dict) else read_metadata(path)
    if is_own_model(meta):
        config, tokenizer = None, _own_tokenizer(meta)
    else:
        config = _model_config(meta, "GPT")
        tokenizer = _tokenizer(meta, config)
        if not isinstance(config, GPTConfig) or tokenizer is None:  # a GPT's tokenizer is checked
            raise CheckpointError(f"checkpoint {meta['path']} does not hold a GPT with its tokenizer")
        like = None  # a GPT's template is its config's
    f = _read_weights(meta)
    model = _read_model(f, meta, _template(meta, config, like))
    opt_state = _deserialise(f, opt_state_like, meta)
    if f.read(1):
        raise CheckpointError(
            f"checkpoint weights for {meta['path']} have trailing data; the file is corrupt"
        )
    return model, opt_state, tokenizer, meta
