"""The training run: data, model and optimiser set-up, the loop, and everything it reports and saves.

`train(...)` runs one training run in a directory `out_dir`:

    out_dir/metrics.jsonl    one JSON object per line: {"step", "loss", "lr", "tokens_per_s", ...}
                             for logged steps, {"step", "train_loss", "val_loss", ...} at evaluations
    out_dir/loss.png         train and validation curves, redrawn at each evaluation
    out_dir/latest.json/.eqx the checkpoint of the last evaluation (or interruption)
    out_dir/best.json/.eqx   the checkpoint with the lowest validation loss so far

The loop never waits for the accelerator at a step: losses are read a few steps after they were
dispatched, every `log_interval` steps, and at evaluations.
"""

import collections
import functools
import hashlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from eqx_gpt.checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from eqx_gpt.config import GPTConfig
from eqx_gpt.data import (
    EVAL_TRAIN_BATCHES,
    EVAL_VAL_BATCHES,
    INIT,
    TRAIN_BATCHES,
    batch_key,
    fixed_batches,
    get_batch,
    load_text,
    split_text,
    to_ids,
)
from eqx_gpt.generate import generate
from eqx_gpt.gpt import GPT
from eqx_gpt.parallel import check_batch, data_mesh, replicate, shard_batch, shard_parameters
from eqx_gpt.tokenizer import CharTokenizer, GPT2Tokenizer, Tokenizer, tokenizer_from_dict
from eqx_gpt.training import (
    TrainConfig,
    count_params,
    describe_schedule,
    init_optimizer_state,
    learning_rate,
    make_optimizer,
    make_train_steps,
    mean_loss,
)

# Fields that may differ between a checkpoint and the flags of `--resume`: they bound or observe
# the run without changing what it computes.
RESUMABLE_CHANGES = ("max_steps", "max_minutes", "eval_interval", "log_interval")
READ_LAG = 2  # read a logged loss this many steps after dispatching it, so the device never idles
STEPS_PER_CALL = 8  # optimiser steps per dispatch at most (`make_train_steps`): 1.2-1.3x on small models
PLAN_AFTER = 20  # steps timed after compilation before fitting the schedule to max_minutes


class TrainingError(ValueError):
    """A run cannot start or continue (one-line message naming the problem and the fix)."""


@dataclass
class TrainResult:
    step: int
    val_loss: float | None
    best_val_loss: float | None
    elapsed_s: float
    interrupted: bool
    sample: str | None
    out_dir: Path


# ---------------------------------------------------------------------------------------------
# Set-up


