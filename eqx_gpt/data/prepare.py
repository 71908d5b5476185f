"""Preparing a corpus: tokenize it once into shards in the cache, and read them on every later start.

`prepare(path, tokenizer)` returns a `Corpus` whose tokens are read from shard files as needed:

- The cache entry of `(path, tokenizer)` (`cache.py`) is used as it is when its manifest names the
  same files with the same sizes and modification times, and every shard has its exact size.
  Nothing is hashed or read then: a run starts in the time it takes to stat the files.
- Otherwise, under the entry's lock: the sources are hashed; the entry is kept if only their
  modification times changed (the manifest is rewritten); else the corpus is tokenized into a
  new entry by one thread per core, chunk by chunk (`chunks.py`), with a progress bar. A char
  vocabulary is the corpus's own characters, found by a first pass over it.
- A corpus of at most `IN_MEMORY_BYTES` (Tiny Shakespeare) is tokenized at each start instead,
  in memory (well under a second for characters): nothing is written.

`check_identity(sha)` is called with the corpus's identity (`Manifest.identity`) before any
tokenizing, so a resumed run refuses changed data without tokenizing it first.
"""

import concurrent.futures
import errno
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from eqx_gpt.data.cache import EntryLock, cache_root, entry_name, fsync, new_folder, publish, remove_leftovers
from eqx_gpt.data.chunks import Chunk, characters, chunk_bytes, plan_chunks, tokens, write_shard
from eqx_gpt.data.manifest import MANIFEST_NAME, Manifest, Shard, SourceRecord, identity, token_dtype
from eqx_gpt.data.shards import TokenSpan, open_shards
from eqx_gpt.data.sources import DataError, Source, find_sources, sha256_of
from eqx_gpt.files import atomic_write_bytes
from eqx_gpt.tokenizer import CharTokenizer, Tokenizer, tokenizer_from_dict

IN_MEMORY_BYTES = 16 << 20  # corpora up to this size are tokenized at each start, not cached


@dataclass
class Corpus:
    """A tokenized corpus: `tokens` end to end, split into `train` (the first 90%) and `val`."""

    tokens: TokenSpan
    tokenizer: Tokenizer
    manifest: Manifest
    folder: Path | None  # the cache entry the shards are read from (None: tokenized in memory)
    prepared: bool  # tokenized by this call (False: read from the cache as it was)

    @property
    def train(self) -> TokenSpan:
        return self.tokens.span(0, self.manifest.n_train)

    @property
    def val(self) -> TokenSpan:
        return self.tokens.span(self.manifest.n_train, len(self.tokens))

    @property
    def identity(self) -> str:
        return self.manifest.identity


class _NoProgress:
    def update(self, text: str) -> None:
        pass

    def clear(self) -> None:
        pass


@dataclass
class _Work:
    """How a preparation reports: `log` for lines, `progress` (`update(text)`, `clear()`) for the bar."""

    log: Callable[[str], None]
    progress: object

    def map(self, fn, items: list, label: str, sizes: list[int]) -> list:
        """`[fn(x) for x in items]` by one thread per core (numpy, file I/O and tiktoken release the
        GIL), in order, with a progress bar over `sizes` bytes; a failure or Ctrl-C cancels the rest."""
        n_threads = min(len(os.sched_getaffinity(0)), len(items)) or 1
        total, done, t0, results = sum(sizes), 0, time.monotonic(), []
        with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
            futures = [pool.submit(fn, x) for x in items]
            try:
                for future, size in zip(futures, sizes, strict=True):
                    results.append(future.result())
                    done += size
                    rate = done / 1e6 / max(time.monotonic() - t0, 1e-9)
                    share = 100 * done / max(total, 1)
                    self.progress.update(
                        f"{label}: {done / 1e6:,.0f} of {total / 1e6:,.0f} MB ({share:.0f}%), {rate:.0f} MB/s"
                    )
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
            finally:
                self.progress.clear()
        return results


def prepare(
    data: str | Path,
    tokenizer: dict,
    *,
    check_identity: Callable[[str], None] = lambda sha: None,
    cache: str | Path | None = None,
    in_memory_bytes: int | None = None,
    log: Callable[[str], None] = lambda line: None,
    progress=None,
) -> Corpus:
    """The corpus at `data` (a file or folder, `sources.py`) tokenized by `tokenizer`, a
    `Tokenizer.to_dict()` or `{"kind": "char"}` (a vocabulary of the corpus's characters); shards
    in `cache` (default `cache_root()`); a corpus of at most `in_memory_bytes` (default
    `IN_MEMORY_BYTES`) stays in memory. See the module docstring. Raises `DataError`."""
    data = Path(data).resolve()
    sources, skipped = find_sources(data)
    work = _Work(log, progress or _NoProgress())
    if sum(s.size for s in sources) <= (IN_MEMORY_BYTES if in_memory_bytes is None else in_memory_bytes):
        return _in_memory(data, sources, skipped, tokenizer, check_identity, work)
    root = cache_root() if cache is None else Path(cache).resolve()
    entry = root / entry_name(data, tokenizer)
    manifest = _cached(entry, sources, tokenizer)
    if manifest is None:
        waiting = lambda: log(f"waiting for another process that is preparing {data} ...")
        with EntryLock(root, entry.name, waiting):
            manifest = _cached(entry, sources, tokenizer)  # prepared by that process meanwhile?
            if manifest is None:
                return _prepare_entry(data, sources, skipped, tokenizer, entry, check_identity, work)
    check_identity(manifest.identity)
    return _open(entry, manifest, prepared=False)


