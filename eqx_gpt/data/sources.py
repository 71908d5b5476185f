"""Where a corpus's text comes from: the files under `--data PATH`, checked, and read in pieces.

PATH is a file or a folder. In a folder every file below it counts, in the sorted order of their
relative names, except hidden ones (`.git/`, `.venv/`), empty ones and binary ones (a NUL byte in
the first 8 KiB, git's test), which are skipped and counted. Symbolic links are followed, to
files and to folders alike; a link back to a folder it is in (a loop) is refused. A file named
`*.jsonl` holds one JSON object per line whose "text" field is a document (a UTF-8 byte-order
mark before the first is allowed); any other file is one document of UTF-8 text. The corpus is
its documents joined by a blank line (`SEPARATOR`).

Files are read in byte ranges that end at a newline (`byte_ranges`), so each range decodes alone,
no file is ever read whole, and a bad byte is reported by its offset in its file. Any error in
reading a file is a `DataError` naming that file (`reading`), never the folder or the cache.
"""

import contextlib
import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from eqx_gpt.errors import DataError

SEPARATOR = "\n\n"  # between two documents (files, or the records of a .jsonl)
BINARY_PROBE = 8192  # bytes looked at for a NUL byte (git's test for a binary file)
SCAN = 1 << 20  # bytes read at a time when looking for the newline that ends a range
MAX_RECORD = 1 << 28  # the longest .jsonl line read (256 MiB: a few GB of memory while tokenized)
BOM = "\ufeff"


@dataclass(frozen=True)
class Source:
    """One file of a corpus: `name` is its path relative to the corpus folder (a lone file: its
    name); `size`, the times and `inode` are its `stat` when listed (see `manifest.py`)."""

    path: Path
    name: str
    size: int
    mtime_ns: int
    ctime_ns: int = 0
    inode: int = 0

    @property
    def jsonl(self) -> bool:
        return self.path.suffix.lower() == ".jsonl"


def _source(path: Path, name: str) -> Source:
    st = path.stat()
    return Source(path, name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@contextlib.contextmanager
def reading(path: Path):
    """Turn an `OSError` while reading the source `path` into a one-line `DataError` naming it."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise DataError(
                f"data file {path} vanished while it was read (deleted or renamed after it was listed); "
                f"run again once the data stops changing"
            ) from None
        raise DataError(
            f"data file {path} cannot be read ({e.strerror or e}); fix its permissions or remove it"
        ) from None


def check_unchanged(sources: list[Source]) -> None:
    """Refuse sources whose `stat` changed since they were listed: the bytes hashed and the bytes
    tokenized would not be known to be the same."""
    for s in sources:
        with reading(s.path):
            now = _source(s.path, s.name)
        if now != s:
            raise DataError(
                f"data file {s.path} changed while it was prepared; run again once the data stops changing"
            )


def _nul_offset(path: Path) -> int | None:
    """Where the first NUL byte of the file's first `BINARY_PROBE` bytes is (None: there is none)."""
    with reading(path), open(path, "rb") as f:
        at = f.read(BINARY_PROBE).find(b"\0")
    return None if at < 0 else at


def resolve(path: str | Path) -> Path:
    """`path` made absolute, its links followed (`DataError` for a loop of links)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # Python 3.11 raises RuntimeError("Symlink loop ...")
        raise DataError(
            f"data path {path} is a loop of symbolic links; pass --data PATH to a real file"
        ) from None


def find_sources(path: str | Path) -> tuple[list[Source], int]:
    """`(sources, binary files skipped)` of the corpus at `path`, a file or a folder (see the module
    docstring). Raises `DataError` for a missing path, an empty or binary file, or a folder with no
    text file in it."""
    path = resolve(path)
    try:
        if path.is_file():
            return [_checked_file(path)], 0
        if path.is_dir():
            return _folder_sources(path)
        exists = path.exists()
    except OSError as e:
        raise DataError(f"data path {path} cannot be read ({e.strerror or e})") from None
    if exists:
        raise DataError(
            f"data path {path} is not a file or a folder (a device, pipe or socket); pass --data PATH to a "
            f"text file or a folder"
        )
    raise DataError(f"data path {path} does not exist; pass --data PATH to a text file or a folder")


def _checked_file(path: Path) -> Source:
    with reading(path):
        source = _source(path, path.name)
    if source.size == 0:
        raise DataError(f"data file {path} is empty; pass a text file with some content")
    at = _nul_offset(path)
    if at is not None:
        raise DataError(
            f"data file {path} is binary (a NUL byte at offset {at}), not text; pass a UTF-8 text or "
            f".jsonl file"
        )
    return source


def _folder_sources(folder: Path) -> tuple[list[Source], int]:
    sources, skipped = [], 0
    for file, name in _walk(folder, "", {_folder_id(folder, folder)}):
        try:
            source = _source(file, name)
        except FileNotFoundError:  # gone since it was listed (an editor's temporary file)
            continue
        except OSError as e:
            raise DataError(
                f"data file {file} cannot be read ({e.strerror or e}); fix it or remove it"
            ) from None
        if source.size == 0:
            continue
        if _nul_offset(file) is not None:
            skipped += 1
            continue
        sources.append(source)
    if not sources:
        what = f"only binary files ({skipped})" if skipped else "no files"
        raise DataError(f"data folder {folder} holds {what}; pass a folder of UTF-8 text or .jsonl files")
    return sorted(sources, key=lambda s: s.name), skipped


def _folder_id(folder: Path, shown: Path) -> tuple[int, int]:
    try:
        st = folder.stat()
    except OSError as e:
        raise DataError(
            f"data folder {shown} cannot be read ({e.strerror or e}); fix it or remove it"
        ) from None
    return st.st_dev, st.st_ino


def _walk(folder: Path, prefix: str, above: set[tuple[int, int]]):
    """`(path, relative name)` of the files below `folder`, but hidden ones, following links;
    `above` holds the folders it is inside (by device and inode), so a loop is caught."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        raise DataError(
            f"data folder {folder} cannot be read ({e.strerror or e}); fix it or remove it"
        ) from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        path, name = Path(entry.path), prefix + entry.name
        try:
            is_dir, is_file = entry.is_dir(), entry.is_file()
        except OSError:  # a dangling link or a loop of links: no file there
            continue
        if is_dir:
            key = _folder_id(path, path)
            if key in above:
                raise DataError(
                    f"data folder {path} is a link to a folder it is in (a loop); remove the link or pass "
                    f"a folder without it"
                )
            yield from _walk(path, name + "/", above | {key})
        elif is_file:
            yield path, name


