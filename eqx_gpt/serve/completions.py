"""The text of one choice of a completion, as its tokens arrive: `ChoiceText`.

It decodes incrementally (`Detokenizer`: only the newest tokens are decoded, with a few before
them for context, so a token costs the same at the 10th as at the 10,000th; a byte-level tokenizer
can split a character across tokens, and text ending in an incomplete one is held back), cuts the
text at the first stop string (which is not included, as in OpenAI's API), searching only the new
text and the stop's length before it, holds back a tail that could still become a stop string,
and keeps the log-probabilities in OpenAI's legacy shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`). A token whose bytes are not text on their own (a part of a UTF-8
character) is named as OpenAI's API names it, `bytes:\\xe2\\x80`, so two such tokens never share a
`top_logprobs` key. Log-probabilities are the model's own (temperature 1, before top-k and top-p).

And the attention a request asked for (eqx_gpt's `attention`), in the same shape of lists aligned
with the generated tokens: `start` (the text position of each token's row's first weight) and
`weights` (per token, per layer, per head, the row), rounded to `ATTENTION_DECIMALS` decimals.
"""

import numpy as np

from eqx_gpt.serve.batcher import Token
from eqx_gpt.serve.requests import AttentionRequest

REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character
MAX_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 tokens
ATTENTION_DECIMALS = 6  # a row of 1,024 weights still sums to 1 within 5e-4


def token_text(tokenizer, token: int) -> str | bytes:
    """One token's text, or its bytes where they are not text alone (a tokenizer without
    `token_bytes` gives its decoded text)."""
    to_bytes = getattr(tokenizer, "token_bytes", None)
    if to_bytes is None:
        return tokenizer.decode([token])
    raw = to_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def token_piece(tokenizer, token: int) -> str:
    """A token as OpenAI's log-probabilities name it: its text, or `bytes:\\xNN...`."""
    text = token_text(tokenizer, token)
    return text if isinstance(text, str) else "bytes:" + "".join(f"\\x{b:02x}" for b in text)


def token_pieces(tokenizer, ids: list[int]) -> list[dict]:
    """`/tokenize`'s pieces, as llama.cpp's server gives them: `{"id", "piece"}`, the piece a string
    where the token's bytes are text, else the list of its byte values."""
    pieces = [(token, token_text(tokenizer, token)) for token in ids]
    return [{"id": t, "piece": text if isinstance(text, str) else list(text)} for t, text in pieces]


