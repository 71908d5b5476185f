"""Files and paths: atomic writes, and paths resolved the same way on every Python.

Every file eqx_gpt writes (checkpoints, metrics, pictures, exported GPT-2 weights) goes through
`atomic_write_bytes`: a temporary file in the same directory, fsynced, then `os.replace`d into place.
A folder written as one (a PEFT adapter folder) goes through `atomic_folder`: filled under a
temporary name beside it, then renamed into place. Both are created as `open()` and `mkdir()`
create them, their modes from the user's umask (0644 and 0755 under the usual 022), never
`tempfile`'s private 0600 and 0700: an exported model is a file like any other.
"""

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

FILE_MODE, FOLDER_MODE = 0o666, 0o777  # before the umask, as open() and mkdir() take them


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms where directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temporary_name(path: Path) -> Path:
    """A name beside `path` for its temporary copy: hidden, random, ending `.tmp`."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` by `data` so that readers see the old file or the new one, never a mix."""
    path = Path(path)
    while True:
        tmp = _temporary_name(path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), FILE_MODE)
            break
        except FileExistsError:  # another writer's name: draw again
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """A new folder to fill, put in place of the folder `path` (its links followed) when the block
    ends without an error; on an error nothing at `path` has changed and the new folder is removed.
    An old folder is swapped out by two renames (POSIX renames a folder over an empty one only), so
    a reader sees the old files or the new ones, never a mix; what it held is not kept."""
    path = resolve(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _temporary_name(path)
        try:
            tmp.mkdir(FOLDER_MODE)
            break
        except FileExistsError:  # another writer's name: draw again
            continue
    try:
        yield tmp
        for file in tmp.iterdir():
            _fsync_file(file)
        if path.is_dir():
            old = _temporary_name(path)
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)  # a file there is refused (NotADirectoryError), never replaced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write `files` (name: bytes) into the folder `directory` (its links followed). A new folder,
    or one holding these files alone, is written whole and put in place at once (`atomic_folder`):
    never a new file beside an old one. In a folder holding other files too (a run's), nothing of
    which may be lost, each file is replaced atomically, in the order given (the one that names the
    others last)."""
    directory = resolve(directory)
    if directory.is_dir() and not {p.name for p in directory.iterdir()} <= set(files):
        for name, data in files.items():
            atomic_write_bytes(directory / name, data)
        return
    with atomic_folder(directory) as new:
        for name, data in files.items():
            (new / name).write_bytes(data)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def resolve(path: str | Path) -> Path:
    """`path` made absolute with its links followed (`Path.resolve()`), except that a loop of links
    raises `OSError(ELOOP)` on every Python: 3.11 raises `RuntimeError`, and 3.13's `resolve()`
    returns the loop's path as if it were a path to nothing."""
    path = Path(path)
    try:
        return path.resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError):  # a path to nothing (yet): resolved as far as it goes
        pass
    except RuntimeError:  # Python 3.11's "Symlink loop from ..."
        raise OSError(errno.ELOOP, "a loop of symbolic links", str(path)) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise OSError(errno.ELOOP, "a loop of symbolic links", str(path)) from None
    try:
        return path.resolve()
    except RuntimeError:
        raise OSError(errno.ELOOP, "a loop of symbolic links", str(path)) from None
