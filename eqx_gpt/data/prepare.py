"""Preparing a corpus: tokenize it once into shards in the cache, and read them on every later start.

`prepare(path, tokenizer)` returns a `Corpus` whose tokens are read from shard files as needed:

- The cache entry of `(path, tokenizer)` (`cache.py`) is used when its manifest names the same
  files with the same size, times and inode (`manifest.py` says what that guarantees), and every
  shard passes `shards.verify`: every shard byte is read once and checked against its CRC-32,
  and every id against the vocabulary. No source is read then. The cost of a start is the
  shards' bytes, read and hashed once (`zlib.crc32`, which releases the GIL) by one thread per
  core: 2 bytes per token (`uint16`), so 2.2 GB for a 1.1 GB text of characters, about 0.5 GB
  for it in GPT-2 ids, read in 8 MiB blocks (`shards.VERIFY_BLOCK`, per thread).
  A damaged entry (zeroed, truncated or changed bytes, ids outside the vocabulary) is logged in
  one line and prepared again.
- Otherwise, under the entry's lock: the sources are hashed (sha256); the entry is kept if only
  their times or inodes changed and its shards verify (the manifest is rewritten); else the
  corpus is tokenized into a new version of the entry by one thread per core, chunk by chunk
  (`chunks.py`), with a progress bar. A char vocabulary is the corpus's own characters, found by
  a first pass over it. A source whose `stat` changed during this is refused: the sha256
  recorded is always that of the bytes tokenized.
- A corpus of at most `IN_MEMORY_BYTES` of text (Tiny Shakespeare) is hashed and tokenized at each
  start instead, in memory (well under a second for characters): nothing is written. The text of
  compressed files and tables is counted as it is read, never guessed from their size (gzip
  reaches 1000:1): such a corpus with an entry in the cache goes the cached way (the entry exists
  because it once passed the limit); else it is read in memory until its text passes the limit,
  and then prepared into the cache from its start (so what is read in memory is at most the
  limit, whatever the ratio).

Compressed files and tables (`formats.py`) go the same way: their identity is the sha256 of their
bytes as stored, the progress bar counts those bytes, and they are read as they decompress (see
`chunks.py`). `text_field` names the text of .jsonl records and tables' column: it is part of the
entry's name and manifest, and of the corpus's identity when the corpus has records, so another
field never reuses the tokens of the first.

`split` picks the split of a folder of splits (`sources.find_sources`); the entry is named after the
split read, and the corpus's identity is that of its files.

`check_identity(sha)` is called with the corpus's identity (`Manifest.identity`) before any
tokenizing, so a resumed run refuses changed data without tokenizing it first. The corpus keeps
the version of the entry it opened until it is closed (`Corpus.close`) or collected.
"""

import collections
import concurrent.futures
import errno
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from eqx_gpt.data.cache import (
    EntryLock,
    Snapshot,
    cache_root,
    collect,
    entry_name,
    fsync,
    new_folder,
    publish,
    remove_leftovers,
    resolve_cache,
)
from eqx_gpt.data.chunks import Chunk, characters, chunk_bytes, chunk_weight, plan_chunks, tokens, write_shard
from eqx_gpt.data.manifest import MANIFEST_NAME, Manifest, Shard, SourceRecord, identity, token_dtype
from eqx_gpt.data.shards import Damaged, ShardFile, TokenSpan, verify
from eqx_gpt.data.sources import (
    Listing,
    Source,
    check_tables,
    check_unchanged,
    find_sources,
    resolve,
    sha256_of,
)
from eqx_gpt.errors import DataError, EqxGptError
from eqx_gpt.files import atomic_write_bytes
from eqx_gpt.tokenizer import CharTokenizer, Tokenizer, tokenizer_from_dict

IN_MEMORY_BYTES = 16 << 20  # corpora of up to this much text are tokenized at each start, not cached
PROGRESS_AFTER = 1.0  # seconds of work before a progress bar shows


