"""Live curves where people look: the records of `metrics.jsonl` sent to TensorBoard or Weights &
Biases as well (`--tracker tensorboard,wandb`), each an optional extra imported only when opened.

    trackers = open_trackers(["tensorboard"], out_dir, config=flat_config, resume_step=None, is_writer=True)
    trackers.log({"step": 10, "loss": 3.2, "grad_norm": 0.8, "lr": 1e-3, "tokens_per_s": 41000.0})
    trackers.log_text(1600, "sample", text)
    trackers.close()

A tracker is fed exactly the records the run writes to `metrics.jsonl` (train loss, gradient norm,
learning rate and tokens/s at logged steps; train and validation loss at evaluations; the final validation),
the run's resolved settings as hyperparameters when opened, and the sample text at the end.

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
at most every `FLUSH_SECS` otherwise, and at `flush()` and `close()`. `bench/trackers.py` times it.
"""

import html
import importlib.util
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from eqx_gpt.errors import ConfigError
from eqx_gpt.files import atomic_write_bytes

TRACKERS = ("tensorboard", "wandb")
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


def parse_trackers(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """The tracker names in `spec` ("tensorboard,wandb", a list of such; None, "" or "none" for
    none, as a resumed run may drop them), each once, in order; an unknown name raises `ConfigError`."""
    if spec is None:
        return ()
    parts = [spec] if isinstance(spec, str) else list(spec)
    names = [n.strip().lower() for part in parts for n in part.split(",")]
    names = [n for n in names if n and n != "none"]
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"--tracker {name!r} is not a tracker; choose from {', '.join(TRACKERS)}")
    return tuple(dict.fromkeys(names))


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a `metrics.jsonl` record by tag (`TAGS`), without its step; a bool is 0 or 1."""
    return {
        TAGS.get(key, key): float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, int | float)
    }


class Tracker(Protocol):
    """Where a run's records go besides `metrics.jsonl`. Every record is a dict with an int "step"."""

    def log(self, record: dict) -> None: ...

    def log_text(self, step: int, name: str, text: str) -> None: ...

    def flush(self) -> None: ...

    def close(self, *, failed: bool = False) -> None: ...


def require_trackers(names: Sequence[str]) -> None:
    """Refuse, in one line, a tracker whose optional package is not installed, without importing it:
    a run checks this with its settings, before it writes anything."""
    for name in parse_trackers(list(names)):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise _missing(name, ModuleNotFoundError(name=PACKAGES[name]))


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


def _config_markdown(config: dict) -> str:
    """The settings as a two-column Markdown table, which TensorBoard's Text tab renders."""
    rows = [f"| {key} | {str(value).replace('|', '&#124;')} |" for key, value in sorted(config.items())]
    return "\n".join(["| setting | value |", "| --- | --- |", *rows])


class TensorBoardTracker:
    """Event files in `out_dir/tensorboard/`, one per session, read by TensorBoard in name order.

    Written with tensorboardX's summaries and its synchronous `EventsWriter`, not its
    `SummaryWriter`: that one writes from a thread through a queue, and its `flush()` does not wait
    for the queue, so no call could make the records before a checkpoint survive a kill.
    The settings are one Markdown table in the Text tab ("config") at the session's first step:
    the HParams plugin (`add_hparams`) wants the final metrics up front and writes each call as a
    run of its own, which a resumed run would multiply.
    """

    def __init__(self, out_dir: Path, *, config: dict, resume_step: int | None, history: Iterable[dict]):
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto import event_pb2
            from tensorboardX.summary import scalar, text
        except ModuleNotFoundError as e:
            raise _missing("tensorboard", e) from None
        # protoc's generated module declares its classes at run time, out of a type checker's sight
        Event, SessionLog = event_pb2.Event, event_pb2.SessionLog  # pyright: ignore[reportAttributeAccessIssue]
        self.Event, self.scalar, self.text = Event, scalar, text
        log_dir = out_dir / TENSORBOARD_DIR
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


class WandbTracker:
    """A W&B run in project `WANDB_PROJECT` (or $WANDB_PROJECT), named after the run folder, its
    files under `out_dir/wandb/`, the settings as its config; each record is one history row at its
    step (an evaluation's joins the train row of the same step). Offline with WANDB_MODE=offline."""

    def __init__(self, out_dir: Path, *, config: dict, resume_step: int | None, history: Iterable[dict]):
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
                project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT), name=out_dir.resolve().name,
                dir=out_dir, id=run_id, resume="allow" if run_id else None, config=config,
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


class Trackers:
    """The trackers a run writes to, as one: each call goes to every tracker, in order. Empty (every
    call does nothing) for a run without `--tracker`, and in every JAX process but the first."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers = tuple(trackers)

    def log(self, record: dict) -> None:
        """Send one `metrics.jsonl` record (a dict with an int "step")."""
        for tracker in self.trackers:
            tracker.log(record)

    def log_text(self, step: int, name: str, text: str) -> None:
        """Send a text (the sample at the end of a run) at `step` under `name`."""
        for tracker in self.trackers:
            tracker.log_text(step, name, text)

    def flush(self) -> None:
        """Make every record sent so far survive a kill (call it before writing a checkpoint)."""
        for tracker in self.trackers:
            tracker.flush()

    def close(self, *, failed: bool = False) -> None:
        """Flush and close every tracker; `failed` marks a run that ended on an error."""
        for tracker in self.trackers:
            tracker.close(failed=failed)

    def __enter__(self) -> "Trackers":
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None and not issubclass(kind, KeyboardInterrupt))


def open_trackers(
    names: Sequence[str],
    out_dir: str | Path,
    *,
    config: dict,
    resume_step: int | None,
    is_writer: bool,
    history: Iterable[dict] = (),
) -> Trackers:
    """Open the trackers `names` (from `TRACKERS`) for the run in `out_dir`.

    `config` is the run's resolved settings, flat (GPTConfig and TrainConfig fields). `resume_step`
    is the step of the checkpoint a resumed run starts from (None for a fresh run): the records up
    to it stay, later ones are replaced by the resumed run's. `history` is the records the resumed
    run kept (`run_dir.kept_records`), sent first to a tracker this run opens for the first time in
    `out_dir`. `is_writer` is False in every JAX process but the first: only one process writes.
    A tracker whose optional package is missing raises a one-line `ConfigError`.
    """
    names = parse_trackers(list(names))
    if not is_writer or not names:
        return Trackers()
    out_dir, history = Path(out_dir), list(history)
    makers = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(makers[name](out_dir, config=config, resume_step=resume_step, history=history))
    except BaseException:
        Trackers(opened).close(failed=True)
        raise
    return Trackers(opened)
