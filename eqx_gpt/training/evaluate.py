"""A run's evaluations, built on `eqx_gpt.evaluation`: at each periodic evaluation the train loss on
fixed training windows and the validation loss on the periodic plan (the whole split when
`--eval-tokens` covers it); at the end, the final validation.

`evaluate_run` returns its figures by name (`{"train_loss": ..., "val_loss": ...}`): the loop, the
metrics log and the log line take whatever it returns, so a new figure is added here alone. Each
evaluation is a loop of jitted calls that returns None as soon as the run is asked to stop, so
Ctrl-C never waits for a whole split. Given a `Shown` (the run's progress bar and a label), an
evaluation that takes more than a moment shows its progress and ETA there. What an evaluation
reads, and how it is split into calls and placed on the devices, is planned once per run
(`plan_evaluations`).
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.evaluation import (
    FINAL_EVAL_FACTOR,
    EvalPlan,
    Evaluation,
    Shown,
    evaluate_plan,
    final_plan,
    periodic_plan,
    rows_per_call,
    summed_loss,
)
from eqx_gpt.model.language_model import LanguageModel
from eqx_gpt.training.parallel import shard_batch
from eqx_gpt.training.setup import RunSetup
from eqx_gpt.training.time_plan import TimePlan, eval_budget


def val_plan(setup: RunSetup, *, final: bool) -> EvalPlan:
    """The validation windows a periodic (or the final) evaluation reads, within `--eval-tokens`."""
    choose = final_plan if final else periodic_plan
    budget = eval_budget(setup.config.eval_tokens, setup.model_config)  # fewer tokens for a costlier head
    return choose(len(setup.val_ids), setup.model_config.context_length, budget)


@dataclass(frozen=True)
class RunEvaluations:
    """What a run's evaluations read and how, decided once per run (`plan_evaluations`): the fixed
    training windows and their weights, the periodic and final validation plans, the windows per
    jitted call (`rows_per_call`, rounded up to whole windows per device) and how a call's rows
    are placed on the devices (split along the batch axis)."""

    val_ids: TokenSpan
    train_rows: np.ndarray
    train_weight: np.ndarray
    periodic: EvalPlan
    final: EvalPlan
    batch: int
    place: Callable[[np.ndarray], object]
    context: int


def plan_evaluations(setup: RunSetup) -> RunEvaluations:
    """The run's evaluations, planned from its set-up."""
    per_call = rows_per_call(setup.model_config.context_length, setup.model_config.vocab_size)
    rows, mesh = setup.eval_train_rows, setup.mesh
    weight = np.ones((len(rows), rows.shape[1] - 1), np.float32)
    return RunEvaluations(
        val_ids=setup.val_ids, train_rows=rows, train_weight=weight,
        periodic=val_plan(setup, final=False), final=val_plan(setup, final=True),
        batch=-(-per_call // mesh.size) * mesh.size, place=lambda x: shard_batch(x, mesh, batch_axis=0),
        context=setup.model_config.context_length,
    )  # fmt: skip


def _part(shown: Shown | None, part: str) -> Shown | None:
    return None if shown is None else Shown(shown.bar, f"{shown.label}, {part}")


def validation_loss(
    evals: RunEvaluations,
    model: LanguageModel,
    plan: EvalPlan,
    stop: Callable[[], bool],
    shown: Shown | None = None,
) -> Evaluation | None:
    """The loss over `plan`'s windows of the validation split; None if the run was asked to stop."""
    return evaluate_plan(
        model, evals.val_ids, plan, place=evals.place, batch=evals.batch, stop=stop, shown=shown
    )


def train_loss(
    evals: RunEvaluations, model: LanguageModel, stop: Callable[[], bool], shown: Shown | None = None
) -> float | None:
    """The mean loss over the run's fixed training windows (the same program as `validation_loss`)."""
    total = summed_loss(
        model, evals.train_rows, evals.train_weight, batch=evals.batch, place=evals.place, stop=stop,
        shown=shown,
    )  # fmt: skip
    return None if total is None else total / evals.train_weight.size


def evaluate_run(
    evals: RunEvaluations, model: LanguageModel, stop: Callable[[], bool], shown: Shown | None = None
) -> dict[str, float] | None:
    """A periodic evaluation's figures by name, `train_loss` then `val_loss` (the one that picks the
    best checkpoint); None if the run was asked to stop before it finished. Its progress shows on
    `shown` (labelled `train windows`, then `validation`) if it takes a while."""
    train = train_loss(evals, model, stop, _part(shown, "train windows"))
    val = (
        validation_loss(evals, model, evals.periodic, stop, _part(shown, "validation"))
        if train is not None
        else None
    )
    if train is None or val is None:
        return None
    return {"train_loss": train, "val_loss": val.loss}


def final_evaluations(evals: RunEvaluations) -> float:
    """The final validation's cost in periodic evaluations, each of which reads the fixed training
    windows and then the validation windows: what the time plan keeps back for it."""
    return evals.final.starts.size / (evals.periodic.starts.size + len(evals.train_rows))


def final_validation(
    evals: RunEvaluations,
    model: LanguageModel,
    last_val: float,
    plan: TimePlan,
    now: float,
    stop: Callable[[], bool],
    shown: Shown | None = None,
) -> tuple[Evaluation | None, str]:
    """The final model's validation loss and what it covers: the whole split in overlapping
    windows where `--eval-tokens` and the time plan allow, else an even sample of windows, or, with
    no time left for it, the last evaluation's figure. None if a stop came meanwhile."""
    context, n, periodic, split_plan = evals.context, len(evals.val_ids), evals.periodic, evals.final
    if not plan.affords_final(now):
        last = Evaluation(last_val, periodic.n_predicted, periodic.stride, periodic.whole)
        return last, (
            f"(the last evaluation's, over {last.n_predicted:,} predicted tokens: the final validation "
            f"would not fit in the time left)"
        )
    final = validation_loss(evals, model, split_plan, stop, shown)
    if final is None or final.whole:
        covers = f"over all {split_plan.n_predicted:,} predicted tokens of the split"
        return final, f"{covers} (windows of {context} every {split_plan.stride})"
    return final, (
        f"estimated over {final.n_predicted:,} of the split's {n:,} tokens ({len(split_plan):,} evenly "
        f"spread windows of {context}; the whole split is over {FINAL_EVAL_FACTOR}x --eval-tokens)"
    )
