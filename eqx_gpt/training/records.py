"""A run's records, typed by kind: what `metrics.jsonl` holds, one JSON object per line, and what
`TrainResult.history` and the callbacks (`callbacks.py`) are given.

    StepRecord        every optimiser step: the step's figures by name (`loss`, `grad_norm`, and
                      any the step adds: `step.step_figures`), the learning rate and tokens/s;
                      metrics.jsonl holds every `log_interval`-th and the last
    EvaluationRecord  each periodic evaluation: its figures by name (`train_loss`, `val_loss`:
                      `evaluate.evaluate_run`) and the time since the run started
    FinalRecord       the final validation, last: its figures (`final_val_loss`) and what it read

Every kind holds its figures alike, `figures` by name, a callback's own among them
(`RunView.log`). Figures travel by name, so a new one is added where it is computed and nowhere
here. And what `train` returns: `TrainResult`, whose `history` holds the records.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from eqx_gpt.tokenizer import Tokenizer

# The keys of each kind of record in metrics.jsonl that are not its figures.
STEP_KEYS = ("step", "lr", "tokens_per_s")
EVALUATION_KEYS = ("step", "elapsed_s")
FINAL_KEYS = ("step", "val_tokens", "whole_split")
# What no figure may be named: the keys of metrics.jsonl besides figures, and the figures that tell
# one kind of record from another (`record_from_dict`).
RESERVED_KEYS = frozenset({*STEP_KEYS, *EVALUATION_KEYS, *FINAL_KEYS, "loss", "val_loss", "final_val_loss"})


@dataclass(frozen=True)
class StepRecord:
    """One optimiser step, 1-based: `figures` by name (`loss` first, then `grad_norm`, the global
    norm of the gradient before clipping), the learning rate it ran at, and tokens/s as measured
    when its figures were read."""

    step: int
    figures: Mapping[str, float]
    lr: float
    tokens_per_s: float

    @property
    def loss(self) -> float:
        """The mean next-token loss (nats) of the step's batch, before its update."""
        return self.figures["loss"]

    def with_figures(self, figures: Mapping[str, float]) -> "StepRecord":
        """The record with `figures` added (a callback's own)."""
        return replace(self, figures={**self.figures, **figures}) if figures else self

    def to_dict(self) -> dict[str, Any]:
        """The line of `metrics.jsonl`: `{"step", "loss", "grad_norm", ..., "lr", "tokens_per_s"}`."""
        return {"step": self.step, **self.figures, "lr": self.lr, "tokens_per_s": self.tokens_per_s}


@dataclass(frozen=True)
class EvaluationRecord:
    """A periodic evaluation after `step` steps: `figures` by name (`train_loss` on fixed training
    windows, `val_loss`, the one that picks the best checkpoint), and seconds since the run started."""

    step: int
    figures: Mapping[str, float]
    elapsed_s: float

    @property
    def val_loss(self) -> float:
        return self.figures["val_loss"]

    @property
    def train_loss(self) -> float:
        return self.figures["train_loss"]

    def with_figures(self, figures: Mapping[str, float]) -> "EvaluationRecord":
        """The record with `figures` added (a callback's own)."""
        return replace(self, figures={**self.figures, **figures}) if figures else self

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, **self.figures, "elapsed_s": self.elapsed_s}


@dataclass(frozen=True)
class FinalRecord:
    """The final validation of the model at `step`: `figures` by name (`final_val_loss`, its loss
    over `val_tokens` predicted tokens), the whole validation split (`whole_split`) or an even
    sample of its windows."""

    step: int
    figures: Mapping[str, float]
    val_tokens: int
    whole_split: bool

    @property
    def final_val_loss(self) -> float:
        return self.figures["final_val_loss"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            **self.figures,
            "val_tokens": self.val_tokens,
            "whole_split": self.whole_split,
        }


Record = StepRecord | EvaluationRecord | FinalRecord


def record_from_dict(d: Mapping[str, Any]) -> Record:
    """The typed record of a line of `metrics.jsonl` (an older run's too, whose steps have no
    `grad_norm`): a final validation has `final_val_loss`, an evaluation `val_loss`, a step the rest."""
    if "final_val_loss" in d:
        figures = {k: v for k, v in d.items() if k not in FINAL_KEYS}
        return FinalRecord(d["step"], figures, d.get("val_tokens", 0), d.get("whole_split", True))
    if "val_loss" in d:
        figures = {k: v for k, v in d.items() if k not in EVALUATION_KEYS}
        return EvaluationRecord(d["step"], figures, d.get("elapsed_s", math.nan))
    figures = {k: v for k, v in d.items() if k not in STEP_KEYS}
    return StepRecord(d["step"], figures, d.get("lr", math.nan), d.get("tokens_per_s", math.nan))


@dataclass(frozen=True)
class TrainResult:
    """What `train` returns: the model as the run ended, its tokenizer, and the run's figures.

    `model` holds the LAST step's weights, not the best: the weights of the lowest periodic
    validation loss (`best_val_loss`) are the `best` checkpoint, `load_model(out_dir, kind="GPT")`.

    `history` holds the records of the whole run, in order, as `metrics.jsonl` holds them (a
    resumed run's too, read back from the file): a `StepRecord` every `log_interval` steps and at
    the last step, an `EvaluationRecord` at each evaluation, and the `FinalRecord` last, if the run
    finished. Every step's figures, logged or not, go to `Callback.on_step`.
    """

    # The last step's weights: a GPT, or a model of one's own (the best: `load_model(out_dir)`, with
    # `like=` for a model passed to `train(model=...)`).
    model: Any
    tokenizer: Tokenizer
    step: int  # optimiser steps done
    val_loss: float | None  # the final validation's loss (interrupted: the last evaluation's)
    best_val_loss: float | None  # the lowest periodic validation loss, the `best` checkpoint's
    elapsed_s: float
    interrupted: bool  # stopped (Ctrl-C, SIGTERM, a callback); `train(out_dir=..., resume=True)` resumes
    sample: str | None  # a short sample from the best checkpoint (None when interrupted, or none asked)
    out_dir: Path
    history: tuple[Record, ...] = ()