@dataclass
class Corpus:
    """A tokenized corpus: `tokens` end to end, split into `train` (the first 90%) and `val`."""

    tokens: TokenSpan
    tokenizer: Tokenizer
    manifest: Manifest
    folder: Path | None  # the cache entry the shards are read from (None: tokenized in memory)
    prepared: bool  # tokenized by this call (False: read from the cache as it was)
    snapshot: Snapshot | None = None  # the version of the entry held open (see `cache.py`)
    listing: Listing | None = None  # the files read and skipped at this start (`summary`)

    @property
    def train(self) -> TokenSpan:
        return self.tokens.span(0, self.manifest.n_train)

    @property
    def val(self) -> TokenSpan:
        return self.tokens.span(self.manifest.n_train, len(self.tokens))

    @property
    def identity(self) -> str:
        return self.manifest.identity

    @property
    def summary(self) -> str:
        """What was read and skipped at this start: "read 12 files (10 .txt, 2 .parquet); skipped
        3 (2 binary, 1 empty)" (`Listing.summary`)."""
        return self.listing.summary if self.listing is not None else ""

    def close(self) -> None:
        """Release the cache version it reads (its tokens can be read no more)."""
        if self.snapshot is not None:
            self.snapshot.close()


class Progress(Protocol):
    """A progress bar: `update(text)` shows a line in place, `clear()` removes it."""

    def update(self, text: str) -> None: ...

    def clear(self) -> None: ...


class _NoProgress:
    def update(self, text: str) -> None:
        pass

    def clear(self) -> None:
        pass


@dataclass
class _Work:
    """How a preparation reports: `log` for lines, `progress` (`update(text)`, `clear()`) for the bar."""

    log: Callable[[str], None]
    progress: Progress
    listed_ns: int = 0  # when the sources were listed (`SourceRecord.of`)
    text_field: str = "text"  # the text of .jsonl records and tables (`prepare`)

    def map(self, fn, items: Iterable, label: str, total: int, weight: Callable[..., int]) -> list:
        """`[fn(x) for x in items]` by one thread per core (numpy, file I/O, decompression and
        tiktoken release the GIL), in order, with a progress bar over `total` bytes, `weight(x)` of
        them per item; `items` are taken as the threads need them (a few in memory at a time: a
        generator of chunks is read as it goes). A failure or Ctrl-C cancels the rest."""
        n_threads = len(os.sched_getaffinity(0)) or 1
        if isinstance(items, list):
            n_threads = min(n_threads, len(items)) or 1
        done, t0, results, pending = 0, time.monotonic(), [], collections.deque()
        with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
            try:
                for item in items:
                    pending.append((pool.submit(fn, item), weight(item)))
                    if len(pending) > 2 * n_threads:
                        done = self._collect(pending.popleft(), results, done, total, t0, label)
                while pending:
                    done = self._collect(pending.popleft(), results, done, total, t0, label)
            except BaseException:
                for future, _ in pending:
                    future.cancel()
                raise
            finally:
                self.progress.clear()
        return results

    def _collect(self, job, results: list, done: int, total: int, t0: float, label: str) -> int:
        """Wait for one item's result, keep it, and show the progress; the bytes now done."""
        future, size = job
        results.append(future.result())
        done += size
        elapsed = time.monotonic() - t0
        if elapsed >= PROGRESS_AFTER:  # no bar for a moment's work (a log off a terminal)
            rate, share = done / 1e6 / elapsed, 100 * done / max(total, 1)
            self.progress.update(
                f"{label}: {done / 1e6:,.0f} of {total / 1e6:,.0f} MB ({share:.0f}%), {rate:.0f} MB/s"
            )
        return done


