"""The text of one choice of a completion, as its tokens arrive: `ChoiceText`.

It decodes incrementally (a byte-level tokenizer can split a character across tokens: text ending
in an incomplete one, U+FFFD, is held back), cuts the text at the first stop string (which is not
included, as in OpenAI's API), holds back a tail that could still become a stop string, and keeps
the log-probabilities in OpenAI's legacy shape (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`). Log-probabilities are the model's own (temperature 1, before top-k and top-p).
"""

from eqx_gpt.serve.batcher import Token


class ChoiceText:
    """Accumulates the tokens of one choice. `add` returns the text released by one more token;
    `stopped` turns True at a stop string (draw no more), `finish` releases what was held back."""

    def __init__(self, tokenizer, stops: list[str], echo: str = "", logprobs: int | None = None):
        self.tokenizer, self.stops, self.top_n = tokenizer, stops, logprobs
        self.ids: list[int] = []
        self.text = ""  # the choice's text so far (decoded, before any cut)
        self.released = 0  # characters of `text` handed out
        self.stopped = False
        self.echo = echo
        self.logprobs = (
            None
            if logprobs is None
            else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        )
        self._offset = len(echo)  # text offset of the next token's text (after the echo)

    def _record(self, token: int, logprob: float | None, top) -> None:
        if self.logprobs is None:
            return
        piece = self.tokenizer.decode([token])
        self.logprobs["tokens"].append(piece)
        self.logprobs["token_logprobs"].append(logprob)
        self.logprobs["top_logprobs"].append(
            None if top is None else {self.tokenizer.decode([i]): p for i, p in top[: self.top_n]}
        )
        self.logprobs["text_offset"].append(self._offset)
        self._offset += len(piece)

    def add_prompt(self, prompt_ids: list[int], event: Token) -> None:
        """Record the prompt's own log-probabilities (for `echo` with `logprobs`): null for the first."""
        if self.logprobs is None:
            return
        self._offset = 0
        self._record(prompt_ids[0], None, None)
        for token, logprob, top in event.prompt or []:
            self._record(token, logprob, top)
        self._offset = len(self.echo)

    def add(self, event: Token) -> str:
        """The text one more token releases ("" while held back or after a stop)."""
        if self.stopped:
            return ""
        self.ids.append(event.id)
        self._record(event.id, event.logprob, event.top)
        self.text = self.tokenizer.decode(self.ids)
        if self.text.endswith("\ufffd"):
            return ""
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self.text) - self._held_tail())

    def finish(self) -> str:
        """The text still held back, once no token follows."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.released : max(end, self.released)]
        self.released = max(end, self.released)
        return piece

    def _first_stop(self) -> int | None:
        found = [i for i in (self.text.find(s, max(0, self.released - len(s))) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _held_tail(self) -> int:
        """The length of the longest end of the text that begins some stop string."""
        tail = self.text[self.released :]
        return max(
            (n for s in self.stops for n in range(1, min(len(s), len(tail) + 1)) if tail.endswith(s[:n])),
            default=0,
        )

    def last_logprobs(self) -> dict | None:
        """The log-probabilities of the latest token alone (a streamed chunk's)."""
        return (
            None if self.logprobs is None else {name: values[-1:] for name, values in self.logprobs.items()}
        )

    def final_logprobs(self) -> dict | None:
        """The log-probabilities of the tokens whose text begins within the released text."""
        if self.logprobs is None:
            return None
        end = len(self.echo) + self.released
        offsets = self.logprobs["text_offset"]
        keep = sum(1 for offset in offsets if offset < end) if self.stopped else len(offsets)
        return {name: values[:keep] for name, values in self.logprobs.items()}
