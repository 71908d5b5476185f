"""Tokenizers: text <-> integer ids. A character vocabulary (the default) or GPT-2's BPE.

Both kinds share one small interface: `encode(text) -> list[int]`, `decode(ids) -> str`,
`token_bytes(id) -> bytes` (a token's own bytes, for the server's log-probabilities), `vocab_size`,
`name`, and `to_dict()`, whose JSON-ready output `tokenizer_from_dict` turns back
into the same tokenizer (checkpoints store it beside the weights).
"""

from collections.abc import Iterable

import numpy as np

from eqx_gpt._checks import is_whole
from eqx_gpt.errors import TokenizerError


def checked_ids(ids: Iterable[int], vocab_size: int, vocabulary: str) -> list[int]:
    """`ids` as a list of Python ints, or a one-line `TokenizerError` (a `ValueError`) naming the
    first id that is not an integer in `[0, vocab_size)`: a float, a bool or a string is not
    truncated or read as a number."""
    try:
        items = list(ids)
    except TypeError:
        raise TokenizerError(f"decode takes a sequence of token ids, got {ids!r}") from None
    if not items:
        return []
    try:
        values = np.asarray(items)
    except (ValueError, TypeError):
        values = np.asarray(items, dtype=object)
    flags = [i for i in items if isinstance(i, bool | np.bool_)]
    if values.ndim != 1 or values.dtype.kind not in "iu" or flags:
        first = flags[0] if flags else next((i for i in items if not _is_integer(i)), items[0])
        raise TokenizerError(
            f"token ids must be integers in [0, {vocab_size}) of the {vocabulary}, got {first!r}"
        )
    outside = values[(values < 0) | (values >= vocab_size)]
    if outside.size:
        raise TokenizerError(f"token id {outside[0]} is outside the {vocabulary} [0, {vocab_size})")
    return values.tolist()


class UnknownCharacters(TokenizerError):
    """A text with characters a `CharTokenizer` does not know (`characters`, sorted). The message
    names the text by what it is (`what`): the tokenizer calls it "the text"; a caller that knows
    better names it again (`naming`): "the prompt", "--text notes.txt", "data file a.txt"."""

    def __init__(self, characters: list[str], what: str = "the text"):
        self.characters, self.what = characters, what
        shown = ", ".join(map(repr, characters[:20])) + (", ..." if len(characters) > 20 else "")
        super().__init__(
            f"{what} has characters the tokenizer does not know: {shown}; a character vocabulary knows "
            f"only those of the corpus it was built from: remove or replace them"
        )

    def naming(self, what: str) -> "UnknownCharacters":
        """The same error, naming the text `what`."""
        return UnknownCharacters(self.characters, what)


def _is_integer(value) -> bool:
    """Whether one id is an integer scalar (Python, NumPy or a 0-d array), not a bool."""
    dtype = np.asarray(value).dtype
    return np.ndim(value) == 0 and dtype.kind in "iu"


class CharTokenizer:
    """One id per character: id `i` is `chars[i]`.

    Built from a corpus with `CharTokenizer.from_text(text)` (its sorted distinct characters, 65
    for Tiny Shakespeare); saved with the checkpoint, because another corpus gives other ids.
    """

    name = "char"

    def __init__(self, chars: str):
        if not chars:
            raise TokenizerError("CharTokenizer needs at least one character")
        if len(set(chars)) != len(chars):
            raise TokenizerError("CharTokenizer characters must be distinct")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer whose vocabulary is the sorted distinct characters of `text`."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        try:
            return [ids[c] for c in text]
        except KeyError:
            raise UnknownCharacters(sorted({c for c in text if c not in ids})) from None

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as a `uint32` array, computed in numpy (a corpus is millions of characters)."""
        unknown = np.iinfo(np.uint32).max
        if not hasattr(self, "_table"):  # the id of each code point up to the largest known one
            codepoints = np.array([ord(c) for c in self.chars])
            table = np.full(codepoints.max() + 2, unknown, np.uint32)  # the last entry: beyond them all
            table[codepoints] = np.arange(len(codepoints))
            self._table = table
        codepoints = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        ids = self._table[np.minimum(codepoints, len(self._table) - 1)]
        if len(ids) and ids.max() == unknown:
            self.encode(text)  # raises, naming the unknown characters
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, each an integer in `[0, vocab_size)` (else a `TokenizerError`)."""
        chars = self.chars
        return "".join(chars[i] for i in checked_ids(ids, len(chars), "character vocabulary"))

    def token_bytes(self, token: int) -> bytes:
        """The UTF-8 bytes of one token's character."""
        return self.decode([token]).encode("utf-8")

    def to_dict(self) -> dict:
        return {"kind": self.name, "chars": self.chars}

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


