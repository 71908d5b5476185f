"""LoRA adapters in Hugging Face PEFT's format, both ways, and the identity of the base they adapt.

A PEFT adapter folder holds `adapter_config.json` (`peft_type` "LORA", `r`, `lora_alpha`,
`target_modules`, `fan_in_fan_out`, `base_model_name_or_path`, ...) and
`adapter_model.safetensors`, whose tensors for GPT-2 are named
`base_model.model.transformer.h.{i}.attn.c_attn.lora_A.weight` `(r, in)` and `...lora_B.weight`
`(out, r)`: the transposes of `LoRALinear.lora_a (in, r)` and `.lora_b (r, out)`. GPT-2's
projections are `Conv1D`s (weight stored `(in, out)`), hence `fan_in_fan_out: true`.
`peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), folder)` loads what
`save_adapters` writes; `load_adapters` reads what PEFT saved (LoRA on GPT-2's blocks; DoRA,
rsLoRA and per-module ranks are refused).

The adapters of a model of one's own (any other model) are written in eqx_gpt's own format, the
same two files: `adapter_config.json` says `"format": "eqx_gpt-lora"`, the model's class, its base
(`base`: the function that builds it, or where it came from), `r`, `lora_alpha`, `lora_dropout` and
`target_modules`, the adapted modules' paths (`named_linears`); `adapter_model.safetensors` holds
`{path}.lora_a` `(in, r)` and `{path}.lora_b` `(r, out)` in eqx_gpt's layout, float32, each with the
leading axes of its module (a stack of layers keeps its `n_layers` axis). `load_adapters` reads
either format.
"""

import json
import os
import re
from operator import attrgetter
from pathlib import Path
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from eqx_gpt._checks import as_path
from eqx_gpt.errors import CheckpointError, TrainingError
from eqx_gpt.files import resolve, write_files
from eqx_gpt.gpt2 import CONFIG_NAME, gpt2_changed
from eqx_gpt.model.block import GPT2_PROJECTIONS
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.lora import LoRALinear, apply_lora, check_lora, lora_record, named_linears

Model = TypeVar("Model")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.transformer.h."
_NAME = re.compile(
    r"base_model\.model\.transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.lora_([AB])\.weight"
)


def is_adapter_directory(path: str | Path) -> bool:
    """Whether `path` is a PEFT adapter folder: its marker is `adapter_config.json`."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _stacked_layers(model: GPT, what: str):
    """The model's stacked layers; a one-line `TrainingError` for anything else."""
    if not isinstance(model, GPT):
        raise TrainingError(f"{what} takes a GPT (eqx_gpt.GPT), got {type(model).__name__}")
    layers = model.blocks.layers
    if isinstance(layers, tuple):
        raise TrainingError("PEFT adapters are read and written for a GPT with stacked layers")
    return layers


def _adapted(model: GPT, what: str = "save_adapters") -> dict[str, LoRALinear]:
    """The model's `LoRALinear`s (stacked over its layers) by GPT-2 module name: at least one, all
    of one rank, alpha and dropout (one `adapter_config.json`), their arrays finite."""
    layers = _stacked_layers(model, what)
    found = {name: attrgetter(path)(layers) for name, path in GPT2_PROJECTIONS.items()}
    adapted = {name: module for name, module in found.items() if isinstance(module, LoRALinear)}
    if not adapted:
        raise TrainingError(
            f"{what}: the model has no LoRA adapters (LoRALinear); adapt it first with apply_lora or "
            f"load_adapters (nothing was written)"
        )
    kinds = {(m.rank, m.scale, m.dropout) for m in adapted.values()}
    if len(kinds) > 1:
        raise TrainingError(
            f"{what}: the model's adapters differ in (rank, scale, dropout): {sorted(kinds)}; PEFT's folder "
            f"holds one of each: apply_lora with one setting (nothing was written)"
        )
    for name, m in adapted.items():
        if not (np.isfinite(np.asarray(m.lora_a)).all() and np.isfinite(np.asarray(m.lora_b)).all()):
            raise TrainingError(
                f"{what}: the adapters of {name} hold NaN or infinite values (the training diverged); "
                f"save adapters from an earlier checkpoint (nothing was written)"
            )
    return adapted


