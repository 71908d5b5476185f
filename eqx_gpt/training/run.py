"""A training run: set-up, the loop, evaluation, checkpoints and reports.

`train(...)` runs one training run in a directory `out_dir`:

    out_dir/metrics.jsonl    one JSON object per line: {"step", "loss", "lr", "tokens_per_s"} for
                             logged steps, {"step", "train_loss", "val_loss", "elapsed_s"} at
                             evaluations
    out_dir/loss.png         train and validation curves, redrawn at each evaluation
    out_dir/<LATEST> ...     the checkpoint of the last evaluation (or interruption)
    out_dir/<BEST> ...       the checkpoint with the lowest validation loss so far
                             (files named by `checkpoint.py`)

Read it top to bottom: `start_run` checks everything and builds a `Run` (nothing in `out_dir`
changes until every check has passed); `train` is the loop; the functions between say what
happens at a step, an evaluation and the end. The loop never waits for the accelerator at a step:
losses are read a few steps after they were dispatched, every `log_interval` steps, and at
evaluations.
"""

import collections
import functools
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from eqx_gpt.checkpoint import (
    BEST,
    LATEST,
    CheckpointError,
    checkpoint_file,
    delete_checkpoints,
    load_checkpoint,
    load_model,
    model_template,
    read_metadata,
    save_checkpoint,
)
from eqx_gpt.data.prepare import Corpus
from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.generation.generate import generate
from eqx_gpt.generation.sampling import SamplingOptions
from eqx_gpt.gpt2 import gpt2_tokenizer, load_gpt2, read_gpt2_config
from eqx_gpt.model.config import GPTConfig
from eqx_gpt.model.gpt import GPT
from eqx_gpt.streams import EVAL_TRAIN_BATCHES, INIT, TRAIN_BATCHES, batch_key
from eqx_gpt.tokenizer import Tokenizer, TokenizerError, tokenizer_from_dict
from eqx_gpt.training.batches import fixed_batches, window_starts, windows_reader
from eqx_gpt.training.corpus import BUNDLED, DataError, check_split, load_corpus
from eqx_gpt.training.evaluate import (
    FINAL_EVAL_FACTOR,
    Evaluation,
    Windows,
    evaluate_windows,
    final_windows,
    periodic_windows,
    summed_loss,
    windows_per_call,
)
from eqx_gpt.training.options import INIT_FROM_OPTIONS, OptionsError, RunOptions, resolve_options
from eqx_gpt.training.parallel import (
    check_batch,
    data_mesh,
    replicate,
    shard_batch,
    shard_parameters,
    shard_rows,
)
from eqx_gpt.training.progress import Progress, clock
from eqx_gpt.training.run_dir import (
    METRICS_NAME,
    Metrics,
    RunDirError,
    RunDirLock,
    check_run_dir,
    check_writable,
)
from eqx_gpt.training.schedule import learning_rate
from eqx_gpt.training.time_plan import TimePlan
from eqx_gpt.training.train_config import TrainConfig
from eqx_gpt.training.train_step import (
    count_params,
    describe_optimizer,
    init_optimizer_state,
    make_optimizer,
    make_train_steps,
)
from eqx_gpt.visualize import plot_losses

READ_LAG = 2  # read a logged loss this many steps after dispatching it, so the device never idles
STEPS_PER_CALL = 8  # optimiser steps per dispatch at most (`make_train_steps`): 1.2-1.3x on small models
SECONDS_PER_CALL = 0.5  # fewer steps per call when steps are slower: a stop waits for the call in flight
PLAN_AFTER = 20  # steps timed after compilation before fitting the schedule to max_minutes


class TrainingError(ValueError):
    """A run cannot start or continue (one-line message naming the problem and the fix)."""


# Everything a run can refuse with: one-line messages that name the fix (all `ValueError`s).
RunError = (TrainingError, RunDirError, DataError, CheckpointError, TokenizerError, OptionsError)


@dataclass
class TrainResult:
    step: int
    val_loss: float | None
    best_val_loss: float | None
    elapsed_s: float
    interrupted: bool
    sample: str | None
    out_dir: Path