def sha256_of(path: Path) -> str:
    """The file's sha256, read in pieces (never whole)."""
    with reading(path), open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def byte_ranges(source: Source, size: int) -> list[tuple[int, int]]:
    """`(start, end)` ranges of about `size` bytes that cover the file, each ending just after a
    newline (a long line without one, in a text file: at the start of a UTF-8 character)."""
    bounds, at = [0], 0
    with reading(source.path), open(source.path, "rb") as f:
        while at + size < source.size:
            at = _range_end(f, at + size, source)
            if at >= source.size:
                break
            bounds.append(at)
    return list(zip(bounds, [*bounds[1:], source.size], strict=True))


def _range_end(f, at: int, source: Source) -> int:
    """The first position at or after `at` just past a newline (or, unless the file is a .jsonl,
    whose records are never split, where a UTF-8 character starts, should no newline come within
    `SCAN` bytes)."""
    start = at
    while True:
        f.seek(at)
        block = f.read(SCAN)
        newline = block.find(b"\n")
        if newline >= 0:
            return at + newline + 1
        if not source.jsonl:
            return at + next((i for i, byte in enumerate(block) if byte & 0xC0 != 0x80), len(block))
        if len(block) < SCAN:
            return at + len(block)
        at += SCAN
        if at - start > MAX_RECORD:
            raise DataError(
                f"data file {source.path} has a line longer than {MAX_RECORD >> 20} MiB (near byte "
                f"{start:,}); a .jsonl holds one JSON object per line: split it into records"
            )


def read_text(source: Source, start: int, end: int) -> str:
    """The bytes `[start, end)` of a file decoded as UTF-8 (`DataError` names the offset of a bad byte)."""
    with reading(source.path), open(source.path, "rb") as f:
        f.seek(start)
        raw = f.read(end - start)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data file {source.path} is not UTF-8 text (byte {start + e.start}: "
            f"{raw[e.start : e.start + 1]!r}); convert it, e.g. `iconv -t UTF-8`, or remove it"
        ) from None


def documents(source: Source, start: int, end: int) -> list[str]:
    """The documents in bytes `[start, end)` of a file: the text itself, or a .jsonl's "text" fields."""
    text = read_text(source, start, end)
    if not source.jsonl:
        return [text]
    if start == 0 and text.startswith(BOM):  # a byte-order mark, as some Windows tools write
        text = text[len(BOM) :]
    docs = []
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("text"), str)):
            n = _line_number(source, start) + i
            raise DataError(
                f'{source.path} line {n} is not a JSON object with a "text" string; every line of a '
                f'.jsonl must be one, e.g. {{"text": "..."}}'
            )
        if record["text"]:
            docs.append(record["text"])
    return docs


def _line_number(source: Source, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` (read only when reporting an error)."""
    count = 0
    with reading(source.path), open(source.path, "rb") as f:
        while offset > 0:
            block = f.read(min(SCAN, offset))
            count += block.count(b"\n")
            offset -= len(block)
    return count + 1
