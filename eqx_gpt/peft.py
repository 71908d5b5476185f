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
import re
from operator import attrgetter
from pathlib import Path
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from eqx_gpt.errors import CheckpointError, TrainingError
from eqx_gpt.files import atomic_write_bytes
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


def _adapted(model: GPT) -> dict[str, LoRALinear]:
    """The model's `LoRALinear`s (stacked over its layers) by GPT-2 module name."""
    layers = model.blocks.layers
    if isinstance(layers, tuple):
        raise TrainingError("PEFT adapters are read and written for a GPT with stacked layers")
    found = {name: attrgetter(path)(layers) for name, path in GPT2_PROJECTIONS.items()}
    return {name: module for name, module in found.items() if isinstance(module, LoRALinear)}


def adapter_config(model: GPT, base: str) -> dict:
    """The `adapter_config.json` PEFT writes for `model`'s adapters on the GPT-2 in folder `base`."""
    adapted = _adapted(model)
    first = next(iter(adapted.values()))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": first.rank, "lora_alpha": first.scale * first.rank, "lora_dropout": first.dropout,
        "target_modules": sorted(adapted), "fan_in_fan_out": True, "bias": "none",
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }  # fmt: skip


def save_adapters(model: PyTree, directory: str | Path, *, base: str) -> Path:
    """Write `model`'s adapters as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`)
    for the GPT-2 in folder `base`; a model of one's own's in eqx_gpt's format (see the module's
    docstring), `base` naming what builds its base. Each file is replaced atomically, the config last."""
    from safetensors.numpy import save

    if not isinstance(model, GPT):
        return _save_own(model, Path(directory), base)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, module in _adapted(model).items():
        a, b = np.asarray(module.lora_a, np.float32), np.asarray(module.lora_b, np.float32)
        for i in range(a.shape[0]):
            tensors[f"{PREFIX}{i}.{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{PREFIX}{i}.{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    atomic_write_bytes(directory / ADAPTER_WEIGHTS, save(tensors, metadata={"format": "pt"}))
    config = adapter_config(model, base)
    atomic_write_bytes(directory / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return directory


def save_run_adapters(out_dir: str | Path, name: str, model: PyTree, *, base: str) -> None:
    """Keep a LoRA run's folder holding, in PEFT's format, the adapters of the model `load_model`
    gives for it: those of its `best` checkpoint, or of `latest` while there is no `best`. Called as
    checkpoint `name` ("best", "latest") of `model` is saved."""
    if name == "best" or not (Path(out_dir) / "best.json").is_file():
        save_adapters(model, out_dir, base=base)


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
    unsupported = [k for k in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save",
                               "layers_to_transform") if config.get(k)]  # fmt: skip
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
    found: dict[str, dict[tuple[int, str], np.ndarray]] = {}
    for name, array in tensors.items():
        match = _NAME.fullmatch(name.replace(".default.", "."))
        if match is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} is not LoRA on a GPT-2 block; eqx_gpt cannot apply it"
            )
        found.setdefault(match[2], {})[(int(match[1]), match[3])] = array
    if not found:
        raise CheckpointError(f"{path} holds no LoRA tensors")
    rank, alpha, n = int(config["r"]), float(config["lora_alpha"]), model.config.n_layers
    dropout = float(config.get("lora_dropout", 0.0)) if dropout is None else dropout
    targets = sorted(found)
    adapted = apply_lora(model, rank, alpha=alpha, targets=targets, dropout=dropout, key=jax.random.key(0))
    getters, arrays = [], []
    for module, per_layer in found.items():
        for which, field in (("A", "lora_a"), ("B", "lora_b")):
            try:
                stacked = np.stack([per_layer[(i, which)].T for i in range(n)])
            except KeyError:
                raise CheckpointError(
                    f"{path}: {module}'s lora_{which} is missing for some of the {n} layers"
                ) from None
            get = attrgetter(f"blocks.layers.{GPT2_PROJECTIONS[module]}.{field}")
            like = get(adapted)
            if stacked.shape != like.shape:
                raise CheckpointError(
                    f"{path}: {module}.lora_{which} has shape {stacked.shape[1:][::-1]} per layer but the "
                    f"base and r={rank} imply {like.shape[1:][::-1]}; the adapter is for another model"
                )
            getters.append(get)
            arrays.append(jnp.asarray(stacked, jnp.float32))
    return eqx.tree_at(lambda m: [get(m) for get in getters], adapted, arrays)


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
        raise CheckpointError(f"the {type(model).__name__} holds no LoRA adapters to save")
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
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / ADAPTER_WEIGHTS, save(tensors, metadata={"format": OWN_FORMAT}))
    atomic_write_bytes(directory / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
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