@dataclass
class Run:
    """Everything the loop reads and updates. Made by `start_run`."""

    config: TrainConfig
    model_config: GPTConfig
    out_dir: Path
    tokenizer: Tokenizer
    train_ids: TokenSpan  # the splits' tokens, read from the shards as needed (`TokenSpan.rows`)
    val_ids: TokenSpan
    mesh: jax.sharding.Mesh
    model: GPT
    opt_state: object
    train_steps: Callable
    eval_train_rows: np.ndarray  # fixed training windows: the train loss at evaluations
    metrics: Metrics
    plan: TimePlan
    checkpoint_meta: dict  # what every checkpoint of the run records besides the step and losses
    log: Callable[[str], None]
    now: Callable[[], float]  # the clock (`time.monotonic`; tests pass a simulated one)
    start: int  # the step the run (or this resumption of it) started from
    step: int  # optimiser steps done
    horizon: int  # the schedule's length: the run ends here
    best_val: float = math.inf
    last_eval: tuple[int, float] | None = None  # (step, val loss) of the latest evaluation
    last_saved: int | None = None  # step of the latest checkpoint
    tokens_per_s: float = 0.0
    last_read: dict | None = None  # the metrics record of the latest step whose loss was read
    last_logged: int | None = None  # the latest step written to metrics.jsonl
    # (steps, losses, lrs) of each dispatched call whose losses have not been read yet
    pending: list = field(default_factory=list)
    read_points: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    stopping: Callable[[], bool] = lambda: False  # true once Ctrl-C or SIGTERM asked the run to stop

    @property
    def tokens_per_step(self) -> int:
        return self.config.batch_size * self.model_config.context_length


# ---------------------------------------------------------------------------------------------
# Set-up: every check first, then the run directory


def optimizer_and_step(config: TrainConfig, *, dropout: bool):
    """`make_optimizer` and `make_train_steps` for `config`, shared by runs whose steps are the same.

    Only the fields the step reads are part of the key, so a resumed run (or a second run in the
    same process, e.g. in tests) reuses the compiled step instead of compiling it again.
    """
    fields = ["grad_accum", "beta1", "beta2", "weight_decay", "grad_clip", "seed", "optimizer"]
    if config.optimizer == "muon":  # the AdamW group's rate is a fraction of the scheduled one
        fields += ["lr", "min_lr", "adam_lr", "adam_weight_decay", "muon_momentum", "muon_ns_steps"]
    return _optimizer_and_step(TrainConfig(**{f: getattr(config, f) for f in fields}), dropout)


@functools.lru_cache(maxsize=8)
def _optimizer_and_step(config: TrainConfig, dropout: bool):
    optimizer = make_optimizer(config)
    return optimizer, make_train_steps(optimizer, config, dropout=dropout)


def _tokenizer_wanted(config: TrainConfig, meta: dict | None, model_options: dict) -> dict:
    """What the corpus is tokenized with: the checkpoint's tokenizer on resume, GPT-2's (of
    --init-from's vocabulary) when fine-tuning, else --tokenizer ('char': the corpus's characters)."""
    if meta is not None:
        return {"kind": "char"} if meta["tokenizer"].get("kind") == "char" else meta["tokenizer"]
    if config.init_from is not None:
        return gpt2_tokenizer(read_gpt2_config(config.init_from, **model_options)).to_dict()
    return {"kind": config.tokenizer}


def _load_corpus(
    config: TrainConfig, meta: dict | None, tokenizer: dict, log: Callable[[str], None]
) -> tuple[Corpus, str, TrainConfig]:
    """`(corpus, source name, config)`: the corpus tokenized (once; later runs open its shards),
    checked against the checkpoint's on resume, and the config with the data path made absolute
    (so a run resumes from anywhere)."""
    corpus = load_corpus(config.data, tokenizer, resumes=meta, log=log, progress=Progress())
    if config.data is not None:
        config = replace(config, data=str(Path(config.data).resolve()))
    return corpus, config.data or BUNDLED, config


