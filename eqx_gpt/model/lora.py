"""LoRA (Hu et al. 2021, "Low-Rank Adaptation of Large Language Models"): a frozen projection plus
a trainable low-rank update, `x @ W + (alpha / r) * (x @ A) @ B`.

`LoRALinear` is a `Linear` (so whatever finds projections by type still finds it) with two more
arrays, `lora_a (in, r)` and `lora_b (r, out)`. `apply_lora` replaces a GPT's chosen projections
by them, `lora_trainable` is the filter spec that marks the adapters alone as trainable (the step
differentiates nothing else, and the optimiser holds state for nothing else), and `merge_lora`
folds them back into plain `Linear`s. Initialisation, scaling and dropout are PEFT's: A uniform
in `+-1/sqrt(in)` (PyTorch's kaiming-uniform with `a=sqrt(5)`), B zeros, so step 0 is the base
model; scale `alpha / r`; dropout, in training, on the adapter's input alone,
`x @ W + (alpha / r) * (dropout(x) @ A) @ B`.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key, PRNGKeyArray, PyTree

from eqx_gpt._checks import typechecked
from eqx_gpt.errors import ConfigError
from eqx_gpt.model.block import GPT2_PROJECTIONS
from eqx_gpt.model.dropout import dropout as drop_out
from eqx_gpt.model.dropout import dropout_active
from eqx_gpt.model.linear import Linear, linear

# The projections of a GPT block LoRA can adapt: all of them, by GPT-2's module names (what PEFT's
# `target_modules` and tensor names use).
LORA_MODULES = GPT2_PROJECTIONS
# Every name a target may be given as: PEFT's (a suffix of the module's name, so `c_proj` is both
# attention's output projection and the MLP's down projection) and eqx_gpt's attribute paths.
TARGET_NAMES = {
    "c_attn": ("attn.c_attn",),
    "c_proj": ("attn.c_proj", "mlp.c_proj"),
    "c_fc": ("mlp.c_fc",),
    **{name: (name,) for name in LORA_MODULES},
    "attn.qkv": ("attn.c_attn",),
    "attn.out": ("attn.c_proj",),
    "mlp.up": ("mlp.c_fc",),
    "mlp.down": ("mlp.c_proj",),
}
DEFAULT_TARGETS = "c_attn"  # PEFT's default for GPT-2


def lora_modules(targets: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The `LORA_MODULES` names that `targets` (a comma list, or a list, of `TARGET_NAMES`) cover,
    in `LORA_MODULES`'s order; an unknown or empty target is a one-line `ConfigError`."""
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    unknown = [t for t in names if t not in TARGET_NAMES]
    if unknown or not names:
        raise ConfigError(
            f"unknown LoRA target {(unknown or [''])[0]!r}; targets are PEFT's GPT-2 names c_attn, c_proj "
            f"(attention's and the MLP's), c_fc, or eqx_gpt's attn.qkv, attn.out, mlp.up, mlp.down"
        )
    covered = {m for t in names for m in TARGET_NAMES[t]}
    return tuple(m for m in LORA_MODULES if m in covered)