def prepare(
    data: str | Path,
    tokenizer: dict,
    *,
    text_field: str = "text",
    split: str | None = None,
    check_identity: Callable[[str], None] = lambda sha: None,
    cache: str | Path | None = None,
    in_memory_bytes: int | None = None,
    log: Callable[[str], None] = lambda line: None,
    progress=None,
) -> Corpus:
    """The corpus at `data` (a file or folder, `sources.py`; of a folder of splits, the split
    `split`, default train) tokenized by `tokenizer`, a `Tokenizer.to_dict()` (a character
    vocabulary's: a corpus with other characters is refused) or `{"kind": "char"}` (a vocabulary
    of the corpus's characters); the documents of .jsonl records and of
    tables are their `text_field`; shards in `cache` (default `cache_root()`); a corpus of at most
    `in_memory_bytes` of text (default `IN_MEMORY_BYTES`) stays in memory. See the module
    docstring. Raises `DataError`."""
    data = resolve(data)
    listed_ns = time.time_ns()
    listing = find_sources(data, split)
    sources = listing.sources
    check_tables(sources, text_field)
    work = _Work(log, progress or _NoProgress(), listed_ns, text_field)
    limit = IN_MEMORY_BYTES if in_memory_bytes is None else in_memory_bytes
    known = sum(s.size for s in sources if not _expands(s))  # text whose size its files tell
    if known <= limit and not any(_expands(s) for s in sources):
        return _in_memory(data, listing, tokenizer, check_identity, work)
    root = cache_root() if cache is None else resolve_cache(cache)
    entry = root / entry_name(data, tokenizer, text_field, listing.split)
    collect(root, entry.name)
    found = _cached(entry, sources, tokenizer, work)
    if found is None and not entry.exists() and known <= limit:  # never cached: it may fit in memory
        try:
            return _in_memory(data, listing, tokenizer, check_identity, work, limit - known)
        except _TooLarge:
            pass  # prepared into the cache, from its start
    if not isinstance(found, Corpus):
        if isinstance(found, _Damage):
            log(f"{found.message}; preparing it again")
        waiting = lambda: log(f"waiting for another process that is preparing {data} ...")
        with EntryLock(root, entry.name, waiting):
            damaged = found.inode if isinstance(found, _Damage) else None
            found = _cached(entry, sources, tokenizer, work, damaged)  # prepared by that process meanwhile?
            if not isinstance(found, Corpus):
                damaged = found.inode if isinstance(found, _Damage) else damaged
                found = _prepare_entry(data, listing, tokenizer, entry, check_identity, work, damaged)
                found.listing = listing
                return found
    check_identity(found.identity)
    found.listing = listing
    return found


def _expands(source: Source) -> bool:
    """Whether the text of `source` is known only once read: a compressed file, or a table."""
    return source.compression is not None or source.table


class _TooLarge(DataError):
    """A corpus read in memory passed the limit of its text (`_in_memory`): a signal that `prepare`
    catches, an `EqxGptError` as every exception eqx_gpt defines is (tests/test_exceptions.py)."""


@dataclass(frozen=True)
class _Damage:
    inode: int  # of the version found damaged (not verified again)
    message: str


def _cached(entry: Path, sources: list[Source], tokenizer: dict, work: "_Work", damaged: int | None = None):
    """The entry's version as a `Corpus` if its sources look unchanged (`Manifest.matches`) and its
    shards verify; a `_Damage` if they do not; None if there is no such version."""
    snapshot = Snapshot.open(entry)
    if snapshot is None:
        return None
    manifest = _manifest(snapshot)
    if (
        manifest is None
        or not manifest.matches(sources)
        or manifest.text_field != work.text_field
        or not _same_kind(manifest.tokenizer, tokenizer)
    ):
        snapshot.close()
        return None
    if snapshot.inode == damaged:
        snapshot.close()
        return None
    problem = _verified(snapshot, manifest, work)
    if problem is not None:
        snapshot.close()
        return problem
    return _open(snapshot, manifest, prepared=False)


def _manifest(snapshot: Snapshot) -> Manifest | None:
    try:
        return Manifest.parse(snapshot.read_bytes(MANIFEST_NAME))
    except OSError:
        return None


def _same_kind(prepared: dict, asked: dict) -> bool:
    """Whether tokens prepared by `prepared` are what `asked` asks for: `{"kind": "char"}` asks for
    the corpus's own characters, whatever they are; any other, for itself."""
    return prepared.get("kind") == "char" if asked == {"kind": "char"} else prepared == asked


def _verified(snapshot: Snapshot, manifest: Manifest, work: "_Work") -> "_Damage | None":
    """None if every shard of the version verifies (`shards.verify`), else what is wrong."""
    try:
        vocab_size = tokenizer_from_dict(manifest.tokenizer).vocab_size
        np.dtype(manifest.dtype)
        check = lambda shard: verify(snapshot, shard, manifest.dtype, vocab_size)
        width = np.dtype(manifest.dtype).itemsize
        shards = list(manifest.shards)
        total = sum(s.n_tokens for s in shards) * width
        work.map(check, shards, "verifying the cache", total, lambda s: s.n_tokens * width)
        return None
    except Damaged as e:
        problem = str(e)
    except (EqxGptError, TypeError, KeyError):
        problem = "its manifest names no valid tokenizer or dtype"
    return _Damage(snapshot.inode, f"the token cache {snapshot.path} is damaged ({problem})")


