"""A corpus cut into chunks: the unit of work that one thread tokenizes into one shard.

A chunk is a list of pieces of about `CHUNK_BYTES` in all: a large file gives many chunks, many
small files share one. A piece of a plain file is a byte range (`sources.byte_ranges`), read when
its chunk is tokenized. A compressed file cannot be read from the middle, so it is cut as it
decompresses, by the same rule (a piece ends at the first newline after `CHUNK_BYTES`; a .jsonl
record is never split), and each piece carries its bytes; a table's pieces carry their rows'
documents. So `plan_chunks` yields chunks as it reads (a few are in memory at a time, whatever the
corpus's size), and a corpus always gives the same chunks: a `.txt.gz` the chunks of its `.txt`.
A chunk's text is its pieces' text, each new document after the corpus's first led by
`SEPARATOR`; so the chunks' texts, end to end, are the corpus.
"""

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eqx_gpt.data import formats
from eqx_gpt.data.sources import MAX_RECORD, SCAN, SEPARATOR, Source, byte_ranges, documents, reading
from eqx_gpt.errors import DataError
from eqx_gpt.tokenizer import CharTokenizer, Tokenizer, UnknownCharacters

CHUNK_BYTES = 8 << 20  # per chunk: a few times this in memory per thread while it is tokenized


@dataclass(frozen=True)
class Piece:
    source: Source
    start: int  # where it starts in the file's text (in a table: its first row)
    end: int
    lead: bool  # a new document that is not the corpus's first: SEPARATOR goes before it
    weight: int = 0  # the bytes of the file (as stored) it stands for: its share of a progress bar
    field: str = "text"  # a .jsonl's text field
    data: bytes | tuple[str, ...] | None = None  # its bytes (a compressed file's) or documents (a table's)

    def text(self) -> str:
        if isinstance(self.data, tuple):
            docs = list(self.data)
        else:
            docs = documents(self.source, self.start, self.end, self.field, self.data)
        body = SEPARATOR.join(docs)
        return SEPARATOR + body if self.lead and body else body


Chunk = tuple[Piece, ...]
Range = tuple[int, int, int, int, bytes | tuple[str, ...] | None]  # start, end, size, weight, data


def plan_chunks(sources: list[Source], size: int | None = None, field: str = "text") -> Iterator[Chunk]:
    """The corpus's sources cut into chunks of about `size` bytes (default `CHUNK_BYTES`), in
    order, as they are read; `field` is the text field of .jsonl records and the text column of
    tables."""
    size = size or CHUNK_BYTES
    current, filled, first = [], 0, True
    for source in sources:
        for start, end, n_bytes, weight, data in _ranges(source, size, field):
            if current and filled + n_bytes > size:
                yield tuple(current)
                current, filled = [], 0
            lead = not first and (start == 0 or source.records)
            current.append(Piece(source, start, end, lead, weight, field, data))
            filled += n_bytes
            first = False
    if current:
        yield tuple(current)


def _ranges(source: Source, size: int, field: str) -> Iterator[Range]:
    if source.table:
        yield from _table_ranges(source, size, field)
    elif source.compression is not None:
        yield from _stream_ranges(source, size)
    else:
        for start, end in byte_ranges(source, size):
            yield start, end, end - start, end - start, None


def _stream_ranges(source: Source, size: int) -> Iterator[Range]:
    """A compressed file's pieces, cut as it decompresses where `byte_ranges` cuts a plain file:
    just after the first newline at or past `size` bytes (in text, if none comes within `SCAN`
    bytes: where a UTF-8 character starts)."""
    assert source.compression is not None
    buffer, start, weighed, scanned = bytearray(), 0, 0, 0
    with reading(source.path):
        for block, read in formats.decompressed(source.path, source.compression):
            buffer += block
            while (cut := _cut(buffer, size, scanned, source)) > 0:
                yield start, start + cut, cut, read - weighed, bytes(buffer[:cut])
                del buffer[:cut]
                start, weighed, scanned = start + cut, read, 0
            scanned = max(len(buffer), size)  # searched for a newline up to here
        while 0 < (cut := _cut(buffer, size, 0, source, end=True)) < len(buffer):
            yield start, start + cut, cut, 0, bytes(buffer[:cut])
            del buffer[:cut]
            start += cut
    yield start, start + len(buffer), len(buffer), source.size - weighed, bytes(buffer)