def start_run(
    options: RunOptions,
    out_dir: Path,
    *,
    log: Callable[[str], None],
    now: Callable[[], float],
    t_start: float,
) -> Run:
    """Check the data, tokenizer, model and devices, and build the model and optimiser state
    (fresh, or from the checkpoint `options.checkpoint` describes). Reads `out_dir` but writes
    nothing there."""
    model_options, config, meta = options.model, options.train, options.checkpoint
    fine_tune = meta is None and config.init_from is not None
    if fine_tune:  # the shape and the tokenizer are GPT-2's
        config = replace(config, init_from=str(Path(config.init_from).resolve()))
        model_options = {k: v for k, v in model_options.items() if k in INIT_FROM_OPTIONS}
    corpus, source, config = _load_corpus(config, meta, _tokenizer_wanted(config, meta, model_options), log)
    model_config, tokenizer = _model_config_and_tokenizer(model_options, config, corpus, meta)
    train_ids, val_ids = corpus.train, corpus.val
    check_split(train_ids, "train", model_config.context_length, source)
    check_split(val_ids, "validation", model_config.context_length, source)
    mesh = data_mesh()
    try:
        check_batch(mesh, config.batch_size, config.grad_accum)
    except ValueError as e:
        raise TrainingError(str(e)) from None

    optimizer, train_steps = optimizer_and_step(config, dropout=model_config.dropout > 0)
    if meta is None:
        if fine_tune:
            log(f"init: {config.init_from}/ (Hugging Face GPT-2)")
        model = (
            load_gpt2(config.init_from, **model_options)
            if fine_tune
            else GPT(model_config, key=batch_key(config.seed, INIT, 0))
        )
        opt_state = init_optimizer_state(optimizer, model)
        start, horizon, best_val = 0, config.max_steps, math.inf
    else:
        opt_like = eqx.filter_eval_shape(init_optimizer_state, optimizer, model_template(model_config))
        model, opt_state, _, meta = load_checkpoint(meta, opt_like)
        start, best_val = meta["step"], meta.get("best_val_loss") or math.inf
        same_length = meta["train_config"]["max_steps"] == config.max_steps
        horizon = meta.get("schedule_steps", config.max_steps) if same_length else config.max_steps
        if start >= horizon and (_saved_evaluation(meta) or (None,))[0] == start:  # else: evaluate it
            raise TrainingError(
                f"the run in {out_dir}/ already finished at step {start}; pass a larger --max-steps to go on"
            )
    # Data parallelism: each batch split over the devices; parameters and optimiser state on every
    # device, or (--fsdp) split over them too.
    place = shard_parameters if config.fsdp else replicate
    model, opt_state = place((model, opt_state), mesh)
    eval_train_rows = fixed_batches(
        train_ids, seed=config.seed, stream=EVAL_TRAIN_BATCHES, n_batches=config.eval_batches,
        batch_size=config.batch_size, length=model_config.context_length + 1,
    ).reshape(-1, model_config.context_length + 1)  # fmt: skip
    preset = options.preset
    # The final validation's cost, in periodic evaluations: the time plan keeps that much back.
    final_evals = _val_windows(val_ids, model_config, config, final=True).starts.size / (
        _val_windows(val_ids, model_config, config, final=False).starts.size
    )
    checkpoint_meta = {
        **({"preset": preset} if preset else {}),
        "data": source,
        "data_sha256": corpus.identity,
        "n_params": count_params(model),
    }
    log(f"data: {source}, {len(train_ids):,} train / {len(val_ids):,} validation tokens; "
        f"tokenizer {tokenizer.name} ({tokenizer.vocab_size} ids)")  # fmt: skip
    return Run(
        config=config, model_config=model_config, out_dir=out_dir, tokenizer=tokenizer, train_ids=train_ids,
        val_ids=val_ids, mesh=mesh, model=model, opt_state=opt_state, train_steps=train_steps,
        eval_train_rows=eval_train_rows,
        metrics=None, plan=TimePlan(config.max_minutes, config.max_steps, t_start, final_evals=final_evals),
        checkpoint_meta=checkpoint_meta, log=log, now=now, start=start, step=start, horizon=horizon,
        best_val=best_val,
        last_eval=_saved_evaluation(meta),
        last_saved=start if meta is not None else None,
    )  # fmt: skip


