"""The formats a corpus file comes in, told by its name: text or `.jsonl`, each plain or compressed
(`.gz`, `.xz`, `.zst`), and tables (`.parquet`, and `.arrow`: Arrow IPC, as Hugging Face
`datasets.save_to_disk` writes it), whose documents are the rows of one string column.

A compressed file is read as a stream of decompressed blocks (`decompressed`), a table as batches
of its column's values (`column_batches`): never whole, so a corpus of any size needs memory of a
few blocks or batches. gzip and xz come with Python; zstd and tables need `zstandard` and
`pyarrow`, the optional extras `zstd` and `parquet`, imported only when a file needs them
(`optional`): a missing one is a one-line `DataError` naming its install command. A damaged file
(truncated, not of its format, a table without the column or with a column of non-strings) is a
one-line `DataError` naming the file and the problem.
"""

import contextlib
import gzip
import importlib
import lzma
import zlib
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType

from eqx_gpt.errors import DataError

COMPRESSIONS = {".gz": "gzip", ".xz": "xz", ".zst": "zstd"}
TABLES = {".parquet": "parquet", ".arrow": "arrow"}
EXTRAS = {"zstandard": "zstd", "pyarrow": "parquet"}  # module: the extra of pyproject.toml that has it
BLOCK = 1 << 20  # compressed bytes read at a time
ZSTD_BLOCK = 1 << 16  # zstd's decompressor has no output limit: small inputs keep its output small
ROWS = 256  # table rows decoded at a time, at most (fewer where a Parquet file's rows are large)
SLICE_BYTES = 1 << 20  # text handed on at a time: rows of about this many bytes (one row may be more)
MAX_RECORD = 1 << 28  # the longest record read (a .jsonl line, a table's value: 256 MiB)


def compression(path: Path) -> str | None:
    """The compression of a file, by its last suffix: "gzip", "xz", "zstd", or None."""
    return COMPRESSIONS.get(path.suffix.lower())


def kind(path: Path) -> str:
    """The format of a file, once decompressed: "jsonl", "parquet", "arrow" or "text"."""
    inner = path.with_suffix("") if compression(path) else path
    suffix = inner.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    return TABLES.get(suffix, "text") if inner == path else "text"


def label(path: Path) -> str:
    """How a file's format is named in a summary: its suffix, with the compression's (".txt.gz")."""
    suffixes = [s.lower() for s in path.suffixes[-2 if compression(path) else -1 :]]
    return "".join(suffixes) or "no suffix"


