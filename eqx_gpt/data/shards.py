"""Token shards as one sequence: `TokenSpan` reads windows of consecutive tokens from them.

A prepared corpus is a few shard files of `uint16` (or `uint32`) token ids. `ShardFile` reads a
window with one `os.pread`: only its bytes are copied, from the kernel's page cache, so no corpus
is ever held in memory whole and a run starts without reading it. Why not `mmap`: on Linux with
large page-cache folios (6.x, ext4) every window read through a map maps its whole folio, up to
2 MiB, into the process, and a run's memory grew to the size of its corpus (2.2 GB for a 1.1 GB
text); pread's cost is about 2 us a window. A small corpus's shards are arrays in memory instead;
the reader is the same.

Shard files are opened through the `Snapshot` of the version a reader opened (`cache.py`), so they
are always that version's, however many shards there are and however often they are reopened.
`verify` reads every byte of a version's shards once and checks them against the manifest (their
CRC-32, and every id against the vocabulary): see `prepare.py` for when.
"""

import os
import zlib

import numpy as np

from eqx_gpt.data.cache import Snapshot
from eqx_gpt.data.manifest import Shard
from eqx_gpt.errors import DataError

MAX_OPEN = 256  # shard files kept open at once (a large corpus has thousands of shards)
VERIFY_BLOCK = 8 << 20  # bytes read at a time by `verify`


class ShardFile:
    """The shard `name` of a `Snapshot`: `dtype` token ids, read a slice at a time (`shard[i:j]`)
    with `os.pread`. The shards of a snapshot share its open files (at most `MAX_OPEN`)."""

    def __init__(self, snapshot: Snapshot, name: str, dtype: str, n_tokens: int):
        self.snapshot, self.name, self.dtype, self.n_tokens = snapshot, name, np.dtype(dtype), n_tokens

    def __len__(self) -> int:
        return self.n_tokens

    def _fd(self) -> int:
        files = self.snapshot.open_files
        fd = files.get(self.name)
        if fd is None:
            if len(files) >= MAX_OPEN:  # a random read touches any shard: close them all
                for other in files.values():
                    os.close(other)
                files.clear()
            try:
                fd = files[self.name] = self.snapshot.open_file(self.name)
            except OSError as e:
                raise _damaged(self.snapshot, f"{self.name} cannot be opened: {e.strerror or e}") from None
        return fd

    def __getitem__(self, part: slice) -> np.ndarray:
        start, stop, _ = part.indices(self.n_tokens)
        width = self.dtype.itemsize
        try:
            data = os.pread(self._fd(), (stop - start) * width, start * width)
        except OSError as e:  # a disk error after the start's verification
            raise _damaged(self.snapshot, f"{self.name} cannot be read: {e.strerror or e}") from None
        if len(data) != (stop - start) * width:
            raise _damaged(self.snapshot, f"{self.name} is shorter than its manifest says")
        return np.frombuffer(data, self.dtype)


def _damaged(snapshot: Snapshot, what: str) -> DataError:
    return DataError(f"the token cache {snapshot.path} is damaged ({what}); delete that folder and run again")


class Damaged(DataError):
    """What `verify` found wrong with a shard (a `DataError`, as every eqx_gpt exception is one of
    `EqxGptError`'s)."""


def verify(snapshot: Snapshot, shard: Shard, dtype: str, vocab_size: int) -> int:
    """Check the shard's bytes in `snapshot`: their size, CRC-32 and that every id is below
    `vocab_size`; returns the bytes read (all of them). Raises `Damaged` saying what is wrong."""
    width = np.dtype(dtype).itemsize
    try:
        fd = snapshot.open_file(shard.name)
    except OSError as e:
        raise Damaged(f"{shard.name} cannot be opened: {e.strerror or e}") from None
    try:
        size = os.fstat(fd).st_size
        if size != shard.n_tokens * width:
            raise Damaged(f"{shard.name} has {size:,} bytes, not {shard.n_tokens * width:,}")
        crc, top, at = 0, 0, 0
        while at < size:
            block = os.pread(fd, min(VERIFY_BLOCK, size - at), at)
            if not block:
                raise Damaged(f"{shard.name} ends at byte {at:,} of {size:,}")
            crc = zlib.crc32(block, crc)
            top = max(top, int(np.frombuffer(block, dtype).max()))
            at += len(block)
    except OSError as e:
        raise Damaged(f"{shard.name} cannot be read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if crc != shard.crc32:
        raise Damaged(f"{shard.name} fails its CRC-32 check")
    if top >= vocab_size:
        raise Damaged(f"{shard.name} holds id {top}, outside the vocabulary of {vocab_size}")
    return size


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
