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
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key, PRNGKeyArray, PyTree

from eqx_gpt._checks import typechecked
from eqx_gpt.errors import ConfigError
from eqx_gpt.model.block import GPT2_PROJECTIONS
from eqx_gpt.model.dropout import dropout as drop_out
from eqx_gpt.model.dropout import dropout_active
from eqx_gpt.model.gpt import GPT
from eqx_gpt.model.linear import Linear, linear

Model = TypeVar("Model")
# What `apply_lora` adapts: module names (a comma list or a list), a regex over module paths, a type
# of `Linear`, a predicate `(path, linear) -> bool`, or None for the default (see `apply_lora`).
LoRATargets = str | Sequence[str] | re.Pattern[str] | type[Linear] | Callable[[str, Linear], bool] | None

# The projections of a GPT block LoRA can adapt, by GPT-2's module names (what PEFT's
# `target_modules` and tensor names use), in a block's order.
LORA_MODULES = tuple(GPT2_PROJECTIONS)
# PEFT's GPT-2 names as the eqx_gpt path suffixes they stand for: a PEFT name is a suffix of the
# module's name, so `c_proj` is both attention's output projection and the MLP's down projection.
GPT2_NAMES: dict[str, tuple[str, ...]] = {
    **{gpt2: (ours,) for gpt2, ours in GPT2_PROJECTIONS.items()},
    **{short: tuple(ours for gpt2, ours in GPT2_PROJECTIONS.items() if gpt2.endswith("." + short))
       for short in ("c_attn", "c_proj", "c_fc")},
}  # fmt: skip
DEFAULT_TARGETS = "c_attn"  # PEFT's default for GPT-2, a GPT's default


def target_names(targets: str | Sequence[str]) -> list[str]:
    """The names of a comma list (or a list) of LoRA targets, stripped; none, or an empty name, is a
    one-line `ConfigError`."""
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    if not names or not all(isinstance(t, str) and t.strip() for t in names):
        raise ConfigError(
            f"LoRA targets must name at least one module, got {targets!r}; pass names such as "
            f"'c_attn' (PEFT's GPT-2 names), 'attn.qkv,mlp.up' (a module path's end) or leave the default"
        )
    return [t.strip() for t in names]


def lora_modules(targets: str | Sequence[str]) -> tuple[str, ...]:
    """The GPT-2 module names (`LORA_MODULES`) that `targets` (GPT-2's or eqx_gpt's names of a GPT
    block's projections) cover, in a block's order; any other name is a one-line `ConfigError`.
    What a PEFT adapter folder's `target_modules` are compared and written as."""
    names = target_names(targets)
    ours = {v: k for k, v in GPT2_PROJECTIONS.items()}
    covered = {ours[s] for t in names for s in GPT2_NAMES.get(t, (t,) if t in ours else ())}
    unknown = [t for t in names if t not in GPT2_NAMES and t not in ours]
    if unknown:
        raise ConfigError(
            f"unknown LoRA target {unknown[0]!r} for a GPT; its targets are PEFT's GPT-2 names c_attn, "
            f"c_proj (attention's and the MLP's), c_fc, or eqx_gpt's attn.qkv, attn.out, mlp.up, mlp.down"
        )
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


def low_rank_update(
    x: Float[Array, "*rows d_in"], a: Float[Array, "d_in rank"], b: Float[Array, "rank d_out"], scale: Array
) -> Float[Array, "*rows d_out"]:
    """`scale * (x @ a) @ b`, LoRA's update, as every adapted projection computes it (`LoRALinear`,
    and `MultiLoRALinear` with one adapter per sequence): `scale` a 0-d array in `x`'s dtype."""
    return scale * linear(linear(x, a), b)


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
        scale = jnp.asarray(self.scale, x.dtype)
        return super().__call__(x) + low_rank_update(adapter_in, self.lora_a, self.lora_b, scale)

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


def _path(key_path) -> str:
    return jax.tree_util.keystr(key_path, simple=True, separator=".")


def named_linears(model: PyTree) -> dict[str, Linear]:
    """Every `Linear` of `model` by its path, the fields and indices that reach it joined by dots
    (`blocks.layers.attn.qkv` in a `GPT`, whose stacked layers hold one `Linear` per projection;
    `blocks.0.mlp.up` in a tuple of blocks): the names LoRA's targets match."""
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)
    return {_path(path): node for path, node in flat if isinstance(node, Linear)}


def _other_linears(model: PyTree) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda n: isinstance(n, eqx.nn.Linear))
    return [_path(path) for path, node in flat if isinstance(node, eqx.nn.Linear)]


def _named(paths: Sequence[str], names: list[str], kind: str) -> list[str]:
    """The paths a list of names chooses: a path that is a name or ends with "." + name (PEFT's
    rule); a GPT-2 name stands for the eqx_gpt names it is (`GPT2_NAMES`). A name that chooses
    nothing is a one-line `ConfigError` listing the paths there are."""
    chosen = []
    for name in names:
        suffixes = GPT2_NAMES.get(name, (name,))
        found = [p for p in paths if any(p == s or p.endswith("." + s) for s in suffixes)]
        if not found:
            shown = ", ".join(paths[:12]) + (", ..." if len(paths) > 12 else "")
            raise ConfigError(
                f"unknown LoRA target {name!r}: no Linear of the {kind} has that name or a path ending "
                f"in '.{name}'; its Linears are {shown}"
            )
        chosen += found
    return [p for p in paths if p in chosen]


