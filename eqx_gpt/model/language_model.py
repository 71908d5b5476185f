"""The language-model protocol: what `train` needs of a model to train it, beside `Decoder` (what
`generate` needs of it to sample)."""

from dataclasses import asdict, dataclass
from typing import Protocol

from jaxtyping import Array, Float, Int

# What a language model must have, by name: `check_language_model` names the first one missing.
MEMBERS = ("context_length", "vocab_size", "__call__")


class LanguageModel(Protocol):
    """A causal language model that `train`, `loss_fn`, `evaluate` and the training step train and
    measure: token ids in, next-token logits out. `GPT` follows it; so does any model of your own
    with these members (a `typing.Protocol`: no base class to inherit, pyright checks a model against
    it by its members). Make it an `eqx.Module`, so that `jit` and the optimiser see its arrays.

    - `context_length`: the most positions the model sees at once; the run's windows are this long.
    - `vocab_size`: the number of logits per position, the ids `0 .. vocab_size - 1` it predicts.
    - `__call__(tokens, *, key=None, inference=None)`: the logits `(batch, seq, vocab_size)` of
      `tokens` `(batch, seq)` (`seq <= context_length`), position `t` predicting token `t + 1` and
      seeing no position after `t` (causal). The run passes a whole batch at once; a model that acts
      on one sequence can `jax.vmap` itself over the batch. Dropout follows `eqx.nn.Dropout`'s
      contract: `key` is one PRNG key per sequence of the batch (`(batch,)`, or None when the run has
      no dropout), `inference=True` (or `eqx.nn.inference_mode(model)`, which evaluation and sampling
      use) turns it off. A model without dropout accepts both and ignores them, as `eqx.nn.Linear`
      does.

    What the run finds by type, with no member to write (see the GUIDE, "Your own model, end to
    end"): the optimiser's groups and weight decay (`eqx_gpt.Linear` and `eqx.nn.Linear` matrices;
    embeddings; norms), LoRA's targets (`eqx_gpt.Linear`s), attention maps (`MultiHeadAttention`).
    A checkpoint of your model is read back into a model your factory builds (`train.py --model
    MODULE:FUNCTION`) or that you pass (`load_model(run, like=...)`).
    """

    @property
    def context_length(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def __call__(
        self, tokens: Int[Array, "batch seq"], /, *, key: Array | None = None, inference: bool | None = None
    ) -> Float[Array, "batch seq vocab"]: ...


def _size_problem(model: object, name: str) -> str | None:
    value = getattr(model, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"has {name}={value!r}, not a whole number >= 1"
    return None


def check_language_model(model: object, what: str = "the model") -> None:
    """Refuse, in one line (`TypeError`), a model that lacks a member of `LanguageModel` or whose
    sizes are not whole numbers >= 1 (the runtime half of what pyright checks statically; the
    call's signature is its part)."""
    missing = [name for name in MEMBERS if not hasattr(model, name)]
    problems = [f"lacks {', '.join(missing)}"] if missing else []
    problems += [
        p for n in ("context_length", "vocab_size") if n not in missing and (p := _size_problem(model, n))
    ]
    if problems:
        raise TypeError(
            f"{what} must be a language model (eqx_gpt.LanguageModel: {', '.join(MEMBERS)}, as GPT has); "
            f"{type(model).__name__} {problems[0]}"
        )


@dataclass(frozen=True)
class ModelShape:
    """What a run and its checkpoints record of a language model that is not a `GPT` (whose shape is
    its `GPTConfig`): its sizes. The model itself is rebuilt by its factory, or given."""

    vocab_size: int
    context_length: int

    @classmethod
    def of(cls, model: LanguageModel) -> "ModelShape":
        return cls(vocab_size=model.vocab_size, context_length=model.context_length)

    def to_dict(self) -> dict:
        return asdict(self)
