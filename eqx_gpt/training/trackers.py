"""Live curves where people look: trackers, callbacks that send a run's records to TensorBoard or
Weights & Biases as well as to `metrics.jsonl`, each an optional extra imported only when opened.

    train(callbacks=[TensorBoardTracker()])     # or the shortcut: train(tracker="tensorboard")
    train(callbacks=[WandbTracker(project="shakespeare")])

A tracker is an ordinary `Callback` (`Tracker` is the base of the two here): it opens at
`on_train_begin` (in the first JAX process only), is fed every record as metrics.jsonl gets it
(`on_log`: train loss, gradient norm, learning rate and tokens/s at logged steps; train and
validation loss at evaluations; the final validation; and any figure a callback logs), makes them
durable at each checkpoint, writes the sample text and closes at `on_end`, and closes marked failed
at `on_exception`. The run's resolved settings are its hyperparameters. A tracker of your own is a
callback with the same powers.

A resumed run continues the same tracker run, and neither tracker duplicates or reorders a step
after a kill. The run resumes at its checkpoint's step (`resume_step`), keeps the records up to
it and redoes the steps after it:
- TensorBoard: the new event file starts with a `SessionLog.START` at `resume_step + 1`
  (TensorBoard's purge step), so the reader discards every event of the killed run from that step
  on and shows the resumed run's instead. A fresh run purges from step 0, so a run started afresh
  in the same folder hides the old one's curves.
- W&B: the run id is created once and kept in `out_dir/wandb-run-id`; a resume calls
  `wandb.init(id=..., resume="allow")`. W&B's history only moves forward: a resumed run starts at
  the step after the last one W&B holds (`run.starting_step`), and W&B drops anything logged to an
  earlier step. This tracker skips those records itself (their losses are the killed run's bit for
  bit, as resume is bit-exact; only tokens/s and elapsed time differ), so the history holds each
  step once, in order. The price: a record the killed run never sent, at a step W&B already holds
  (an evaluation cut short by the kill), stays out of W&B; `metrics.jsonl` has it. Rewinding the
  history to the checkpoint (`resume_from="{id}?_step={n}"`) would avoid both, but W&B offers it
  only as a private preview and not on self-hosted servers, so it is not used. Offline
  (`WANDB_MODE=offline`) W&B cannot look the run up, so nothing is skipped: each session writes its
  own `out_dir/wandb/offline-run-<time>-<id>[-n]` folder under the same id, each in step order, and
  `wandb sync` uploads them to that one run, whose history takes only increasing steps.

Cost: nothing here runs at a training step; records arrive at log and evaluation intervals. The
TensorBoard tracker writes each record's events synchronously to a buffered file (no thread, no
queue) and makes them durable (`fsync`) at each evaluation's record, which precedes its checkpoint,
at each record of a run stopping, at most every `FLUSH_SECS` otherwise, and at each checkpoint and
`close()`. `bench/trackers.py` times it.
"""

import html
import importlib.util
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from eqx_gpt.errors import ConfigError
from eqx_gpt.files import atomic_write_bytes
from eqx_gpt.training.callbacks import Callback, RunView
from eqx_gpt.training.records import Record, TrainResult

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_NAME = "wandb-run-id"
WANDB_PROJECT = "eqx_gpt"  # unless WANDB_PROJECT is set
FLUSH_SECS = 5.0  # TensorBoard's own reload interval: make events durable at most this often