def _open(snapshot: Snapshot, manifest: Manifest, *, prepared: bool) -> Corpus:
    shards = [ShardFile(snapshot, s.name, manifest.dtype, s.n_tokens) for s in manifest.shards]
    tokenizer = tokenizer_from_dict(manifest.tokenizer)
    return Corpus(TokenSpan(shards), tokenizer, manifest, snapshot.path, prepared, snapshot)


def _hashed(sources: list[Source], work: "_Work") -> tuple[SourceRecord, ...]:
    total = sum(s.size for s in sources)
    hashes = work.map(lambda s: sha256_of(s.path), sources, "hashing", total, lambda s: s.size)
    return tuple(SourceRecord.of(s, h, work.listed_ns) for s, h in zip(sources, hashes, strict=True))


def _prepare_entry(
    data, listing: Listing, tokenizer, entry: Path, check_identity, work: "_Work", damaged: int | None
) -> Corpus:
    """Under the entry's lock: keep the entry if its sources were only touched, else tokenize anew."""
    t0, sources = time.monotonic(), listing.sources
    records = _hashed(sources, work)
    check_unchanged(sources)  # the bytes hashed are the bytes listed
    check_identity(identity(records, work.text_field))
    kept = _touched(entry, records, tokenizer, work, damaged)
    if kept is not None:
        return kept
    remove_leftovers(entry.parent, entry.name)
    try:
        folder = new_folder(entry.parent, entry.name)
    except OSError as e:
        raise _cache_error(e, entry, data) from None
    try:
        manifest, text_bytes = _tokenize_into(folder, data, listing, records, tokenizer, work)
        check_unchanged(sources)  # and the bytes tokenized
        publish(folder, entry)
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise _cache_error(e, entry, data) from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    size, seconds = sum(s.size for s in sources), time.monotonic() - t0
    # The text's bytes, what tokenizing costs: a compressed file's or a table's differ from its size.
    stored = f"{_amount(size)}, {_amount(text_bytes)} of text" if text_bytes != size else _amount(size)
    work.log(
        f"prepared {data} ({listing.summary}; {stored}) into {manifest.n_tokens:,} tokens in {seconds:.1f} s "
        f"({_amount(text_bytes / max(seconds, 1e-9))} of text/s); cached in {entry}/"
    )
    snapshot = Snapshot.open(entry)  # the version just published: the lock keeps any other out
    if snapshot is None:
        raise DataError(f"the token cache {entry} vanished as it was written; run again")
    return _open(snapshot, manifest, prepared=True)


def _cache_error(e: OSError, entry: Path, data: Path) -> DataError:
    full = e.errno == errno.ENOSPC
    return DataError(
        f"{'no space left' if full else 'cannot write'} in the token cache {entry.parent} "
        f"({e.strerror or e}) while preparing {data}; {'free some space' if full else 'fix it'} or set "
        f"EQX_GPT_DATA_CACHE to another folder"
    )


def _touched(entry: Path, records, tokenizer: dict, work: "_Work", damaged: int | None) -> Corpus | None:
    """The entry's version with its manifest rewritten to `records`, if it holds the same sources
    by name, size and sha256 (they were only touched) and its shards verify; else None."""
    snapshot = Snapshot.open(entry)
    if snapshot is None:
        return None
    old = _manifest(snapshot)
    same = lambda rs: [(r.name, r.size, r.sha256) for r in rs]
    same_text = (
        old is not None
        and _same_kind(old.tokenizer, tokenizer)
        and old.text_field == work.text_field
        and same(old.sources) == same(records)
    )
    if old is None or not same_text or snapshot.inode == damaged:
        snapshot.close()
        return None
    problem = _verified(snapshot, old, work)
    if problem is not None:
        work.log(f"{problem.message}; preparing it again")
        snapshot.close()
        return None
    manifest = replace(old, sources=records)
    try:
        atomic_write_bytes(entry / MANIFEST_NAME, manifest.to_json())
    except OSError as e:
        snapshot.close()
        raise _cache_error(e, entry, Path(manifest.data)) from None
    return _open(snapshot, manifest, prepared=False)