def _cached(entry: Path, sources: list[Source], tokenizer: dict) -> Manifest | None:
    """The entry's manifest if the entry is complete and its sources look unchanged (name, size, mtime)."""
    manifest = Manifest.read(entry)
    if manifest is None or not manifest.matches(sources) or not _same_kind(manifest.tokenizer, tokenizer):
        return None
    return manifest if manifest.intact(entry) else None


def _same_kind(prepared: dict, asked: dict) -> bool:
    return prepared["kind"] == asked["kind"] if asked["kind"] == "char" else prepared == asked


def _open(entry: Path, manifest: Manifest, *, prepared: bool) -> Corpus:
    shards = open_shards(entry, manifest.shards, manifest.dtype)
    return Corpus(TokenSpan(shards), tokenizer_from_dict(manifest.tokenizer), manifest, entry, prepared)


def _hashed(sources: list[Source], work: _Work) -> tuple[SourceRecord, ...]:
    hashes = work.map(lambda s: sha256_of(s.path), sources, "hashing", [s.size for s in sources])
    return tuple(SourceRecord(s.name, s.size, s.mtime_ns, h) for s, h in zip(sources, hashes, strict=True))


def _prepare_entry(data, sources, skipped, tokenizer, entry: Path, check_identity, work: _Work) -> Corpus:
    """Under the entry's lock: keep the entry if only modification times changed, else tokenize anew."""
    t0 = time.monotonic()
    records = _hashed(sources, work)
    check_identity(identity(records))
    old = Manifest.read(entry)
    same = lambda rs: [(r.name, r.size, r.sha256) for r in rs]
    if old is not None and _same_kind(old.tokenizer, tokenizer) and same(old.sources) == same(records):
        if old.intact(entry):  # the files were touched, not changed
            manifest = replace(old, sources=records)
            atomic_write_bytes(entry / MANIFEST_NAME, manifest.to_json())
            return _open(entry, manifest, prepared=False)
    remove_leftovers(entry.parent, entry.name)
    folder = new_folder(entry.parent, entry.name)
    try:
        manifest = _tokenize_into(folder, data, sources, records, skipped, tokenizer, work)
        publish(folder, entry)
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        full = e.errno == errno.ENOSPC
        raise DataError(
            f"{'no space left' if full else 'cannot write'} in the token cache {entry.parent} "
            f"({e.strerror or e}) while preparing {data}; {'free some space' if full else 'fix it'} or set "
            f"EQX_GPT_DATA_CACHE to another folder"
        ) from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    size, seconds = sum(s.size for s in sources), time.monotonic() - t0
    work.log(
        f"prepared {data} ({len(sources):,} file{'s' if len(sources) > 1 else ''}, {size / 1e6:,.1f} MB"
        f"{f'; {skipped:,} binary files skipped' if skipped else ''}) "
        f"into "
        f"{manifest.n_tokens:,} tokens in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):.1f} MB/s); "
        f"cached in {entry}/"
    )
    return _open(entry, manifest, prepared=True)


def _tokenize_into(folder: Path, data, sources, records, skipped, tokenizer: dict, work: _Work) -> Manifest:
    """Tokenize the corpus into shards in `folder`, fsynced, then its manifest (last)."""
    chunks = plan_chunks(sources)
    tok = _tokenizer(tokenizer, chunks, work, data)
    dtype = token_dtype(tok.vocab_size)
    names = [f"shard-{i:05d}.bin" for i in range(len(chunks))]
    counts = work.map(
        lambda i: write_shard(chunks[i], tok, dtype, folder / names[i]),
        list(range(len(chunks))), f"tokenizing ({tok.name})", [chunk_bytes(c) for c in chunks],
    )  # fmt: skip
    shards = tuple(Shard(name, n) for name, n in zip(names, counts, strict=True) if n)
    manifest = Manifest(str(data), records, skipped, tok.to_dict(), dtype, shards)
    with open(folder / MANIFEST_NAME, "wb") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync(folder)
    return manifest


def _tokenizer(tokenizer: dict, chunks: list[Chunk], work: _Work, data: Path) -> Tokenizer:
    """The tokenizer asked for; a char vocabulary is the corpus's characters (a pass over it)."""
    if tokenizer["kind"] != CharTokenizer.name:
        return tokenizer_from_dict(tokenizer)
    found = work.map(characters, chunks, "reading characters", [chunk_bytes(c) for c in chunks])
    codepoints = sorted(set().union(*(c.tolist() for c in found)))
    if not codepoints:
        raise DataError(f"{data} holds no text (its .jsonl records are all empty); pass a corpus with some")
    return CharTokenizer("".join(map(chr, codepoints)))


def _in_memory(data, sources, skipped, tokenizer: dict, check_identity, work: _Work) -> Corpus:
    """A small corpus, tokenized in memory (nothing written; too quick for a progress bar)."""
    work = replace(work, progress=_NoProgress())
    records = tuple(SourceRecord(s.name, s.size, s.mtime_ns, sha256_of(s.path)) for s in sources)
    check_identity(identity(records))
    chunks = plan_chunks(sources)
    tok = _tokenizer(tokenizer, chunks, work, data)
    dtype = token_dtype(tok.vocab_size)
    arrays = work.map(lambda c: tokens(c, tok, dtype), chunks, "tokenizing", [0] * len(chunks))
    arrays = [a for a in arrays if len(a)]
    shards = tuple(Shard(f"(in memory {i})", len(a)) for i, a in enumerate(arrays))
    manifest = Manifest(str(data), records, skipped, tok.to_dict(), dtype, shards)
    return Corpus(TokenSpan(arrays), tok, manifest, None, prepared=True)