def _cut(buffer: bytearray, size: int, scanned: int, source: Source, *, end: bool = False) -> int:
    """Where the piece that `buffer` starts ends (0: not known before more is read); `end`: the
    file ends with `buffer`; `scanned`: no newline is in `buffer[size:scanned]`."""
    if len(buffer) <= size:
        return 0
    if source.jsonl:  # a record is never split
        newline = buffer.find(b"\n", max(size, scanned))
        if newline < 0 and len(buffer) - size > MAX_RECORD:
            raise DataError(
                f"data file {source.path} has a line longer than {MAX_RECORD >> 20} MiB; a .jsonl holds "
                f"one JSON object per line: split it into records"
            )
        return newline + 1
    newline = buffer.find(b"\n", max(size, scanned), size + SCAN)
    if newline >= 0:
        return newline + 1
    if len(buffer) < size + SCAN and not end:
        return 0
    stop = min(len(buffer), size + SCAN)
    return next((i for i in range(size, stop) if buffer[i] & 0xC0 != 0x80), stop)


def _table_ranges(source: Source, size: int, field: str) -> Iterator[Range]:
    """A table's pieces: rows of its column `field` of about `size` characters, as documents."""
    docs, chars, row, first, weighed = [], 0, 0, 0, 0
    with reading(source.path):
        for values, read in formats.column_batches(source.path, source.kind, field):
            for value in values:
                row += 1
                if value:  # a missing or empty value: no document
                    docs.append(value)
                    chars += len(value)
                if chars >= size:
                    yield first, row, chars, read - weighed, tuple(docs)
                    docs, chars, first, weighed = [], 0, row, read
    yield first, row, chars, source.size - weighed, tuple(docs)


def chunk_weight(chunk: Chunk) -> int:
    """The bytes of the corpus's files (as stored) that the chunk stands for."""
    return sum(p.weight for p in chunk)


def chunk_bytes(chunk: Chunk) -> int:
    """The bytes of text the chunk holds (of a table's documents: their characters)."""
    return sum(
        sum(map(len, p.data))
        if isinstance(p.data, tuple)
        else len(p.data)
        if p.data is not None
        else p.end - p.start
        for p in chunk
    )


def chunk_text(chunk: Chunk) -> str:
    return "".join(p.text() for p in chunk)


def characters(chunk: Chunk) -> np.ndarray:
    """The distinct code points of the chunk's text, sorted (a char vocabulary is their union)."""
    text = chunk_text(chunk)
    if text.isascii():  # one byte per character: no 4-byte copy needed
        codepoints = np.frombuffer(text.encode("ascii"), np.uint8)
    else:
        codepoints = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    return np.flatnonzero(np.bincount(codepoints)) if len(codepoints) else np.zeros(0, np.int64)


def tokens(chunk: Chunk, tokenizer: Tokenizer, dtype: str) -> np.ndarray:
    """The chunk's token ids, as `dtype` (characters a given vocabulary lacks: `UnknownCharacters`
    naming the file that has them)."""
    try:
        return tokenizer.encode_array(chunk_text(chunk)).astype(dtype, copy=False)
    except UnknownCharacters as e:
        known = set(tokenizer.chars) if isinstance(tokenizer, CharTokenizer) else set()
        path = next((p.source.path for p in chunk if set(p.text()) - known), chunk[0].source.path)
        raise e.naming(f"data file {path}") from None


def write_shard(chunk: Chunk, tokenizer: Tokenizer, dtype: str, path: Path) -> tuple[int, int]:
    """Tokenize the chunk into the file `path` (fsynced; none if it has no tokens); its token
    count and the CRC-32 of its bytes."""
    ids = tokens(chunk, tokenizer, dtype)
    if len(ids):
        with open(path, "wb") as f:
            f.write(ids.data)
            f.flush()
            os.fsync(f.fileno())
    return len(ids), zlib.crc32(ids.data)
