"""The decoder protocol: what `generate` needs of a model to sample from it with a KV cache."""

from typing import Protocol

from jaxtyping import Array, Float, Int, PyTree

from eqx_gpt._checks import is_whole

# What a decoder must have, by name: `check_decoder` names the first one missing.
MEMBERS = ("context_length", "vocab_size", "init_cache", "decode")


class Decoder(Protocol):
    """A causal language model that `generate`, `generate_batch`, `stream_batch` and
    `stream_text` sample from, and `eqx-gpt serve` (`create_app`) serves, KV-cached: prefill a
    cache with the prompt, then decode one position at a time. `GPT` follows it, and so does a
    `Transformer` bound to its sources (`Transformer.bind`); so does any model of your own with
    these four members (a `typing.Protocol`: no base class to inherit, pyright checks a model
    against it by its members). Make it an `eqx.Module` (any PyTree works), so that `jit` sees its
    arrays.

    - `context_length`: the most positions a window, and a cache, holds.
    - `vocab_size`: the number of logits per position, all of them ids the model may produce.
    - `init_cache(batch=...)`: an empty cache for `batch` sequences, holding `context_length`
      positions each. Any PyTree of arrays (`KVCache`s, a tuple of them, ...) whose arrays all
      have the batch as their leading axis.
    - `decode(tokens, cache, start)`: the logits `(batch, new, vocab_size)` of `tokens`
      `(batch, new)` at positions `start, ..., start + new - 1` (`start` an int32 array, the
      same for every row), attending to the positions before them held in `cache`, and the
      cache with the new positions written in. It also takes one sequence: `tokens` `(new,)`
      with the cache of one row (each array indexed `[0]`) gives `(new, vocab_size)`, as every
      eqx_gpt module does; the decode loop runs a single sequence that way, because XLA:CPU then
      updates the cache in place.

    `decode` hands back the cache it was given, updated: the same structure, shapes and dtypes
    (a loop carries it), and its logits are exactly `vocab_size` wide; a decoder that breaks either
    is refused in one line when first traced. The server runs the same calls, one sequence per
    slot under `jax.vmap`, on a cache of `init_cache(batch=slots)`.

    `generate` calls `decode` twice over: once on the whole prompt at `start = 0` (padded at its
    end to a power-of-two length; the padding's logits and cache slots are ignored and later
    overwritten, so a causal model must not let a position see the ones after it), then on one
    token at each next position inside a jitted loop. When a window is full it re-prefills the
    most recent tokens at position 0 into a fresh cache (`SamplingOptions.keep`). Dropout is off:
    the model is put in inference mode (`eqx.nn.inference_mode`) first. The cache is state
    threaded through: passed in, returned updated, of a fixed capacity so that `jit` compiles once.
    """

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def init_cache(self, *, batch: int) -> PyTree: ...

    def decode(
        self, tokens: Int[Array, "*batch new"], cache: PyTree, start: Int[Array, ""], /
    ) -> tuple[Float[Array, "*batch new vocab"], PyTree]: ...


def missing_members(model: object) -> list[str]:
    """The members of `Decoder` that `model` lacks (none: generation can take it)."""
    return [name for name in MEMBERS if not hasattr(model, name)]


def check_decoder(model: object) -> None:
    """Refuse, in one line, a model that lacks a member of `Decoder` (the runtime half of what
    pyright checks statically; the members' signatures are its part)."""
    missing = missing_members(model)
    name = type(model).__name__
    if missing:
        raise TypeError(
            f"generation takes a decoder (eqx_gpt.Decoder: {', '.join(MEMBERS)}, as GPT has); "
            f"{name} lacks {', '.join(missing)}"
        )
    for member in ("context_length", "vocab_size"):
        value = getattr(model, member)
        if not is_whole(value, 1):
            raise TypeError(
                f"{name}.{member} must be a whole number >= 1 (a Decoder's {member}), got {value!r}"
            )