def check_writable(out_dir: Path) -> None:
    """Create `out_dir` and prove it writable, or raise a one-line `TrainingError`."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        raise TrainingError(
            f"cannot write to output folder {out_dir} ({e.strerror or e}); "
            f"pass --out-dir to a writable folder"
        ) from None


def optimizer_and_step(config: TrainConfig, *, dropout: bool):
    """`make_optimizer` and `make_train_steps` for `config`, shared by runs whose steps are the same.

    Only the fields the step reads are part of the key, so a resumed run (or a second run in the
    same process, e.g. in tests) reuses the compiled step instead of compiling it again.
    """
    fields = ("grad_accum", "beta1", "beta2", "weight_decay", "grad_clip", "seed")
    return _optimizer_and_step(TrainConfig(**{f: getattr(config, f) for f in fields}), dropout)


@functools.lru_cache(maxsize=8)
def _optimizer_and_step(config: TrainConfig, dropout: bool):
    optimizer = make_optimizer(config)
    return optimizer, make_train_steps(optimizer, config, dropout=dropout)


def make_tokenizer(kind: str, text: str) -> Tokenizer:
    return CharTokenizer.from_text(text) if kind == "char" else GPT2Tokenizer()


def resolve_resume(meta: dict, model_flags: dict, train_flags: dict) -> tuple[dict, TrainConfig]:
    """The checkpoint's configs with `*_flags` (explicitly given options) laid over them.

    A flag that changes what the run computes must agree with the checkpoint; only the fields in
    `RESUMABLE_CHANGES` may differ. Returns `(model_options, train_config)`.
    """
    saved_model = {k: v for k, v in meta["model_config"].items() if k != "vocab_size"}
    saved_train = meta["train_config"]
    for saved, flags in ((saved_model, model_flags), (saved_train, train_flags)):
        for name, value in flags.items():
            if name in RESUMABLE_CHANGES or name not in saved or saved[name] == value:
                continue
            flag = "--" + name.replace("_", "-")
            raise CheckpointError(
                f"{flag} {value} contradicts the checkpoint in {Path(meta['path']).parent} "
                f"({name}={saved[name]}); drop the flag to resume, or pass another --out-dir to start afresh"
            )
    train = {**saved_train, **{k: v for k, v in train_flags.items() if k in RESUMABLE_CHANGES}}
    try:
        return saved_model, TrainConfig.from_dict(train)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {meta['path']} has an invalid train config: {e}") from None


# ---------------------------------------------------------------------------------------------
# Reporting


class Progress:
    """A one-line progress bar on stderr, redrawn with \\r (or a plain line now and then off a TTY)."""

    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.shown = False
        self.last_plain = 0.0

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + text.ljust(100)[:160])
            self.shown = True
        elif time.monotonic() - self.last_plain > 10:
            self.stream.write(text + "\n")
            self.last_plain = time.monotonic()
        self.stream.flush()

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
            self.shown = False


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Metrics:
    """`metrics.jsonl`: appended line by line (flushed), reloaded and truncated on resume."""

    def __init__(self, path: Path, keep_until: int | None):
        self.path = path
        self.records: list[dict] = []
        if keep_until is not None and path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if isinstance(record, dict) and record.get("step", math.inf) <= keep_until:
                    self.records.append(record)
        text = "".join(json.dumps(r) + "\n" for r in self.records)
        atomic_write_bytes(path, text.encode())
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def plot_losses(records: list[dict], path: Path) -> None:
    """Train (per logged step, and at evaluations) and validation loss against step, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = [r["step"] for r in records if "loss" in r]
    ax.plot(steps, [r["loss"] for r in records if "loss" in r], lw=0.8, alpha=0.45, label="train (batch)")
    evals = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", ms=3, label="train (eval)")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    if evals:
        low = min(min(r["val_loss"], r["train_loss"]) for r in evals)
        ax.set_ylim(max(0.0, low - 0.2), min(5.0, max(r["val_loss"] for r in evals) + 0.2))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, path)


