"""Where a corpus's text comes from: the files under `--data PATH`, checked, and read in pieces.

PATH is a file or a folder. In a folder every file below it counts, in the sorted order of their
relative names, except hidden ones (`.git/`, `.venv/`, not counted) and those skipped and counted
(`Listing.summary`): empty ones, binary ones (a NUL byte in the first 8 KiB, git's test, of the
text once decompressed) and the metadata of a Hugging Face `datasets` folder (`dataset_info.json`,
`state.json`, a dataset card: only its `.arrow` files are read). A folder that is mostly binary
files by bytes is refused. Symbolic links are followed, to files and to folders alike; a link
back to a folder it is in (a loop) is refused.

A folder of splits is not one corpus: one split is read, `train` unless `split` names another
(`"all"`: every file, as if it had none). Such a folder is a `datasets` `DatasetDict`
(`dataset_dict.json` names its splits, a folder each), or any folder whose folders and data files
(`SPLIT_DATA`: not `train.py` beside `test.py`) name two splits or more the way Hugging Face does
(`train/`, `test.jsonl`, `validation-00000-of-00001.parquet`, `wiki.valid.raw`: a keyword of
`SPLIT_KEYWORDS` as a word of the name, in any case: `Test.txt`, `TRAIN`, `testSet.txt`); there the
other splits are left out, and files of no split are skipped and counted. A folder without the
split asked for is refused, naming its splits. The summary says which split of which folder was
read, and from how many folders. Anywhere else, at any depth, a file or folder named for a held-out
split (validation or test: `test.txt` beside `corpus.txt`, `heldout/`, `devSet.jsonl`) is never
read unless that split is asked for (then, in its folder, it alone) or `all`: it is skipped, and
the summary names it.

A file's format is told by its name (`formats.py`): a `*.jsonl` holds one JSON object per line
whose text field (`"text"`, or another named) is a document (a UTF-8 byte-order mark before the
first is allowed); a table (`.parquet`, `.arrow`) holds a document per row of its text column.
One rule for every format: a null text is no document, as an empty one is (a record without the
field, or a table without the column, is refused: the field is likely misnamed);
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
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from eqx_gpt import files
from eqx_gpt.data import formats
from eqx_gpt.errors import DataError

SEPARATOR = "\n\n"  # between two documents (files, or the records of a .jsonl)
BINARY_PROBE = 8192  # bytes looked at for a NUL byte (git's test for a binary file)
SCAN = 1 << 20  # bytes read at a time when looking for the newline that ends a range
MAX_RECORD = formats.MAX_RECORD  # the longest .jsonl line read (256 MiB: a few GB of memory while tokenized)
BOM = "\ufeff"
ALL_SPLITS = "all"  # the `split` that reads every file of a folder of splits
DEFAULT_SPLIT = "train"
# Hugging Face's split keywords (`datasets.data_files`), by the split they name.
# Hugging Face's split keywords (`datasets.data_files`), by the split they name, and "held out".
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation", "heldout", "holdout"),
}
HELD_OUT_SPLITS = ("validation", "test")  # never training text unless asked for
HELD_OUT = "held out"  # the `Skipped.why` of a file or folder named for one
SPLIT_DATA = {"txt", "text", "raw", "tokens", "jsonl", "json", "parquet", "arrow", "csv", "tsv", "no suffix"}
_KEYWORD = {k: split for split, keywords in SPLIT_KEYWORDS.items() for k in keywords}
# The words of a name, in any case: "testSet" is test and set, "XMLTest" XML and test, "TRAIN"
# train, "wiki.valid.raw" wiki, valid and raw; "latest" and "LATEST" are one word, not "test".
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")


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
    """A file of a folder that was not read: `why` is "empty", "binary", "metadata" (of a
    `datasets` folder) or "outside the splits" (in a folder of splits, a file of none)."""

    name: str
    size: int
    why: str


@dataclass(frozen=True)
class Listing:
    """The files of a corpus: `sources` read, in order, and those `skipped`; `split` is the split
    read of a folder of splits (None: it has none), `parts` what was read, in words, where it is
    not the whole of a plain folder ("split train of data/ (splits test, train)")."""

    sources: list[Source]
    skipped: tuple[Skipped, ...] = field(default=())
    split: str | None = None
    parts: tuple[str, ...] = field(default=())

    @property
    def summary(self) -> str:
        """What was read and skipped, by kind: "read 12 files (10 .txt, 2 .parquet) from 3 folders
        (., a/, b/); skipped 3 (2 binary, 1 empty)", or "read 1 file (1 .arrow) of split train
        (splits test, train, validation); ..." for a folder of splits."""
        n = len(self.sources)
        text = (
            f"read {n:,} file{'s' if n != 1 else ''} ({_counts(formats.label(s.path) for s in self.sources)})"
        )
        if self.parts:
            text += " of " + "; ".join(self.parts)
        folders = sorted({s.name.rpartition("/")[0] + "/" for s in self.sources})
        if len(folders) > 1:
            shown = ", ".join("." if f == "/" else f for f in folders[:3])
            text += f" from {len(folders):,} folders ({shown}{', ...' if len(folders) > 3 else ''})"
        if self.skipped:
            text += f"; skipped {len(self.skipped):,} ({_counts(s.why for s in self.skipped)})"
        held = [s.name for s in self.skipped if s.why == HELD_OUT]
        if held:
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            text += f"; held out, named for a split: {shown} (--split NAME reads one, --split all every file)"
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
        return files.resolve(path)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise DataError(f"data path {path} cannot be read ({e.strerror or e})") from None
        raise DataError(
            f"data path {path} is a loop of symbolic links; pass --data PATH to a real file"
        ) from None


