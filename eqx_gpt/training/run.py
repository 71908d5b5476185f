"""A training run, start to end: `train(config, model, ..., callbacks=...)`.

    out_dir/metrics.jsonl    one JSON object per line (`records.py`): {"step", "loss", "grad_norm",
                             "lr", "tokens_per_s"} for logged steps, {"step", "train_loss",
                             "val_loss", "elapsed_s"} at evaluations, and the final validation last
    out_dir/loss.png         train and validation curves, redrawn at each evaluation, and the
                             final validation's point
    out_dir/tensorboard/     with `tracker="tensorboard"`: the records of metrics.jsonl as event
                             files (`eqx_gpt.trackers`); `tracker="wandb"` writes out_dir/wandb/
    out_dir/<LATEST> ...     the checkpoint of the last evaluation (or interruption)
    out_dir/<BEST> ...       the checkpoint with the lowest validation loss so far
                             (files named by `checkpoint.py`)

Read it top to bottom: `train` resolves the settings (`options.py`), locks and checks the folder
(`run_dir.py`), sets up (`setup.py`: every check, nothing written), claims the folder, says what
it runs, then hands the run to the loop (`loop.py`), which reports through `report.py` (and the
callbacks, `callbacks.py`), checkpoints through `saving.py` and ends in `end.py`.
"""

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from eqx_gpt.checkpoint import LATEST, checkpoint_file, delete_checkpoints, read_metadata
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.trackers import TENSORBOARD_DIR, Trackers, open_trackers, require_trackers
from eqx_gpt.training.arguments import check_train_arguments, resume_in_python
from eqx_gpt.training.callbacks import Callback, Callbacks
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.evaluate import final_evaluations, plan_evaluations
from eqx_gpt.training.loop import train_loop
from eqx_gpt.training.options import (
    MODEL_FIELDS,
    TRAIN_FIELDS,
    RunOptions,
    check_printable,
    given_settings,
    resolve_options,
)
from eqx_gpt.training.report import Progress, Report
from eqx_gpt.training.result import TrainResult
from eqx_gpt.training.run_dir import (
    METRICS_NAME,
    Metrics,
    RunDirLock,
    check_run_dir,
    kept_records,
)
from eqx_gpt.training.running import Run
from eqx_gpt.training.setup import RunSetup, TrainState, set_up
from eqx_gpt.training.step import describe_optimizer
from eqx_gpt.training.stop import StopFlag
from eqx_gpt.training.time_plan import TimePlan

AUTO = (
    "auto"  # `train(preset=AUTO)`: `cpu`, `finetune-shakespeare` with `init_from`, on resume the checkpoint's
)


def train(
    config: TrainConfig | None = None,
    model: GPTConfig | None = None,
    *,
    preset: str | None = AUTO,
    out_dir: str | Path = "out",
    resume: bool = False,
    overwrite: bool = False,
    sample_tokens: int = 300,
    log: Callable[[str], None] = print,
    progress: bool = True,
    now: Callable[[], float] = time.monotonic,
    callbacks: Sequence[Callback] = (),
    **options: object,
) -> TrainResult:
    """Train a GPT in `out_dir` and return it, its tokenizer and the run's figures.

    Where each setting comes from: the dataclass defaults, then the preset, then what is passed.
    `preset` is a name of `PRESETS`, None for the defaults alone, or `AUTO` (`cpu`, or
    `finetune-shakespeare` with `init_from`). A config passed gives the fields it was constructed
    with, which override the preset's: `train(TrainConfig(max_steps=40))` is the `cpu` preset's
    recipe for 40 steps, as `train(max_steps=40)` is (pass `preset=None` for the dataclass defaults
    under it). `model` likewise gives the model fields it was constructed with (its `vocab_size` is
    not read: the tokenizer's is). `options` are single settings by name, any `TrainConfig` field or
    `GPTConfig` field but `vocab_size`, and override both. The run's first lines name the preset
    and every setting given that changed it.

    A folder that already holds a run is refused unless `resume` (continue it with the
    checkpoint's settings; what is passed anew must agree with them, but for how long and how
    often it reports) or `overwrite` (delete it first). A folder in use by a live run is refused.
    Bad input raises an `EqxGptError` (a `ValueError`) with a one-line message; a setting of the
    wrong name raises `TypeError`. Ctrl-C or SIGTERM, or a callback raising `StopTraining`, saves a
    checkpoint and returns with `interrupted`. `callbacks` (`Callback`s) are told of every step,
    evaluation and checkpoint, and of the result. `now` is the clock that `max_minutes` is
    measured by (tests pass a simulated one).
    """
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if model is not None and not isinstance(model, GPTConfig):
        raise TypeError(f"model must be a GPTConfig, got {type(model).__name__}")
    unknown = sorted(set(options) - {*MODEL_FIELDS, *TRAIN_FIELDS})
    if unknown:
        raise TypeError(
            f"train() got unknown setting(s) {unknown}; settings are TrainConfig fields and GPTConfig "
            f"fields but vocab_size"
        )
    settings = given_settings(config, model, options)
    if preset != AUTO:
        settings["preset"] = preset
    return _train(
        settings, out_dir, resume=resume, overwrite=overwrite, sample_tokens=sample_tokens, log=log,
        progress=progress, now=now, callbacks=callbacks, resume_with=resume_in_python,
    )  # fmt: skip


