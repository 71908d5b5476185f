"""The steps of KV-cached decoding, for any `Decoder`: what `generate` and the server's batcher
both run, so that a request served alone gives `generate`'s tokens.

- `prompt_bucket`: the padded length a window is prefilled at (few shapes compile).
- `prefill`: a window of tokens at position 0 into a fresh cache; the logits of every position.
- `decode_rows`: one token per row at a position the rows share (`generate`'s loop).
- `decode_slot`: one token of one sequence, its cache without the batch axis (the batcher runs it
  under `jax.vmap` over slots, each at its own position; `generate` runs it for a single row,
  whose cache XLA:CPU then updates in place).
- `loop_model` and `loop_cache`: the form the one-token steps run in. A `GPT` decodes one token
  unstacked (`GPT.unstack`: each weight read once per token; a `scan` over stacked layers would
  copy every layer's slice first), and prefills stacked (a `scan` compiles fast, and the first
  token waits for that compile), so its prefill's cache is split into per-layer caches. Any other
  decoder runs as it is. This is the one place that knows about `GPT`.

Every call of `decode` goes through `checked_decode`, which refuses at trace time, in one line, a
`decode` that does not return `(logits, cache)` or whose logits are not `vocab_size` wide (wider
would let ids past the vocabulary out; narrower would sample among fewer).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PyTree

from eqx_gpt.generation.decoder import Decoder
from eqx_gpt.model.gpt import GPT


def prompt_bucket(length: int, context_length: int) -> int:
    """The padded size a prompt of `length` tokens is run at: a power of two in [16, context]."""
    return min(context_length, max(16, 1 << max(0, length - 1).bit_length()))


def checked_decode(
    model: Decoder, tokens, cache: PyTree, start, *, same_cache: bool = True
) -> tuple[Array, PyTree]:
    """`model.decode(tokens, cache, start)`, its answer refused in one line (a `TypeError` while
    tracing) unless it is `(logits (*batch, new, vocab_size), cache)`, the cache (`same_cache`) in
    the form it was given: the same structure, shapes and dtypes, which a loop carries."""
    answer = model.decode(tokens, cache, start)
    name = type(model).__name__
    if not isinstance(answer, tuple) or len(answer) != 2:
        got = f"a tuple of {len(answer)}" if isinstance(answer, tuple) else type(answer).__name__
        raise TypeError(f"{name}.decode must return (logits, cache), got {got}; see eqx_gpt.Decoder")
    logits, updated = answer
    want = (*tokens.shape, model.vocab_size)
    shape = tuple(getattr(logits, "shape", ()))
    if shape != want:
        raise TypeError(
            f"{name}.decode returned logits of shape {shape} for tokens of shape {tuple(tokens.shape)}; "
            f"a Decoder's are (*batch, new, vocab_size={model.vocab_size}): one logit per id it may produce"
        )
    if same_cache and _form(updated) != _form(cache):
        raise TypeError(
            f"{name}.decode returned its cache in another form than it took (structure, shapes or "
            f"dtypes); a Decoder hands back the cache it was given, updated"
        )
    return logits, updated


def _form(cache: PyTree):
    """A cache's structure and its arrays' shapes and dtypes."""
    leaves, structure = jax.tree.flatten(cache)
    return structure, [(tuple(jnp.shape(a)), jnp.result_type(a)) for a in leaves]


def loop_model(model: Decoder) -> Decoder:
    """The model the one-token steps run: a GPT's layers unstacked, any other decoder as it is."""
    return model.unstack() if isinstance(model, GPT) else model


def loop_cache(model: Decoder, cache: PyTree) -> PyTree:
    """A cache of `model`'s (stacked, for a GPT) in the form `loop_model(model)` reads."""
    if isinstance(model, GPT) and not isinstance(cache, tuple):
        return model.blocks.split(cache)
    return cache


def prefill(
    model: Decoder, padded: Int[Array, "batch bucket"], *, same_cache: bool = True
) -> tuple[Float[Array, "batch bucket vocab"], PyTree]:
    """The logits of every position of `padded`, run at position 0 into a fresh cache, and that
    cache in the loop's form (`loop_cache`). Padding at the end changes no earlier position
    (causal) and its cache slots are overwritten later. `same_cache` as in `checked_decode`."""
    cache = model.init_cache(batch=padded.shape[0])
    start = jnp.zeros((), jnp.int32)
    logits, cache = checked_decode(model, padded, cache, start, same_cache=same_cache)
    return logits, loop_cache(model, cache)


def decode_rows(
    model: Decoder, tokens: Int[Array, " batch"], cache: PyTree, start: Int[Array, ""]
) -> tuple[Float[Array, "batch vocab"], PyTree]:
    """Feed `tokens`, one per row, at position `start` (the same for every row): the logits of the
    next token of each row and the cache. `model` in the loop's form (`loop_model`)."""
    logits, cache = checked_decode(model, tokens[:, None], cache, start)
    return logits[:, 0], cache


def decode_slot(
    model: Decoder, token: Int[Array, ""], cache: PyTree, start: Int[Array, ""], *, same_cache: bool = True
) -> tuple[Float[Array, " vocab"], PyTree]:
    """Feed one sequence's `token` at position `start`, its `cache` one row's (every array
    without the batch axis): the logits of its next token and the cache. `model` in the loop's
    form (`loop_model`); `same_cache` as in `checked_decode`."""
    logits, cache = checked_decode(model, token[None], cache, start, same_cache=same_cache)
    return logits[0], cache


def one_row(cache: PyTree) -> PyTree:
    """Row 0 of a batched cache, without the batch axis (what `decode_slot` takes)."""
    return jax.tree.map(lambda a: a[0], cache)


def batch_of_one(cache: PyTree) -> PyTree:
    """A one-row cache given its batch axis back."""
    return jax.tree.map(lambda a: a[None], cache)


def empty_loop_cache(model: Decoder, batch: int) -> PyTree:
    """Zeros in the layout of the loop model's cache for `batch` rows, learned from shapes alone
    (no copy of the weights is made to learn them)."""
    shapes = eqx.filter_eval_shape(lambda m: loop_model(m).init_cache(batch=batch), model)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
