"""The end of a run: `finish` (the final validation, a sample, the summary) when it reached its
schedule's end, `interrupted` (a checkpoint and how to resume) when it was asked to stop; either
way a `TrainResult`."""

import math

from eqx_gpt.checkpoint import BEST, LATEST, checkpoint_file, load_model
from eqx_gpt.evaluation import Shown
from eqx_gpt.model.gpt import GPT
from eqx_gpt.training.evaluate import final_validation
from eqx_gpt.training.records import FinalRecord
from eqx_gpt.training.report import sample_text
from eqx_gpt.training.result import TrainResult
from eqx_gpt.training.running import Run
from eqx_gpt.training.saving import save


def result(run: Run, *, val_loss: float | None, interrupted: bool, sample: str | None) -> TrainResult:
    """The run's `TrainResult`, its history every record of `metrics.jsonl`."""
    state = run.state
    return TrainResult(
        state.model, run.setup.tokenizer, state.step, val_loss=val_loss,
        best_val_loss=None if math.isinf(state.best_val) else state.best_val, elapsed_s=run.report.elapsed(),
        interrupted=interrupted, sample=sample, out_dir=run.setup.out_dir, history=run.report.history(),
    )  # fmt: skip


def interrupted(run: Run) -> TrainResult:
    """Ctrl-C, SIGTERM or a callback's stop: log the step reached, checkpoint it, say how to resume."""
    report, state, out_dir = run.report, run.state, run.setup.out_dir
    report.record_last_read()
    if state.last_saved is None or state.step > state.last_saved:
        save(run, LATEST)
    report.log(
        f"interrupted at step {state.step}; saved {checkpoint_file(out_dir, LATEST)}. Resume with: "
        f"{run.resume_with(out_dir)}"
    )
    val = state.last_eval[1] if state.last_eval is not None else None
    return result(run, val_loss=val, interrupted=True, sample=None)


def finish(run: Run, sample_tokens: int) -> TrainResult:
    """The end of a run that reached its schedule's end: the final model's loss over the whole
    validation split in overlapping windows (the figure to quote; `final_validation`), a sample
    from the best checkpoint, the summary. A stop during the final validation skips it and the
    sample: the checkpoints are complete."""
    setup, state, report = run.setup, run.state, run.report
    assert state.last_eval is not None  # the loop evaluates at the schedule's end
    t0, val = report.now(), state.last_eval[1]
    shown = Shown(report.bar, "final validation")
    final, covers = final_validation(run.evaluations, state.model, val, run.plan, t0, run.stopping, shown)
    if final is None:
        report.log(
            f"interrupted during the final validation; the run is complete at step {state.step} (periodic "
            f"val loss {val:.4f}). The final figure: uv run evaluate.py --checkpoint "
            f"{checkpoint_file(setup.out_dir, LATEST)}"
        )
        return result(run, val_loss=val, interrupted=True, sample=None)
    report.record_final(FinalRecord(state.step, final.loss, final.n_predicted, final.whole))
    report.log(f"final validation: loss {final.loss:.4f} {covers} in {report.now() - t0:.1f} s")
    sample = None
    if sample_tokens > 0 and not run.stopping():
        has_best = checkpoint_file(setup.out_dir, BEST).exists()
        best = load_model(setup.out_dir, kind="GPT")[0] if has_best else state.model
        assert isinstance(best, GPT)  # kind="GPT" refuses another model
        sample = sample_text(best, setup.tokenizer, sample_tokens, seed=setup.config.seed)
    report.log(
        f"done: step {state.step}, final val loss {final.loss:.4f} (periodic {val:.4f}, best "
        f"{state.best_val:.4f}) in {report.elapsed() / 60:.1f} min; checkpoints in {setup.out_dir}/"
    )
    if sample is not None:
        report.log(f"sample (best checkpoint, temperature 0.8):\n{sample}")
        report.record_sample(state.step, sample)
    return result(run, val_loss=final.loss, interrupted=False, sample=sample)
