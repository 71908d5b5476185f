"""Continuous batching: a fixed number of slots decoded together, one token per step, in one thread.

Each request's sample is a `Sequence`. `Batcher.submit` puts sequences in a bounded waiting queue
(a full queue refuses at once: `QueueFull`). One background thread runs the loop:

1. **Admit.** Every free slot takes the next waiting sequence: its prompt is prefilled into the
   slot's part of the batched KV cache and its first token sampled (`Programs.prefill`).
2. **Slide.** A slot whose window is full (`context_length` tokens) and still has tokens to draw
   is cut to its last `keep` tokens and re-prefilled, as `generate` does (see
   `eqx_gpt.generation.generate`): the same tokens come out as from `sample.py`.
3. **Decode.** One jitted call advances every live slot by one token (`Programs.decode`); each slot
   has its own position. A sequence that has all its tokens, or was cancelled (its client left,
   or a stop string was found), frees its slot, which the next step gives to a waiting one.

So a request joins the batch at the next step and leaves it when done, without waiting for the
others. Every token is handed to the sequence's `emit` callback (from the loop's thread) as a
`Token`, then `Finished`; a failure in a step hands `Failed` to the sequences it hit and the loop
goes on with a fresh cache. A token drawn from logits with no distribution (NaN, `+inf`, all
`-inf`) ends its own sequence with `Failed`; the others go on.

A sequence that asks for attention (`attention_rows`) stays in the batch too: a step in which some
live slot asks runs the programs' attention variant for every slot, and each asking sequence's
`Token` carries its rows; a step in which none asks runs the programs as they were.

It serves any `Decoder` (`GPT`, or a model of your own): the programs are `generate`'s steps
(`eqx_gpt.serve.steps`), and the batched cache is the decoder's own `init_cache(batch=slots)` in
the loop's form, every array's leading axis the slot.
"""

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqx_gpt.errors import EqxGptError
from eqx_gpt.generation.decoder import Decoder, check_decoder
from eqx_gpt.generation.decoding import empty_loop_cache, prefill, prompt_bucket
from eqx_gpt.generation.sampling import UNUSABLE, SamplingOptions
from eqx_gpt.model.multi_lora import adapter_count
from eqx_gpt.serve.steps import ATTENTION_MAX_PAIRS, Programs, attention_width

# Jitted only so that JAX keeps its trace, per model structure: a batcher of a model of the same
# structure (a server started again in this process) learns the model meets the contract without
# tracing its prefill again. Nothing is compiled: it is only ever traced, by `filter_eval_shape`.
_checked_prefill = eqx.filter_jit(prefill)


class QueueFull(EqxGptError):
    """The waiting queue cannot take the sequences of a request now: retry later."""


@dataclass(frozen=True)
class Token:
    """A sampled token: its id, its log-probability under the model (temperature 1, no filters)
    and the `LOGPROBS_MAX` most likely ids with theirs. `prompt` is set on the first token of a
    sequence that asked for its prompt's log-probabilities: one `(id, logprob, top)` per prompt
    token after the first. `attention` is set for a sequence that asks for it (`attention_rows`):
    the weights of the query that drew the token (the token before it) over the window the model
    saw, one row per asked layer and head."""

    id: int
    logprob: float
    top: list[tuple[int, float]]
    prompt: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    attention: np.ndarray | None = None  # (pairs, window): the query row that drew it, if asked


@dataclass(frozen=True)
class Finished:
    """The sequence drew all its tokens (`reason="length"`), or was cancelled (`"cancelled"`)."""

    reason: str


@dataclass(frozen=True)
class Failed:
    """A step failed; the sequence ends without its remaining tokens."""

    message: str


@dataclass(eq=False)
class Sequence:
    """One sample to draw: a prompt (token ids, at most `context_length`, at least one), how many
    tokens, how (`SamplingOptions`; its `keep` and `chunk_size` are not used here) and with which
    sample key (`key_data` of `jax.random.key`, as `generate`'s `key`). `emit` receives each event.
    """

    prompt: list[int]
    max_tokens: int
    options: SamplingOptions
    key_data: np.ndarray
    emit: Callable[[Token | Finished | Failed], None]
    prompt_logprobs: bool = False
    logit_bias: np.ndarray | None = None  # (vocab,) float32 added to the logits before sampling
    adapter: int = 0  # the LoRA adapter it decodes with (`stack_adapters`' index; 0: the base)
    attention_rows: np.ndarray | None = None  # (pairs,) int32: `layer * heads + head` to report
    cancelled: bool = False
    failure: str | None = None  # why the sequence ends before its tokens are drawn
    # The loop's own record, while the sequence holds a slot:
    window: list[int] = field(default_factory=list)  # the tokens fed to the cache, in order
    produced: int = 0  # tokens sampled so far
    next_token: int = 0  # the latest, not yet fed


