"""The training corpus: the bundled Tiny Shakespeare or `--data PATH`, prepared into token shards
(`eqx_gpt.data`), split 90/10, and checked against the checkpoint a run resumes.

The corpus's identity (`data_sha256` in checkpoints) is the sha256 of its file, or for a folder
of its files' names and hashes (`Manifest.identity`); a resumed run refuses any other corpus.
"""

import hashlib
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from eqx_gpt.checkpoint import CheckpointError
from eqx_gpt.data.manifest import TRAIN_FRACTION
from eqx_gpt.data.prepare import Corpus, prepare
from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.data.sources import DataError

SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
BUNDLED = "Tiny Shakespeare (bundled)"

__all__ = ["DataError", "SHAKESPEARE_SHA256", "load_corpus", "load_text", "shakespeare_path", "split_text"]


def shakespeare_path() -> Path:
    """The bundled Tiny Shakespeare text (1,115,394 characters), shipped in the package."""
    return Path(str(resources.files("eqx_gpt") / "data" / "tinyshakespeare.txt"))


def load_corpus(
    data: str | None,
    tokenizer: dict,
    *,
    resumes: dict | None = None,
    log: Callable[[str], None] = lambda line: None,
    progress=None,
) -> Corpus:
    """The corpus at `data` (None: the bundled Tiny Shakespeare, checked against its known sha256)
    tokenized by `tokenizer` (see `prepare`). `resumes` is the metadata of the checkpoint a run
    resumes: a corpus other than its `data_sha256` is refused before anything is tokenized."""
    bundled = data is None
    source = BUNDLED if bundled else data

    def check(sha: str) -> None:
        if bundled and sha != SHAKESPEARE_SHA256:
            raise DataError(
                f"bundled corpus {shakespeare_path()} does not match its sha256; reinstall eqx_gpt"
            )
        if resumes is not None and resumes.get("data_sha256") not in (None, sha):
            raise CheckpointError(
                f"{source} is not the corpus the checkpoint in {Path(resumes['path']).parent}/ was trained "
                f"on (its sha256 differs); pass --data PATH to that corpus"
            )

    return prepare(
        shakespeare_path() if bundled else data, tokenizer, check_identity=check, log=log, progress=progress
    )


def check_split(tokens: TokenSpan, name: str, context_length: int, source: str) -> None:
    """Refuse a split shorter than one window of `context_length + 1` tokens."""
    if len(tokens) < context_length + 1:
        raise DataError(
            f"{source}: the {name} split has {len(tokens)} tokens, fewer than one window of "
            f"context_length + 1 = {context_length + 1}; use a longer file or a smaller --context-length"
        )


def load_text(path: str | Path | None = None) -> str:
    """A small text whole, as a string: the bundled Tiny Shakespeare when `path` is None (checked
    against its sha256), else a UTF-8 file. Training reads corpora with `load_corpus` instead."""
    bundled = path is None
    path = shakespeare_path() if bundled else Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist; pass --data PATH to a UTF-8 text file") from None
    except IsADirectoryError:
        raise DataError(f"data path {path} is a directory; pass --data PATH to a UTF-8 text file") from None
    except OSError as e:
        raise DataError(f"data file {path} cannot be read ({e.strerror or e})") from None
    if bundled and hashlib.sha256(raw).hexdigest() != SHAKESPEARE_SHA256:
        raise DataError(f"bundled corpus {path} does not match its sha256; reinstall eqx_gpt")
    if not raw:
        raise DataError(f"data file {path} is empty; pass a text file with some content")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"data file {path} is not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r}); "
            f"convert it, e.g. `iconv -t UTF-8`"
        ) from None


def split_text(text: str, train_fraction: float = TRAIN_FRACTION) -> tuple[str, str]:
    """The first `train_fraction` of the characters for training, the rest for validation (for a
    char tokenizer, the same split as `Corpus.train` and `Corpus.val`)."""
    n = int(len(text) * train_fraction)
    return text[:n], text[n:]