def sample_text(
    model: GPT, tokenizer: Tokenizer, n_tokens: int, *, seed: int, temperature: float = 0.8
) -> str:
    """A short continuation of a newline, to show what the model learned."""
    prompt = tokenizer.encode("\n")
    out = generate(model, prompt, n_tokens, key=jax.random.key(seed), temperature=temperature)
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
    model_options: dict,
    config: TrainConfig,
    out_dir: str | Path = "out",
    *,
    resume: bool = False,
    resume_flags: tuple[dict, dict] | None = None,
    sample_tokens: int = 300,
    log: Callable[[str], None] = print,
    progress: bool = True,
    extra_metadata: dict | None = None,
) -> TrainResult:
    """Train a GPT of `model_options` (GPTConfig fields except `vocab_size`) under `config`.

    With `resume=True`, continue the run saved in `out_dir` (its latest checkpoint); the
    configs then come from the checkpoint and `resume_flags = (model_flags, train_flags)` holds the
    options given explicitly, which must agree with it (see `resolve_resume`). Raises
    `TrainingError`, `DataError`, `CheckpointError` or `TokenizerError` (all `ValueError`s with
    one-line messages) for bad input; Ctrl-C saves a checkpoint and returns with `interrupted`.
    """
    t_start = time.monotonic()
    out_dir = Path(out_dir)
    check_writable(out_dir)

    meta = None
    if resume:
        latest = out_dir / "latest.json"
        if not latest.is_file():
            raise CheckpointError(f"--resume but no checkpoint in {out_dir}/; run without --resume to start")
        meta = read_metadata(latest)
        model_options, config = resolve_resume(meta, *(resume_flags or ({}, {})))

    text = load_text(config.data)
    source = config.data or "Tiny Shakespeare (bundled)"
    data_sha = hashlib.sha256(text.encode()).hexdigest()
    if meta is not None and meta.get("data_sha256") not in (None, data_sha):
        raise CheckpointError(f"{source} is not the corpus the checkpoint in {out_dir}/ was trained on")

    if meta is None:
        tokenizer = make_tokenizer(config.tokenizer, text)
    else:
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
    try:
        model_config = GPTConfig(vocab_size=tokenizer.vocab_size, **model_options)
    except (TypeError, ValueError) as e:
        raise TrainingError(str(e)) from None
    window = model_config.context_length + 1

    train_text, val_text = split_text(text)
    train_ids = to_ids(tokenizer.encode(train_text), "train", model_config.context_length, source)
    val_ids = to_ids(tokenizer.encode(val_text), "validation", model_config.context_length, source)

    optimizer, train_steps = optimizer_and_step(config, dropout=model_config.dropout > 0)
    if meta is None:
        model = GPT(model_config, key=batch_key(config.seed, INIT, 0))
        opt_state = init_optimizer_state(optimizer, model)
        start, best_val, horizon = 0, math.inf, config.max_steps
        if (out_dir / "latest.json").exists():
            log(f"starting afresh in {out_dir}/, replacing the run there (--resume continues it)")
        for name in ("best", "latest"):  # a fresh run replaces whatever an earlier one left here
            (out_dir / f"{name}.json").unlink(missing_ok=True)
            for stale in out_dir.glob(f"{name}-*.eqx"):
                stale.unlink()
    else:
        template = eqx.filter_eval_shape(GPT, model_config, key=jax.random.key(0))
        opt_like = eqx.filter_eval_shape(init_optimizer_state, optimizer, template)
        model, opt_state, _, meta = load_checkpoint(meta["path"], opt_like)
        start = meta["step"]
        best_val = meta.get("best_val_loss") or math.inf
        same_length = meta["train_config"]["max_steps"] == config.max_steps
        horizon = meta.get("schedule_steps", config.max_steps) if same_length else config.max_steps
        if start >= horizon:
            raise TrainingError(
                f"the run in {out_dir}/ already finished at step {start}; pass a larger --max-steps to go on"
            )

    # Data parallelism: each batch split over the devices; parameters and optimiser state on every
    # device, or (--fsdp) split over them too.
    mesh = data_mesh()
    try:
        check_batch(mesh, config.batch_size, config.grad_accum)
    except ValueError as e:
        raise TrainingError(str(e)) from None
    place = shard_parameters if config.fsdp else replicate
    model, opt_state = place((model, opt_state), mesh)
    metrics = Metrics(out_dir / "metrics.jsonl", keep_until=start if meta is not None else None)
    tokens_per_step = config.batch_size * model_config.context_length
    eval_batches = {
        split: shard_batch(
            fixed_batches(
                ids, seed=config.seed, stream=stream, n_batches=config.eval_batches,
                batch_size=config.batch_size, length=window,
            ),
            mesh, batch_axis=1,
        )
        for split, ids, stream in (
            ("train", train_ids, EVAL_TRAIN_BATCHES),
            ("val", val_ids, EVAL_VAL_BATCHES),
        )
    }  # fmt: skip

    n_params = count_params(model)
    log(
        f"data: {source}, {len(train_ids):,} train / {len(val_ids):,} validation tokens; "
        f"tokenizer {tokenizer.name} ({tokenizer.vocab_size} ids)"
    )
    log(
        f"model: {n_params / 1e6:.2f}M parameters, {model_config.n_layers} layers, d_model "
        f"{model_config.d_model}, {model_config.n_heads} heads, context {model_config.context_length}; "
        f"batch {config.batch_size} ({tokens_per_step:,} tokens/step) on {mesh.size} "
        f"{jax.devices()[0].platform} device{'s' if mesh.size > 1 else ''}"
    )
    log(f"schedule: {describe_schedule(config, horizon)}")
    if config.max_minutes:
        log(f"time limit: {config.max_minutes:g} min; the schedule is refitted to the steps that fit")
    if meta is not None:
        log(f"resuming {out_dir}/latest.json at step {start}")

    run_meta = {
        **({"preset": meta.get("preset")} if meta is not None and "preset" in meta else {}),
        **(extra_metadata or {}),
        "data": source,
        "data_sha256": data_sha,
        "n_params": n_params,
    }
    last_good_step = start if meta is not None else None
    last_val = meta.get("val_loss") if meta is not None else None

    def save(name: str, step: int, val_loss: float | None) -> None:
        save_checkpoint(
            out_dir, name, model, opt_state, step=step, tokenizer=tokenizer, train_config=config.to_dict(),
            val_loss=val_loss, best_val_loss=None if math.isinf(best_val) else best_val,
            schedule_steps=horizon, **run_meta,
        )  # fmt: skip

    def evaluate() -> tuple[float, float, float]:
        t0 = time.monotonic()
        train_loss = float(mean_loss(model, eval_batches["train"]))
        val_loss = float(mean_loss(model, eval_batches["val"]))
        return train_loss, val_loss, time.monotonic() - t0

    bar = Progress(enabled=progress)
    # (steps, losses, lrs) of each dispatched call whose losses have not been read yet
    pending: list[tuple[list[int], jax.Array, list[float]]] = []
    read_points = collections.deque([(start, t_start)], maxlen=8)  # (step, time) of recent reads
    tps = 0.0
    steps_timed_from = None  # (step, time) after compilation, for the time plan
    eval_seconds = 0.0
    deadline = t_start + 60 * config.max_minutes if config.max_minutes else math.inf
    reserve = 15.0  # seconds kept for the final evaluation, checkpoint and sample

    def read_pending(until: int) -> None:
        """Record the logged steps among `pending` up to step `until`; stop on a non-finite loss."""
        nonlocal tps
        calls = [p for p in pending if p[0][-1] <= until]
        if not calls:
            return
        del pending[: len(calls)]
        ready = [(s, lr) for steps, _, lrs in calls for s, lr in zip(steps, lrs, strict=True)]
        losses = np.concatenate([np.asarray(losses)[: len(steps)] for steps, losses, _ in calls])
        bad = np.flatnonzero(~np.isfinite(losses))
        if bad.size:
            s = ready[bad[0]][0]
            kept = f"{out_dir}/latest.json (step {last_good_step})" if last_good_step is not None else "none"
            raise TrainingError(
                f"loss became {losses[bad[0]]} at step {s}; stopped. Last good checkpoint: {kept}. "
                f"Try a lower --lr or --grad-clip"
            )
        now = time.monotonic()
        read_points.append((ready[-1][0], now))
        (first_step, first_time), (last_step, _) = read_points[0], read_points[-1]
        if last_step > first_step:  # tokens/s over the last few reads, which smooths their jitter
            tps = (last_step - first_step) * tokens_per_step / max(now - first_time, 1e-9)
        for (s, lr), loss in zip(ready, losses, strict=True):
            if s % config.log_interval == 0 or s == horizon:
                metrics.write({"step": s, "loss": float(loss), "lr": lr, "tokens_per_s": round(tps, 1)})
        s, loss = ready[-1][0], float(losses[-1])
        elapsed = now - t_start
        if steps_timed_from is not None and s > steps_timed_from[0]:
            rate = (s - steps_timed_from[0]) / max(now - steps_timed_from[1] - eval_seconds, 1e-9)
            eta = f"ETA {_clock((horizon - s) / rate)}"
        else:
            eta = "compiling" if s == start + 1 and start == 0 else ""
        bar.update(
            f"step {s}/{horizon} | loss {loss:.4f} | lr {lr:.2e} | {tps / 1e3:.1f}k tok/s | "
            f"{_clock(elapsed)} elapsed | {eta}"
        )

    def replan(step: int) -> int:
        """Fit the schedule's length to the steps that fit before the deadline."""
        if not config.max_minutes or steps_timed_from is None or step <= steps_timed_from[0]:
            return horizon
        now = time.monotonic()
        rate = (step - steps_timed_from[0]) / (now - steps_timed_from[1] - eval_seconds)
        evals_left = max(0, (horizon - step) // config.eval_interval)
        # Until one is measured, price an evaluation as its forward passes: a third of a step each.
        per_eval = eval_seconds / n_evals if n_evals else 2 * config.eval_batches / 3 / rate
        budget = deadline - now - reserve - evals_left * per_eval
        return max(step + 1, min(config.max_steps, step + int(budget * rate)))

    def evaluation(step: int) -> None:
        nonlocal best_val, last_good_step, last_val, eval_seconds, n_evals
        read_pending(step)
        train_loss, val_loss, seconds = evaluate()
        if step > start:
            eval_seconds += seconds
            n_evals += 1
        if not (math.isfinite(train_loss) and math.isfinite(val_loss)):
            kept = f"{out_dir}/latest.json (step {last_good_step})" if last_good_step is not None else "none"
            raise TrainingError(
                f"evaluation loss became non-finite at step {step}; stopped. Last good checkpoint: {kept}"
            )
        is_best = val_loss < best_val
        best_val = min(best_val, val_loss)
        last_val = val_loss
        elapsed = round(time.monotonic() - t_start, 2)
        metrics.write({"step": step, "train_loss": train_loss, "val_loss": val_loss, "elapsed_s": elapsed})
        save("latest", step, val_loss)
        if is_best:
            save("best", step, val_loss)
        last_good_step = step
        plot_losses(metrics.records, out_dir / "loss.png")
        read_points.clear()  # keep evaluation time out of tokens/s
        read_points.append((step, time.monotonic()))
        bar.clear()
        log(
            f"step {step}: train loss {train_loss:.4f}, val loss {val_loss:.4f}"
            f"{' (best)' if is_best else ''} [{_clock(time.monotonic() - t_start)}]"
        )

    n_evals = 0
    interrupted = False
    step = start
    try:
        with _StopFlag() as stop:
            if start == 0:
                evaluation(0)
            while step < horizon:
                if stop.set:
                    interrupted = True
                    break
                # Up to STEPS_PER_CALL steps in one call, ending at the next evaluation (and the
                # first step alone: it compiles, and the time plan starts after it).
                next_eval = (step // config.eval_interval + 1) * config.eval_interval
                n = 1 if step == start else min(STEPS_PER_CALL, horizon - step, next_eval - step)
                steps = list(range(step, step + n))
                lrs = [learning_rate(s, config, horizon) for s in steps]
                batches = np.zeros((STEPS_PER_CALL, config.batch_size, window), np.int32)
                for i, s in enumerate(steps):
                    batches[i] = get_batch(
                        train_ids, s, seed=config.seed, stream=TRAIN_BATCHES,
                        batch_size=config.batch_size, length=window,
                    )  # fmt: skip
                step_ids, rates = np.zeros(STEPS_PER_CALL, np.int32), np.zeros(STEPS_PER_CALL, np.float32)
                step_ids[:n], rates[:n] = steps, lrs
                model, opt_state, losses = train_steps(
                    model, opt_state, shard_batch(batches, mesh, batch_axis=1), step_ids, rates, np.int32(n)
                )
                step += n
                pending.append(([s + 1 for s in steps], losses, lrs))
                if step == start + 1:  # the first step compiles: time the rest from here
                    losses.block_until_ready()
                    now = time.monotonic()
                    tps = tokens_per_step / (now - t_start)  # the first step's figure includes compiling
                    steps_timed_from = (step, now)
                    read_points.clear()
                    read_points.append(steps_timed_from)
                    bar.clear()
                    log(f"compiled the training step in {time.monotonic() - t_start:.1f} s since start")
                elif steps_timed_from is not None and step - n < steps_timed_from[0] + PLAN_AFTER <= step:
                    new = replan(step)
                    if new != horizon:
                        horizon = new
                        bar.clear()
                        log(
                            f"time plan: {horizon} steps fit in {config.max_minutes:g} min; schedule refitted"
                        )
                if step // config.log_interval > (step - n) // config.log_interval or step == horizon:
                    read_pending(step - READ_LAG)
                if time.monotonic() > deadline - reserve and step < horizon:
                    horizon = step
                    log(f"time limit reached at step {step}")
                if step % config.eval_interval == 0 or step == horizon:
                    evaluation(step)
                    if step < horizon and config.max_minutes:
                        horizon = replan(step)
            read_pending(step)
    except BaseException:
        bar.clear()
        metrics.close()
        raise

    if interrupted:
        read_pending(step)
        if step > last_good_step:
            save("latest", step, last_val)
        bar.clear()
        metrics.close()
        log(
            f"interrupted at step {step}; saved {out_dir}/latest.json. Resume with: "
            f"uv run train.py --resume --out-dir {out_dir}"
        )
        return TrainResult(step, last_val, best_val, time.monotonic() - t_start, True, None, out_dir)

    metrics.close()
    bar.clear()
    sample = None
    if sample_tokens > 0:
        from eqx_gpt.checkpoint import load_model

        best_model = load_model(out_dir)[0] if (out_dir / "best.json").exists() else model
        sample = sample_text(best_model, tokenizer, sample_tokens, seed=config.seed)
    elapsed = time.monotonic() - t_start
    log(
        f"done: step {step}, val loss {last_val:.4f} (best {best_val:.4f}) in {elapsed / 60:.1f} min; "
        f"checkpoints in {out_dir}/"
    )
    if sample is not None:
        log(f"sample (best checkpoint, temperature 0.8):\n{sample}")
    return TrainResult(step, last_val, best_val, elapsed, False, sample, out_dir)