def find_sources(path: str | Path, split: str | None = None) -> Listing:
    """The `Listing` of the corpus at `path`, a file or a folder (see the module docstring);
    `split` is the split to read of a folder of splits (None: `train` if it has splits).
    Raises `DataError` for a missing path, an empty, binary or damaged file, a folder with no
    file to read, one that is mostly binary files, or one without the split asked for."""
    path = resolve(path)
    if split is not None and (not isinstance(split, str) or not split or "/" in split):
        raise DataError(f"split must be a split's name such as 'train' or 'test', got {split!r}")
    try:
        if path.is_file():
            if split not in (None, ALL_SPLITS):
                raise DataError(
                    f"data file {path} is one corpus, with no splits; --split {split} reads a split of a "
                    f"folder of splits: leave it out"
                )
            return Listing([_checked_file(path)])
        if path.is_dir():
            return _folder_sources(path, split)
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


def _folder_sources(folder: Path, split: str | None) -> Listing:
    walk = _Walk(split)
    sources, skipped = [], []
    for file, name, why in walk.files(folder, "", {_folder_id(folder, folder)}):
        try:
            source = _source(file, name)
        except FileNotFoundError:  # gone since it was listed (an editor's temporary file)
            continue
        except OSError as e:
            raise DataError(
                f"data file {file} cannot be read ({e.strerror or e}); fix it or remove it"
            ) from None
        why = why or _skip_reason(source)
        if why is not None:
            skipped.append(Skipped(name, source.size, why))
            continue
        sources.append(source)
    walk.check_split_found(folder)
    skipped += [Skipped(name, 0, HELD_OUT) for name in walk.held_out]
    listing = Listing(
        sorted(sources, key=lambda s: s.name),
        tuple(sorted(skipped, key=lambda s: s.name)),
        walk.chosen,
        tuple(walk.parts),
    )
    if not sources and {s.why for s in skipped} == {HELD_OUT}:
        raise DataError(
            f"data folder {folder} holds only files named for a held-out split ({listing.summary}); pass "
            f"--split NAME to read one of them"
        )
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


def split_of(name: str) -> str | None:
    """The split a file or folder `name` belongs to by Hugging Face's keywords ("train",
    "validation" or "test") among its words, in any case, or None: `wiki.valid.raw` and `devSet`
    are "validation", `Test.txt`, `held-out` and `heldout` "test", `latest.txt` None. A name of a
    held-out split and of train (`train_test.txt`) is held out."""
    words = [w.lower() for w in _WORD.findall(name)]
    pairs = [a + b for a, b in zip(words, words[1:], strict=False)]  # "held", "out": heldout
    found = {_KEYWORD[w] for w in (*words, *pairs) if w in _KEYWORD}
    return next((s for s in (*HELD_OUT_SPLITS, "train") if s in found), None)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _split_data(entry: os.DirEntry) -> bool:
    """Whether a folder entry may be a split's data by its name: a folder, or a file of data (not
    `train.py` and `test.py` in a folder of code; `TEST`, with no suffix, is)."""
    label = formats.label(Path(entry.name))
    return _is_dir(entry) or (label.split(".")[1] if label.startswith(".") else label) in SPLIT_DATA


def _dataset_dict_splits(folder: Path) -> list[str]:
    """The splits `dataset_dict.json` in `folder` names (`{"splits": [...]}`)."""
    path = folder / "dataset_dict.json"
    with reading(path):
        raw = path.read_bytes()
    try:
        splits = json.loads(raw)["splits"]
        if isinstance(splits, list) and splits and all(isinstance(x, str) and x for x in splits):
            return splits
    except (ValueError, TypeError, KeyError):
        pass
    raise DataError(
        f'data file {path} does not name the splits of a datasets DatasetDict ({{"splits": [...]}}); '
        f"save the dataset again, or pass --data the folder of one split"
    )


def _single_split(folder: Path) -> str | None:
    """The split a `save_to_disk` folder of one split records (`_split` of its `state.json`)."""
    try:
        found = json.loads((folder / "state.json").read_bytes()).get("_split")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and found else None


