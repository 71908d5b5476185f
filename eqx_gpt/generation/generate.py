"""Autoregressive generation with a key/value cache, for `GPT` or any model that follows the
`Decoder` protocol (`eqx_gpt.generation.decoder`: `context_length`, `vocab_size`, `init_cache`,
`decode`).

How the cached loop works (`GPT`'s, and the same calls on any decoder):

1. **Prefill.** The prompt (cropped to its last `context_length` tokens) is padded to a
   power-of-two *bucket* (at least 16, at most `context_length`) and run once through
   `decode` at position 0, filling a fixed-size per-layer `KVCache` of `context_length`
   slots. Padded slots hold junk that the causal mask hides and that later tokens overwrite, so
   only a handful of prompt shapes (log2 of the context) are ever compiled. The same program
   samples the first new token, so it can be shown before the decode loop has compiled.
2. **Decode.** Each step runs `decode` on the latest token at the next position and samples
   the following token from its logits: one position of work per token, not a whole window. Steps run
   inside one jitted loop (`jax.lax.fori_loop`) of up to `chunk_size` tokens that carries the
   cache; the number of steps is a traced value, so one compiled program serves every chunk,
   prompt length, temperature, top-k and top-p value. This loop runs a GPT unstacked
   (`GPT.unstack`: a Python loop over separate per-layer weights and caches, updated in place),
   because one token's work is a chain of matrix-vector products bound by memory traffic, and a
   `scan` over the stacked layers would copy every layer's weights and cache once more per token.
   Another decoder runs as it is. The steps themselves (`eqx_gpt.generation.decoding`) are the
   ones the server's batcher runs too.
3. **Sliding past the context.** GPT has absolute (sinusoidal) positions, so cached keys
   belong to the positions they were computed at and a ring buffer would not be exact. Instead,
   when the window already holds `context_length` tokens and one more arrives, the window is cut
   to its most recent `keep` tokens (default `max(1, context_length // 2)`, the new token included),
   these are re-prefilled at positions `0 .. keep - 1` in one pass (the prefill program of step 1),
   and decoding continues one token at a time. That costs one `keep`-token prefill every
   `context_length - keep + 1` tokens. The window's length never depends on the tokens drawn, so
   the host schedules each slide between chunks and the decode loop holds no branch.
   `keep = context_length` gives nanoGPT's true sliding window (every token then pays a
   full-window pass). The same policy, stated on token lists: predict from the window `W`;
   append the new token; if `len(W) > context_length`, `W = W[-keep:]`.

Randomness: token `i` of sample (row) `r` is drawn with `fold_in(fold_in(key, r), i)`, so the
same key gives the same tokens whatever the chunk size, and sample 0 of a batch equals `generate`.

Generation is inference: the model is put in inference mode (`eqx.nn.inference_mode`) first, so
a model with dropout, still in training mode, generates without dropout and needs no key for it.

Logits with no distribution (NaN, `+inf`, or all `-inf`) are never sampled from: the token drawn
from them is `UNUSABLE` (see `eqx_gpt.generation.sampling`), and the host refuses it in one line
before handing it over.
"""

from collections.abc import Iterable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from eqx_gpt._checks import INT32_MAX, is_whole
from eqx_gpt.generation.decoder import Decoder, check_decoder
from eqx_gpt.generation.decoding import (
    batch_of_one,
    decode_rows,
    decode_slot,
    loop_model,
    one_row,
    prefill,
    prompt_bucket,
)
from eqx_gpt.generation.sampling import (
    DEFAULT_SAMPLING,
    UNUSABLE,
    SamplingOptions,
    sample_rows,
    sampling_arrays,
    with_settings,
)


class GenerationState(eqx.Module):
    """What the decode loop carries between tokens, for a batch of rows sharing one length.

    cache: the decoder's cache (a GPT's: a tuple of per-layer `KVCache`s), every array with a
        leading `batch` axis.
    window: `(batch, context_length)` token ids at the cache positions (valid up to `length`).
    length: number of positions in the window (the same for every row).
    next_token: `(batch,)` the latest sampled token, not yet fed to the model.
    produced: how many tokens have been sampled so far (the index of the next one to sample).
    """

    cache: PyTree
    window: Int[Array, "batch context"]
    length: Int[Array, ""]
    next_token: Int[Array, " batch"]
    produced: Int[Array, ""]