def _model_config_and_tokenizer(
    model_options: dict, config: TrainConfig, corpus: Corpus, meta: dict | None
) -> tuple[GPTConfig, Tokenizer]:
    """The model's config and tokenizer: the checkpoint's on resume, GPT-2's from `--init-from`
    (`model_options` then holds only `INIT_FROM_OPTIONS`), else built from the options and corpus."""
    if meta is None and config.init_from is not None:
        model_config = read_gpt2_config(config.init_from, **model_options)
        return model_config, gpt2_tokenizer(model_config)
    tokenizer = corpus.tokenizer if meta is None else tokenizer_from_dict(meta["tokenizer"])
    if tokenizer != corpus.tokenizer:  # the same corpus has the same characters: a damaged cache
        raise TrainingError(
            f"the corpus's tokens ({corpus.tokenizer!r}, in {corpus.folder}) are not the checkpoint's "
            f"({tokenizer!r}); delete that folder and resume again"
        )
    try:
        return GPTConfig(vocab_size=tokenizer.vocab_size, **model_options), tokenizer
    except (TypeError, ValueError) as e:
        raise TrainingError(str(e)) from None


def _saved_evaluation(meta: dict | None) -> tuple[int, float] | None:
    """`(step, val loss)` of the latest evaluation a checkpoint records."""
    if meta is None or meta.get("val_loss") is None:
        return None
    return meta.get("val_loss_step", meta["step"]), meta["val_loss"]


def describe_run_start(run: Run, resumed_from: Path | None) -> None:
    """The lines a run starts with: what it trains, how, for how long, and from where."""
    c, m = run.config, run.model_config
    preset = run.checkpoint_meta.get("preset")
    run.log(
        f"model: {run.checkpoint_meta['n_params'] / 1e6:.2f}M parameters, {m.n_layers} layers, d_model "
        f"{m.d_model}, {m.n_heads} heads, context {m.context_length}; batch {c.batch_size} "
        f"({run.tokens_per_step:,} tokens/step) on {run.mesh.size} {jax.devices()[0].platform} "
        f"device{'s' if run.mesh.size > 1 else ''}" + (f"; preset {preset}" if preset else "")
    )
    run.log(f"schedule: {describe_optimizer(c, run.horizon)}")
    if c.max_minutes:
        run.log(f"time limit: {c.max_minutes:g} min; the schedule is refitted to the steps that fit")
    if resumed_from is not None:
        run.log(f"resuming {resumed_from} at step {run.start}")


# ---------------------------------------------------------------------------------------------
# A step, an evaluation, a checkpoint


def dispatch_steps(run: Run, n: int) -> None:
    """Queue `n` optimiser steps from `run.step` on the device, in one call (not waiting for them)."""
    c, window = run.config, run.model_config.context_length + 1
    steps = list(range(run.step, run.step + n))
    lrs = [learning_rate(s, c, run.horizon) for s in steps]
    starts = np.full((STEPS_PER_CALL, c.batch_size), -1, np.int64)  # -1: an unused slot, zeros
    for i, s in enumerate(steps):
        starts[i] = window_starts(
            s, n_tokens=len(run.train_ids), seed=c.seed, stream=TRAIN_BATCHES, batch_size=c.batch_size,
            length=window,
        )  # fmt: skip
    # Each process reads only its own devices' rows of the windows from the shards.
    batches = shard_rows(windows_reader(run.train_ids, starts, window), (*starts.shape, window), run.mesh, 1)
    step_ids, rates = np.zeros(STEPS_PER_CALL, np.int32), np.zeros(STEPS_PER_CALL, np.float32)
    step_ids[:n], rates[:n] = steps, lrs
    run.model, run.opt_state, losses = run.train_steps(
        run.model, run.opt_state, batches, step_ids, rates, np.int32(n)
    )
    run.step += n
    run.pending.append(([s + 1 for s in steps], losses, lrs))