# The tag each number of a `metrics.jsonl` record is shown under; any other number keeps its name.
TAGS = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "train_loss": "eval/train_loss",
    "val_loss": "eval/val_loss",
    "elapsed_s": "eval/elapsed_s",
    "final_val_loss": "final/val_loss",
    "val_tokens": "final/val_tokens",
    "whole_split": "final/whole_split",
}
EVALUATIONS = ("val_loss", "final_val_loss")  # records that precede a checkpoint or end the run
# The package each tracker imports, and the extra that installs it.
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a `metrics.jsonl` record by tag (`TAGS`), without its step; a bool is 0 or 1."""
    return {
        TAGS.get(key, key): float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float)
    }


def _missing(tracker: str, error: ModuleNotFoundError) -> ConfigError:
    """The one-line refusal of a tracker whose optional package is not installed, or `error` itself
    re-raised when some other module is missing (a broken install is not a missing extra)."""
    package = PACKAGES[tracker]
    if (error.name or "").split(".")[0] != package:
        raise error
    return ConfigError(
        f"--tracker {tracker} needs {package}: uv sync --extra {tracker} "
        f"(or pip install 'eqx_gpt[{tracker}]')"
    )


class Tracker(Callback):
    """A callback that sends the run's records somewhere besides metrics.jsonl: the base of
    `TensorBoardTracker` and `WandbTracker`, which implement `open`, `log`, `log_text`, `flush` and
    `close` over plain `metrics.jsonl` records (dicts with an int "step"). `extra` names the optional
    package it needs (`PACKAGES`), checked when it is made, before a run writes anything."""

    extra: str = ""

    def __init__(self):
        if importlib.util.find_spec(PACKAGES[self.extra]) is None:
            raise _missing(self.extra, ModuleNotFoundError(name=PACKAGES[self.extra]))
        self.opened = False

    def where(self, out_dir: Path) -> str:
        """Where to look at the run's curves (the run's first lines say it)."""
        raise NotImplementedError

    def open(self, out_dir: Path, *, config: dict, resume_step: int | None, history: Iterable[dict]) -> None:
        """Start writing for the run in `out_dir`: `config` its settings, flat; `resume_step` the
        step of the checkpoint a resumed run starts from (None: a fresh run), whose later records
        the resumed run's replace; `history` the records it kept, sent first to a tracker opened
        for the first time in `out_dir`."""
        raise NotImplementedError

    def log(self, record: dict) -> None:
        """Send one `metrics.jsonl` record."""
        raise NotImplementedError

    def log_text(self, step: int, name: str, text: str) -> None:
        """Send a text (the sample at the end of a run) at `step` under `name`."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make every record sent so far survive a kill."""

    def close(self, *, failed: bool = False) -> None:
        """Flush and close; `failed` marks a run that ended on an error."""

    def on_train_begin(self, run: RunView) -> None:
        if run.is_writer:  # only the first JAX process writes
            history = [record.to_dict() for record in run.history]
            self.open(run.out_dir, config=run.settings, resume_step=run.resumed_at, history=history)
            self.opened = True

    def on_log(self, record: Record, run: RunView) -> None:
        if self.opened:
            self.log(record.to_dict())
            if run.stopping:  # its checkpoint comes next: the records up to it survive a kill
                self.flush()

    def on_checkpoint(self, name: str, path: Path, run: RunView) -> None:
        if self.opened:
            self.flush()

    def on_end(self, result: TrainResult, run: RunView) -> None:
        if self.opened:
            if result.sample is not None:
                self.log_text(result.step, "sample", result.sample)
            self.opened = False
            self.close()

    def on_exception(self, error: BaseException, run: RunView) -> None:
        if self.opened:  # W&B shows a failed run as "failed"; a second Ctrl-C is not a failure
            self.opened = False
            self.close(failed=not isinstance(error, KeyboardInterrupt))


def _config_markdown(config: dict) -> str:
    """The settings as a two-column Markdown table, which TensorBoard's Text tab renders."""
    rows = [f"| {key} | {str(value).replace('|', '&#124;')} |" for key, value in sorted(config.items())]
    return "\n".join(["| setting | value |", "| --- | --- |", *rows])


class TensorBoardTracker(Tracker):
    """Event files in `log_dir` (default `out_dir/tensorboard/`), one per session, read by
    TensorBoard in name order.

    Written with tensorboardX's summaries and its synchronous `EventsWriter`, not its
    `SummaryWriter`: that one writes from a thread through a queue, and its `flush()` does not wait
    for the queue, so no call could make the records before a checkpoint survive a kill.
    The settings are one Markdown table in the Text tab ("config") at the session's first step:
    the HParams plugin (`add_hparams`) wants the final metrics up front and writes each call as a
    run of its own, which a resumed run would multiply.
    """

    extra = "tensorboard"

    def __init__(self, log_dir: str | Path | None = None):
        super().__init__()
        self.log_dir = None if log_dir is None else Path(log_dir)

    def where(self, out_dir: Path) -> str:
        return f"tensorboard --logdir {self.log_dir or out_dir / TENSORBOARD_DIR}"

    def open(self, out_dir: Path, *, config: dict, resume_step: int | None, history: Iterable[dict]) -> None:
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto import event_pb2
            from tensorboardX.summary import scalar, text
        except ModuleNotFoundError as e:
            raise _missing("tensorboard", e) from None
        # protoc's generated module declares its classes at run time, out of a type checker's sight
        Event, SessionLog = event_pb2.Event, event_pb2.SessionLog  # pyright: ignore[reportAttributeAccessIssue]
        self.Event, self.scalar, self.text = Event, scalar, text
        log_dir = self.log_dir or out_dir / TENSORBOARD_DIR
        log_dir.mkdir(parents=True, exist_ok=True)
        earlier = sorted(log_dir.glob("events.out.tfevents.*"))
        # Files are read in name order (a timestamp in seconds, the host, then this suffix): the
        # count orders two sessions started within one second, and keeps the second from
        # overwriting the first (EventsWriter opens its file with "wb").
        self.writer = EventsWriter(str(log_dir / "events"), f".{len(earlier):06d}")
        start = 0 if resume_step is None else resume_step + 1
        self.writer.write_event(Event(step=start, session_log=SessionLog(status=SessionLog.START)))
        self.last_flush = time.monotonic()
        if resume_step is not None and not earlier:  # a tracker added on resume: the records kept
            for record in history:
                self.log(record)
        self._write(start, text("config", _config_markdown(config)))
        self.flush()

    def _write(self, step: int, summary: Any) -> None:
        self.writer.write_event(self.Event(step=step, wall_time=time.time(), summary=summary))

    def log(self, record: dict) -> None:
        step = record["step"]
        for tag, value in scalars(record).items():
            self._write(step, self.scalar(tag, value))
        if any(key in record for key in EVALUATIONS) or time.monotonic() - self.last_flush > FLUSH_SECS:
            self.flush()

    def log_text(self, step: int, name: str, text: str) -> None:
        # Indented four spaces: a Markdown code block keeps the sample's line breaks.
        self._write(step, self.text(name, "\n".join("    " + line for line in text.splitlines())))
        self.flush()

    def flush(self) -> None:
        self.writer.flush()  # write and fsync
        self.last_flush = time.monotonic()

    def close(self, *, failed: bool = False) -> None:
        self.writer.close()  # flushes first


