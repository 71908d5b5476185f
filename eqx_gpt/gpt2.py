"""GPT-2 in Hugging Face's format: a directory of `config.json` and `model.safetensors` read into
an eqx_gpt `GPT`, and a GPT-2-shaped `GPT` written back as one.

GPT-2 is the `GPT` with `positions="learned"`, `bias=True`, `norm="layer"` (pre-norm, with a final
LayerNorm), the tanh GELU and `tie_embeddings=True`. Its tensors map one to one onto ours
(`TENSORS`). Hugging Face stores the projections as `Conv1D` weights of shape `(in, out)`, which
is our `x @ w` layout, so nothing is transposed; `c_attn` holds the query, key and value weights
side by side as our attention's `qkv` does. The token table is padded with zero rows to
`padded_vocab_size`, and `GPT` never returns the padding's logits, so they are never sampled.

Files are read with the `safetensors` package's NumPy API (no torch, and nothing that could run
code), sharded checkpoints (`model.safetensors.index.json`) included. The sizes come from
`config.json`, so gpt2, gpt2-medium, gpt2-large and gpt2-xl load alike.
"""

import hashlib
import json
import re
from operator import attrgetter
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from eqx_gpt._checks import as_path
from eqx_gpt.errors import GPT2FormatError
from eqx_gpt.files import write_files
from eqx_gpt.model.block import GPT2_PROJECTIONS
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.template import model_template
from eqx_gpt.tokenizer import GPT2_VOCAB_SIZE, GPT2Tokenizer

CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME = "config.json", "model.safetensors", "model.safetensors.index.json"

# Hugging Face's tensor names (per block after "h.{i}.") and where each lives in a `GPT`. Its `Conv1D`
# modules are our `Linear`s (`GPT2_PROJECTIONS`); a `Conv1D`'s weight is stored `(in, out)`, as ours is.
BLOCK_TENSORS = {
    "ln_1.weight": lambda b: b.attn_norm.scale,
    "ln_1.bias": lambda b: b.attn_norm.bias,
    "ln_2.weight": lambda b: b.mlp_norm.scale,
    "ln_2.bias": lambda b: b.mlp_norm.bias,
    **{f"{name}.weight": attrgetter(f"{path}.weight") for name, path in GPT2_PROJECTIONS.items()},
    **{f"{name}.bias": attrgetter(f"{path}.bias") for name, path in GPT2_PROJECTIONS.items()},
}
TENSORS = {
    "wpe.weight": lambda m: m.pos_embed,
    "ln_f.weight": lambda m: m.final_norm.scale,
    "ln_f.bias": lambda m: m.final_norm.bias,
    **{f"h.*.{name}": (lambda m, get=get: get(m.blocks.layers)) for name, get in BLOCK_TENSORS.items()},
}  # fmt: skip
# The token table (padded) and an untied head (transposed) are handled on their own.
# Hugging Face's activation names and ours; the first name of each of ours is the one written back.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
HF_ACTIVATIONS = {ours: hf for hf, ours in reversed(ACTIVATIONS.items())}
GPT2_OPTIONS = dict(positions="learned", bias=True, norm="layer", norm_position="pre")