GPT2_VOCAB_SIZE = 50257


class GPT2Tokenizer:
    """GPT-2's byte-pair encoding via tiktoken: 50257 ids (the model pads its table to 50304).

    With `vocab_size` below 50257, the same encoding keeps only its first `vocab_size` tokens: the
    256 bytes and the first `vocab_size - 256` merges, which is the BPE that stopped merging
    there (small test models, such as Hugging Face's tiny GPT-2s, are built this way). Its ids
    are GPT-2's. tiktoken downloads its two BPE files once and caches them; set
    `TIKTOKEN_CACHE_DIR` to a folder holding them to work offline.
    """

    name = "gpt2"

    def __init__(self, vocab_size: int = GPT2_VOCAB_SIZE):
        import tiktoken

        if not is_whole(vocab_size, 256, GPT2_VOCAB_SIZE):
            raise TokenizerError(
                f"a GPT-2 BPE vocabulary has 256 (the bytes) to 50257 ids, got vocab_size={vocab_size!r}"
            )
        try:
            encoding = tiktoken.get_encoding("gpt2")
        except Exception as e:  # network or cache failures come in many exception types
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(
                f"tiktoken could not load the GPT-2 BPE files ({reason}); connect to the network once "
                f"or set TIKTOKEN_CACHE_DIR to a folder that holds them"
            ) from None
        if vocab_size < GPT2_VOCAB_SIZE:
            ranks = {token: rank for token, rank in encoding._mergeable_ranks.items() if rank < vocab_size}
            encoding = tiktoken.Encoding(
                f"gpt2-{vocab_size}", pat_str=encoding._pat_str, mergeable_ranks=ranks, special_tokens={}
            )
        self._encoding = encoding

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        # Special tokens such as "<|endoftext|>" are encoded as plain text, never as control ids.
        return self._encoding.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as a `uint32` array, without a Python list between (tiktoken releases the
        GIL meanwhile, so threads encode in parallel)."""
        return self._encoding.encode_to_numpy(text, disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, each an integer in `[0, vocab_size)` (else a `TokenizerError`)."""
        return self._encoding.decode(checked_ids(ids, self.vocab_size, "GPT-2 vocabulary"))

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token, which may be part of a UTF-8 character (so not text alone)."""
        (token,) = checked_ids([token], self.vocab_size, "GPT-2 vocabulary")
        return self._encoding.decode_single_token_bytes(token)

    def to_dict(self) -> dict:
        full = self.vocab_size == GPT2_VOCAB_SIZE
        return {"kind": self.name} if full else {"kind": self.name, "vocab_size": self.vocab_size}

    def __eq__(self, other) -> bool:
        return isinstance(other, GPT2Tokenizer) and other.vocab_size == self.vocab_size

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(vocab_size={self.vocab_size})"


Tokenizer = CharTokenizer | GPT2Tokenizer


def tokenizer_from_dict(d: dict) -> Tokenizer:
    """Inverse of `to_dict` for either tokenizer kind."""
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == CharTokenizer.name and isinstance(d.get("chars"), str):
        return CharTokenizer(d["chars"])
    if kind == GPT2Tokenizer.name:
        return GPT2Tokenizer(d.get("vocab_size", GPT2_VOCAB_SIZE))
    raise TokenizerError(f"unknown tokenizer description {d!r}; expected kind 'char' (with chars) or 'gpt2'")