@eqx.filter_jit
def _prefill(
    model: Decoder,
    padded: Int[Array, "batch bucket"],
    length: Int[Array, ""],
    produced: Int[Array, ""],
    key: PRNGKeyArray,
    temperature: Float[Array, ""],
    top_k: Int[Array, ""] | None,
    top_p: Float[Array, ""] | None,
) -> GenerationState:
    """Run the first `length` tokens of `padded` at position 0 into a fresh cache (`prefill`; a GPT
    stacked, whose `scan` over layers compiles fast, and the first token waits for this compile)
    and sample token number `produced` from the last one's logits.

    Sampling here lets the first token be shown before the decode loop is even compiled.
    """
    batch, bucket = padded.shape
    logits, cache = prefill(model, padded)
    token = sample_rows(logits[:, length - 1], key, produced, temperature, top_k, top_p)
    window = jnp.zeros((batch, model.context_length), jnp.int32).at[:, :bucket].set(padded)
    return GenerationState(cache, window, length, token, produced + 1)


@eqx.filter_jit
def _decode_steps(
    model: Decoder,
    state: GenerationState,
    key: PRNGKeyArray,
    temperature: Float[Array, ""],
    top_k: Int[Array, ""] | None,
    top_p: Float[Array, ""] | None,
    n_valid: Int[Array, ""],
    n_steps: int,
) -> tuple[GenerationState, Int[Array, "batch n_steps"]]:
    """`n_valid <= n_steps` steps per row: feed `next_token` in, sample the one after it.
    `model` is in the loop's form (`loop_model`: a GPT unstacked).

    Returns the newly sampled tokens; columns past `n_valid` are padding. The caller keeps
    `state.length + n_valid <= context_length`. `n_valid` is traced, so one program serves
    every chunk, however the window boundary cuts it.
    """
    # A single sequence runs without its batch axis (`decode_slot`): XLA:CPU then updates the
    # cache in place, whereas with a size-1 batch axis it copies every layer's cache per token.
    squeeze = state.window.shape[0] == 1
    cache = one_row(state.cache) if squeeze else state.cache
    state = eqx.tree_at(lambda s: s.cache, state, ())  # the loop carries `cache` instead

    def step(i, carry):
        state, cache, tokens = carry
        if squeeze:
            logits, cache = decode_slot(model, state.next_token[0], cache, state.length)
            logits = logits[None]
        else:
            logits, cache = decode_rows(model, state.next_token, cache, state.length)
        window = jax.lax.dynamic_update_slice(state.window, state.next_token[:, None], (0, state.length))
        token = sample_rows(logits, key, state.produced, temperature, top_k, top_p)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
        state = GenerationState(state.cache, window, state.length + 1, token, state.produced + 1)
        return state, cache, tokens

    tokens = jnp.zeros((state.window.shape[0], n_steps), jnp.int32)
    state, cache, tokens = jax.lax.fori_loop(0, n_valid, step, (state, cache, tokens))
    cache = batch_of_one(cache) if squeeze else cache
    return eqx.tree_at(lambda s: s.cache, state, cache), tokens


@eqx.filter_jit
def _cut_window(state: GenerationState, keep: int, bucket: int) -> Int[Array, "batch bucket"]:
    """The last `keep` tokens of a full window followed by `next_token`, padded to `bucket`."""
    context = state.window.shape[1]
    kept = jnp.concatenate([state.window[:, context - keep + 1 :], state.next_token[:, None]], axis=1)
    return jnp.zeros((kept.shape[0], bucket), jnp.int32).at[:, :keep].set(kept)


def refuse_text(prompts) -> None:
    """Refuse, in one line, text where token ids were expected."""
    rows = prompts if isinstance(prompts, list | tuple) else [prompts]
    if any(isinstance(p, str | bytes) for p in [prompts, *rows]) or (
        isinstance(prompts, np.ndarray) and prompts.dtype.kind in "USO" and prompts.size
        and isinstance(prompts.flat[0], str | bytes)
    ):  # fmt: skip
        raise TypeError(
            "prompt tokens must be token ids (a list or array of ints), got text; encode it with the "
            "model's tokenizer first (tokenizer.encode(text))"
        )