def _stored_run_id(out_dir: Path) -> str | None:
    """The W&B run id kept in `out_dir/wandb-run-id`, or None if there is none."""
    try:
        return (out_dir / WANDB_ID_NAME).read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


class WandbTracker(Tracker):
    """A W&B run in `project` (default $WANDB_PROJECT, else `WANDB_PROJECT`), named after the run
    folder, its files under `out_dir/wandb/`, the settings as its config; each record is one history
    row at its step (an evaluation's joins the train row of the same step). Offline with
    WANDB_MODE=offline."""

    extra = "wandb"

    def __init__(self, project: str | None = None):
        super().__init__()
        self.project = project

    def where(self, out_dir: Path) -> str:
        return f"W&B run in {out_dir / 'wandb'}"

    def open(self, out_dir: Path, *, config: dict, resume_step: int | None, history: Iterable[dict]) -> None:
        try:
            import wandb
            from wandb.errors import Error as WandbError
        except ModuleNotFoundError as e:
            raise _missing("wandb", e) from None
        self.wandb = wandb
        # A fresh run is a new W&B run (W&B makes its id); a resumed one continues the stored id.
        run_id = _stored_run_id(out_dir) if resume_step is not None else None
        try:
            self.run = wandb.init(
                project=self.project or os.environ.get("WANDB_PROJECT", WANDB_PROJECT),
                name=out_dir.resolve().name, dir=out_dir, id=run_id, resume="allow" if run_id else None,
                config=config,
            )  # fmt: skip
        except WandbError as e:  # not logged in, a server refusing: the user's to fix, in one line
            said = " ".join(str(e).split())
            raise ConfigError(
                f"--tracker wandb could not start a W&B run: {said} (or set WANDB_MODE=offline)"
            ) from None
        if run_id is None:
            atomic_write_bytes(out_dir / WANDB_ID_NAME, self.run.id.encode())
            if resume_step is not None:  # a tracker added on resume: the records kept
                for record in history:
                    self.log(record)

    def log(self, record: dict) -> None:
        if record["step"] >= self.run.starting_step:  # W&B holds the earlier steps already
            self.run.log(scalars(record), step=record["step"])

    def log_text(self, step: int, name: str, text: str) -> None:
        if step >= self.run.starting_step:  # preformatted: the sample's line breaks show
            self.run.log({name: self.wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def flush(self) -> None:
        """Nothing to do: W&B's own process writes what it was handed, even if this one is killed."""

    def close(self, *, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # W&B shows a failed run as "failed"


def tracker_callbacks(names: Sequence[str], callbacks: Sequence[Callback] = ()) -> tuple[Tracker, ...]:
    """The trackers the setting `tracker` names (`TrainConfig.trackers`), but those of a kind already
    among `callbacks` (`tracker="tensorboard"` is a shortcut for `TensorBoardTracker()`). A missing
    extra is a one-line `ConfigError`."""
    kinds = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
    return tuple(kinds[name]() for name in names if not any(isinstance(c, kinds[name]) for c in callbacks))
