"""Where a corpus's text comes from: the files under `--data PATH`, checked, and read in pieces.

PATH is a file or a folder. In a folder every file below it counts, in the sorted order of their
relative names, except hidden ones (`.git/`, `.venv/`, not counted) and those skipped and counted
(`Listing.summary`): empty ones, binary ones (a NUL byte in the first 8 KiB, git's test, of the
text once decompressed) and the metadata of a Hugging Face `datasets` folder (`dataset_info.json`,
`state.json`, a dataset card: only its `.arrow` files are read). A folder that is mostly binary
files by bytes is refused. Symbolic links are followed, to files and to folders alike; a link
back to a folder it is in (a loop) is refused.

A file's format is told by its name (`formats.py`): a `*.jsonl` holds one JSON object per line
whose text field (`"text"`, or another named) is a document (a UTF-8 byte-order mark before the
first is allowed); a table (`.parquet`, `.arrow`) holds a document per row of its text column;
any other file is one document of UTF-8 text; `.gz`, `.xz` and `.zst` text and `.jsonl` are read
as they decompress. The corpus is its documents joined by a blank line (`SEPARATOR`).

Plain files are read in byte ranges that end at a newline (`byte_ranges`), so each range decodes
alone, no file is ever read whole, and a bad byte is reported by its offset in its file. Any
error in reading a file is a `DataError` naming that file (`reading`), never the folder or the cache.
"""

import contextlib
import errno
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from eqx_gpt.data import formats
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
    def compression(self) -> str | None:
        """The compression it is read through: "gzip", "xz", "zstd", or None."""
        return formats.compression(self.path)

    @property
    def kind(self) -> str:
        """Its format: "text", "jsonl", "parquet" or "arrow" (see `formats.kind`)."""
        return formats.kind(self.path)

    @property
    def jsonl(self) -> bool:
        return self.kind == "jsonl"

    @property
    def records(self) -> bool:
        """Whether it holds documents one by one (a .jsonl or a table), not one document of text."""
        return self.kind != "text"

    @property
    def table(self) -> bool:
        return self.kind in formats.TABLES.values()


@dataclass(frozen=True)
class Skipped:
    """A file of a folder that was not read: `why` is "empty", "binary" or "metadata"."""

    name: str
    size: int
    why: str


@dataclass(frozen=True)
class Listing:
    """The files of a corpus: `sources` read, in order, and those `skipped`."""

    sources: list[Source]
    skipped: tuple[Skipped, ...] = field(default=())

    @property
    def summary(self) -> str:
        """What was read and skipped, by kind: "read 12 files (10 .txt, 2 .parquet); skipped 3
        (2 binary, 1 empty)"."""
        n = len(self.sources)
        text = (
            f"read {n:,} file{'s' if n != 1 else ''} ({_counts(formats.label(s.path) for s in self.sources)})"
        )
        if self.skipped:
            text += f"; skipped {len(self.skipped):,} ({_counts(s.why for s in self.skipped)})"
        return text

    @property
    def skipped_binary(self) -> int:
        return sum(s.why == "binary" for s in self.skipped)