def optional(module: str, path: Path) -> ModuleType:
    """The optional `module` that reading `path` needs; `DataError` with the install command if absent."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRAS[module]
        raise DataError(
            f"data file {path} needs the optional package {module}: run `uv sync --extra {extra}` "
            f"(or `pip install 'eqx_gpt[{extra}]'`)"
        ) from None


def _damaged(path: Path, how: str, e: BaseException) -> DataError:
    if isinstance(e, EOFError):
        return DataError(
            f"data file {path} is truncated: its {how} data ends before its end marker; copy it again"
        )
    return DataError(f"data file {path} is not valid {how} data ({e}); copy it again or remove it")


def decompressed(path: Path, how: str) -> Generator[tuple[bytes, int], None, None]:
    """`(block, compressed bytes read so far)` of the compressed file, in order; `DataError` if it
    is damaged (an `OSError` reading it is left to the caller, `sources.reading`)."""
    if how == "zstd":
        yield from _zstd(path)
        return
    with open(path, "rb") as raw:
        stream = gzip.GzipFile(fileobj=raw) if how == "gzip" else lzma.LZMAFile(raw)
        try:
            while block := stream.read(BLOCK):
                yield block, raw.tell()
        except (EOFError, gzip.BadGzipFile, zlib.error, lzma.LZMAError) as e:
            raise _damaged(path, how, e) from None


def _zstd(path: Path) -> Iterator[tuple[bytes, int]]:
    """zstd frames one after another (what `zstd` and `pzstd` write); a file that ends inside a
    frame is truncated (`zstandard`'s stream reader would end there without a word)."""
    zstandard = optional("zstandard", path)
    decoder, frame = zstandard.ZstdDecompressor(), None  # the frame being read (None: between frames)
    with open(path, "rb") as raw:
        try:
            while data := raw.read(ZSTD_BLOCK):
                while data:
                    if frame is None:
                        frame = decoder.decompressobj()
                    if block := frame.decompress(data):
                        yield block, raw.tell()
                    data = frame.unused_data if frame.eof else b""  # the next frame's first bytes
                    if frame.eof:
                        frame = None
        except zstandard.ZstdError as e:
            raise _damaged(path, "zstd", e) from None
    if frame is not None:
        raise _damaged(path, "zstd", EOFError())


@contextlib.contextmanager
def _table_errors(path: Path, how: str):
    pa = optional("pyarrow", path)
    try:
        yield pa
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:  # the system's error reading it, not Arrow's
            raise
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data file {path} is not a readable {how} file ({reason}); copy it again") from None


def check_column(path: Path, how: str, field: str) -> None:
    """Refuse a table without a string column `field` (reads only its schema)."""
    with _table_errors(path, how) as pa, _reader(path, how) as (schema, _):
        if field not in schema.names:
            shown = ", ".join(schema.names[:8]) + (", ..." if len(schema.names) > 8 else "")
            raise DataError(
                f"data file {path} has no column {field!r} (its columns: {shown}); pass --text-field NAME"
            )
        found = schema.field(field).type
        if not _is_text(pa, found):
            raise DataError(
                f"data file {path}: its column {field!r} holds {found}, not text; pass --text-field NAME "
                f"of a string column"
            )


def _is_text(pa, found) -> bool:
    """Whether a column of Arrow type `found` holds strings: plain, large or views, or a dictionary
    of them (what a pandas categorical or a dictionary-encoded Parquet column reads as)."""
    if pa.types.is_dictionary(found):
        return _is_text(pa, found.value_type)
    view = hasattr(pa.types, "is_string_view") and pa.types.is_string_view(found)
    return pa.types.is_string(found) or pa.types.is_large_string(found) or view


def column_batches(path: Path, how: str, field: str) -> Iterator[tuple[list, int]]:
    """`(values, file bytes read so far, about)` of the column `field` of a table, rows of about
    `SLICE_BYTES` of text at a time, whatever a row's size; `values` are strings, or None for a
    missing value. Memory is bounded by bytes, not rows: a dictionary-encoded column stays
    encoded until a slice is taken (a few bytes of file can repeat one long value a million times),
    and a value over `MAX_RECORD` is refused, as a .jsonl line is."""
    with _table_errors(path, how) as pa, _reader(path, how, field) as (_, batches):
        row = 0
        for batch, at in batches:
            column = batch.column(0)
            for start, stop in _byte_slices(pa, column, path, field, row):
                yield column.slice(start, stop - start).to_pylist(), at
            row += len(column)


def _byte_slices(pa, column, path: Path, field: str, row: int) -> Iterator[tuple[int, int]]:
    """`(start, stop)` rows of `column` holding about `SLICE_BYTES` of text each (at least one row);
    `DataError` for a value over `MAX_RECORD` (`row`: the rows of the file before `column`'s)."""
    import numpy as np
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):
        lengths = (
            pc.call_function("binary_length", [column.dictionary]).fill_null(0).to_numpy(zero_copy_only=False)
        )
        indices = column.indices.fill_null(0).to_numpy(zero_copy_only=False)
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        sizes = np.where(valid, lengths[indices] if len(lengths) else 0, 0)
    else:
        sizes = pc.call_function("binary_length", [column]).fill_null(0).to_numpy(zero_copy_only=False)
    sizes = np.asarray(sizes, np.int64)
    over = np.flatnonzero(sizes > MAX_RECORD)
    if over.size:
        raise DataError(
            f"data file {path}: row {row + int(over[0]) + 1:,} of its column {field!r} holds "
            f"{int(sizes[over[0]]) / (1 << 20):,.0f} MiB of text, over {MAX_RECORD >> 20} MiB; split it into "
            f"rows of documents"
        )
    ends = np.cumsum(sizes)
    start = 0
    while start < len(sizes):
        before = int(ends[start - 1]) if start else 0
        stop = max(start + 1, int(np.searchsorted(ends, before + SLICE_BYTES, side="right")))
        yield start, stop
        start = stop


@contextlib.contextmanager
def _reader(path: Path, how: str, field: str | None = None):
    """`(schema, batches)` of a table; `batches` yields `(record batch of column field, file bytes
    read so far)`. An .arrow file is Arrow's stream format (what `datasets` writes), or its file
    format (Feather v2)."""
    pa = optional("pyarrow", path)
    if how == "parquet":
        parquet = importlib.import_module("pyarrow.parquet")
        # A dictionary-encoded column is read as Arrow's dictionary: each row an index, not a copy.
        with parquet.ParquetFile(path, read_dictionary=[field] if field else None) as table:
            meta, size = table.metadata, path.stat().st_size
            rows = max(meta.num_rows, 1)
            # Rows per batch so that a batch's decoded pages hold about SLICE_BYTES (all columns'
            # uncompressed bytes: an overestimate of the one read).
            decoded = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
            batch_size = int(min(ROWS, max(1, SLICE_BYTES * rows // max(decoded, 1))))
            batches = table.iter_batches(batch_size=batch_size, columns=[field]) if field else iter(())
            yield table.schema_arrow, _rows_read(batches, rows, size)
        return
    with pa.OSFile(str(path)) as raw:
        try:
            reader = pa.ipc.open_stream(raw)
            batches = ((b, raw.tell()) for b in reader)
        except pa.ArrowInvalid:
            raw.seek(0)
            reader = pa.ipc.open_file(raw)
            batches = ((reader.get_batch(i), raw.tell()) for i in range(reader.num_record_batches))
        index = reader.schema.get_field_index(field) if field else -1
        yield reader.schema, ((b.select([index]), at) for b, at in batches)


def _rows_read(batches, rows: int, size: int):
    """`(batch, file bytes read so far, about: its share of rows)` of a Parquet file's batches."""
    done = 0
    for batch in batches:
        done += batch.num_rows
        yield batch, size * done // rows