def lora_target_paths(model: PyTree, targets: LoRATargets = None) -> list[str]:
    """The paths (`named_linears`) of the `Linear`s `apply_lora(model, ..., targets=targets)`
    adapts, in the model's order. One-line `ConfigError`s: a model with no `Linear`, a name that
    matches none, targets that choose nothing, a model that already holds adapters."""
    kind = type(model).__name__
    linears = named_linears(model)
    if not linears:
        others = _other_linears(model)
        hint = (
            f"; its eqx.nn.Linear ({', '.join(others[:4])}) are not: build them as eqx_gpt.Linear"
            if others
            else ""
        )
        raise ConfigError(f"apply_lora: the {kind} holds no eqx_gpt.Linear to adapt{hint}")
    adapted = [p for p, m in linears.items() if isinstance(m, LoRALinear)]
    if adapted:
        raise ConfigError(
            f"apply_lora: the {kind} already holds LoRA adapters (at {adapted[0]}); adapt the base, or "
            f"merge_lora(model) first to adapt the merged weights"
        )
    paths = list(linears)
    if targets is None:
        targets = DEFAULT_TARGETS if isinstance(model, GPT) else Linear
    if isinstance(targets, re.Pattern):
        chosen = [p for p in paths if targets.fullmatch(p)]
    elif isinstance(targets, type):
        chosen = [p for p, m in linears.items() if isinstance(m, targets)]
    elif isinstance(targets, str) or isinstance(targets, Sequence):
        chosen = _named(paths, target_names(targets), kind)
    else:
        chosen = [p for p, m in linears.items() if targets(p, m)]
    if not chosen:
        raise ConfigError(
            f"apply_lora: targets {targets!r} choose none of the {kind}'s Linears ({', '.join(paths[:12])})"
        )
    return chosen


def apply_lora(
    model: Model,
    rank: int,
    *,
    alpha: float = 16.0,
    targets: LoRATargets = None,
    dropout: float = 0.0,
    key: PRNGKeyArray,
) -> Model:
    """`model` (any Equinox model) with the `Linear`s `targets` chooses replaced by `LoRALinear`s of
    `rank`, scale `alpha / rank`, their A drawn from `key` (one key per projection), their B zero:
    the model computes what it did, and is of its type still.

    `targets` chooses, as PEFT's `target_modules` and Levanter's `LoraConfig` do (the paths are
    `named_linears(model)`'s, such as `blocks.layers.attn.qkv`):
    - names (a comma list or a list): every `Linear` whose path is the name or ends with "." + the
      name (`"qkv"`, `"attn.out"`, `"mlp.up,mlp.down"`); PEFT's GPT-2 names `c_attn`, `c_proj`,
      `c_fc` stand for `attn.qkv`, `attn.out` and `mlp.down`, `mlp.up`;
    - a compiled regex (`re.compile(r".*attn[.](qkv|out)")`): every path it matches whole;
    - a type (`Linear`, or a subclass of your own): every `Linear` of that type;
    - a predicate `(path, linear) -> bool`;
    - None (the default): PEFT's GPT-2 default `c_attn` on a `GPT`, every `Linear` on any other model.
    A model with no `Linear`, one that already holds adapters, or targets that choose nothing are a
    one-line `ConfigError`. `dropout` is PEFT's `lora_dropout`, on the adapters' input in training
    mode. Train with `lora_trainable(model)` as the filter spec; `merge_lora` folds the adapters in."""
    paths = lora_target_paths(model, targets)
    linears = named_linears(model)
    width = min(min(linears[p].in_features, linears[p].out_features) for p in paths)
    check_lora(rank, alpha, dropout, width)
    keys = jax.random.split(key, len(paths))

    def where(m):
        found = named_linears(m)
        return [found[p] for p in paths]

    adapted = [
        LoRALinear(linears[p], rank, alpha=alpha, dropout=dropout, key=k)
        for p, k in zip(paths, keys, strict=True)
    ]
    return eqx.tree_at(where, model, adapted)


def lora_template(
    model: Model, rank: int, *, alpha: float, targets: LoRATargets, dropout: float = 0.0
) -> Model:
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


def lora_record(model: PyTree) -> dict | None:
    """`apply_lora`'s `rank`, `alpha`, `dropout` and `targets` (the adapted paths) that rebuild
    `model`'s adapters on its base (`lora_template`), as a checkpoint of a model of one's own records
    them; None for a model without adapters."""
    adapted = {p: m for p, m in named_linears(model).items() if isinstance(m, LoRALinear)}
    if not adapted:
        return None
    first = next(iter(adapted.values()))
    return {"rank": first.rank, "alpha": first.scale * first.rank, "dropout": first.dropout,
            "targets": list(adapted)}  # fmt: skip


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


def merge_lora(model: Model) -> Model:
    """`model` with every `LoRALinear` folded into the plain `Linear` it computes
    (`weight + alpha / r * A @ B`): a model of the base's type and structure, exact to float32
    rounding."""
    return jax.tree.map(lambda n: n.merged() if isinstance(n, LoRALinear) else n, model, is_leaf=_is_linear)