class Detokenizer:
    """Text from token ids, one id at a time: `add` returns the text the id completes ("" while a
    character is incomplete). Each call decodes only the ids since the last text it returned and
    the ids before that (as vLLM does), never the whole sequence."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # ids[_prefix:_read]: the context decoded again, already in `text`
        self._read = 0  # ids[_read:]: not yet in `text`

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is held back, as it decodes (no more ids follow)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        held = len(self.ids) - self._read
        incomplete = after.endswith(REPLACEMENT) and held < MAX_CHAR_TOKENS
        if len(after) <= len(before) or (incomplete and not final):
            return ""
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += new
        return new


class ChoiceText:
    """Accumulates the tokens of one choice. `add` returns the text released by one more token;
    `stopped` turns True at a stop string (draw no more), `finish` releases what was held back."""

    def __init__(
        self, tokenizer, stops: list[str], echo: str = "", logprobs: int | None = None,
        attention: AttentionRequest | None = None, prompt_tokens: int = 0,
    ):  # fmt: skip
        self.tokenizer, self.stops, self.top_n = tokenizer, stops, logprobs
        self.decoded = Detokenizer(tokenizer)
        self.released = 0  # characters of the text handed out
        self.stopped = False
        self.echo = echo
        self.logprobs = (
            None
            if logprobs is None
            else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        )
        self.offsets: list[int] = []  # each generated token's text offset (where a stop cuts)
        self.prompt_tokens = prompt_tokens  # the prompt's, as sent: where the generated ones begin
        self.asked = attention
        self.attention = None if attention is None else {"start": [], "weights": []}

    @property
    def text(self) -> str:
        """The choice's text so far (decoded, before any cut)."""
        return self.decoded.text

    def _record(self, token: int, logprob: float | None, top, offset: int) -> None:
        if self.logprobs is None:
            return
        self.logprobs["tokens"].append(token_piece(self.tokenizer, token))
        self.logprobs["token_logprobs"].append(logprob)
        alternatives = None
        if top is not None:
            alternatives = {}
            for i, p in top[: self.top_n]:  # most likely first: a shared key keeps the likelier
                alternatives.setdefault(token_piece(self.tokenizer, i), p)
        self.logprobs["top_logprobs"].append(alternatives)
        self.logprobs["text_offset"].append(offset)

    def _record_attention(self, event: Token) -> None:
        if self.attention is None or self.asked is None or event.attention is None:
            return
        rows = np.round(event.attention.astype(np.float64), ATTENTION_DECIMALS)
        window = rows.shape[-1]  # the token's query sits at the window's last position
        self.attention["start"].append(self.prompt_tokens + len(self.offsets) - window)
        shape = (len(self.asked.layers), len(self.asked.heads), window)
        self.attention["weights"].append(rows.reshape(shape).tolist())

    def add_prompt(self, prompt_ids: list[int], event: Token) -> None:
        """Record the prompt's own log-probabilities (for `echo` with `logprobs`): null for the first
        (and for those cropped off a prompt longer than the context)."""
        if self.logprobs is None:
            return
        prompt = Detokenizer(self.tokenizer)
        scored = event.prompt or []  # past the context, only the prompt's last tokens were scored
        entries = [*((t, None, None) for t in prompt_ids[: len(prompt_ids) - len(scored)]), *scored]
        for token, logprob, top in entries:
            self._record(token, logprob, top, len(prompt.text))
            prompt.add(token)

    def add(self, event: Token) -> str:
        """The text one more token releases ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        start = len(self.text)
        self._record(event.id, event.logprob, event.top, len(self.echo) + start)
        self._record_attention(event)
        self.offsets.append(len(self.echo) + start)
        if not self.decoded.add(event.id):
            return ""
        cut = self._first_stop(start)
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self.text) - self._held_tail())

    def finish(self) -> str:
        """The text still held back, once no token follows."""
        if self.stopped:
            return ""
        start = len(self.text)
        self.decoded.flush()
        cut = self._first_stop(start)
        self.stopped = cut is not None
        return self._release(len(self.text) if cut is None else cut)

    def _release(self, end: int) -> str:
        piece = self.text[self.released : max(end, self.released)]
        self.released = max(end, self.released)
        return piece

    def _first_stop(self, start: int) -> int | None:
        """Where the first stop string begins, searching only what can end in the text after
        `start` (an earlier one would have stopped the choice already)."""
        text = self.text
        found = [i for s in self.stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        return min(found) if found else None

    def _held_tail(self) -> int:
        """The length of the longest end of the unreleased text that begins some stop string."""
        text, unreleased = self.text, len(self.text) - self.released
        held = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, unreleased), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held

    def last_logprobs(self) -> dict | None:
        """The log-probabilities of the latest token alone (a streamed chunk's)."""
        return (
            None if self.logprobs is None else {name: values[-1:] for name, values in self.logprobs.items()}
        )

    def _kept(self, offsets: list[int]) -> int:
        """How many of the tokens at `offsets` begin within the released text."""
        end = len(self.echo) + self.released
        return sum(1 for offset in offsets if offset < end) if self.stopped else len(offsets)

    def final_logprobs(self) -> dict | None:
        """The log-probabilities of the tokens whose text begins within the released text."""
        if self.logprobs is None:
            return None
        keep = self._kept(self.logprobs["text_offset"])
        return {name: values[:keep] for name, values in self.logprobs.items()}

    def _attention_of(self, start: int, end: int | None) -> dict | None:
        if self.attention is None or self.asked is None:
            return None
        kept = {name: values[start:end] for name, values in self.attention.items()}
        return {"layers": self.asked.layers, "heads": self.asked.heads, **kept}

    def last_attention(self) -> dict | None:
        """The attention of the latest token alone (a streamed chunk's)."""
        return self._attention_of(-1, None)

    def final_attention(self) -> dict | None:
        """The attention of the generated tokens whose text begins within the released text."""
        return self._attention_of(0, self._kept(self.offsets))
