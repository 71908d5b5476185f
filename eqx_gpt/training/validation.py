"""A run's evaluations: the train loss on fixed training windows, the validation loss on the
periodic windows (the whole split when `--eval-tokens` covers it), and the final validation.

Each is a loop of jitted calls (`evaluate.summed_loss`) that returns None as soon as the run is
asked to stop, so Ctrl-C never waits for a whole split.
"""

from collections.abc import Callable

import numpy as np

from eqx_gpt.model.gpt import GPT
from eqx_gpt.training.evaluate import (
    FINAL_EVAL_FACTOR,
    Evaluation,
    Windows,
    evaluate_windows,
    summed_loss,
    windows_per_call,
)
from eqx_gpt.training.parallel import shard_batch
from eqx_gpt.training.setup import RunSetup
from eqx_gpt.training.time_plan import TimePlan


def _place(setup: RunSetup):
    """Puts one evaluation call's rows on the devices, split along the batch axis."""
    return lambda x: shard_batch(x, setup.mesh, batch_axis=0)


def _eval_batch(setup: RunSetup) -> int:
    """Windows per evaluation call: `windows_per_call`, rounded up to whole windows per device."""
    per_call = windows_per_call(setup.model_config.context_length, setup.model_config.vocab_size)
    return -(-per_call // setup.mesh.size) * setup.mesh.size


def validation_loss(
    setup: RunSetup, model: GPT, windows: Windows, stop: Callable[[], bool]
) -> Evaluation | None:
    """The loss over `windows` of the validation split (`evaluate_windows`); None if the run was
    asked to stop meanwhile."""
    return evaluate_windows(
        model, setup.val_ids, windows, place=_place(setup), batch=_eval_batch(setup), stop=stop
    )


def train_loss(setup: RunSetup, model: GPT, stop: Callable[[], bool]) -> float | None:
    """The mean loss over the run's fixed training windows (the same program as `validation_loss`)."""
    rows = setup.eval_train_rows
    weight = np.ones((len(rows), rows.shape[1] - 1), np.float32)
    total = summed_loss(model, rows, weight, batch=_eval_batch(setup), place=_place(setup), stop=stop)
    return None if total is None else total / weight.size


def final_evaluations(setup: RunSetup) -> float:
    """The final validation's cost in periodic evaluations: what the time plan keeps back for it."""
    return setup.val_windows(final=True).starts.size / setup.val_windows(final=False).starts.size


def final_validation(
    setup: RunSetup, model: GPT, last_val: float, plan: TimePlan, now: float, stop: Callable[[], bool]
) -> tuple[Evaluation | None, str]:
    """The final model's validation loss and what it covers: the whole split in overlapping
    windows where `--eval-tokens` and the time plan allow, else an even sample of windows, or, with
    no time left for it, the last evaluation's figure. None if a stop came meanwhile."""
    context, n = setup.model_config.context_length, len(setup.val_ids)
    if not plan.affords(now, plan.final_evals):
        periodic = setup.val_windows(final=False)
        last = Evaluation(last_val, periodic.n_predicted, periodic.stride, periodic.whole)
        return last, (
            f"(the last evaluation's, over {last.n_predicted:,} predicted tokens: the final validation "
            f"would not fit in the time left)"
        )
    windows = setup.val_windows(final=True)
    final = validation_loss(setup, model, windows, stop)
    if final is None or final.whole:
        covers = f"over all {windows.n_predicted:,} predicted tokens of the split"
        return final, f"{covers} (windows of {context} every {windows.stride})"
    return final, (
        f"estimated over {final.n_predicted:,} of the split's {n:,} tokens ({len(windows):,} evenly "
        f"spread windows of {context}; the whole split is over {FINAL_EVAL_FACTOR}x --eval-tokens)"
    )