class _Walk:
    """A walk of a corpus folder that reads the split `split` of each folder of splits in it
    (None: train; `ALL_SPLITS`: every file); `parts` says in words what it read of them."""

    def __init__(self, split: str | None):
        self.asked = split
        self.split = DEFAULT_SPLIT if split is None else split
        self.chosen: str | None = None  # the split read, once a folder of splits is found
        self.parts: list[str] = []
        self.held_out: list[str] = []  # files and folders (ending "/") named for a held-out split

    def _wanted(self, splits) -> str:
        """The split asked for, by the name it has among `splits` (or its keyword's split)."""
        return self.split if self.split in splits else _KEYWORD.get(self.split.lower(), self.split)

    def _held_out(self, entry: os.DirEntry) -> bool:
        """Whether an entry of a folder that is not a folder of splits is named for a held-out split
        other than the one asked for: then it is skipped, said, and never read (`--split all` reads it)."""
        if self.split == ALL_SPLITS or not _split_data(entry):
            return False
        split = split_of(entry.name)
        return split in HELD_OUT_SPLITS and split != self._wanted([split])

    def files(self, folder: Path, prefix: str, above: set[tuple[int, int]]):
        """`(path, relative name, why it is skipped or None)` of the files below `folder`, but
        hidden ones and other splits', following links; `above` holds the folders it is inside
        (by device and inode), so a loop is caught."""
        try:
            entries = [
                e for e in sorted(os.scandir(folder), key=lambda e: e.name) if not e.name.startswith(".")
            ]
        except OSError as e:
            raise DataError(
                f"data folder {folder} cannot be read ({e.strerror or e}); fix it or remove it"
            ) from None
        names = [e.name for e in entries]
        hf, keep = _hf_dataset(names), self._split_entries(folder, prefix, entries)
        if hf and "dataset_dict.json" not in names and prefix == "":
            split = _single_split(folder)
            self.parts.append(f"the datasets split {split}" if split else "a datasets folder")
            if self.asked not in (None, ALL_SPLITS, split):
                raise DataError(
                    f"data folder {folder} is one split of a datasets dataset ({split or 'unnamed'}), not a "
                    f"folder of splits; --split {self.asked} reads a split of one: leave it out"
                )
        for entry in entries:
            path, name = Path(entry.path), prefix + entry.name
            why = keep.get(entry.name, "metadata" if hf and not entry.name.endswith(".arrow") else None)
            if why is False:  # another split's
                continue
            if why is None and not keep and self._held_out(entry):
                self.held_out.append(name + ("/" if _is_dir(entry) else ""))
                continue
            try:
                is_dir, is_file = entry.is_dir(), entry.is_file()
            except OSError:  # a dangling link or a loop of links: no file there
                continue
            if is_dir and why is None:
                key = _folder_id(path, path)
                if key in above:
                    raise DataError(
                        f"data folder {path} is a link to a folder it is in (a loop); remove the link or "
                        f"pass a folder without it"
                    )
                yield from self.files(path, name + "/", above | {key})
            elif is_file:
                yield path, name, why

    def _split_entries(self, folder: Path, prefix: str, entries) -> dict:
        """Of a folder of splits: entry name -> None (read), False (another split's: left out) or
        why it is skipped; {} for any other folder (all read)."""
        names = [e.name for e in entries]
        if "dataset_dict.json" in names:
            splits = _dataset_dict_splits(folder)
            split_of_entry = {n: n if n in splits and (folder / n).is_dir() else None for n in names}
            other = "metadata"
        else:
            split_of_entry = {e.name: split_of(e.name) if _split_data(e) else None for e in entries}
            splits = sorted({x for x in split_of_entry.values() if x is not None})
            other = "outside the splits"
            # One split's name beside others of none is a folder of splits only for that split asked.
            asked_alone = self.asked not in (None, ALL_SPLITS) and splits == [self._wanted(splits)]
            if len(splits) < 2 and not asked_alone:
                return {}
        shown = ", ".join(sorted(splits))
        where = f" of {prefix}" if prefix else ""
        if self.split == ALL_SPLITS:  # every file, as if it had no splits (a DatasetDict: its splits')
            self.parts.append(f"all splits{where} ({shown})")
            if other != "metadata":
                return {}
            return {n: None if s is not None else other for n, s in split_of_entry.items()}
        wanted = self._wanted(splits)
        if wanted not in splits:
            default = " (the split read by default)" if self.asked is None else ""
            raise DataError(
                f"data folder {folder} holds the splits {shown}, and no {self.split}{default}; pass "
                f"--split NAME to read one of them (--split all: every file)"
            )
        self.chosen = wanted
        self.parts.append(f"split {wanted}{where} (splits {shown})")
        return {
            n: None if s == wanted else False if s is not None else other for n, s in split_of_entry.items()
        }

    def check_split_found(self, folder: Path) -> None:
        """Refuse a split asked for by name in a folder that has none."""
        if self.asked not in (None, ALL_SPLITS) and self.chosen is None and not self.parts:
            raise DataError(
                f"data folder {folder} has no splits (neither a datasets DatasetDict nor files named for "
                f"train, validation and test); --split {self.asked} reads one of a folder of splits: leave "
                f"it out"
            )


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
        if not (isinstance(record, dict) and field in record and isinstance(record[field], str | None)):
            n = _line_number(source, start) + i
            raise DataError(
                f'{source.path} line {n} is not a JSON object with a "{field}" string (or null); every line '
                f'of a .jsonl must be one, e.g. {{"{field}": "..."}} (--text-field NAME reads another field)'
            )
        if record[field]:  # null or "": no document, as a table's missing or empty value
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
