"""Where prepared corpora live, how one is written so that no reader ever sees half of it, and
how a reader keeps the version it opened.

The cache is `$EQX_GPT_DATA_CACHE` if set, else `$XDG_CACHE_HOME/eqx_gpt/tokens` (by default
`~/.cache/eqx_gpt/tokens`): never beside the data, so a read-only data folder works. Each corpus
has one entry there, a folder named after its path and tokenizer (`entry_name`).

Writing: one process at a time per entry (`EntryLock`, an `flock` the kernel releases when its
holder dies), into a temporary folder beside the entry, each file fsynced, the manifest last;
then `publish` renames it into place. A published folder's shards are never written again (only
its manifest may be replaced, atomically, by one listing the same shards).

Reading: `Snapshot.open` opens the entry's folder and takes a shared `flock` on it, which it holds
until closed; the manifest and every shard are opened through that folder's descriptor
(`openat`), never by path. So a reader keeps the version it opened for as long as it lives:
a later preparation renames the old folder aside (`.NAME.old-PID`) and publishes a new one, and
the old folder is deleted only once no reader holds it (`collect` takes an exclusive lock on it
first). Why not hold every shard open from the start: a corpus of tens of gigabytes has
thousands of shards, more than the usual limit of 1,024 open files; one folder descriptor per
reader works at any shard count, and shards are still opened as needed (`shards.ShardFile`).

A crash leaves a temporary folder or an old version aside; `collect` deletes them at the next
start that finds the entry's lock free, so nothing is left for good. It never leaves an entry
without its manifest.
"""

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from eqx_gpt.errors import DataError
from eqx_gpt.files import resolve

CACHE_ENV = "EQX_GPT_DATA_CACHE"


def cache_root() -> Path:
    """The folder that holds prepared corpora (see the module docstring)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    root = Path(os.environ[CACHE_ENV]) if os.environ.get(CACHE_ENV) else Path(xdg) / "eqx_gpt" / "tokens"
    return resolve_cache(root)


def resolve_cache(root: str | Path) -> Path:
    """`root` made absolute, its links followed (`DataError` for a loop of links)."""
    try:
        return resolve(Path(root).expanduser())
    except OSError as e:
        cause = (
            "is a loop of symbolic links" if e.errno == errno.ELOOP else f"cannot be read ({e.strerror or e})"
        )
        raise DataError(f"the token cache {root} {cause}; set {CACHE_ENV} to a real folder") from None


def entry_name(data: Path, tokenizer: dict, text_field: str = "text", split: str | None = None) -> str:
    """`<file or folder name>-<tokenizer>-<hash of the absolute path, the tokenizer, the text
    field of records, if not "text", and the split read of a folder of splits, if any>`."""
    keyed = [str(data), tokenizer, *([text_field] if text_field != "text" else [])]
    keyed += [{"split": split}] if split is not None else []
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", data.name)[:48] or "data"
    return f"{slug}-{tokenizer['kind']}-{key}"


def unwritable(root: Path, e: OSError) -> DataError:
    return DataError(
        f"the token cache {root} cannot be written ({e.strerror or e}); set {CACHE_ENV} to a writable folder"
    )


class EntryLock:
    """An exclusive `flock` on `<root>/<name>.lock`: one preparer of an entry at a time. `waiting`
    is called (once) if another process holds it; with `wait=False`, `held` tells whether it
    was taken instead."""

    def __init__(self, root: Path, name: str, waiting=lambda: None, *, wait: bool = True):
        self.path, self.waiting, self.wait, self.fd, self.held = (
            root / f"{name}.lock",
            waiting,
            wait,
            -1,
            False,
        )

    def __enter__(self) -> "EntryLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise unwritable(self.path.parent, e) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.held = True
        except BlockingIOError:
            if self.wait:
                self.waiting()
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                self.held = True
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # releases the lock


class Snapshot:
    """One published version of an entry, held open: `fd` is its folder's descriptor, with a
    shared `flock` on it, so `collect` never deletes it while this lives (see the module
    docstring). Files are opened relative to it (`open_file`)."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path
        self.open_files: dict[str, int] = {}  # shard descriptors, kept by `shards.ShardFile`

    @classmethod
    def open(cls, entry: Path) -> "Snapshot | None":
        """The version now at `entry`, locked shared; None if there is none."""
        for _ in range(8):  # a version renamed aside between open and lock: take the new one
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError:  # a file system without locks (some network ones): read, unprotected
                pass
            try:
                if os.stat(entry).st_ino == os.fstat(fd).st_ino:
                    return cls(fd, entry)
            except OSError:
                pass
            os.close(fd)
        return None

    @property
    def inode(self) -> int:
        return os.fstat(self.fd).st_ino

    def open_file(self, name: str) -> int:
        """A read-only descriptor of the file `name` in this version's folder."""
        if self.fd < 0:
            raise ValueError(f"the corpus in {self.path} was closed; prepare it again to read it")
        return os.open(name, os.O_RDONLY, dir_fd=self.fd)

    def read_bytes(self, name: str) -> bytes:
        fd = self.open_file(name)
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Close its files and release the version (a closed snapshot reads nothing more)."""
        for fd in self.open_files.values():
            os.close(fd)
        self.open_files.clear()
        if self.fd >= 0:
            os.close(self.fd)  # releases the shared lock
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def new_folder(root: Path, name: str) -> Path:
    """A fresh temporary folder for entry `name`, beside it (the same file system: renames are atomic)."""
    return Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-"))


def _unused(folder: Path) -> bool:
    """Whether no reader holds `folder` (then it stays locked by nobody: the caller deletes it)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held by a reader (or no locks here: kept, to be safe)
        return False
    finally:
        os.close(fd)


def remove_leftovers(root: Path, name: str) -> None:
    """Delete what crashed preparations of entry `name` left, and its old versions that no
    reader holds any more (call with the entry's lock held)."""
    for leftover in root.glob(f".{name}.*"):
        if ".old-" not in leftover.name or _unused(leftover):
            shutil.rmtree(leftover, ignore_errors=True)


def collect(root: Path, name: str) -> None:
    """`remove_leftovers` if the entry's lock is free now (a preparer at work keeps its folder)."""
    if not any(root.glob(f".{name}.*")):
        return
    try:
        with EntryLock(root, name, wait=False) as lock:
            if lock.held:
                remove_leftovers(root, name)
    except DataError:  # a cache this process cannot write: it can still read it
        pass


def publish(folder: Path, entry: Path) -> None:
    """Make the complete `folder` the entry: the old entry (if any) is moved aside first, then
    `folder` renamed into place; a crash in between leaves no entry, never a partial one. The old
    version is deleted now if no reader holds it, else by a later `collect`."""
    if entry.exists():
        os.rename(entry, entry.with_name(f".{entry.name}.old-{os.getpid()}-{os.urandom(4).hex()}"))
        fsync(entry.parent)
    os.rename(folder, entry)
    fsync(entry.parent)
    remove_leftovers(entry.parent, entry.name)


def fsync(path: Path) -> None:
    """Flush a file's or a folder's data (a folder: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
