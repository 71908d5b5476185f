"""The manifest of a prepared corpus: what was tokenized (each source's name, size, times, inode
and sha256), by which tokenizer, and what was written (each shard's name, token count and CRC-32).

It is written last, into the folder that is then renamed into place, so a folder with a manifest
is complete. Whether its shards still hold the bytes it promises is `shards.verify`'s to say.

A source's identity is its sha256, computed from its bytes when the corpus is prepared (or when a
source is found touched: hashed again, tokens kept). A later start that finds a source with the
same size, modification time, status-change time (`ctime`) and inode trusts that sha256 without
reading it (`Manifest.matches`). What that guarantees: any write to a file, by any program,
sets its `ctime` to the current time, and no system call sets it back; `cp -p`, `rsync -t`,
`tar x` and `os.utime` restore a modification time, not a `ctime`. So an edited source is hashed
again, whatever its size and modification time say. A file changed within `RACY_NS` of being
listed is hashed again at the next start (file times tick coarsely: a write in the same tick
leaves them unchanged). Only a clock set back, or a file system that keeps no `ctime`, could pass
an edit off as the old text.
"""

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from eqx_gpt.data import formats
from eqx_gpt.data.sources import Source

FORMAT = 2
MANIFEST_NAME = "manifest.json"
TRAIN_FRACTION = 0.9  # the first 90% of the tokens train, the rest validate
RACY_NS = 2_000_000_000  # a source changed this close to its listing is hashed again next time


@dataclass(frozen=True)
class SourceRecord:
    name: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    sha256: str

    @classmethod
    def of(cls, source: Source, sha256: str, listed_ns: int = 0) -> "SourceRecord":
        """`source`'s record. One changed less than `RACY_NS` before it was listed (at
        `listed_ns`, `time.time_ns()`) is racy: a write in the same clock tick would leave its
        times as they are, so its `ctime_ns` is recorded as -1, which no file matches, and the
        next start hashes it again (git's rule for racily clean files)."""
        racy = listed_ns - max(source.mtime_ns, source.ctime_ns) < RACY_NS
        ctime_ns = -1 if racy else source.ctime_ns
        return cls(source.name, source.size, source.mtime_ns, ctime_ns, source.inode, sha256)


@dataclass(frozen=True)
class Shard:
    name: str  # file name in the cache folder
    n_tokens: int
    crc32: int  # `zlib.crc32` of the shard's bytes (`shards.verify`)


@dataclass(frozen=True)
class Manifest:
    data: str  # the path prepared (absolute)
    sources: tuple[SourceRecord, ...]
    skipped_binary: int  # binary files of a folder that were left out
    tokenizer: dict  # `Tokenizer.to_dict()`: a char vocabulary is the corpus's own
    dtype: str  # "uint16" when the vocabulary fits, else "uint32"
    shards: tuple[Shard, ...]
    format: int = FORMAT
    text_field: str = "text"  # the text of .jsonl records and tables' column (a manifest without: "text")

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.shards)

    @property
    def n_train(self) -> int:
        """Tokens of the training split: the first `TRAIN_FRACTION` of the corpus."""
        return int(self.n_tokens * TRAIN_FRACTION)

    @property
    def identity(self) -> str:
        """What a checkpoint records as its corpus (`data_sha256`): for a single file its sha256
        (the sha256 of the text, as checkpoints always recorded), for a folder the sha256 of its
        files' names and sha256s; and of the text field, when it is not "text" and the corpus has
        records (.jsonl, tables), since it picks their text."""
        return identity(self.sources, self.text_field)

    def matches(self, sources: list[Source]) -> bool:
        """Whether `sources` are the files prepared, by name, size, times and inode (see the
        module docstring for what that guarantees)."""
        return [(s.name, s.size, s.mtime_ns, s.ctime_ns, s.inode) for s in self.sources] == [
            (s.name, s.size, s.mtime_ns, s.ctime_ns, s.inode) for s in sources
        ]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def parse(cls, raw: bytes) -> "Manifest | None":
        """The manifest `raw` holds, or None if it is not one this version can read."""
        try:
            d = json.loads(raw)
            if d.get("format") != FORMAT:
                return None
            return cls(
                **{**d, "sources": tuple(SourceRecord(**s) for s in d["sources"]),
                   "shards": tuple(Shard(**s) for s in d["shards"])}
            )  # fmt: skip
        except (ValueError, TypeError, KeyError, AttributeError):
            return None

    @classmethod
    def read(cls, folder: Path) -> "Manifest | None":
        """The manifest in `folder`, or None if there is none, or not one this version can read."""
        try:
            return cls.parse((folder / MANIFEST_NAME).read_bytes())
        except OSError:
            return None


def identity(sources: tuple[SourceRecord, ...], text_field: str = "text") -> str:
    """See `Manifest.identity`."""
    if text_field != "text" and any(formats.kind(Path(s.name)) != "text" for s in sources):
        listing = json.dumps({"text_field": text_field, "sources": [[s.name, s.sha256] for s in sources]})
        return hashlib.sha256(listing.encode()).hexdigest()
    if len(sources) == 1:
        return sources[0].sha256
    listing = json.dumps([[s.name, s.sha256] for s in sources]).encode()
    return hashlib.sha256(listing).hexdigest()


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