def _amount(n: float) -> str:
    """A count of bytes in the unit that shows it: "877 bytes", "12.3 KB", "1,024.0 MB"."""
    return f"{n / 1e6:,.1f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} KB" if n >= 1e3 else f"{n:,.0f} bytes"


def _tokenize_into(
    folder: Path, data, listing: Listing, records, tokenizer: dict, work: _Work
) -> tuple[Manifest, int]:
    """Tokenize the corpus into shards in `folder`, fsynced, then its manifest (last); the
    manifest and the bytes of text tokenized."""
    sources, field = listing.sources, work.text_field
    total = sum(s.size for s in sources)
    tok = _tokenizer(tokenizer, lambda: plan_chunks(sources, None, field), total, work, data)
    dtype = token_dtype(tok.vocab_size)

    def shard(job: tuple[int, Chunk]) -> tuple[int, int, int]:
        i, chunk = job
        return (*write_shard(chunk, tok, dtype, folder / f"shard-{i:05d}.bin"), chunk_bytes(chunk))

    written = work.map(
        shard,
        enumerate(plan_chunks(sources, None, field)), f"tokenizing ({tok.name})", total,
        lambda job: chunk_weight(job[1]),
    )  # fmt: skip
    shards = tuple(Shard(f"shard-{i:05d}.bin", n, crc) for i, (n, crc, _) in enumerate(written) if n)
    manifest = Manifest(
        str(data), records, listing.skipped_binary, tok.to_dict(), dtype, shards, text_field=field
    )
    with open(folder / MANIFEST_NAME, "wb") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync(folder)
    return manifest, sum(text for _, _, text in written)


def _tokenizer(
    tokenizer: dict, plan: Callable[[], Iterable[Chunk]], total: int, work: _Work, data: Path
) -> Tokenizer:
    """The tokenizer asked for; `{"kind": "char"}` is the corpus's characters (a pass over it)."""
    if tokenizer != {"kind": CharTokenizer.name}:
        return tokenizer_from_dict(tokenizer)
    found = work.map(characters, plan(), "reading characters", total, chunk_weight)
    codepoints = sorted(set().union(*(c.tolist() for c in found)))
    if not codepoints:
        raise DataError(f"{data} holds no text (its records are all empty); pass a corpus with some")
    return CharTokenizer("".join(map(chr, codepoints)))


def _in_memory(
    data, listing: Listing, tokenizer: dict, check_identity, work: _Work, limit: int | None = None
) -> Corpus:
    """A small corpus, tokenized in memory (nothing written; too quick for a progress bar).
    `limit`: the most text its compressed files and tables may hold (`_TooLarge` past it)."""
    work, sources, field = replace(work, progress=_NoProgress()), listing.sources, work.text_field
    records = tuple(SourceRecord.of(s, sha256_of(s.path), work.listed_ns) for s in sources)
    check_unchanged(sources)
    check_identity(identity(records, field))
    plan = lambda: _bounded(plan_chunks(sources, None, field), limit)
    tok = _tokenizer(tokenizer, plan, 0, work, data)
    dtype = token_dtype(tok.vocab_size)
    arrays = work.map(lambda c: tokens(c, tok, dtype), plan(), "tokenizing", 0, len)
    check_unchanged(sources)  # the bytes tokenized are the bytes hashed
    arrays = [a for a in arrays if len(a)]
    shards = tuple(Shard(f"(in memory {i})", len(a), zlib.crc32(a.data)) for i, a in enumerate(arrays))
    manifest = Manifest(
        str(data), records, listing.skipped_binary, tok.to_dict(), dtype, shards, text_field=field
    )
    return Corpus(TokenSpan(arrays), tok, manifest, None, prepared=True, listing=listing)


def _bounded(chunks: Iterable[Chunk], limit: int | None) -> Iterable[Chunk]:
    """`chunks`, until the text of the compressed files and tables among them passes `limit`
    (then `_TooLarge`): their text is counted as it is read, not guessed from their size."""
    read = 0
    for chunk in chunks:
        read += sum(chunk_bytes((p,)) for p in chunk if _expands(p.source))
        if limit is not None and read > limit:
            raise _TooLarge
        yield chunk