def check_generation_args(
    model: Decoder, prompts, max_new_tokens: int, options: SamplingOptions
) -> tuple[np.ndarray, int]:
    """Check the arguments of a generation; return `(prompts (batch, seq) int32 cropped to the
    context, keep)`, or raise a one-line `ValueError`/`TypeError` naming the bad one."""
    check_decoder(model)
    if not isinstance(options, SamplingOptions):
        raise TypeError(f"options must be a SamplingOptions, got {type(options).__name__}")
    context = model.context_length
    keep = options.window_keep(context)
    if not is_whole(max_new_tokens, 0):
        raise ValueError(f"max_new_tokens must be an integer in [0, {INT32_MAX}], got {max_new_tokens!r}")
    refuse_text(prompts)
    prompts = np.asarray(prompts)
    if prompts.ndim != 2:
        raise ValueError(
            "prompt token ids must have shape (seq,) for generate and (batch, seq) for "
            "generate_batch/stream_batch"
        )
    if prompts.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token; start from e.g. the id of a newline")
    if prompts.shape[0] == 0:
        raise ValueError("generate_batch/stream_batch need at least one prompt row, got shape (0, seq)")
    if not np.issubdtype(prompts.dtype, np.integer):
        raise ValueError(f"prompt tokens must be integers, got dtype {prompts.dtype}")
    if prompts.min() < 0 or prompts.max() >= model.vocab_size:
        raise ValueError(
            f"prompt token ids must be in [0, vocab_size={model.vocab_size}), "
            f"got ids from {prompts.min()} to {prompts.max()}"
        )
    return prompts[:, -context:].astype(np.int32), keep