def adapter_config(model: GPT, base: str) -> dict:
    """The `adapter_config.json` PEFT writes for `model`'s adapters on the GPT-2 named `base` (as
    the folder records it: a path relative to the adapter folder, or a Hub name)."""
    adapted = _adapted(model)
    first = next(iter(adapted.values()))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": first.rank, "lora_alpha": first.scale * first.rank, "lora_dropout": first.dropout,
        "target_modules": sorted(adapted), "fan_in_fan_out": True, "bias": "none",
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip


def portable_base(base: str | Path, directory: str | Path) -> str:
    """How an adapter folder at `directory` names its base: a local GPT-2 folder by its path
    relative to `directory` (the two travel together, as `../gpt2` in a copy of both), anything
    else (a Hub name) as given. `read_adapter_config` reads it back relative to the folder."""
    local = Path(base).expanduser()
    if not (local / CONFIG_NAME).is_file():
        return str(base)
    try:
        return Path(os.path.relpath(resolve(local), resolve(directory))).as_posix()
    except ValueError:  # another drive (Windows): no relative path
        return resolve(local).as_posix()


def save_adapters(model: PyTree, directory: str | Path, *, base: str | Path) -> Path:
    """Write `model`'s adapters as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`)
    for the GPT-2 in folder `base` (recorded relative to `directory`: `portable_base`).

    Everything is checked before anything is written. A new folder, or one holding these two files
    alone, is written whole and put in place at once (`atomic_folder`); in a folder holding other
    files too (a run's) each file is replaced atomically, the config last. A model of one's own (not
    a `GPT`) has its adapters written in eqx_gpt's format (see the module's docstring), `base` naming
    what builds its base."""
    from safetensors.numpy import save

    if not isinstance(model, GPT):  # a model of one's own: eqx_gpt's format
        return _save_own(model, as_path(directory, "directory"), str(base))
    directory = as_path(directory, "directory")
    if not isinstance(base, str | os.PathLike) or not str(base):
        raise TypeError(f"base must name the GPT-2 the adapters are for (a path or a name), got {base!r}")
    adapted = _adapted(model)
    if directory.exists() and not directory.is_dir():
        raise TrainingError(f"save_adapters: {directory} is a file; pass a folder (nothing was written)")
    tensors = {}
    for name, module in adapted.items():
        a, b = np.asarray(module.lora_a, np.float32), np.asarray(module.lora_b, np.float32)
        for i in range(a.shape[0]):
            tensors[f"{PREFIX}{i}.{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{PREFIX}{i}.{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    files = {
        ADAPTER_WEIGHTS: save(tensors, metadata={"format": "pt"}),
        ADAPTER_CONFIG: (
            json.dumps(adapter_config(model, portable_base(base, directory)), indent=2) + "\n"
        ).encode(),
    }
    write_files(directory, files)  # the weights, then the config that names them
    return directory


def save_run_adapters(out_dir: str | Path, name: str, model: PyTree, *, base: str) -> None:
    """Keep a LoRA run's folder holding, in PEFT's format, the adapters of the model `load_model`
    gives for it: those of its `best` checkpoint, or of `latest` while there is no `best`. Called as
    checkpoint `name` ("best", "latest") of `model` is saved."""
    if name == "best" or not (Path(out_dir) / "best.json").is_file():
        save_adapters(model, out_dir, base=base)


