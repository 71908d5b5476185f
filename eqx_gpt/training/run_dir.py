"""The run directory: who may write into it, whether it already holds a run, and its metrics log.

A run directory holds at most one run. `RunDirLock` keeps two live runs (two processes, or two
threads of one) out of one folder at once, and `check_run_dir` refuses to start afresh over a run
already there unless told to replace it: a finished run is never lost to a repeated command.
"""

import errno
import fcntl
import json
import os
import socket
import tempfile
import threading
from pathlib import Path

from eqx_gpt.checkpoint import (
    BEST,
    LATEST,
    CheckpointError,
    checkpoint_file,
    checkpoint_paths,
    holds_run,
    read_metadata,
)
from eqx_gpt.errors import TrainingError
from eqx_gpt.files import atomic_write_bytes
from eqx_gpt.gpt2 import is_gpt2_directory
from eqx_gpt.training.config import setting

LOCK_NAME = ".lock"
LOCK_TRIES = 5  # a folder removed under a run locking it (by a refused run that created it) is made again
METRICS_NAME = "metrics.jsonl"


def _missing_folders(out_dir: Path) -> list[Path]:
    """The folders of `out_dir` that do not exist yet, deepest first (what `mkdir` would create)."""
    missing, folder = [], out_dir
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def check_writable(out_dir: Path) -> list[Path]:
    """Create `out_dir` and prove it writable, or raise a one-line `TrainingError`; returns the
    folders it created, deepest first (`RunDirLock` removes them again if the run is refused)."""
    try:
        os.stat(out_dir)
    except OSError as e:
        if e.errno == errno.ELOOP:  # as --data names it, not mkdir's "File exists"
            raise TrainingError(
                f"{setting('out_dir', str(out_dir))}: a loop of symbolic links; pass a path that resolves"
            ) from None
        if out_dir.is_symlink():
            raise TrainingError(
                f"{setting('out_dir', str(out_dir))} is a symbolic link to {os.readlink(out_dir)}, which "
                f"does not exist; create that folder or pass another {setting('out_dir')}"
            ) from None
    created = _missing_folders(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except FileNotFoundError:  # removed meanwhile by a refused run that had made it (`RunDirLock`)
        raise
    except OSError as e:
        _remove_empty(created)
        raise TrainingError(
            f"cannot write to output folder {out_dir} ({e.strerror or e}); "
            f"pass {setting('out_dir')} to a writable folder"
        ) from None
    return created


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) while each is empty: what a refused run created."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def describe_run(out_dir: Path) -> str | None:
    """A few words on the run in `out_dir` ("step 7000, val loss 1.5913"), or None if there is none."""
    for name in (LATEST, BEST):
        if checkpoint_file(out_dir, name).exists():
            try:
                meta = read_metadata(checkpoint_file(out_dir, name))
            except CheckpointError:
                return f"an unreadable checkpoint {checkpoint_file(out_dir, name).name}"
            val = meta.get("val_loss")
            return f"step {meta['step']}" + (f", val loss {val:.4f}" if isinstance(val, float) else "")
    metrics = out_dir / METRICS_NAME
    if checkpoint_paths(out_dir) or (metrics.exists() and metrics.stat().st_size > 0):
        return "the files of an earlier run"
    return None


def check_run_dir(out_dir: Path, *, resume: bool, overwrite: bool) -> str | None:
    """Refuse to start afresh in a folder that holds a run, unless `overwrite` asks to replace it;
    return a few words on the run there (`describe_run`), None if there is none."""
    if is_gpt2_directory(out_dir) and not holds_run(out_dir):
        raise TrainingError(
            f"{out_dir}/ holds a Hugging Face GPT-2 model, not a run; pass another {setting('out_dir')} "
            f"(a run's "
            f"checkpoints are never written beside a model they could be mistaken for)"
        )
    found = describe_run(out_dir)
    if resume and found is None:
        raise TrainingError(
            f"{setting('resume', True)} but no checkpoint in {out_dir}/; run without {setting('resume')} "
            f"to start"
        )
    if not resume and not overwrite and found is not None:
        raise TrainingError(
            f"{out_dir}/ already holds a run ({found}); pass {setting('resume', True)} to continue it, "
            f"another {setting('out_dir')} to start a new one, or {setting('overwrite', True)} to delete "
            f"it and start afresh"
        )
    return found


