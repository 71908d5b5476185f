"""A corpus cut into chunks: the unit of work that one thread tokenizes into one shard.

A chunk is a list of pieces (byte ranges of source files, see `sources.byte_ranges`) of about
`CHUNK_BYTES` in all: a large file gives many chunks, many small files share one. A chunk's text
is its pieces' text, each new document after the corpus's first led by `SEPARATOR`; so the
chunks' texts, end to end, are the corpus.
"""

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eqx_gpt.data.sources import SEPARATOR, Source, byte_ranges, documents
from eqx_gpt.tokenizer import Tokenizer

CHUNK_BYTES = 8 << 20  # per chunk: a few times this in memory per thread while it is tokenized


@dataclass(frozen=True)
class Piece:
    source: Source
    start: int
    end: int
    lead: bool  # a new document that is not the corpus's first: SEPARATOR goes before it

    def text(self) -> str:
        body = SEPARATOR.join(documents(self.source, self.start, self.end))
        return SEPARATOR + body if self.lead and body else body


Chunk = tuple[Piece, ...]


def plan_chunks(sources: list[Source], size: int | None = None) -> list[Chunk]:
    """The corpus's sources cut into chunks of about `size` bytes (default `CHUNK_BYTES`)."""
    size = size or CHUNK_BYTES
    chunks, current, filled, first = [], [], 0, True
    for source in sources:
        for start, end in byte_ranges(source, size):
            if current and filled + (end - start) > size:
                chunks.append(tuple(current))
                current, filled = [], 0
            current.append(Piece(source, start, end, lead=not first and (start == 0 or source.jsonl)))
            filled += end - start
            first = False
    return [*chunks, tuple(current)] if current else chunks


def chunk_bytes(chunk: Chunk) -> int:
    return sum(p.end - p.start for p in chunk)


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
    """The chunk's token ids, as `dtype`."""
    return tokenizer.encode_array(chunk_text(chunk)).astype(dtype, copy=False)


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
