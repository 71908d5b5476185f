"""Where prepared corpora live, and how one is written so that no reader ever sees half of it.

The cache is `$EQX_GPT_DATA_CACHE` if set, else `$XDG_CACHE_HOME/eqx_gpt/tokens` (by default
`~/.cache/eqx_gpt/tokens`): never beside the data, so a read-only data folder works. Each corpus
has one folder there, named after its path and tokenizer (`entry_name`).

Writing: one process at a time per entry (`EntryLock`, an `flock` the kernel releases when its
holder dies), into a temporary folder beside the entry, each file fsynced, the manifest last;
then `publish` renames it into place. A crash leaves a temporary folder, which the next holder
of the lock deletes (`remove_leftovers`); it never leaves an entry without its manifest.
"""

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from eqx_gpt.data.sources import DataError

CACHE_ENV = "EQX_GPT_DATA_CACHE"


def cache_root() -> Path:
    """The folder that holds prepared corpora (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser().resolve() / "eqx_gpt" / "tokens"


def entry_name(data: Path, tokenizer: dict) -> str:
    """`<file or folder name>-<tokenizer>-<hash of the absolute path and the tokenizer>`."""
    key = hashlib.sha256(json.dumps([str(data), tokenizer], sort_keys=True).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", data.name)[:48] or "data"
    return f"{slug}-{tokenizer['kind']}-{key}"


class EntryLock:
    """An exclusive `flock` on `<root>/<name>.lock`: one preparer of an entry at a time. `waiting`
    is called (once) if another process holds it."""

    def __init__(self, root: Path, name: str, waiting=lambda: None):
        self.path, self.waiting, self.fd = root / f"{name}.lock", waiting, None

    def __enter__(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DataError(
                f"the token cache {self.path.parent} cannot be written ({e.strerror or e}); set "
                f"{CACHE_ENV} to a writable folder"
            ) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.waiting()
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)  # releases the lock


def new_folder(root: Path, name: str) -> Path:
    """A fresh temporary folder for entry `name`, beside it (the same file system: renames are atomic)."""
    return Path(tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-"))


def remove_leftovers(root: Path, name: str) -> None:
    """Delete what crashed preparations of entry `name` left (call with its lock held)."""
    for leftover in root.glob(f".{name}.*"):
        shutil.rmtree(leftover, ignore_errors=True)


def publish(folder: Path, entry: Path) -> None:
    """Make the complete `folder` the entry: the old entry (if any) is moved aside first, then
    `folder` renamed into place; a crash in between leaves no entry, never a partial one."""
    if entry.exists():
        aside = entry.with_name(f".{entry.name}.old-{os.getpid()}")
        os.rename(entry, aside)
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