def read_losses(run: Run, until: int, bar: Progress, t_start: float) -> None:
    """Record the logged steps among the dispatched ones up to step `until`, update tokens/s and
    the progress bar; stop on a non-finite loss."""
    calls = [p for p in run.pending if p[0][-1] <= until]
    if not calls:
        return
    del run.pending[: len(calls)]
    ready = [(s, lr) for steps, _, lrs in calls for s, lr in zip(steps, lrs, strict=True)]
    losses = np.concatenate([np.asarray(losses)[: len(steps)] for steps, losses, _ in calls])
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        raise TrainingError(
            f"loss became {losses[bad[0]]} at step {ready[bad[0]][0]}; stopped. {_last_good(run)}. "
            f"Try a lower --lr or --grad-clip"
        )
    now = run.now()
    run.read_points.append((ready[-1][0], now))
    (first_step, first_time), (last_step, _) = run.read_points[0], run.read_points[-1]
    if last_step > first_step:  # tokens/s over the last few reads, which smooths their jitter
        run.tokens_per_s = (last_step - first_step) * run.tokens_per_step / max(now - first_time, 1e-9)
    for (s, lr), loss in zip(ready, losses, strict=True):
        run.last_read = {"step": s, "loss": float(loss), "lr": lr, "tokens_per_s": round(run.tokens_per_s, 1)}
        if s % run.config.log_interval == 0 or s == run.horizon:
            run.metrics.write(run.last_read)
            run.last_logged = s
    s, lr = ready[-1]
    rate = run.plan.steps_per_second(s, now)
    eta = f"ETA {clock((run.horizon - s) / rate)}" if rate else ("compiling" if s == 1 else "")
    bar.update(
        f"step {s}/{run.horizon} | loss {losses[-1]:.4f} | lr {lr:.2e} | "
        f"{run.tokens_per_s / 1e3:.1f}k tok/s | {clock(now - t_start)} elapsed | {eta}"
    )


def _last_good(run: Run) -> str:
    latest = checkpoint_file(run.out_dir, LATEST)
    where = f"{latest} (step {run.last_saved})" if run.last_saved is not None else "none"
    return f"Last good checkpoint: {where}"


def save(run: Run, name: str) -> None:
    """Write checkpoint `name` (`LATEST` or `BEST`) of the run at its current step."""
    val_step, val_loss = run.last_eval if run.last_eval is not None else (None, None)
    save_checkpoint(
        run.out_dir, name, run.model, run.opt_state, step=run.step, tokenizer=run.tokenizer,
        train_config=run.config.to_dict(), val_loss=val_loss, val_loss_step=val_step,
        best_val_loss=None if math.isinf(run.best_val) else run.best_val, schedule_steps=run.horizon,
        **run.checkpoint_meta,
    )  # fmt: skip
    if name == LATEST:
        run.last_saved = run.step


def _place(run: Run):
    """Puts one evaluation call's rows on the devices, split along the batch axis."""
    return lambda x: shard_batch(x, run.mesh, batch_axis=0)


