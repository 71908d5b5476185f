"""Where a corpus's text comes from: the files under `--data PATH`, checked, and read in pieces.

PATH is a file or a folder. In a folder every file below it counts, in the sorted order of their
relative names, except hidden ones (`.git/`, `.venv/`), empty ones and binary ones (a NUL byte in
the first 8 KiB, git's test), which are skipped and counted. A file named `*.jsonl` holds one
JSON object per line whose "text" field is a document; any other file is one document of UTF-8
text. The corpus is its documents joined by a blank line (`SEPARATOR`).

Files are read in byte ranges that end at a newline (`byte_ranges`), so each range decodes alone,
no file is ever read whole, and a bad byte is reported by its offset in its file.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from eqx_gpt.errors import DataError

SEPARATOR = "\n\n"  # between two documents (files, or the records of a .jsonl)
BINARY_PROBE = 8192  # bytes looked at for a NUL byte (git's test for a binary file)
SCAN = 1 << 20  # bytes read at a time when looking for the newline that ends a range


@dataclass(frozen=True)
class Source:
    """One file of a corpus: `name` is its path relative to the corpus folder (a lone file: its name)."""

    path: Path
    name: str
    size: int
    mtime_ns: int

    @property
    def jsonl(self) -> bool:
        return self.path.suffix.lower() == ".jsonl"


def _source(path: Path, name: str) -> Source:
    st = path.stat()
    return Source(path, name, st.st_size, st.st_mtime_ns)


def _nul_offset(path: Path) -> int | None:
    """Where the first NUL byte of the file's first `BINARY_PROBE` bytes is (None: there is none)."""
    with open(path, "rb") as f:
        at = f.read(BINARY_PROBE).find(b"\0")
    return None if at < 0 else at


def find_sources(path: str | Path) -> tuple[list[Source], int]:
    """`(sources, binary files skipped)` of the corpus at `path`, a file or a folder (see the module
    docstring). Raises `DataError` for a missing path, an empty or binary file, or a folder with no
    text file in it."""
    path = Path(path).resolve()
    try:
        if path.is_file():
            return [_checked_file(path)], 0
        if not path.is_dir():
            raise DataError(f"data path {path} does not exist; pass --data PATH to a text file or a folder")
        return _folder_sources(path)
    except OSError as e:
        raise DataError(f"data path {path} cannot be read ({e.strerror or e})") from None


def _checked_file(path: Path) -> Source:
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
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            file = Path(root, name)
            if name.startswith(".") or not file.is_file():
                continue
            source = _source(file, file.relative_to(folder).as_posix())
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


def sha256_of(path: Path) -> str:
    """The file's sha256, read in pieces (never whole)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def byte_ranges(source: Source, size: int) -> list[tuple[int, int]]:
    """`(start, end)` ranges of about `size` bytes that cover the file, each ending just after a
    newline (a long line without one, in a text file: at the start of a UTF-8 character)."""
    bounds, at = [0], 0
    with open(source.path, "rb") as f:
        while at + size < source.size:
            at = _range_end(f, at + size, source.jsonl)
            if at >= source.size:
                break
            bounds.append(at)
    return list(zip(bounds, [*bounds[1:], source.size], strict=True))


def _range_end(f, at: int, whole_lines: bool) -> int:
    """The first position at or after `at` just past a newline (or, unless `whole_lines`, where a
    UTF-8 character starts, should no newline come within `SCAN` bytes)."""
    f.seek(at)
    block = f.read(SCAN)
    newline = block.find(b"\n")
    if newline >= 0:
        return at + newline + 1
    if whole_lines:  # a .jsonl record is never split; look further
        return at + len(block) if len(block) < SCAN else _range_end(f, at + SCAN, True)
    lead = next((i for i, byte in enumerate(block) if byte & 0xC0 != 0x80), len(block))
    return at + lead


def read_text(source: Source, start: int, end: int) -> str:
    """The bytes `[start, end)` of a file decoded as UTF-8 (`DataError` names the offset of a bad byte)."""
    with open(source.path, "rb") as f:
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
    with open(source.path, "rb") as f:
        while offset > 0:
            block = f.read(min(SCAN, offset))
            count += block.count(b"\n")
            offset -= len(block)
    return count + 1