def check_key(key) -> None:
    """Refuse, in one line, a `key` that is not one JAX PRNG key (`jax.random.key(seed)`)."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    legacy = isinstance(key, jax.Array | np.ndarray) and key.shape == (2,) and key.dtype == np.uint32
    if not ((typed and key.shape == ()) or legacy):
        got = f"shape {key.shape} dtype {key.dtype}" if hasattr(key, "shape") else type(key).__name__
        raise TypeError(f"key must be one JAX PRNG key, e.g. key=jax.random.key(0), got {got}")


def _handed_over(pending: list, batch: int, model: Decoder) -> np.ndarray:
    """The oldest pending chunk `(batch, n)` on the host, its tokens checked (`_drawn`)."""
    tokens, n, first = pending.pop(0)
    return _drawn(np.asarray(tokens).reshape(batch, -1)[:, :n], first, model)


def _drawn(tokens: np.ndarray, first: int, model: Decoder) -> np.ndarray:
    """`tokens` (new ids `first, first + 1, ...` of each row), or a one-line `ValueError` where one
    was drawn from logits with no distribution (`UNUSABLE`)."""
    bad = np.argwhere(tokens == UNUSABLE)
    if bad.size:
        row, column = (int(i) for i in bad[0])
        raise ValueError(
            f"{type(model).__name__}'s logits for new token {first + column} of row {row} hold NaN or "
            f"+inf, or are all -inf: no distribution to sample from (a diverged run, a NaN adapter, a "
            f"broken decoder); check the model's weights"
        )
    return tokens


def stream_batch(
    model: Decoder,
    prompts: Int[Array, "batch seq"] | np.ndarray,
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    options: SamplingOptions = DEFAULT_SAMPLING,
    **settings,
) -> Iterator[np.ndarray]:
    """Generate from each row of `prompts` (equal lengths), yielding `(batch, <= chunk_size)`
    NumPy arrays of new token ids as they are ready; `max_new_tokens` in total.

    The first token comes alone, straight from the prefill (before the decode loop compiles).
    The window length does not depend on the tokens drawn, so the host knows when the window
    fills: it cuts chunks at that boundary and runs the slide (re-prefill the kept tokens, which
    samples the next one) as its own step. Work is dispatched one chunk ahead of what is handed
    over, so the device keeps working while the caller prints. See the module docstring.
    Keyword `settings` (`temperature=`, `top_k=`, `top_p=`, `keep=`, `chunk_size=`) override
    `options`'s fields, here and in every function below.
    """
    options = with_settings(options, settings)
    prompts, keep = check_generation_args(model, prompts, max_new_tokens, options)
    check_key(key)
    chunk_size = options.chunk_size
    if max_new_tokens == 0:
        return
    model = eqx.nn.inference_mode(model)
    context = model.context_length
    batch, length = prompts.shape
    padded = np.zeros((batch, prompt_bucket(length, context)), np.int32)
    padded[:, :length] = prompts
    sampling = sampling_arrays(options)
    state = _prefill(model, jax.device_put(padded), jnp.int32(length), jnp.int32(0), key, **sampling)
    yield _drawn(np.asarray(state.next_token)[:, None], 0, model)  # at once: the loop compiles after
    looped = loop_model(model) if max_new_tokens > 1 else model
    produced, pending = 1, []
    while produced < max_new_tokens:
        if length == context:  # full: cut to the last `keep` tokens (the pending one included)
            padded = _cut_window(state, keep=keep, bucket=prompt_bucket(keep, context))
            state = _prefill(model, padded, jnp.int32(keep), jnp.int32(produced), key, **sampling)
            pending.append((state.next_token, 1, produced))
            length, produced = keep, produced + 1
        else:
            n = min(chunk_size, context - length, max_new_tokens - produced)
            state, tokens = _decode_steps(
                looped, state, key, n_valid=jnp.int32(n), n_steps=chunk_size, **sampling
            )
            pending.append((tokens, n, produced))
            length, produced = length + n, produced + n
        if len(pending) == 2:  # slicing on the host: no device program per chunk length
            yield _handed_over(pending, batch, model)
    while pending:
        yield _handed_over(pending, batch, model)


def generate_batch(
    model: Decoder,
    prompts: Int[Array, "batch seq"] | np.ndarray,
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    options: SamplingOptions = DEFAULT_SAMPLING,
    **settings,
) -> np.ndarray:
    """`(batch, max_new_tokens)` new token ids, one row per prompt row (all rows equally long).

    For several samples of one prompt, repeat it: `np.tile(prompt, (n, 1))`; each row draws
    its own randomness. `options` (a `SamplingOptions`) sets temperature (0: greedy), top-k, top-p,
    the window's `keep` and the chunk size. Only real vocabulary ids are produced.
    """
    chunks = list(
        stream_batch(
            model,
            prompts,
            max_new_tokens,
            key=key,
            options=options,
            **settings,
        )
    )
    batch = np.asarray(prompts).shape[0]
    return np.concatenate(chunks, axis=1) if chunks else np.zeros((batch, 0), np.int32)


def generate(
    model: Decoder,
    prompt_tokens: Int[Array, " seq"] | np.ndarray | list[int],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    options: SamplingOptions = DEFAULT_SAMPLING,
    **settings,
) -> np.ndarray:
    """`max_new_tokens` new token ids `(max_new_tokens,)` continuing `prompt_tokens` `(seq,)`.

    KV-cached: the prompt is prefilled once, then each token costs one position. Past
    `context_length` the window slides as described in the module docstring (cut to the last
    `options.keep` tokens, default `max(1, context_length // 2)`, and re-prefilled).
    `temperature=0` (or `options=SamplingOptions(temperature=0)`) is greedy; `top_k=`, `top_p=`
    as keywords or in `options`.
    """
    refuse_text(prompt_tokens)
    prompts = np.asarray(prompt_tokens)[None]
    return generate_batch(
        model,
        prompts,
        max_new_tokens,
        key=key,
        options=options,
        **settings,
    )[0]


def stream_text(
    model: Decoder,
    tokenizer,
    prompt_tokens: list[int],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    options: SamplingOptions = DEFAULT_SAMPLING,
    **settings,
) -> Iterator[str]:
    """`generate`, yielding the continuation as text, a chunk of tokens at a time.

    A byte-level tokenizer (GPT-2 BPE) can split one UTF-8 character across tokens, so text is
    released only when it ends on a complete character (see `decode_incrementally`).
    """
    refuse_text(prompt_tokens)
    chunks = stream_batch(
        model,
        np.asarray(prompt_tokens)[None],
        max_new_tokens,
        key=key,
        options=options,
        **settings,
    )
    yield from decode_incrementally(tokenizer, (chunk[0] for chunk in chunks))


def decode_incrementally(tokenizer, chunks: Iterable[Iterable[int]]) -> Iterator[str]:
    """Text of successive chunks of token ids, never ending inside a multi-byte character.

    Text that ends in an incomplete character (decoded as U+FFFD) is held back until a later chunk
    completes it; whatever is left is decoded at the end.
    """
    pending: list[int] = []
    for chunk in chunks:
        pending.extend(int(t) for t in chunk)
        text = tokenizer.decode(pending)
        if not text.endswith("\ufffd"):
            pending.clear()
            yield text
    if pending:
        yield tokenizer.decode(pending)