def _eval_batch(run: Run) -> int:
    """Windows per evaluation call: `windows_per_call`, rounded up to whole windows per device."""
    per_call = windows_per_call(run.model_config.context_length, run.model_config.vocab_size)
    return -(-per_call // run.mesh.size) * run.mesh.size


def _val_windows(val_ids: TokenSpan, model_config: GPTConfig, config: TrainConfig, *, final: bool) -> Windows:
    """The validation windows a periodic (or the final) evaluation reads, within `--eval-tokens`."""
    choose = final_windows if final else periodic_windows
    return choose(len(val_ids), model_config.context_length, config.eval_tokens)


def validation_loss(run: Run, windows: Windows) -> Evaluation | None:
    """The loss over `windows` of the validation split (`evaluate_windows`); None if the run was
    asked to stop meanwhile."""
    return evaluate_windows(
        run.model, run.val_ids, windows, place=_place(run), batch=_eval_batch(run), stop=run.stopping
    )


def train_loss(run: Run) -> float | None:
    """The mean loss over the run's fixed training windows (the same program as `validation_loss`)."""
    rows = run.eval_train_rows
    weight = np.ones((len(rows), rows.shape[1] - 1), np.float32)
    total = summed_loss(run.model, rows, weight, batch=_eval_batch(run), place=_place(run), stop=run.stopping)
    return None if total is None else total / weight.size


def evaluate_and_save(run: Run, bar: Progress, t_start: float) -> bool:
    """Evaluate (the train loss on fixed windows; the validation loss over the whole split, in
    non-overlapping windows, so that no sampling noise can pick the best checkpoint, or on a
    larger corpus over the same evenly spread windows each time, `--eval-tokens`), log it,
    checkpoint `latest` (and `best` if it is) and redraw the loss plot. Returns False, having
    recorded nothing, if the run was asked to stop before the evaluation finished."""
    read_losses(run, run.step, bar, t_start)
    t0 = run.now()
    train = train_loss(run)
    periodic = _val_windows(run.val_ids, run.model_config, run.config, final=False)
    val = validation_loss(run, periodic) if train is not None else None
    if val is None:
        return False
    val_loss = val.loss
    if run.step > run.start:
        run.plan.add_evaluation(run.now() - t0)
    if not (math.isfinite(train) and math.isfinite(val_loss)):
        raise TrainingError(
            f"evaluation loss became non-finite at step {run.step}; stopped. {_last_good(run)}"
        )
    is_best = val_loss < run.best_val
    run.best_val = min(run.best_val, val_loss)
    run.last_eval = (run.step, val_loss)
    elapsed = round(run.now() - t_start, 2)
    run.metrics.write({"step": run.step, "train_loss": train, "val_loss": val_loss, "elapsed_s": elapsed})
    save(run, LATEST)
    if is_best:
        save(run, BEST)
    plot_losses(run.metrics.records, run.out_dir / "loss.png")
    run.read_points.clear()  # keep evaluation time out of tokens/s
    run.read_points.append((run.step, run.now()))
    bar.clear()
    run.log(
        f"step {run.step}: train loss {train:.4f}, val loss {val_loss:.4f}"
        f"{' (best)' if is_best else ''} [{clock(run.now() - t_start)}]"
    )
    return True


def fit_to_time(run: Run, *, announce: bool) -> None:
    """Refit the schedule's length to the steps that fit before `--max-minutes` runs out."""
    # Until one is timed, price an evaluation as its forward passes (a third of a step's work per
    # step's worth of tokens): the fixed training batches, then the validation tokens it reads.
    c, now = run.config, run.now()
    eval_cost = (c.eval_batches + min(len(run.val_ids), c.eval_tokens) / run.tokens_per_step) / 3
    horizon = run.plan.fit(run.step, run.horizon, now, c.eval_interval, eval_cost)
    if announce:
        fits = run.plan.steps_that_fit(run.step, now, c.eval_interval, eval_cost)
        if fits is not None and fits > c.max_steps:
            # More steps than the recipe wants: a preset's max_steps is where its model stops gaining.
            run.log(
                f"time plan: {fits} steps would fit in {c.max_minutes:g} min; the run stops at {c.max_steps}"
            )
        elif horizon != run.horizon:
            run.log(f"time plan: {horizon} steps fit in {c.max_minutes:g} min; schedule refitted")
    run.horizon = horizon


def sample_text(
    model: GPT, tokenizer: Tokenizer, n_tokens: int, *, seed: int, temperature: float = 0.8
) -> str:
    """A short continuation of a newline (or of token 0, in a corpus without newlines), to show
    what the model learned."""
    try:
        prompt = tokenizer.encode("\n")
    except TokenizerError:
        prompt = [0]
    options = SamplingOptions(temperature=temperature)
    out = generate(model, prompt, n_tokens, key=jax.random.key(seed), options=options)
    return tokenizer.decode(np.asarray(out).reshape(-1).tolist())


# ---------------------------------------------------------------------------------------------
# The run


class _StopFlag:
    """Set by SIGINT/SIGTERM so the loop stops between steps; a second Ctrl-C aborts at once."""

    def __init__(self):
        self.set = False
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.set and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.set = True

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(
    settings: dict,
    out_dir: str | Path = "out",
    *,
    resume: bool = False,
    overwrite: bool = False,
    sample_tokens: int = 300,
    log: Callable[[str], None] = print,
    progress: bool = True,
    now: Callable[[], float] = time.monotonic,
) -> TrainResult:
    """Train a GPT in `out_dir`. `settings` are the settings given (any `GPTConfig` field but
    `vocab_size`, any `TrainConfig` field, and `preset`, a name or None), resolved by
    `options.resolve_options`: `train({"max_steps": 100})` is the `cpu` preset with 100 steps, and
    `train({}, out_dir, resume=True)` continues the run there with the checkpoint's settings.

    A folder that already holds a run is refused unless `resume` (continue it; settings given
    anew must agree with the checkpoint) or `overwrite` (delete it first). A folder in use by a
    live run is refused. Raises one of `RunError` (`ValueError`s with one-line messages) for bad
    input; Ctrl-C or SIGTERM saves a checkpoint and returns with `interrupted`. `now` is the clock
    that `max_minutes` is measured by (tests pass a simulated one).
    """
    t_start = now()
    options = None if resume else resolve_options(settings)  # a fresh run's settings, checked first
    out_dir = Path(out_dir)
    check_writable(out_dir)
    with RunDirLock(out_dir) as lock:
        check_run_dir(out_dir, resume=resume, overwrite=overwrite)
        if resume:  # the checkpoint's metadata, read once, and the settings laid over it
            options = resolve_options(settings, read_metadata(checkpoint_file(out_dir, LATEST)))
        meta = options.checkpoint
        run = start_run(options, out_dir, log=log, now=now, t_start=t_start)
        # Every check has passed: from here on the folder is this run's.
        stale = lock.claim()
        if stale:
            log(f"took over {out_dir}/ from a run that is no longer running ({stale})")
        if overwrite and not resume:
            log(f"--overwrite: deleting the run in {out_dir}/ and starting afresh")
            delete_checkpoints(out_dir)
        run.metrics = Metrics(out_dir / METRICS_NAME, keep_until=run.start if meta is not None else None)
        try:
            describe_run_start(run, Path(meta["path"]) if meta is not None else None)
            return _loop(run, sample_tokens, progress, t_start)
        finally:
            run.metrics.close()


def steps_per_call(run: Run) -> int:
    """Steps in the next call: 1 until the step rate is measured, then as many as run in about
    `SECONDS_PER_CALL`, at most `STEPS_PER_CALL`. A stop waits for the call in flight, so slow steps
    go one at a time. Every group size runs the same compiled program (`make_train_steps`), so the
    grouping never changes what a step computes."""
    rate = run.plan.steps_per_second(run.step, run.now())
    return 1 if rate is None else max(1, min(STEPS_PER_CALL, int(SECONDS_PER_CALL * rate)))


def _evaluated(run: Run) -> bool:
    return run.last_eval is not None and run.last_eval[0] == run.step


def _loop(run: Run, sample_tokens: int, progress: bool, t_start: float) -> TrainResult:
    c, bar = run.config, Progress(enabled=progress)
    run.read_points.append((run.start, t_start))
    try:
        with _StopFlag() as stop:
            run.stopping = lambda: stop.set
            # The start of a run, and a resumption from a checkpoint whose evaluation was interrupted.
            if (run.step % c.eval_interval == 0 or run.step == run.horizon) and not _evaluated(run):
                evaluate_and_save(run, bar, t_start)
            while run.step < run.horizon and not stop.set:
                # The first call is one step alone: it compiles, and the time plan starts after it.
                # Calls end at the next evaluation.
                next_eval = (run.step // c.eval_interval + 1) * c.eval_interval
                first = run.step == run.start
                n = min(steps_per_call(run), run.horizon - run.step, next_eval - run.step)
                dispatch_steps(run, n)
                if first:
                    _time_first_step(run, bar, t_start)
                elif run.step - n < run.plan.timed_from[0] + PLAN_AFTER <= run.step:
                    fit_to_time(run, announce=True)
                if run.step // c.log_interval > (run.step - n) // c.log_interval or run.step == run.horizon:
                    read_losses(run, run.step - READ_LAG, bar, t_start)
                if run.plan.out_of_time(run.now()) and run.step < run.horizon:
                    run.horizon = run.step
                    run.log(f"time limit reached at step {run.step}")
                if run.step % c.eval_interval == 0 or run.step == run.horizon:
                    if evaluate_and_save(run, bar, t_start) and run.step < run.horizon:
                        fit_to_time(run, announce=False)
            read_losses(run, run.step, bar, t_start)
            if stop.set and not (run.step == run.horizon and _evaluated(run)):
                return interrupted(run, t_start)
            return finish(run, sample_tokens, t_start)
    finally:
        bar.clear()


def _time_first_step(run: Run, bar: Progress, t_start: float) -> None:
    """Wait for the first step (it compiles), then start timing the steps from here."""
    run.pending[-1][1].block_until_ready()
    now = run.now()
    run.tokens_per_s = run.tokens_per_step / max(now - t_start, 1e-9)  # includes compiling
    run.plan.start_timing(run.step, now)
    run.read_points.clear()
    run.read_points.append((run.step, now))
    bar.clear()
    run.log(f"compiled the training step in {now - t_start:.1f} s since start")


def interrupted(run: Run, t_start: float) -> TrainResult:
    """Ctrl-C or SIGTERM: log the step reached, checkpoint it, say how to resume."""
    if run.last_read is not None and run.last_logged != run.last_read["step"]:
        run.metrics.write(run.last_read)  # the step the run stopped at is always logged
    if run.last_saved is None or run.step > run.last_saved:
        save(run, LATEST)
    run.log(
        f"interrupted at step {run.step}; saved {checkpoint_file(run.out_dir, LATEST)}. Resume with: "
        f"uv run train.py --resume --out-dir {run.out_dir}"
    )
    val = run.last_eval[1] if run.last_eval is not None else None
    return TrainResult(run.step, val, run.best_val, run.now() - t_start, True, None, run.out_dir)


def final_validation(run: Run) -> tuple[Evaluation | None, str]:
    """The final model's validation loss and what it covers: the whole split in overlapping
    windows where `--eval-tokens` and the time plan allow, else an even sample of windows, or, with
    no time left for it, the last evaluation's figure. None if a stop came meanwhile."""
    context, n = run.model_config.context_length, len(run.val_ids)
    if not run.plan.affords(run.now(), run.plan.final_evals):
        periodic = _val_windows(run.val_ids, run.model_config, run.config, final=False)
        last = Evaluation(run.last_eval[1], periodic.n_predicted, periodic.stride, periodic.whole)
        return last, (
            f"(the last evaluation's, over {last.n_predicted:,} predicted tokens: the final validation "
            f"would not fit in the time left)"
        )
    windows = _val_windows(run.val_ids, run.model_config, run.config, final=True)
    final = validation_loss(run, windows)
    if final is None or final.whole:
        covers = f"over all {windows.n_predicted:,} predicted tokens of the split"
        return final, f"{covers} (windows of {context} every {windows.stride})"
    return final, (
        f"estimated over {final.n_predicted:,} of the split's {n:,} tokens ({len(windows):,} evenly "
        f"spread windows of {context}; the whole split is over {FINAL_EVAL_FACTOR}x --eval-tokens)"
    )


def finish(run: Run, sample_tokens: int, t_start: float) -> TrainResult:
    """The end of a run that reached its horizon: the final model's loss over the whole validation
    split in overlapping windows (the figure to quote; `final_validation`), a sample from the best
    checkpoint, the summary. A stop during the final validation skips it and the sample: the
    checkpoints are complete."""
    t0, stride = run.now(), max(1, run.model_config.context_length // 2)
    final, covers = final_validation(run)
    val = run.last_eval[1]
    if final is None:
        run.log(
            f"interrupted during the final validation; the run is complete at step {run.step} (periodic "
            f"val loss {val:.4f}). The final figure: uv run evaluate.py --checkpoint "
            f"{checkpoint_file(run.out_dir, LATEST)} --stride {stride}"
        )
        return TrainResult(run.step, val, run.best_val, run.now() - t_start, True, None, run.out_dir)
    run.metrics.write(
        {
            "step": run.step,
            "final_val_loss": final.loss,
            "val_tokens": final.n_predicted,
            "whole_split": final.whole,
        }
    )
    run.log(f"final validation: loss {final.loss:.4f} {covers} in {run.now() - t0:.1f} s")
    sample = None
    if sample_tokens > 0 and not run.stopping():
        best = load_model(run.out_dir)[0] if checkpoint_file(run.out_dir, BEST).exists() else run.model
        sample = sample_text(best, run.tokenizer, sample_tokens, seed=run.config.seed)
    elapsed = run.now() - t_start
    run.log(
        f"done: step {run.step}, final val loss {final.loss:.4f} (periodic {val:.4f}, best "
        f"{run.best_val:.4f}) in {elapsed / 60:.1f} min; checkpoints in {run.out_dir}/"
    )
    if sample is not None:
        run.log(f"sample (best checkpoint, temperature 0.8):\n{sample}")
    return TrainResult(run.step, final.loss, run.best_val, elapsed, False, sample, run.out_dir)