def _train(
    settings: dict,
    out_dir: str | Path,
    *,
    resume: bool,
    overwrite: bool,
    sample_tokens: int,
    log: Callable[[str], None],
    progress: bool,
    now: Callable[[], float],
    callbacks: Sequence[Callback] = (),
    resume_with: Callable[[Path], str] = resume_in_python,
) -> TrainResult:
    """`train` with its settings by name (`options.resolve_options`) and its arguments checked
    (`check_train_arguments`); `resume_with` says how the caller resumes an interrupted run
    (`train.py` calls this with its command line's)."""
    out_dir = check_train_arguments(
        out_dir=out_dir, resume=resume, overwrite=overwrite, sample_tokens=sample_tokens, log=log,
        progress=progress, now=now,
    )  # fmt: skip
    t_start = now()
    if log is print:  # a path its lines cannot print: refused now, not at the line that names it
        check_printable({"out_dir": out_dir, **{k: settings.get(k) for k in ("data", "init_from")}})
    stop = StopFlag()
    told = Callbacks(callbacks, request_stop=stop.request, log=log)  # checked before anything is written
    options = None if resume else resolve_options(settings)  # a fresh run's settings, checked first
    if options is not None:  # a missing extra is refused before anything is written
        require_trackers(options.trackers)
    with RunDirLock(out_dir) as lock:
        check_run_dir(out_dir, resume=resume, overwrite=overwrite)
        records = []
        if resume:  # the checkpoint's metadata, and the settings laid over it
            meta = read_metadata(checkpoint_file(out_dir, LATEST))
            options = resolve_options(settings, meta)
            require_trackers(options.trackers)
            records = kept_records(out_dir / METRICS_NAME, meta["step"])
        assert options is not None
        setup, state = set_up(options, out_dir, log=log)
        # Every check has passed: from here on the folder is this run's.
        stale = lock.claim()
        if stale:
            log(f"took over {out_dir}/ from a run that is no longer running ({stale})")
        if overwrite and not resume:
            log(f"--overwrite: deleting the run in {out_dir}/ and starting afresh")
            delete_checkpoints(out_dir)
        evaluations = plan_evaluations(setup)
        plan = TimePlan(
            setup.config.max_minutes, setup.config.max_steps, t_start,
            final_evals=final_evaluations(evaluations), sample=sample_tokens > 0,
        )  # fmt: skip
        # Closed in reverse: the trackers last, marked failed if the run raised (not on Ctrl-C).
        with (
            _open_trackers(setup, options.trackers, records) as trackers,
            Report(
                log, Metrics(out_dir / METRICS_NAME, records), Progress(enabled=progress), now, t_start,
                tokens_per_step=setup.tokens_per_step, log_interval=setup.config.log_interval,
                plot=out_dir / "loss.png", trackers=trackers, callbacks=told,
            ) as report,
        ):  # fmt: skip
            _describe_start(report, options, setup, state)
            with stop:
                run = Run(setup, state, report, plan, evaluations, stopping=stop, resume_with=resume_with)
                result = train_loop(run, sample_tokens)
    told.on_end(result)
    return result


def _open_trackers(setup: RunSetup, names: tuple[str, ...], records: list[dict]) -> Trackers:
    """The run's `--tracker`s `names`, given its resolved settings; only the first JAX process
    writes. A resumed run continues the tracker run from its checkpoint's step, after the `records`
    it kept."""
    config = {
        **setup.model_config.to_dict(), **setup.config.to_dict(),
        "preset": setup.checkpoint_meta.get("preset"), "n_params": setup.checkpoint_meta["n_params"],
    }  # fmt: skip
    return open_trackers(
        names, setup.out_dir, config=config,
        resume_step=setup.start if setup.resumed_from is not None else None,
        is_writer=jax.process_index() == 0, history=records,
    )  # fmt: skip


def _describe_start(report: Report, options: RunOptions, setup: RunSetup, state: TrainState) -> None:
    """The lines a run starts with: what it trains, from which settings, how, for how long, and from where."""
    c, m, preset = setup.config, setup.model_config, setup.checkpoint_meta.get("preset")
    report.log(
        f"model: {setup.checkpoint_meta['n_params'] / 1e6:.2f}M parameters, {m.n_layers} layers, d_model "
        f"{m.d_model}, {m.n_heads} heads, context {m.context_length}; batch {c.batch_size} "
        f"({setup.tokens_per_step:,} tokens/step) on {setup.mesh.size} {jax.devices()[0].platform} "
        f"device{'s' if setup.mesh.size > 1 else ''}" + (f"; preset {preset}" if preset else "")
    )
    report.log(options.describe())
    report.log(f"schedule: {describe_optimizer(c, state.schedule_steps)}")
    if c.max_minutes:
        report.log(f"time limit: {c.max_minutes:g} min; the schedule is refitted to the steps that fit")
    if setup.resumed_from is not None:
        report.log(f"resuming {setup.resumed_from} at step {setup.start}")
    if options.trackers:  # where to look (only the first process writes them)
        where = {"tensorboard": f"tensorboard --logdir {setup.out_dir / TENSORBOARD_DIR}",
                 "wandb": f"W&B run in {setup.out_dir / 'wandb'}"}  # fmt: skip
        report.log("trackers: " + "; ".join(where[name] for name in options.trackers))
