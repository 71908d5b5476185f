"""Token shards as one sequence: `TokenSpan` reads windows of consecutive tokens from them.

A prepared corpus is a few shard files of `uint16` (or `uint32`) token ids, each memory-mapped
(`map_shard`): reading a window touches only its pages, so no corpus is ever held in memory
whole, and a run starts without reading it. A small corpus's shards are plain arrays instead;
the reader is the same.
"""

import mmap
from pathlib import Path

import numpy as np


def map_shard(path: Path, dtype: str) -> np.ndarray:
    """The shard file at `path` as a read-only array, memory-mapped."""
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype)


class TokenSpan:
    """Tokens `[start, stop)` of the sequence that `shards` (1-D arrays) make end to end."""

    def __init__(self, shards: list[np.ndarray], start: int = 0, stop: int | None = None):
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
        for k in np.unique(shard[inside]):  # windows within one shard: one gather per shard
            rows = np.flatnonzero(inside & (shard == k))
            out[rows] = self.shards[k][local[rows, None] + np.arange(length)]
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
