"""A run's checkpoints: `latest` at each evaluation (and when it stops), `best` at each new lowest
validation loss (files named and written atomically by `eqx_gpt.checkpoint`)."""

import math

from eqx_gpt.checkpoint import LATEST, checkpoint_file, save_checkpoint
from eqx_gpt.training.running import Run


def save(run: Run, name: str) -> None:
    """Write checkpoint `name` (`LATEST` or `BEST`) of the run at its current step, then tell the
    callbacks."""
    setup, state = run.setup, run.state
    val_step, val_loss = state.last_eval if state.last_eval is not None else (None, None)
    run.report.flush()  # the trackers hold every record up to the checkpoint, whatever kills the run
    path = save_checkpoint(
        setup.out_dir, name, state.model, state.opt_state, step=state.step, tokenizer=setup.tokenizer,
        train_config=setup.config.to_dict(), val_loss=val_loss, val_loss_step=val_step,
        best_val_loss=None if math.isinf(state.best_val) else state.best_val,
        schedule_steps=state.schedule_steps, **setup.checkpoint_meta,
    )  # fmt: skip
    if name == LATEST:
        state.last_saved = state.step
    run.report.callbacks.on_checkpoint(name, path, state.step)


def last_good(run: Run) -> str:
    """Which checkpoint a run that failed can resume from, for its error message."""
    latest, saved = checkpoint_file(run.setup.out_dir, LATEST), run.state.last_saved
    return f"Last good checkpoint: {f'{latest} (step {saved})' if saved is not None else 'none'}"
