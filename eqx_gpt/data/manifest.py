"""The manifest of a prepared corpus: what was tokenized (each source's name, size, modification
time and sha256), by which tokenizer, and what was written (each shard's name and token count).

It is written last, into the folder that is then renamed into place, so a folder with a manifest
is complete; `intact` also checks that every shard has exactly the bytes the manifest promises.
"""

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from eqx_gpt.data.sources import Source

FORMAT = 1
MANIFEST_NAME = "manifest.json"
TRAIN_FRACTION = 0.9  # the first 90% of the tokens train, the rest validate


@dataclass(frozen=True)
class SourceRecord:
    name: str
    size: int
    mtime_ns: int
    sha256: str


@dataclass(frozen=True)
class Shard:
    name: str  # file name in the cache folder
    n_tokens: int


@dataclass(frozen=True)
class Manifest:
    data: str  # the path prepared (absolute)
    sources: tuple[SourceRecord, ...]
    skipped_binary: int  # binary files of a folder that were left out
    tokenizer: dict  # `Tokenizer.to_dict()`: a char vocabulary is the corpus's own
    dtype: str  # "uint16" when the vocabulary fits, else "uint32"
    shards: tuple[Shard, ...]
    format: int = FORMAT

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
        files' names and sha256s."""
        return identity(self.sources)

    def matches(self, sources: list[Source]) -> bool:
        """Whether `sources` are the files prepared, by name, size and modification time."""
        return [(s.name, s.size, s.mtime_ns) for s in self.sources] == [
            (s.name, s.size, s.mtime_ns) for s in sources
        ]

    def intact(self, folder: Path) -> bool:
        """Whether every shard in `folder` has exactly the bytes this manifest promises."""
        width = np.dtype(self.dtype).itemsize
        try:
            return all((folder / s.name).stat().st_size == s.n_tokens * width for s in self.shards)
        except OSError:
            return False

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def read(cls, folder: Path) -> "Manifest | None":
        """The manifest in `folder`, or None if there is none, or not one this version can read."""
        try:
            d = json.loads((folder / MANIFEST_NAME).read_text())
            if d.get("format") != FORMAT:
                return None
            return cls(
                **{**d, "sources": tuple(SourceRecord(**s) for s in d["sources"]),
                   "shards": tuple(Shard(**s) for s in d["shards"])}
            )  # fmt: skip
        except (OSError, ValueError, TypeError, KeyError):
            return None


def identity(sources: tuple[SourceRecord, ...]) -> str:
    if len(sources) == 1:
        return sources[0].sha256
    listing = json.dumps([[s.name, s.sha256] for s in sources]).encode()
    return hashlib.sha256(listing).hexdigest()


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
