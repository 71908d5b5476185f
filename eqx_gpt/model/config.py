"""The model's hyperparameters in one frozen dataclass; each field's kind (its choices, whether a
fine-tune from a GPT-2 may set it) in its metadata (`eqx_gpt.configs.KINDS`)."""

import math
from dataclasses import dataclass

from eqx_gpt.configs import DictConfig, check_fields, described
from eqx_gpt.errors import ConfigError
from eqx_gpt.model.vocab import pad_vocab

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
NORM_KINDS = ("rms", "layer")
NORM_POSITIONS = ("pre", "post")
POSITION_KINDS = ("sinusoidal", "learned", "rope")
ACTIVATION_KINDS = ("gelu_tanh", "gelu", "relu", "relu2", "silu", "swiglu", "geglu")


@dataclass(frozen=True)
class GPTConfig(DictConfig):
    """Sizes of a decoder-only GPT. Impossible combinations raise `ValueError` on construction.

    vocab_size: number of real token ids; the embedding table is padded to `padded_vocab_size`.
    context_length: the longest sequence the model sees (positions 0 .. context_length - 1).
    d_model: width of the residual stream; must be even (sin/cos position pairs).
    n_heads: attention heads; must divide d_model.
    n_layers: decoder blocks, stacked and run with `jax.lax.scan`.
    d_hidden: width of the MLP; None means 4 * d_model, as in the paper.
    dropout: rate on attention weights, sub-layer outputs and embeddings while training.
    norm_eps: epsilon of every norm.
    scan_unroll: how many layers each iteration of the layer scan runs (speed vs compile time).
    compute_dtype: dtype of activations and matmuls; parameters stay float32 ("mixed precision").
    norm: "rms" (RMSNorm, the default) or "layer" (LayerNorm, the paper's).
    norm_position: "pre" (a norm before each sub-layer and one before the head, the default) or
        "post" (the paper's Add & Norm after each residual sum, no final norm).
    positions: how the model knows where a token is. "sinusoidal" (the default): the paper's fixed
        table, added to the token vectors, which are scaled by sqrt(d_model) as in its section 3.4;
        "learned": a trained table of context_length vectors, added (GPT-2's); "rope": queries and
        keys rotated by position in every self-attention (RoPE). The last two add the token
        vectors unscaled, as GPT-2 does.
    bias: biases in every projection (attention and MLP), as GPT-2 has; LayerNorm has its own.
    activation: the MLP's non-linearity: "gelu_tanh" (the default, GPT-2's), "gelu" (exact), "relu"
        (the paper's), "relu2" (relu squared, the speedruns'), "silu"; or a gated MLP, "swiglu"
        (Llama's) or "geglu", whose `up` is twice d_hidden wide (see `MLP`).
    tie_embeddings: the head is the token embedding, transposed (GPT-2's weight tying).
    zero_init: the projections that write into the residual stream (attention out, MLP out) and the
        head start at zero, so every block starts as the identity and the first logits are uniform
        (the speedruns' initialisation); False: GPT-2's scaled normal.
    logit_softcap: if set, logits are `cap * tanh(logits / cap)`, bounded in (-cap, cap).
    """

    vocab_size: int
    context_length: int = described("tokens the model sees at once", default=256, fine_tune=True)
    d_model: int = described("width of the residual stream (even, divisible by n_heads)", default=384)
    n_heads: int = described("attention heads", default=6)
    n_layers: int = described("decoder blocks", default=6)
    d_hidden: int | None = described("MLP width (default: 4 * d_model)", default=None)
    dropout: float = described("dropout rate while training", default=0.0, fine_tune=True)
    norm_eps: float = described("epsilon of every norm", default=1e-5)
    scan_unroll: int = described(
        "layers per iteration of the layer scan (speed vs compile time)", default=1, fine_tune=True
    )
    compute_dtype: str = described(
        "dtype of activations and matmuls; parameters stay float32",
        default="float32",
        choices=COMPUTE_DTYPES,
        fine_tune=True,
    )
    norm: str = described(
        "'rms' (RMSNorm) or 'layer' (LayerNorm, the paper's)", default="rms", choices=NORM_KINDS
    )
    norm_position: str = described(
        "'pre': a norm before each sub-layer; 'post': after each residual sum (the paper's)",
        default="pre",
        choices=NORM_POSITIONS,
    )
    positions: str = described(
        "'sinusoidal' (the paper's table), 'learned' (GPT-2's) or 'rope' (rotary, in attention)",
        default="sinusoidal",
        choices=POSITION_KINDS,
    )
    bias: bool = described("biases in every projection (GPT-2's)", default=False)
    activation: str = described(
        "the MLP's non-linearity: 'gelu_tanh' (GPT-2's), 'gelu', 'relu' (the paper's), 'relu2', 'silu'; "
        "gated: 'swiglu' (Llama's), 'geglu'",
        default="gelu_tanh",
        choices=ACTIVATION_KINDS,
    )
    tie_embeddings: bool = described("the head is the token embedding, transposed (GPT-2's)", default=False)
    zero_init: bool = described(
        "output projections and head start at zero: each block starts as the identity", default=False
    )
    logit_softcap: float | None = described(
        "bound the logits to (-cap, cap) with cap * tanh(logits / cap)", default=None
    )

    def __post_init__(self):
        if self.d_hidden is None:
            object.__setattr__(self, "d_hidden", 4 * self.d_model)
        check_fields(
            self,
            positive=(
                "vocab_size",
                "context_length",
                "d_model",
                "n_heads",
                "n_layers",
                "d_hidden",
                "scan_unroll",
            ),
            finite=("dropout", "norm_eps"),
        )
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                f"choose n_heads among {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}."
            )
        for name, kinds in (("positions", POSITION_KINDS), ("activation", ACTIVATION_KINDS)):
            if getattr(self, name) not in kinds:
                raise ConfigError(f"GPTConfig.{name} must be one of {kinds}, got {getattr(self, name)!r}")
        for name in ("bias", "tie_embeddings", "zero_init"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"GPTConfig: d_model must be even for sinusoidal positions, got {self.d_model}")
        if self.positions == "rope" and self.d_head % 2:
            raise ConfigError(
                f"GPTConfig: rope rotates feature pairs, so d_model / n_heads must be even, got {self.d_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.norm_eps > 0:
            raise ConfigError(f"GPTConfig.norm_eps must be > 0, got {self.norm_eps}")
        cap = self.logit_softcap
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf
        ):
            raise ConfigError(f"GPTConfig.logit_softcap must be a finite number > 0 (or None), got {cap!r}")
        if self.norm not in NORM_KINDS or self.norm_position not in NORM_POSITIONS:
            raise ConfigError(
                f"GPTConfig: norm must be one of {NORM_KINDS} and norm_position one of {NORM_POSITIONS}, "
                f"got {self.norm!r} and {self.norm_position!r}"
            )
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(
                f"GPTConfig.compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}"
            )

    @property
    def padded_vocab_size(self) -> int:
        return pad_vocab(self.vocab_size)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads
