"""Token shards as one sequence: `TokenSpan` reads windows of consecutive tokens from them.

A prepared corpus is a few shard files of `uint16` (or `uint32`) token ids. `ShardFile` reads a
window with one `os.pread`: only its bytes are copied, from the kernel's page cache, so no corpus
is ever held in memory whole and a run starts without reading it. Why not `mmap`: on Linux with
large page-cache folios (6.x, ext4) every window read through a map maps its whole folio, up to
2 MiB, into the process, and a run's memory grew to the size of its corpus (2.2 GB for a 1.1 GB
text); pread's cost is about 2 us a window. A small corpus's shards are arrays in memory instead;
the reader is the same.
"""

import os
from pathlib import Path

import numpy as np

MAX_OPEN = 256  # shard files kept open at once (a large corpus has thousands of shards)


class ShardFile:
    """A shard file of `dtype` token ids, read a slice at a time (`shard[i:j]`) with `os.pread`."""

    def __init__(self, path: Path, dtype: str, n_tokens: int):
        self.path, self.dtype, self.n_tokens = Path(path), np.dtype(dtype), n_tokens
        self.open_files = {}  # shared by the shards of a corpus: see `_fd`

    def __len__(self) -> int:
        return self.n_tokens

    def _fd(self) -> int:
        fd = self.open_files.get(self.path)
        if fd is None:
            if len(self.open_files) >= MAX_OPEN:  # a random read touches any shard: close them all
                for other in self.open_files.values():
                    os.close(other)
                self.open_files.clear()
            fd = self.open_files[self.path] = os.open(self.path, os.O_RDONLY)
        return fd

    def __getitem__(self, part: slice) -> np.ndarray:
        start, stop, _ = part.indices(self.n_tokens)
        width = self.dtype.itemsize
        data = os.pread(self._fd(), (stop - start) * width, start * width)
        if len(data) != (stop - start) * width:
            raise OSError(f"shard {self.path} is shorter than its manifest says; delete its folder")
        return np.frombuffer(data, self.dtype)


def open_shards(folder: Path, shards, dtype: str) -> list[ShardFile]:
    """The shard files `shards` (names and token counts) in `folder`, sharing open files."""
    files = [ShardFile(folder / s.name, dtype, s.n_tokens) for s in shards]
    for f in files[1:]:
        f.open_files = files[0].open_files
    return files


class TokenSpan:
    """Tokens `[start, stop)` of the sequence that `shards` (1-D arrays or `ShardFile`s) make end to end."""

    def __init__(self, shards: list, start: int = 0, stop: int | None = None):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])  # where each shard starts
        self.start = start
        self.stop = int(self.offsets[-1]) if stop is None else stop
        if not 0 <= self.start <= self.stop <= self.offsets[-1]:
            raise ValueError(f"span [{start}, {stop}) is outside the {self.offsets[-1]} tokens")

    def __len__(self) -> int:
        return self.stop - self.start

    def span(self, start: int, stop: int) -> "TokenSpan":
        """Tokens `[start, stop)` of this span (a view: nothing is read)."""
        return TokenSpan(self.shards, self.start + start, self.start + stop)

    def rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """`int32 [len(starts), length]`: row `i` is the `length` tokens from `starts[i]` (relative to
        this span), read from the shards that hold them."""
        starts = np.asarray(starts, np.int64).reshape(-1)
        if len(starts) and (starts.min() < 0 or starts.max() + length > len(self)):
            raise ValueError(
                f"windows of {length} from {starts.min()}..{starts.max()} leave the span of {len(self)}"
            )
        where = self.start + starts
        shard = np.searchsorted(self.offsets, where, side="right") - 1
        local = where - self.offsets[shard]
        out = np.empty((len(starts), length), np.int32)
        inside = local + length <= self.offsets[shard + 1] - self.offsets[shard]
        for k in np.unique(shard[inside]):  # windows within one shard: one gather (or read) each
            rows, source = np.flatnonzero(inside & (shard == k)), self.shards[k]
            if isinstance(source, np.ndarray):
                out[rows] = source[local[rows, None] + np.arange(length)]
            else:
                for r in rows:
                    out[r] = source[local[r] : local[r] + length]
        for i in np.flatnonzero(~inside):  # windows across a shard boundary
            out[i] = self.read(where[i], where[i] + length)
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens `[start, stop)` of the whole sequence (not of this span), across shards."""
        parts, at = [], start
        while at < stop:
            k = int(np.searchsorted(self.offsets, at, side="right")) - 1
            end = min(stop, int(self.offsets[k + 1]))
            parts.append(self.shards[k][at - self.offsets[k] : end - self.offsets[k]])
            at = end
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)

    def to_array(self) -> np.ndarray:
        """`int32 [len(self)]`: every token of the span, in memory (for small spans only)."""
        return self.read(self.start, self.stop)