class Batcher:
    """The decode loop of a served model: `slots` sequences decoded together, `queue_size` waiting.

    `keep` is the window's cut when it fills (None: `generate`'s default, `context_length // 2`).
    Call `start()` once; `stop()` ends the thread. `submit`, `cancel` and the counters are safe
    to call from any thread.
    """

    def __init__(self, model: Decoder, *, slots: int = 16, queue_size: int = 64, keep: int | None = None):
        check_decoder(model)
        self.context_length, self.vocab_size = model.context_length, model.vocab_size
        # A decode that breaks the contract is refused here, in one line, not at the first request.
        one_prompt = jax.ShapeDtypeStruct((1, prompt_bucket(1, self.context_length)), jnp.int32)
        eqx.filter_eval_shape(_checked_prefill, eqx.nn.inference_mode(model), one_prompt)
        self.slots: list[Sequence | None] = [None] * slots
        self.queue_size = queue_size
        self.keep = SamplingOptions(keep=keep).window_keep(model.context_length)
        self.programs = Programs(model)
        self.adapters = adapter_count(model)  # a sequence's `adapter` is below this
        self._model = model
        self._swap: tuple[Programs, Decoder] | None = None  # new weights, taken between two steps
        self._cache = self._empty_cache()
        self._waiting: deque[Sequence] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="eqx_gpt-batcher", daemon=True)
        self.steps = 0  # decode steps run (each advances every live slot by one token)
        self.busy_slot_steps = 0  # live slots summed over decode steps (for /metrics: per step, on average)

    def _empty_cache(self):
        """Zeros in the layout of the loop model's batched cache, one row per slot; a cache whose
        arrays do not all lead with that axis is refused in one line."""
        cache = empty_loop_cache(self._model, len(self.slots))
        shapes = {tuple(a.shape) for a in jax.tree.leaves(cache)}
        if any(not shape or shape[0] != len(self.slots) for shape in shapes):
            raise TypeError(
                f"{type(self._model).__name__}.init_cache(batch={len(self.slots)}) gave arrays of shapes "
                f"{sorted(shapes)}; a Decoder's cache arrays all lead with the batch axis"
            )
        return cache

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def live(self) -> int:
        return sum(s is not None for s in self.slots)

    def start(self) -> "Batcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue `sequences` (all or none): `QueueFull` when the queue cannot take them all. A prompt
        longer than the context is cropped to its last `context_length` tokens, as `generate` does."""
        context, vocab = self.context_length, self.vocab_size
        for s in sequences:
            if not s.prompt or not all(0 <= t < vocab for t in s.prompt):
                raise ValueError(f"a prompt is one or more token ids in [0, vocab_size={vocab})")
            if s.max_tokens < 1:
                raise ValueError(f"a sequence draws at least one token, got max_tokens={s.max_tokens}")
            if not 0 <= s.adapter < self.adapters:
                raise ValueError(f"a sequence's adapter is in [0, {self.adapters}), got {s.adapter}")
            if s.attention_rows is not None and not 1 <= len(s.attention_rows) <= ATTENTION_MAX_PAIRS:
                raise ValueError(f"a sequence asks for 1 to {ATTENTION_MAX_PAIRS} attention rows")
            s.prompt = s.prompt[-context:]
        with self._wake:
            if len(self._waiting) + len(sequences) > self.queue_size:
                raise QueueFull(
                    f"the server is busy: {len(self._waiting)} samples wait for a slot (queue size "
                    f"{self.queue_size}); retry shortly"
                )
            self._waiting.extend(sequences)
            self._wake.notify()

    def swap(self, model: Decoder) -> None:
        """Decode with `model` (the served model's structure, new weights) from the next step on.
        A sequence in flight goes on with the cache its earlier tokens left (`eqx_gpt.serve.follow`)."""
        programs = Programs(model)
        with self._wake:
            self._swap = programs, model

    def cancel(self, sequence: Sequence) -> None:
        """Stop drawing for `sequence`: it frees its slot (or its place in the queue) at the next step."""
        with self._wake:
            sequence.cancelled = True
            if sequence in self._waiting:  # its place in the queue is free at once
                self._waiting.remove(sequence)
                _deliver(sequence, Finished("cancelled"))
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and self.live == 0:
                    self._wake.wait()
                if self._stopping:
                    return
                if self._swap is not None:  # between two steps: no step runs half on each
                    (self.programs, self._model), self._swap = self._swap, None
                admitted = self._admit()
            try:
                self._step(admitted)
            except Exception as e:  # a failed step must not stop the server: fail its sequences
                self._fail_all(f"generation failed: {type(e).__name__}: {e}")

    def _admit(self) -> list[int]:
        """Give free slots to waiting sequences (under the lock); return those slots."""
        admitted = []
        for slot, held in enumerate(self.slots):
            while held is None and self._waiting:
                candidate = self._waiting.popleft()
                if candidate.cancelled:
                    _deliver(candidate, Finished("cancelled"))
                else:
                    held = self.slots[slot] = candidate
                    admitted.append(slot)
        return admitted

    def _step(self, admitted: list[int]) -> None:
        for slot in admitted:
            sequence = self.slots[slot]
            assert sequence is not None
            self._prefill(slot, sequence, sequence.prompt, first=True)
        self._release()
        for slot, sequence in enumerate(self.slots):
            if sequence is not None and len(sequence.window) == self.context_length:
                cut = sequence.window[len(sequence.window) - (self.keep - 1) :] if self.keep > 1 else []
                self._prefill(slot, sequence, [*cut, sequence.next_token], first=False)
        self._release()
        if self.live:
            self._decode()
            self._release()

    def _prefill(self, slot: int, sequence: Sequence, tokens: list[int], *, first: bool) -> None:
        """Run `tokens` into `slot` from position 0 and sample the sequence's next token."""
        o = sequence.options
        bucket = prompt_bucket(len(tokens), self.context_length)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, : len(tokens)] = tokens
        greedy = o.temperature == 0
        rows = sequence.attention_rows
        if rows is not None:  # padded to a power of two: few programs compile
            rows = np.pad(rows, (0, attention_width(len(rows)) - len(rows)))
        self._cache, token, chosen, prompt, attention = self.programs.prefill(
            self._cache, np.int32(slot), padded, np.int32(len(tokens)),
            np.int32(sequence.produced), sequence.key_data, np.float32(o.temperature),
            None if greedy or o.top_k is None else np.int32(o.top_k),
            None if greedy or o.top_p is None else np.float32(o.top_p),
            first and sequence.prompt_logprobs,
            sequence.logit_bias,
            np.int32(sequence.adapter),
            rows,
        )  # fmt: skip
        sequence.window = list(tokens)
        logprobs = None
        if prompt is not None:
            top_ids, top, chosen_all = (np.asarray(a) for a in (prompt.top_ids, prompt.top, prompt.chosen))
            logprobs = [
                (tokens[i + 1], float(chosen_all[i]), _pairs(top_ids[i], top[i]))
                for i in range(len(tokens) - 1)
            ]
        weights = None if attention is None else _window_rows(sequence, np.asarray(attention))
        self._advance(
            sequence, int(token), float(chosen.chosen), _pairs(chosen.top_ids, chosen.top), logprobs, weights
        )

    def _decode(self) -> None:
        """One step: every live slot feeds its latest token and draws the next."""
        n, vocab = len(self.slots), self.vocab_size
        tokens, starts, produced = (np.zeros(n, np.int32) for _ in range(3))
        key_data = np.zeros((n, 2), np.uint32)
        temperature, top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
        top_k = np.full(n, vocab, np.int32)
        for i, s in enumerate(self.slots):
            if s is None:
                continue  # a free slot decodes a junk token at position 0; its next prefill overwrites it
            tokens[i], starts[i], produced[i], key_data[i] = (
                s.next_token,
                len(s.window),
                s.produced,
                s.key_data,
            )
            temperature[i] = s.options.temperature
            top_k[i] = vocab if s.options.top_k is None else min(s.options.top_k, vocab)
            top_p[i] = 1.0 if s.options.top_p is None else s.options.top_p
        live = [s for s in self.slots if s is not None and s.options.temperature > 0]
        rows, bias = [None if s is None else s.logit_bias for s in self.slots], None
        if any(r is not None for r in rows):  # a (slots, vocab) array only when some slot has a bias
            bias = np.stack([np.zeros(vocab, np.float32) if r is None else r for r in rows])
        asked = self._attention_rows()
        self._cache, chosen, logprobs, attention = self.programs.decode(
            self._cache,
            tokens, starts, produced, key_data, temperature, top_k, top_p,
            use_top_k=any(s.options.top_k is not None for s in live),
            use_top_p=any(s.options.top_p is not None for s in live),
            bias=bias,
            adapters=np.asarray([0 if s is None else s.adapter for s in self.slots], np.int32),
            rows=asked,
        )  # fmt: skip
        attention = None if attention is None else np.asarray(attention)
        chosen, lp = np.asarray(chosen), np.asarray(logprobs.chosen)
        top_ids, top = np.asarray(logprobs.top_ids), np.asarray(logprobs.top)
        self.steps += 1
        self.busy_slot_steps += sum(s is not None for s in self.slots)
        for i, s in enumerate(self.slots):
            if s is not None:
                s.window.append(s.next_token)
                weights = None
                if attention is not None and s.attention_rows is not None:
                    weights = _window_rows(s, attention[i])
                self._advance(s, int(chosen[i]), float(lp[i]), _pairs(top_ids[i], top[i]), None, weights)

    def _attention_rows(self) -> np.ndarray | None:
        """The decode step's `rows` `(slots, width)`: each slot's asked layers and heads, zeros for
        the others; None when no live slot asks (the step then compiles no attention output)."""
        asking = [s.attention_rows for s in self.slots if s is not None and s.attention_rows is not None]
        if not asking:
            return None
        rows = np.zeros((len(self.slots), attention_width(max(len(r) for r in asking))), np.int32)
        for i, s in enumerate(self.slots):
            if s is not None and s.attention_rows is not None:
                rows[i, : len(s.attention_rows)] = s.attention_rows
        return rows

    def _advance(
        self, sequence: Sequence, token: int, logprob: float, top, prompt=None, attention=None
    ) -> None:
        if token == UNUSABLE:  # its slot is freed by the next `_release`
            sequence.failure = (
                f"the model's logits for token {sequence.produced} hold NaN or +inf, or are all -inf: "
                f"no distribution to sample from (a diverged or broken model)"
            )
            return
        sequence.next_token = token
        sequence.produced += 1
        _deliver(sequence, Token(token, logprob, top, prompt, attention))

    def _release(self) -> None:
        """Free the slots of sequences that are done or cancelled, telling them so."""
        for slot, s in enumerate(self.slots):
            if s is not None and s.failure is not None:
                self.slots[slot] = None
                _deliver(s, Failed(s.failure))
            elif s is not None and (s.cancelled or s.produced >= s.max_tokens):
                self.slots[slot] = None
                _deliver(s, Finished("cancelled" if s.cancelled else "length"))

    def _fail_all(self, message: str) -> None:
        self._cache = self._empty_cache()  # a failed call may have consumed the donated cache
        for slot, s in enumerate(self.slots):
            if s is not None:
                self.slots[slot] = None
                _deliver(s, Failed(message))


def _window_rows(sequence: Sequence, attention: np.ndarray) -> np.ndarray:
    """A slot's attention `(width, capacity)` cut to its asked rows over its window (every
    position after its window is hidden from the query: weight 0)."""
    assert sequence.attention_rows is not None
    return attention[: len(sequence.attention_rows), : len(sequence.window)].copy()


def _pairs(ids, logprobs) -> list[tuple[int, float]]:
    return [(int(i), float(p)) for i, p in zip(np.asarray(ids), np.asarray(logprobs), strict=True)]


def _deliver(sequence: Sequence, event: Token | Finished | Failed) -> None:
    try:
        sequence.emit(event)
    except Exception:  # the listener is gone (its event loop closed): nobody is left to tell
        sequence.cancelled = True


def sample_key_data(seed: int, sample: int) -> np.ndarray:
    """The key data of sample number `sample` of a seeded request: `sample.py --seed seed`'s key for
    its sample of that number (`fold_in(key(seed), sample)`)."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), sample)))
