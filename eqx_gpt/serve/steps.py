"""The batcher's two jitted programs: prefill one request into a slot, and one decode step of every slot.

Both are built of `generate`'s own steps (`eqx_gpt.generation.decoding` and `sample_rows`), for any
`Decoder`: `prefill` runs the model at position 0 into a fresh one-row cache, and each slot's
token is fed by `decode_slot`, the step `generate` runs for a single sequence. The slots share one
batched cache (every array's leading axis the slot, in the loop's form: `loop_model`), and each
slot holds its own sequence at its own position, so the decode step runs `decode_slot` under
`jax.vmap` over slots: every projection is then one matrix multiply for all slots (each weight is
read once per step, which is what batching buys on a memory-bound CPU), and each slot writes its
key and value at its own position. The cache is donated to both programs, so XLA updates it in
place rather than copying it per step.

Randomness is `generate`'s: token `i` of a sample whose key is `k` is row 0 of `sample_rows` (drawn
with `row_key(k, 0, i)`), so a seeded request draws the tokens `sample.py --seed` draws, and a token
drawn from logits with no distribution is `UNUSABLE`, which the batcher refuses for that sequence
alone. Compiled shapes stay few: one decode program per combination of the two filter switches
(some slot uses top-k; some slot uses top-p), and one prefill per prompt bucket (`prompt_bucket`:
powers of two from 16 to the context). A slot without a filter passes the setting that keeps every
token (`top_k = vocab_size`, `top_p = 1`), which leaves its logits bit for bit as they were.

A model serving many LoRA adapters (`stack_adapters`: its adapted projections `MultiLoRALinear`s)
takes each slot's adapter index (`choose_adapter`, under the same `vmap`), so requests for
different adapters decode in one step; a model without them ignores the index.

Attention (a request's `attention`): both programs take `rows`, the `layer * heads + head` rows each
slot asks for (`eqx_gpt.serve.recording`), or None. With None the programs are the ones above,
unchanged, so a step no slot asks in costs nothing more; with rows they are compiled again with
every attention layer recording the weights it attends with, and return the query row that drew
each slot's token, for its chosen layers and heads `(slots, pairs, capacity)`. The batcher passes
rows only on a step where some live slot asks, padded to a power of two (`attention_width`), so
this adds at most a few programs, and the slots decode together as ever.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.generation.decoding import decode_slot, loop_model, prefill
from eqx_gpt.generation.sampling import sample_rows
from eqx_gpt.model.multi_lora import choose_adapter
from eqx_gpt.serve.recording import recording, take_recorded

LOGPROBS_MAX = 5  # OpenAI's bound on `logprobs`: the most likely alternatives reported per token
ATTENTION_MAX_PAIRS = 16  # the layers x heads a request's `attention` may ask for


def attention_width(pairs: int) -> int:
    """The rows a program is compiled for when at most `pairs` are asked: a power of two."""
    return 1 << max(0, pairs - 1).bit_length()


class TokenLogprobs(eqx.Module):
    """Log-probabilities under the model's own distribution (temperature 1, no filters): of the
    chosen token `(...,)`, and the `LOGPROBS_MAX` most likely ids with theirs `(..., LOGPROBS_MAX)`."""

    chosen: Float[Array, "*rows"]
    top_ids: Int[Array, "*rows top"]
    top: Float[Array, "*rows top"]


def token_logprobs(logits: Float[Array, "*rows vocab"], chosen: Int[Array, "*rows"]) -> TokenLogprobs:
    """`TokenLogprobs` of `chosen` ids given the `logits` they were drawn from."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    top, top_ids = jax.lax.top_k(logp, LOGPROBS_MAX)
    return TokenLogprobs(jnp.take_along_axis(logp, chosen[..., None], axis=-1)[..., 0], top_ids, top)


def sample_key(key_data: UInt[Array, "*rows 2"]) -> Any:
    return jax.random.wrap_key_data(key_data)


def _prefill(
    static: Any,
    params: Any,
    cache: Any,
    slot: Int[Array, ""],
    padded: Int[Array, "1 bucket"],
    length: Int[Array, ""],
    produced: Int[Array, ""],
    key_data: UInt[Array, "2"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""] | None,
    top_p: Float[Array, ""] | None,
    bias: Float[Array, " vocab"] | None,
    adapter: Int[Array, ""] | None,
    rows: Int[Array, " pairs"] | None,
    *,
    prompt_logprobs: bool,
):
    """Run the first `length` tokens of `padded` at position 0 (`prefill`, as `generate` does), write
    the slot's cache, and sample token number `produced` from the last one.

    Returns `(cache, token, its TokenLogprobs, the prompt's TokenLogprobs or None, attention or
    None)`; the prompt's are for tokens 1 .. bucket - 1 given those before (the caller keeps the
    first `length - 1`); attention is the last token's query row `(pairs, capacity)` for `rows`.
    """
    model: Decoder = choose_adapter(eqx.combine(params, static), adapter)  # many adapters: its own
    attention = None
    if rows is None:
        logits, fresh = prefill(model, padded)
    else:
        logits, fresh = prefill(recording(model, length - 1), padded, same_cache=False)
        attention, fresh = take_recorded(fresh, rows)
    last = logits[:, length - 1]
    last = last if bias is None else last + bias  # logit_bias: before the filters
    token = sample_rows(last, sample_key(key_data), produced, temperature, top_k, top_p)
    write = lambda whole, one: jax.lax.dynamic_update_slice_in_dim(whole, one.astype(whole.dtype), slot, 0)
    cache = jax.tree.map(write, cache, fresh)
    chosen = token_logprobs(logits[0, length - 1], token[0])
    prompt = token_logprobs(logits[0, :-1], padded[0, 1:]) if prompt_logprobs else None
    return cache, token[0], chosen, prompt, attention


