"""What `train` returns: `TrainResult`."""

from dataclasses import dataclass
from pathlib import Path

from eqx_gpt.model.gpt import GPT
from eqx_gpt.tokenizer import Tokenizer
from eqx_gpt.training.records import Record


@dataclass(frozen=True)
class TrainResult:
    """What `train` returns: the model as the run ended (the final step's weights; the best
    checkpoint is `load_model(out_dir)`), its tokenizer, and the run's figures.

    `history` holds the records of the whole run, in order, as `metrics.jsonl` holds them (a
    resumed run's too, read back from the file): a `StepRecord` every `log_interval` steps and at
    the last step, an `EvaluationRecord` at each evaluation, and the `FinalRecord` last, if the run
    finished. Every step's figures, logged or not, go to `Callback.on_step`.
    """

    model: GPT
    tokenizer: Tokenizer
    step: int  # optimiser steps done
    val_loss: float | None  # the final validation's loss (interrupted: the last evaluation's)
    best_val_loss: float | None  # the lowest periodic validation loss, the `best` checkpoint's
    elapsed_s: float
    interrupted: bool  # stopped (Ctrl-C, SIGTERM, a callback); `train(out_dir=..., resume=True)` resumes
    sample: str | None  # a short sample from the best checkpoint (None when interrupted, or none asked)
    out_dir: Path
    history: tuple[Record, ...] = ()