def _counts(kinds: Iterable[str]) -> str:
    """The kinds counted, the most common first: "10 .txt, 2 .parquet"."""
    counted = sorted(Counter(kinds).items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{n:,} {kind}" for kind, n in counted)


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


def _head(source: Source) -> bytes | None:
    """The first `BINARY_PROBE` bytes of the file's text (decompressed); None for a table, which
    is not probed (the package that reads it must be there, though)."""
    if source.table:
        formats.optional("pyarrow", source.path)
        return None
    with reading(source.path):
        if source.compression is None:
            with open(source.path, "rb") as f:
                return f.read(BINARY_PROBE)
        head = b""
        with contextlib.closing(formats.decompressed(source.path, source.compression)) as blocks:
            for block, _ in blocks:
                head += block
                if len(head) >= BINARY_PROBE:
                    break
        return head[:BINARY_PROBE]


def _skip_reason(source: Source) -> str | None:
    """Why a folder skips the file, "empty" or "binary" (None: it is read)."""
    if source.size == 0:
        return "empty"
    head = _head(source)
    if head is None:
        return None
    return "empty" if not head else "binary" if b"\0" in head else None


def resolve(path: str | Path) -> Path:
    """`path` made absolute, its links followed (`DataError` for a loop of links)."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # Python 3.11 raises RuntimeError("Symlink loop ...")
        raise DataError(
            f"data path {path} is a loop of symbolic links; pass --data PATH to a real file"
        ) from None


def find_sources(path: str | Path) -> Listing:
    """The `Listing` of the corpus at `path`, a file or a folder (see the module docstring).
    Raises `DataError` for a missing path, an empty, binary or damaged file, a folder with no
    file to read, or one that is mostly binary files."""
    path = resolve(path)
    try:
        if path.is_file():
            return Listing([_checked_file(path)])
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
    why = _skip_reason(source)
    if why == "empty":
        raise DataError(f"data file {path} is empty; pass a text file with some content")
    if why == "binary":
        at = (_head(source) or b"").find(b"\0")
        where = f"byte {at} of its decompressed text" if source.compression else f"offset {at}"
        raise DataError(
            f"data file {path} is binary (a NUL byte at {where}), not text; pass a UTF-8 text, .jsonl or "
            f".parquet file"
        )
    return source


def _folder_sources(folder: Path) -> Listing:
    sources, skipped = [], []
    for file, name, metadata in _walk(folder, "", {_folder_id(folder, folder)}):
        try:
            source = _source(file, name)
        except FileNotFoundError:  # gone since it was listed (an editor's temporary file)
            continue
        except OSError as e:
            raise DataError(
                f"data file {file} cannot be read ({e.strerror or e}); fix it or remove it"
            ) from None
        why = "metadata" if metadata else _skip_reason(source)
        if why is not None:
            skipped.append(Skipped(name, source.size, why))
            continue
        sources.append(source)
    listing = Listing(sorted(sources, key=lambda s: s.name), tuple(sorted(skipped, key=lambda s: s.name)))
    if not sources:
        kinds = {s.why for s in skipped}
        what = f"only {kinds.pop()} files ({len(skipped)})" if len(kinds) == 1 else "no files"
        what = f"no file to read ({listing.summary})" if len(kinds) > 1 else what
        raise DataError(
            f"data folder {folder} holds {what}; pass a folder of UTF-8 text, .jsonl or .parquet files"
        )
    _check_bulk(folder, listing)
    return listing


def _check_bulk(folder: Path, listing: Listing) -> None:
    """Refuse a folder with more bytes in binary files than in the files read: a corpus would be
    the little text beside them (say, the README of a folder of images or of weights)."""
    binary = [s for s in listing.skipped if s.why == "binary"]
    skipped, read = sum(s.size for s in binary), sum(s.size for s in listing.sources)
    if skipped > read:
        names = ", ".join(s.name for s in binary[:3]) + (", ..." if len(binary) > 3 else "")
        raise DataError(
            f"data folder {folder} is mostly binary files, which are skipped: {len(binary):,} of "
            f"{_size(skipped)} ({names}) against {_size(read)} read ({listing.summary}); pass --data the "
            f"text alone, or move them out"
        )


def _size(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n:,} bytes"


def _folder_id(folder: Path, shown: Path) -> tuple[int, int]:
    try:
        st = folder.stat()
    except OSError as e:
        raise DataError(
            f"data folder {shown} cannot be read ({e.strerror or e}); fix it or remove it"
        ) from None
    return st.st_dev, st.st_ino


def _hf_dataset(names: list[str]) -> bool:
    """Whether a folder holding files `names` is one of Hugging Face `datasets.save_to_disk`:
    `.arrow` files and `state.json` (a split) or `dataset_dict.json` (the splits' folder)."""
    arrow = any(n.endswith(".arrow") for n in names)
    return "dataset_dict.json" in names or ("state.json" in names and arrow)


def _walk(folder: Path, prefix: str, above: set[tuple[int, int]]):
    """`(path, relative name, whether it is a datasets folder's metadata)` of the files below
    `folder`, but hidden ones, following links; `above` holds the folders it is inside (by device
    and inode), so a loop is caught."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        raise DataError(
            f"data folder {folder} cannot be read ({e.strerror or e}); fix it or remove it"
        ) from None
    hf = _hf_dataset([e.name for e in entries])
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
            yield path, name, hf and not entry.name.endswith(".arrow")


def check_tables(sources: list[Source], field: str) -> None:
    """Refuse a table without a string column `field` (only their schemas are read)."""
    for source in sources:
        if source.table:
            with reading(source.path):
                formats.check_column(source.path, source.kind, field)


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


def read_text(source: Source, start: int, end: int, raw: bytes | None = None) -> str:
    """The bytes `[start, end)` of a file's text decoded as UTF-8 (`DataError` names the offset of a
    bad byte); `raw` is those bytes if already read (as a compressed file's are, by `chunks`)."""
    if raw is None:
        with reading(source.path), open(source.path, "rb") as f:
            f.seek(start)
            raw = f.read(end - start)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = " of its decompressed text" if source.compression else ""
        raise DataError(
            f"data file {source.path} is not UTF-8 text (byte {start + e.start}{where}: "
            f"{raw[e.start : e.start + 1]!r}); convert it, e.g. `iconv -t UTF-8`, or remove it"
        ) from None


def documents(
    source: Source, start: int, end: int, field: str = "text", raw: bytes | None = None
) -> list[str]:
    """The documents in bytes `[start, end)` of a file's text (`raw`: those bytes, if read): the
    text itself, or a .jsonl's `field` strings."""
    text = read_text(source, start, end, raw)
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
        if not (isinstance(record, dict) and isinstance(record.get(field), str)):
            n = _line_number(source, start) + i
            raise DataError(
                f'{source.path} line {n} is not a JSON object with a "{field}" string; every line of a '
                f'.jsonl must be one, e.g. {{"{field}": "..."}} (--text-field NAME reads another field)'
            )
        if record[field]:
            docs.append(record[field])
    return docs


def _line_number(source: Source, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` of the file's text (read only
    when reporting an error)."""
    count = 0
    with reading(source.path):
        for block in _blocks(source):
            count += block[:offset].count(b"\n")
            offset -= len(block)
            if offset <= 0:
                break
    return count + 1


def _blocks(source: Source):
    """The file's text, a block at a time (decompressed)."""
    if source.compression is not None:
        yield from (block for block, _ in formats.decompressed(source.path, source.compression))
        return
    with open(source.path, "rb") as f:
        while block := f.read(SCAN):
            yield block