def _decode(
    static: Any,
    params: Any,
    cache: Any,
    tokens: Int[Array, " slots"],
    starts: Int[Array, " slots"],
    produced: Int[Array, " slots"],
    key_data: UInt[Array, "slots 2"],
    temperature: Float[Array, " slots"],
    top_k: Int[Array, " slots"],
    top_p: Float[Array, " slots"],
    bias: Float[Array, "slots vocab"] | None,
    adapters: Int[Array, " slots"] | None,
    rows: Int[Array, "slots pairs"] | None,
    *,
    use_top_k: bool,
    use_top_p: bool,
):
    """Feed each slot's `tokens` at its position `starts` (`decode_slot` under `vmap`) and sample
    its token number `produced`. `model` is in the loop's form (`loop_model`); with many adapters
    (`MultiLoRALinear`s) each slot applies its own, `adapters` (the base's weights read once for all).
    With `rows`, also each slot's attention `(slots, pairs, capacity)`: its query's weights for its
    rows."""
    model: Decoder = eqx.combine(params, static)
    attention = None
    if rows is None:
        step = lambda t, c, s, a: decode_slot(choose_adapter(model, a), t, c, s)
        logits, cache = jax.vmap(step)(tokens, cache, starts, adapters)
    else:

        def recording_step(t, c, s, a, r):
            lg, c = decode_slot(recording(choose_adapter(model, a)), t, c, s, same_cache=False)
            weights, c = take_recorded(c, r)
            return lg, c, weights

        logits, cache, attention = jax.vmap(recording_step)(tokens, cache, starts, adapters, rows)

    def sample(lg, kd, index, t, k, p):
        k, p = (k if use_top_k else None), (p if use_top_p else None)
        return sample_rows(lg[None], sample_key(kd), index, t, k, p)[0]

    biased = logits if bias is None else logits + bias  # logit_bias: before the filters
    chosen = jax.vmap(sample)(biased, key_data, produced, temperature, top_k, top_p)
    return cache, chosen, token_logprobs(logits, chosen), attention


# Module-level, so every batcher of a model of the same structure shares the compiled programs: the
# static half of the model (its config and flags) is a static argument, hashed, and the weights and
# the cache are arguments (the cache donated).
_prefill_jit = jax.jit(_prefill, static_argnums=0, donate_argnums=2, static_argnames="prompt_logprobs")
_decode_jit = jax.jit(_decode, static_argnums=0, donate_argnums=2, static_argnames=("use_top_k", "use_top_p"))


class Programs:
    """The jitted prefill and decode step for one model: `prefill` runs the model as it is (a GPT
    stacked: fast to compile), `decode` its loop form (`loop_model`; a GPT unstacked: fast to run).

    Their per-request and per-slot arguments are host values, NumPy arrays and scalars, passed as
    they are: the jitted call moves them with its own dispatch. Converted one by one first
    (`jnp.asarray`, `jnp.int32`), they cost about 20 microseconds each at every step, and a NumPy
    array compiled a copying program per shape."""

    def __init__(self, model: Decoder):
        model = eqx.nn.inference_mode(model)
        self.params, self.static = eqx.partition(model, eqx.is_array)
        self.looped_params, self.looped_static = eqx.partition(loop_model(model), eqx.is_array)

    def prefill(
        self, cache, slot, padded, length, produced, key_data, temperature, top_k, top_p, prompt_logprobs,
        bias=None, adapter=None, rows=None,
    ):  # fmt: skip
        return _prefill_jit(
            self.static, self.params, cache, slot, padded, length, produced, key_data,
            temperature, top_k, top_p, bias, adapter, rows, prompt_logprobs=prompt_logprobs,
        )  # fmt: skip

    def decode(
        self, cache, tokens, starts, produced, key_data, temperature, top_k, top_p, use_top_k, use_top_p,
        bias=None, adapters=None, rows=None,
    ):  # fmt: skip
        return _decode_jit(
            self.looped_static, self.looped_params, cache, tokens, starts, produced, key_data,
            temperature, top_k, top_p, bias, adapters, rows, use_top_k=use_top_k, use_top_p=use_top_p,
        )  # fmt: skip