def is_gpt2_directory(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face GPT-2 directory: its marker is a `config.json` that parses
    and says `"model_type": "gpt2"` (any other `config.json` is not one)."""
    try:
        hf = json.loads((Path(path) / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(hf, dict) and hf.get("model_type") == "gpt2"


def read_gpt2_config(directory: str | Path, **options) -> GPTConfig:
    """The `GPTConfig` of the GPT-2 in `directory`, from its `config.json`.

    `options` set what is not the model's shape: `context_length` (at most `n_positions`: the
    position table is cropped, as nanoGPT's `crop_block_size`), `dropout`, `compute_dtype`,
    `scan_unroll`.
    """
    return _read_config(as_path(directory, "a GPT-2 directory"), options)[0]


def _read_config(directory: Path, options: dict) -> tuple[GPTConfig, int]:
    """`(config, n_positions)`: see `read_gpt2_config`."""
    path, hf = _read_hf_config(directory)
    try:
        n_positions, vocab_size = int(hf["n_positions"]), int(hf["vocab_size"])
        sizes = dict(d_model=int(hf["n_embd"]), n_heads=int(hf["n_head"]), n_layers=int(hf["n_layer"]),
                     d_hidden=hf.get("n_inner"), norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                     tie_embeddings=bool(hf.get("tie_word_embeddings", True)))  # fmt: skip
    except KeyError as e:
        raise GPT2FormatError(f"{path} lacks {e.args[0]!r}; it is not a complete GPT-2 config") from None
    except (TypeError, ValueError) as e:
        raise GPT2FormatError(f"{path}: {e}") from None
    options = {"context_length": n_positions, **options}
    if options["context_length"] > n_positions:
        raise GPT2FormatError(
            f"context_length {options['context_length']} is longer than the {n_positions} positions "
            f"{directory}/ was trained on; pass at most {n_positions}"
        )
    if vocab_size > GPT2_VOCAB_SIZE:
        raise GPT2FormatError(
            f"{path}: vocab_size {vocab_size} is larger than GPT-2's BPE ({GPT2_VOCAB_SIZE} ids)"
        )
    activation = ACTIVATIONS[hf.get("activation_function", "gelu_new")]
    try:
        config = GPTConfig(vocab_size=vocab_size, activation=activation, **sizes, **GPT2_OPTIONS, **options)
    except (TypeError, ValueError) as e:
        raise GPT2FormatError(f"{path}: {e}") from None
    return config, n_positions


def _read_hf_config(directory: Path) -> tuple[Path, dict]:
    """`(path, contents)` of the directory's `config.json`, checked to describe a GPT-2 that eqx_gpt
    builds."""
    path = directory / CONFIG_NAME
    if not directory.exists():
        raise GPT2FormatError(
            f"no folder {directory}: a Hugging Face GPT-2 is a folder holding {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}"
        )
    if not directory.is_dir():
        raise GPT2FormatError(
            f"{directory} is not a folder; a Hugging Face GPT-2 is a folder holding {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}" + (f": pass {directory.parent}/" if directory.name == CONFIG_NAME else "")
        )
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GPT2FormatError(
            f"{directory}/ has no {CONFIG_NAME}; a Hugging Face GPT-2 directory holds {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}: download {CONFIG_NAME} too (README: 'GPT-2')"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GPT2FormatError(f"{path} is unreadable ({type(e).__name__}); download it again") from None
    if not isinstance(hf, dict) or hf.get("model_type") != "gpt2":
        kind = hf.get("model_type") if isinstance(hf, dict) else None
        raise GPT2FormatError(f"{path} describes model_type {kind!r}, not 'gpt2'; only GPT-2 loads")
    unsupported = [
        k for k, ok in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
                        ("scale_attn_weights", True)) if hf.get(k, ok) != ok
    ]  # fmt: skip
    activation = hf.get("activation_function", "gelu_new")
    if unsupported or activation not in ACTIVATIONS:
        raise GPT2FormatError(
            f"{path}: eqx_gpt cannot build a GPT-2 with "
            f"{unsupported or f'activation_function={activation!r}'}"
        )
    return path, hf


def _read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors file(s), by name, without a `transformer.` prefix."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    if (directory / WEIGHTS_NAME).is_file():
        files = [directory / WEIGHTS_NAME]
    elif (directory / INDEX_NAME).is_file():
        try:
            weight_map = json.loads((directory / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise GPT2FormatError(f"{directory / INDEX_NAME} is unreadable; download it again") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) and Path(name).name == name for name in weight_map.values()
        ):
            raise GPT2FormatError(
                f"{directory / INDEX_NAME}: weight_map must map tensor names to file names in {directory}/; "
                f"download it again"
            )
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        other = (
            " (it has pytorch_model.bin, which eqx_gpt does not read)"
            * (directory / "pytorch_model.bin").exists()
        )
        raise GPT2FormatError(
            f"{directory}/ has no {WEIGHTS_NAME}{other}; download the safetensors weights, e.g. "
            f"`hf download openai-community/gpt2 config.json model.safetensors --local-dir {directory}`"
        )
    tensors = {}
    for file in files:
        try:
            loaded = load_file(file)
        except (OSError, SafetensorError, ValueError, TypeError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise GPT2FormatError(f"{file} cannot be read ({reason}); download it again") from None
        tensors.update({name.removeprefix("transformer."): array for name, array in loaded.items()})
    return tensors


def _tensor(tensors: dict, name: str, shape: tuple, directory: Path) -> np.ndarray:
    if name not in tensors:
        raise GPT2FormatError(
            f"{directory}/ lacks the tensor {name!r}; the weights are partial, download them again"
        )
    array = tensors[name]
    if array.shape != shape:
        raise GPT2FormatError(
            f"{directory}/: {name} has shape {array.shape} but {CONFIG_NAME} implies {shape}; the files "
            f"are from different models"
        )
    if array.dtype.kind != "f":  # never cast to float without a word
        raise GPT2FormatError(
            f"{directory}/: {name} holds {array.dtype}, not floating-point weights; download them again"
        )
    array = np.asarray(array, np.float32)
    if not np.isfinite(array).all():
        raise GPT2FormatError(
            f"{directory}/: {name} holds NaN or infinite values (a diverged or damaged model); download the "
            f"weights again or save them from an earlier checkpoint"
        )
    return array


# What a GPT-2 folder may hold beside the weights read: the attention's causal-mask buffers (older
# transformers saved them) and a tied head's copy of the token table.
BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)|lm_head\.weight")


def _check_all_read(tensors: dict, read: set[str], directory: Path) -> None:
    """Refuse a tensor the model would leave unread (a layer `config.json` does not have, a
    module GPT-2 lacks): the files are not the model the config describes."""
    unread = sorted(name for name in tensors if name not in read and not BUFFERS.fullmatch(name))
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        raise GPT2FormatError(
            f"{directory}/ holds the tensor {unread[0]!r}{more}, which a GPT-2 of its {CONFIG_NAME} does not "
            f"have; the files are from different models"
        )


def load_gpt2(directory: str | Path, **options) -> GPT:
    """The `GPT` of the Hugging Face GPT-2 in `directory`.

    `options` as in `read_gpt2_config` (`context_length`, `dropout`, `compute_dtype`,
    `scan_unroll`). Its tokenizer is `gpt2_tokenizer(model.config)`. Raises `GPT2FormatError` (a
    `CheckpointError`) naming what is missing or wrong. The model is in training mode, as built
    (it matters with `dropout=`): `eqx.nn.inference_mode(model)` for inference.
    """
    directory = as_path(directory, "a GPT-2 directory")
    config, n_positions = _read_config(directory, options)
    tensors = _read_tensors(directory)
    template = model_template(config)
    n = config.n_layers

    def read(name, like):
        if name == "wpe.weight":  # the whole table, cropped to the context
            return _tensor(tensors, name, (n_positions, config.d_model), directory)[: config.context_length]
        if not name.startswith("h.*."):
            return _tensor(tensors, name, like.shape, directory)
        return np.stack(
            [_tensor(tensors, name.replace("*", str(i)), like.shape[1:], directory) for i in range(n)]
        )

    names = {name.replace("*", str(i)) for name in TENSORS for i in range(n)} | {"wte.weight"}
    _check_all_read(tensors, names | ({"lm_head.weight"} if not config.tie_embeddings else set()), directory)
    getters = list(TENSORS.values())
    arrays = [read(name, get(template)) for name, get in TENSORS.items()]
    wte = _tensor(tensors, "wte.weight", (config.vocab_size, config.d_model), directory)
    getters.append(lambda m: m.embed)
    arrays.append(np.zeros(template.embed.shape, np.float32))
    arrays[-1][: config.vocab_size] = wte
    if not config.tie_embeddings:
        head = _tensor(tensors, "lm_head.weight", (config.vocab_size, config.d_model), directory)
        getters.append(lambda m: m.head.weight)
        arrays.append(np.zeros((config.d_model, config.padded_vocab_size), np.float32))
        arrays[-1][:, : config.vocab_size] = head.T
    return eqx.tree_at(lambda m: [get(m) for get in getters], template, [jnp.asarray(a) for a in arrays])


def gpt2_tokenizer(config: GPTConfig) -> GPT2Tokenizer:
    """GPT-2's BPE, cut to the model's vocabulary when that is smaller (tiny test models)."""
    return GPT2Tokenizer(config.vocab_size)


def gpt2_config_dict(config: GPTConfig) -> dict:
    """The Hugging Face `config.json` of a GPT-2-shaped `config` (`GPT2FormatError` if it is not one)."""
    gpt2_like = {**GPT2_OPTIONS, "logit_softcap": None}  # and an activation Hugging Face names
    mismatched = [f"{k}={getattr(config, k)!r}" for k, v in gpt2_like.items() if getattr(config, k) != v]
    mismatched += [f"activation={config.activation!r}"] * (config.activation not in HF_ACTIVATIONS)
    if mismatched or config.vocab_size > GPT2_VOCAB_SIZE:
        raise GPT2FormatError(
            f"the model is not GPT-2-shaped ({', '.join(mismatched) or f'vocab_size={config.vocab_size}'}); "
            f"GPT-2 has positions='learned', bias=True, norm='layer', norm_position='pre' and at most "
            f"{GPT2_VOCAB_SIZE} ids"
        )
    c = config
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
        "n_positions": c.context_length, "n_ctx": c.context_length, "n_embd": c.d_model, "n_head": c.n_heads,
        "n_layer": c.n_layers, "n_inner": c.d_hidden, "activation_function": HF_ACTIVATIONS[c.activation],
        "layer_norm_epsilon": c.norm_eps, "tie_word_embeddings": c.tie_embeddings, "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout, "attn_pdrop": c.dropout, "initializer_range": 0.02,
        **({"bos_token_id": 50256, "eos_token_id": 50256} if c.vocab_size == GPT2_VOCAB_SIZE else {}),
    }  # fmt: skip


def save_gpt2(model: GPT, directory: str | Path) -> Path:
    """Write a GPT-2-shaped `model` as a Hugging Face directory (`config.json`, `model.safetensors`)
    that `transformers.GPT2LMHeadModel.from_pretrained` loads. Everything is checked before anything
    is written; a new folder (or one of these two files alone) is put in place at once, otherwise each
    file is replaced atomically, the config last (`files.write_files`)."""
    from safetensors.numpy import save

    config_dict = gpt2_config_dict(model.config)
    directory = as_path(directory, "directory")
    if directory.exists() and not directory.is_dir():
        raise GPT2FormatError(f"save_gpt2: {directory} is a file; pass a folder (nothing was written)")
    v = model.config.vocab_size
    tensors = {"wte.weight": np.asarray(model.embed)[:v]}
    for name, get in TENSORS.items():
        array = np.asarray(get(model))
        if name.startswith("h.*."):
            tensors.update({name.replace("*", str(i)): array[i] for i in range(model.config.n_layers)})
        else:
            tensors[name] = array
    if model.head is not None:
        tensors["lm_head.weight"] = np.asarray(model.head.weight)[:, :v].T
    diverged = next((k for k, a in tensors.items() if not np.isfinite(a).all()), None)
    if diverged is not None:
        raise GPT2FormatError(
            f"save_gpt2: the model's {diverged} holds NaN or infinite values (the training diverged); "
            f"save an earlier checkpoint (nothing was written)"
        )
    data = save({("" if k == "lm_head.weight" else "transformer.") + k: np.ascontiguousarray(a, np.float32)
                 for k, a in tensors.items()}, metadata={"format": "pt"})  # fmt: skip
    write_files(
        directory, {WEIGHTS_NAME: data, CONFIG_NAME: (json.dumps(config_dict, indent=2) + "\n").encode()}
    )
    return directory


def gpt2_identity(directory: str | Path) -> dict:
    """What identifies a GPT-2 folder's weights: its path and each file's size and sha256
    (`config.json` and every `.safetensors`), as a LoRA run records its frozen base."""
    directory = Path(directory).resolve()  # read back from any working directory
    files = {}
    for path in sorted([directory / CONFIG_NAME, *directory.glob("*.safetensors")]):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        files[path.name] = {"size": path.stat().st_size, "sha256": digest.hexdigest()}
    return {"path": str(directory), "files": files}


def gpt2_changed(recorded: dict) -> str | None:
    """None if the folder `recorded` (a `gpt2_identity`) names still holds the same files, else
    what happened to it ("is gone", "has changed since ...")."""
    try:
        now = gpt2_identity(Path(str(recorded.get("path"))))["files"]
    except OSError:
        return "is gone"
    if now != recorded.get("files"):
        return "has changed since the run started (its files' sha256 differ)"
    return None
