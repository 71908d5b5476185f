"""The model card the page shows: the model's config and parameter count, and for a run folder its
final validation loss and loss curve, read from the run's `metrics.jsonl`."""

import json
import math
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from eqx_gpt.model.gpt import GPT

METRICS_NAME = "metrics.jsonl"


def parameter_count(model: GPT) -> int:
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


def model_card(model: GPT, meta: dict, name: str) -> dict[str, Any]:
    """`name`, the config, the parameter count, where the weights came from, and (for a run) the
    training and validation losses by step with the final validation loss."""
    path = Path(meta.get("path", "."))
    records = loss_records(path if path.is_dir() else path.parent)
    finals = [r for r in records if _finite(r.get("final_val_loss")) is not None]
    curve = lambda key: [[r["step"], _finite(r[key])] for r in records if _finite(r.get(key)) is not None]
    return {
        "name": name,
        "source": meta.get("format", "eqx_gpt-checkpoint"),
        "step": meta.get("step"),
        "config": model.config.to_dict(),
        "parameters": parameter_count(model),
        "final_val_loss": finals[-1]["final_val_loss"] if finals else _finite(meta.get("best_val_loss")),
        "curve": {"train": curve("loss"), "val": curve("val_loss")},
    }