class RunDirLock:
    """An exclusive lock on a run directory for as long as a run writes into it.

    `fcntl.flock` on the directory itself: the kernel releases it when the process ends, however
    it ends, so a lock left by a killed run is simply taken over. Within one process, the folders
    held are also kept in `_HELD` (by device and inode), so that a second run in another thread
    is told it is this process's. Taking the lock creates the folder if need be (`check_writable`)
    and writes nothing in it; `claim` then records the holder's pid and host in `out_dir/.lock`,
    so that a refused run can name the live one and a new run can say whose stale lock it took
    over. A run refused before it claims the folder leaves no folder it created behind.
    """

    _HELD: dict[tuple[int, int], str] = {}  # (st_dev, st_ino) of each folder held -> holder thread
    _HELD_LOCK = threading.Lock()

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.info = out_dir / LOCK_NAME
        self.fd: int | None = None
        self.claimed = False
        self.created: list[Path] = []
        self.identity: tuple[int, int] | None = None

    def __enter__(self) -> "RunDirLock":
        # A folder this run created and another run then locked is that run's: a refused run
        # removes only what it created and still holds (`__exit__`). So a lock is taken on the
        # folder the path names, and taken again if a refused run removed that folder meanwhile
        # (two runs racing into one new folder, threads or processes).
        for _ in range(LOCK_TRIES):
            try:
                self.created += [p for p in check_writable(self.out_dir) if p not in self.created]
                self._take()
            except FileNotFoundError:  # removed between its making and its locking: make it again
                continue
            if self._still_there():
                return self
            self._release()
        raise TrainingError(f"{self.out_dir}/ kept vanishing while this run locked it; pass another out_dir")

    def _still_there(self) -> bool:
        """Whether the path still names the folder locked (not removed, nor replaced, meanwhile)."""
        assert self.fd is not None
        try:
            now = os.stat(self.out_dir)
        except OSError:
            return False
        held = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    def _take(self) -> None:
        self.fd = os.open(self.out_dir, os.O_RDONLY)
        stat = os.fstat(self.fd)
        with self._HELD_LOCK:
            thread = self._HELD.get((stat.st_dev, stat.st_ino))
            if thread is None:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass
                else:
                    self.identity = (stat.st_dev, stat.st_ino)
                    self._HELD[self.identity] = threading.current_thread().name
                    return
        os.close(self.fd)
        self.fd = None
        if thread is not None:
            who = f"another run in this process (thread {thread!r})"
        else:
            holder = self._holder()
            who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "another process"
        raise TrainingError(
            f"{self.out_dir}/ is in use by a live run ({who}); wait for it to end, or pass another "
            f"{setting('out_dir')}"
        ) from None

    def _release(self) -> None:
        with self._HELD_LOCK:
            if self.identity is not None:
                del self._HELD[self.identity]
                self.identity = None
        if self.fd is not None:
            os.close(self.fd)  # and with it the flock
            self.fd = None

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.info.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def claim(self) -> str | None:
        """Record this process as the holder; return "pid N" if a killed run's record was taken over."""
        stale = self._holder()
        atomic_write_bytes(self.info, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        self.claimed = True
        if stale and stale.get("pid") != os.getpid():
            return f"pid {stale.get('pid')} on {stale.get('host')}"
        return None

    def __exit__(self, *exc) -> None:
        if self.claimed:
            self.info.unlink(missing_ok=True)
        elif (
            self.fd is not None
        ):  # refused before it was the run's: the folders it created go, while it holds them
            _remove_empty(self.created)
        self._release()


def final_recorded(metrics: Path, step: int) -> bool:
    """Whether `metrics.jsonl` holds the final validation of the run finished at `step`."""
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "final_val_loss" in record and record.get("step") == step:
            return True
    return False


# What a record of `metrics.jsonl` may hold besides its step and numbers (the plot and a resumed run
# read them; every other value is a loss, a rate or a time).
NOT_NUMBERS = ("step", "whole_split")


def _check_record(record: dict, path: Path, number: int) -> None:
    """Refuse a record of `metrics.jsonl` whose step is not a whole number >= 0, or whose losses,
    rates and times are not numbers (a hand-edited file), in one line naming the line."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TrainingError(f"{path} line {number}: 'step' is {step!r}, not a whole number >= 0; fix or "
                            f"delete that line, then resume")  # fmt: skip
    for key, value in record.items():
        if key not in NOT_NUMBERS and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise TrainingError(f"{path} line {number}: {key!r} is {value!r}, not a number; fix or delete "
                                f"that line, then resume")  # fmt: skip


def kept_records(path: Path, keep_until: int) -> list[dict]:
    """The records of `metrics.jsonl` a run resumed at step `keep_until` keeps: those up to that step
    (later ones came after the checkpoint, and a resumed run ends with its own final line), each
    checked (`_check_record`), so that a hand-edited file is refused before the run starts."""
    records = []
    if not path.exists():
        return records
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if not isinstance(record, dict):
            continue
        _check_record(record, path, number)
        if record["step"] <= keep_until and "final_val_loss" not in record:
            records.append(record)
    return records


class Metrics:
    """`metrics.jsonl`: one JSON object per line, appended and flushed. It starts as `records` (a
    resumed run's `kept_records`; none for a fresh run), rewritten atomically."""

    def __init__(self, path: Path, records: list[dict]):
        self.path = path
        self.records = list(records)
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.records.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