def check_lora(rank: int, alpha: float, dropout: float, width: int | None = None) -> None:
    """A one-line `ConfigError` unless `rank` is a whole number in `[1, width]`, `alpha` a finite
    number >= 0 and `dropout` in `[0, 1)`."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"lora_rank must be a whole number >= 1, got {rank!r}")
    if width is not None and rank > width:
        raise ConfigError(
            f"lora_rank {rank} is larger than the model's width {width}: a low-rank update needs "
            f"rank <= {width}; pass a smaller --lora-rank (8 or 16 is usual)"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha < math.inf:
        raise ConfigError(
            f"lora_alpha must be a finite number >= 0 (the scale is alpha / rank), got {alpha!r}"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {dropout!r}")


class LoRALinear(Linear):
    """A `Linear` whose `weight` (and `bias`) are frozen and whose output adds a low-rank update:
    `x @ weight + bias + scale * (dropout(x) @ lora_a) @ lora_b`.

    `lora_a` is `(in_features, rank)`, `lora_b` `(rank, out_features)`, in the `x @ W` layout of
    `Linear` (PEFT stores their transposes, `lora_A.weight (r, in)` and `lora_B.weight (out, r)`).
    `scale` is `alpha / rank`. Within a stack of layers each array has a leading `n_layers` axis.
    `lora_trainable` marks the two adapters alone as trainable; `merged()` is the plain `Linear`
    with `weight + scale * lora_a @ lora_b`.

    `dropout` (PEFT's `lora_dropout`) drops out the adapter's input, not the frozen path's, and
    keeps `eqx.nn.Dropout`'s contract: in training mode (`inference=False`, as built) with
    `dropout > 0` a call needs a `key` (the attention or MLP that holds it passes one on);
    `eqx.nn.inference_mode` switches it off.
    """

    lora_a: Float[Array, "in_features rank"]
    lora_b: Float[Array, "rank out_features"]
    inference: bool
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        base: Linear,
        rank: int,
        *,
        alpha: float,
        key: PRNGKeyArray,
        dropout: float = 0.0,
        inference: bool = False,
    ):
        """Adapt `base` (a `Linear`, or a stack of them: leading axes are kept) at `rank`; A is
        drawn from `key` as PEFT draws it, B starts at zero."""
        check_lora(rank, alpha, dropout, min(base.in_features, base.out_features))
        self.weight, self.bias = base.weight, base.bias
        lead, d_in, d_out = base.weight.shape[:-2], base.in_features, base.out_features
        bound = 1.0 / math.sqrt(d_in)
        self.lora_a = jax.random.uniform(key, (*lead, d_in, rank), jnp.float32, -bound, bound)
        self.lora_b = jnp.zeros((*lead, rank, d_out), jnp.float32)
        self.scale = alpha / rank
        self.dropout, self.inference = float(dropout), inference

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*rows d_in"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*rows d_out"]:
        """`x @ weight + bias + scale * (dropout(x) @ lora_a) @ lora_b` for `x` `(*rows,
        in_features)`. `key` is one key, or one per sequence (leading axes of `x`); `inference`
        overrides `self.inference` for this call."""
        own = self.inference if inference is None else inference
        active = dropout_active(self.dropout, own, key, "LoRALinear")
        adapter_in = drop_out(x, self.dropout, key) if active else x
        update = linear(linear(adapter_in, self.lora_a), self.lora_b)
        return super().__call__(x) + jnp.asarray(self.scale, x.dtype) * update

    def columns(self, start: int, stop: int) -> "LoRALinear":
        """The projection restricted to output features `start:stop`: B is sliced with the weight."""
        sliced = super().columns(start, stop)
        return eqx.tree_at(lambda m: m.lora_b, sliced, self.lora_b[..., start:stop])

    def merged(self) -> Linear:
        """The plain `Linear` this computes: `weight + scale * lora_a @ lora_b` (float32)."""
        delta = jnp.matmul(self.lora_a, self.lora_b, precision=jax.lax.Precision.HIGHEST)
        out = eqx.filter_eval_shape(Linear, 1, 1, key=jax.random.key(0))
        return eqx.tree_at(
            lambda m: (m.weight, m.bias), out, (self.weight + self.scale * delta, self.bias),
            is_leaf=lambda x: x is None,
        )  # fmt: skip


def _is_linear(node) -> bool:
    return isinstance(node, Linear)


def _block_linears(model, modules: tuple[str, ...]):
    """`where` for `eqx.tree_at`: the chosen projections of every block of a GPT (its stacked
    layers, or each of a tuple of them)."""

    def where(m):
        layers = m.blocks.layers
        blocks = layers if isinstance(layers, tuple) else (layers,)
        return [LORA_MODULES[name](b) for b in blocks for name in modules]

    return where


def apply_lora(
    model,
    rank: int,
    *,
    alpha: float = 16.0,
    targets: str | list[str] = DEFAULT_TARGETS,
    dropout: float = 0.0,
    key: PRNGKeyArray,
):
    """`model` (a `GPT`) with the projections `targets` names (see `TARGET_NAMES`: PEFT's GPT-2
    names `c_attn`, `c_proj`, `c_fc`, or eqx_gpt's `attn.qkv`, `attn.out`, `mlp.up`, `mlp.down`)
    of every block replaced by `LoRALinear`s of `rank`, scale `alpha / rank`, their A drawn from
    `key` (one key per projection), their B zero: the model computes what it did. `dropout` is
    PEFT's `lora_dropout`, on the adapters' input in training mode. Train with
    `lora_trainable(model)` as the filter spec; `merge_lora` folds the adapters in."""
    modules = lora_modules(targets)
    check_lora(rank, alpha, dropout, model.config.d_model)
    where = _block_linears(model, modules)
    found = where(model)
    keys = jax.random.split(key, len(found))
    adapted = [
        LoRALinear(lin, rank, alpha=alpha, dropout=dropout, key=k) for lin, k in zip(found, keys, strict=True)
    ]
    return eqx.tree_at(where, model, adapted)


def lora_template(model, rank: int, *, alpha: float, targets: str | list[str], dropout: float = 0.0):
    """`apply_lora` on shapes only (`model` may itself be a template): what a checkpoint of a LoRA
    run is read into."""
    return eqx.filter_eval_shape(
        lambda m: apply_lora(m, rank, alpha=alpha, targets=targets, dropout=dropout, key=jax.random.key(0)),
        model,
    )


def lora_options(train_config: dict) -> dict | None:
    """`apply_lora`'s `rank`, `alpha`, `targets` and `dropout` from a run's training config (as a
    checkpoint records it), or None for a run without LoRA."""
    if train_config.get("lora_rank") is None:
        return None
    rank, alpha = train_config["lora_rank"], train_config.get("lora_alpha", 16.0)
    targets = train_config.get("lora_targets", DEFAULT_TARGETS)
    return {
        "rank": rank,
        "alpha": alpha,
        "targets": targets,
        "dropout": train_config.get("lora_dropout", 0.0),
    }


def has_lora(model: PyTree) -> bool:
    """Whether `model` holds any `LoRALinear`."""
    leaves = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, LoRALinear))
    return any(isinstance(leaf, LoRALinear) for leaf in leaves)


def lora_trainable(model: PyTree) -> PyTree:
    """The filter spec of a LoRA model's trainable arrays: True at every `LoRALinear`'s `lora_a`
    and `lora_b`, False everywhere else (for `eqx.partition`, `eqx.filter_grad`'s first argument)."""

    def mark(node):
        marks = jax.tree.map(lambda _: False, node)
        if isinstance(node, LoRALinear):
            return eqx.tree_at(lambda m: (m.lora_a, m.lora_b), marks, (True, True))
        return marks

    return jax.tree.map(mark, model, is_leaf=lambda n: isinstance(n, LoRALinear))


def trainable_filter(model: PyTree) -> PyTree:
    """What a training step differentiates: the adapters of a LoRA model, else every float array."""
    return lora_trainable(model) if has_lora(model) else eqx.is_inexact_array


def merge_lora(model: PyTree) -> PyTree:
    """`model` with every `LoRALinear` folded into the plain `Linear` it computes
    (`weight + alpha / r * A @ B`): a GPT of the base's structure, exact to float32 rounding."""
    return jax.tree.map(lambda n: n.merged() if isinstance(n, LoRALinear) else n, model, is_leaf=_is_linear)