# PEFT's LoRA settings that eqx_gpt reads (checked below) or that do not change what a saved
# adapter computes (metadata, and how the adapters were first drawn); every other setting must be
# unset (null, false, empty), whatever its name: a newer PEFT's may change the computation.
READ_SETTINGS = {
    "peft_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "bias",
    "fan_in_fan_out",
    "init_lora_weights",
}
INERT_SETTINGS = {
    "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version",
    "target_modules", "exclude_modules", "layers_pattern", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "megatron_core", "qalora_group_size", "runtime_config",
}  # fmt: skip
INIT_LORA_WEIGHTS = (True, False, "gaussian")  # draws of A that leave the base as it is


def read_adapter_config(directory: str | Path) -> dict:
    """`adapter_config.json` of a PEFT folder, checked to be LoRA that eqx_gpt computes; its
    `base_model_name_or_path` made absolute (relative to the folder)."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}); save the adapters again") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise CheckpointError(f"{path}: peft_type is {kind!r}; eqx_gpt reads LoRA adapters ('LORA') only")
    unsupported = [
        k
        for k, v in config.items()
        if k not in READ_SETTINGS | INERT_SETTINGS and v not in (None, False, {}, [], "")
    ]
    if config.get("init_lora_weights", True) not in INIT_LORA_WEIGHTS:
        unsupported.append(f"init_lora_weights {config['init_lora_weights']!r}")
    if unsupported or config.get("bias", "none") != "none" or not config.get("fan_in_fan_out", True):
        raise CheckpointError(
            f"{path}: eqx_gpt reads plain LoRA on GPT-2 (bias 'none', fan_in_fan_out true, no "
            f"{', '.join(unsupported) or 'bias training'}); this adapter is another kind"
        )
    try:
        check_lora(config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0))
    except KeyError as e:
        raise CheckpointError(f"{path} lacks {e.args[0]!r}; it is not a complete adapter config") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base:
        local = (Path(directory) / base).expanduser()
        config["base_model_name_or_path"] = str(local.resolve()) if local.exists() else base
    return config


def base_directory(directory: str | Path) -> Path:
    """The local GPT-2 folder a PEFT adapter folder names as its base (a one-line error if it
    names a Hub model or nothing that exists)."""
    base = read_adapter_config(directory).get("base_model_name_or_path")
    if not isinstance(base, str) or not (Path(base) / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"{Path(directory) / ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not a local GPT-2 "
            f"folder; download the base (config.json, model.safetensors) and set that field to its path"
        )
    return Path(base)


def adapter_targets(directory: str | Path) -> list[str]:
    """The GPT-2 modules (`GPT2_PROJECTIONS`' names) a PEFT folder's tensors adapt."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        with safe_open(path, framework="numpy") as f:
            names = list(f.keys())
    except (OSError, SafetensorError, ValueError) as e:
        raise CheckpointError(
            f"{path} cannot be read ({type(e).__name__}); save the adapters again"
        ) from None
    matches = [_NAME.fullmatch(name.replace(".default.", ".")) for name in names]
    if not names or None in matches:
        raise CheckpointError(
            f"{path} holds tensors that are not LoRA on GPT-2's blocks; eqx_gpt cannot apply them"
        )
    return sorted({m[2] for m in matches if m is not None})


def load_adapters(model: Model, directory: str | Path, *, dropout: float | None = None) -> Model:
    """`model` (the base GPT-2, plain `Linear`s) with the PEFT adapters of `directory` applied:
    `LoRALinear`s holding the saved A and B at the saved rank and alpha, and the saved
    `lora_dropout` unless `dropout` is given (a run that continues them may choose its own). A
    folder in eqx_gpt's format is applied to any model of its class (see the module's docstring)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if _own_config(directory) is not None:
        return _load_own(model, Path(directory), dropout)
    if not isinstance(model, GPT):
        raise CheckpointError(
            f"{directory}/ holds PEFT adapters of GPT-2, and the model is a {type(model).__name__}; apply "
            f"them to a GPT (load_gpt2)"
        )

    config = read_adapter_config(directory)
    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError, ValueError) as e:
        raise CheckpointError(
            f"{path} cannot be read ({str(e).splitlines()[0] if str(e) else e}); save it again"
        ) from None
    _stacked_layers(model, "load_adapters")
    n = model.config.n_layers
    found: dict[str, dict[tuple[int, str], np.ndarray]] = {}
    for name, array in tensors.items():
        match = _NAME.fullmatch(name.replace(".default.", "."))
        if match is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} is not LoRA on a GPT-2 block; eqx_gpt cannot apply it"
            )
        _check_tensor(path, name, array)
        layer, key = int(match[1]), (int(match[1]), match[3])
        if layer >= n:
            raise CheckpointError(
                f"{path}: tensor {name!r} is for layer {layer}, but the base has {n} layers (h.0 to "
                f"h.{n - 1}); the adapter is for another model"
            )
        if key in found.setdefault(match[2], {}):
            raise CheckpointError(f"{path}: {match[2]}'s lora_{match[3]} of layer {layer} is there twice")
        found[match[2]][key] = array
    if not found:
        raise CheckpointError(f"{path} holds no LoRA tensors")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    dropout = float(config.get("lora_dropout", 0.0)) if dropout is None else dropout
    targets = sorted(found)
    adapted = apply_lora(model, rank, alpha=alpha, targets=targets, dropout=dropout, key=jax.random.key(0))
    getters, arrays = [], []
    for module, per_layer in found.items():
        for which, field in (("A", "lora_a"), ("B", "lora_b")):
            get = attrgetter(f"blocks.layers.{GPT2_PROJECTIONS[module]}.{field}")
            like = get(adapted)
            missing = [i for i in range(n) if (i, which) not in per_layer]
            if missing:
                raise CheckpointError(
                    f"{path}: {module}'s lora_{which} is missing for layer {missing[0]} of the base's {n}"
                )
            shape = like.shape[1:][::-1]  # PEFT's layout, the transpose of eqx_gpt's
            wrong = next(
                (a.shape for (_, w), a in per_layer.items() if w == which and a.shape != shape), None
            )
            if wrong is not None:
                raise CheckpointError(
                    f"{path}: {module}.lora_{which} has shape {wrong} per layer but the base and r={rank} "
                    f"imply {shape}; the adapter is for another model"
                )
            stacked = np.stack([per_layer[(i, which)].T for i in range(n)])
            getters.append(get)
            arrays.append(jnp.asarray(stacked, jnp.float32))
    return eqx.tree_at(lambda m: [get(m) for get in getters], adapted, arrays)


def _check_tensor(path: Path, name: str, array: np.ndarray) -> None:
    """Refuse a tensor that is not of floats, or holds NaN or an infinity: never cast or used."""
    if array.dtype.kind != "f":
        raise CheckpointError(
            f"{path}: tensor {name!r} holds {array.dtype}, not floating-point numbers; LoRA's A and B are "
            f"floats: the file is damaged or not an adapter"
        )
    if not np.isfinite(array).all():
        raise CheckpointError(
            f"{path}: tensor {name!r} holds NaN or infinite values (its training diverged, or the file is "
            f"damaged); save the adapters of an earlier checkpoint"
        )


def check_base(recorded: dict) -> None:
    """A one-line `TrainingError` unless the base folder a run recorded still holds the same files."""
    changed = gpt2_changed(recorded)
    if changed is not None:
        raise TrainingError(
            f"the LoRA run's base model {recorded.get('path')}/ {changed}: its adapters are for the weights "
            f"it had; restore that folder to resume, or start a new run with --out-dir"
        )


def describe(model: GPT) -> str:
    """One line: the adapters' rank, scale, targets and trainable share."""
    adapted = _adapted(model)
    first = next(iter(adapted.values()))
    trainable = sum(m.lora_a.size + m.lora_b.size for m in adapted.values())
    total = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    share = 100 * trainable / (total - trainable)
    return (
        f"LoRA rank {first.rank}, scale {first.scale:g} (alpha {first.scale * first.rank:g}) on "
        f"{', '.join(sorted(adapted))}: {trainable:,} trainable parameters ({share:.2f}% of the frozen "
        f"{(total - trainable) / 1e6:.2f}M)"
    )


OWN_FORMAT = "eqx_gpt-lora"


def _own_config(directory: str | Path) -> dict | None:
    """`adapter_config.json` of a folder in eqx_gpt's format, or None for any other (PEFT's)."""
    path = Path(directory) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # read_adapter_config says what is wrong with it
    return config if isinstance(config, dict) and config.get("format") == OWN_FORMAT else None


def _save_own(model: PyTree, directory: Path, base: str) -> Path:
    from safetensors.numpy import save

    record = lora_record(model)
    if record is None:
        raise TrainingError(f"save_adapters: the {type(model).__name__} holds no LoRA adapters to save")
    linears = named_linears(model)
    tensors = {}
    for name in record["targets"]:
        module = linears[name]
        assert isinstance(module, LoRALinear)
        tensors[f"{name}.lora_a"] = np.ascontiguousarray(np.asarray(module.lora_a, np.float32))
        tensors[f"{name}.lora_b"] = np.ascontiguousarray(np.asarray(module.lora_b, np.float32))
    config = {
        "format": OWN_FORMAT, "version": 1, "model": type(model).__name__, "base": base,
        "r": record["rank"], "lora_alpha": record["alpha"], "lora_dropout": record["dropout"],
        "target_modules": record["targets"],
    }  # fmt: skip
    write_files(directory, {
        ADAPTER_WEIGHTS: save(tensors, metadata={"format": OWN_FORMAT}),
        ADAPTER_CONFIG: (json.dumps(config, indent=2) + "\n").encode(),
    })  # fmt: skip
    return directory


def _load_own(model: Model, directory: Path, dropout: float | None) -> Model:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    config = _own_config(directory) or {}
    path = directory / ADAPTER_WEIGHTS
    if config.get("model") != type(model).__name__:
        raise CheckpointError(
            f"{directory}/ holds adapters of a {config.get('model')}, not of a {type(model).__name__}"
        )
    try:
        check_lora(config["r"], config["lora_alpha"], config.get("lora_dropout", 0.0))
        targets = list(config["target_modules"])
        tensors = load_file(path)
    except KeyError as e:
        raise CheckpointError(
            f"{directory / ADAPTER_CONFIG} lacks {e.args[0]!r}; save the adapters again"
        ) from None
    except (OSError, SafetensorError, ValueError) as e:
        raise CheckpointError(
            f"{directory}: the adapters cannot be read ({str(e).splitlines()[0]})"
        ) from None
    expected = {f"{t}.lora_{w}" for t in targets for w in "ab"}
    if set(tensors) != expected:
        odd = sorted(set(tensors) ^ expected)[0]
        raise CheckpointError(
            f"{path}: tensor {odd!r} is missing or not of the adapters it names; save them again"
        )
    dropout = float(config.get("lora_dropout", 0.0)) if dropout is None else dropout
    adapted = apply_lora(
        model, int(config["r"]), alpha=float(config["lora_alpha"]), targets=targets, dropout=dropout,
        key=jax.random.key(0),
    )  # fmt: skip
    linears = named_linears(adapted)
    arrays = []
    for name in sorted(expected):
        path_name, field = name.rsplit(".", 1)
        like = getattr(linears[path_name], field)
        if tensors[name].shape != like.shape or not np.isfinite(tensors[name]).all():
            raise CheckpointError(
                f"{path}: {name} has shape {tensors[name].shape} where the model's is {like.shape}, or "
                f"values that are not finite; the adapters are for another model"
            )
        arrays.append(jnp.asarray(tensors[name], jnp.float32))
    where = lambda m: [
        getattr(named_linears(m)[n.rsplit(".", 1)[0]], n.rsplit(".", 1)[1]) for n in sorted(expected)
    ]
    return eqx.tree_at(where, adapted, arrays)
