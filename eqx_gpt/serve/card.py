"""The model card the page shows: the model's config and parameter count, and for a run folder its
final validation loss and loss curve, read from the run's `metrics.jsonl`."""

import json
import math
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.serve.inspect import AttentionLayout, attention_layout

METRICS_NAME = "metrics.jsonl"


def parameter_count(model: Decoder) -> int:
    """Numbers in the model's arrays (the padded vocabulary rows included)."""
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def _finite(value) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def loss_records(run_dir: Path) -> list[dict]:
    """The JSON records of `run_dir/metrics.jsonl` (none if it is missing; bad lines are skipped)."""
    path = run_dir / METRICS_NAME
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def model_config(model: Decoder) -> dict[str, Any]:
    """A model's config as a dict (`config.to_dict()`); for a decoder of your own without one, its
    class and the sizes the `Decoder` protocol gives."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()  # type: ignore[union-attr]
    return {
        "class": type(model).__name__,
        "context_length": model.context_length,
        "vocab_size": model.vocab_size,
    }


def run_losses(meta: dict) -> dict[str, Any]:
    """The training and validation losses by step (`curve`) and the final validation loss of the run
    whose checkpoint `meta` describes, read from its `metrics.jsonl` now (a run in progress: so far)."""
    path = Path(meta.get("path", "."))
    records = loss_records(path if path.is_dir() else path.parent)
    finals = [r for r in records if _finite(r.get("final_val_loss")) is not None]
    curve = lambda key: [[r["step"], _finite(r[key])] for r in records if _finite(r.get(key)) is not None]
    return {
        "final_val_loss": finals[-1]["final_val_loss"] if finals else _finite(meta.get("best_val_loss")),
        "curve": {"train": curve("loss"), "val": curve("val_loss")},
    }


def model_card(
    model: Decoder,
    meta: dict,
    name: str,
    layout: AttentionLayout | None = None,
    adapters: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """`name`, the names of the LoRA `adapters` served beside it (each a `model` a request may
    name), the config, the parameter count, where the weights came from, the attention layers the
    page can draw (`layout`, found by type when not given), and (for a run) the training and
    validation losses by step with the final validation loss (`run_losses`)."""
    layout = attention_layout(model) if layout is None else layout
    return {
        "name": name,
        "adapters": list(adapters),
        "source": meta.get("format", "eqx_gpt-checkpoint"),
        "step": meta.get("step"),
        "config": model_config(model),
        "parameters": parameter_count(model),
        "attention": {"layers": layout.n_layers, "heads": layout.n_heads, "absent": layout.absent},
        **run_losses(meta),
    }
