"""Many LoRA adapters over one base, one chosen per sequence: what lets a server decode requests for
different adapters in the same batched step (S-LoRA's and Punica's way, not one merged model per
adapter).

`stack_adapters(base, adapted)` turns every projection that any of the `adapted` models adapts
(`LoRALinear`s, as `apply_lora` or `load_adapters` give them on that base) into a
`MultiLoRALinear`: the base's `weight` and `bias`, shared, and the adapters' A and B stacked along
an adapter axis, with a zero adapter at index 0 (the base itself). `choose_adapter(model, index)`
sets which adapter every `MultiLoRALinear` applies; under `jax.vmap` over sequences `index` is one
per sequence, so each sequence's projection adds its own adapter's `scale * (x @ A[index]) @
B[index]` (`low_rank_update`, `LoRALinear`'s own arithmetic) to the base's product shared by all.

Adapters of different ranks are zero-padded to the largest (the padding adds exact zeros); an
adapter that does not adapt a projection some other adapts holds zeros there, so it computes the
base's product at that projection, as it does alone. Adapter 0 adds `0 * (x @ 0) @ 0`: the base's
own product.
"""

from collections.abc import Sequence
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray, PyTree

from eqx_gpt._checks import typechecked
from eqx_gpt.errors import ConfigError
from eqx_gpt.model.linear import Linear
from eqx_gpt.model.lora import LoRALinear, low_rank_update, named_linears

Model = TypeVar("Model")


class MultiLoRALinear(Linear):
    """A `Linear` (frozen `weight`, `bias`) with `n` LoRA adapters stacked, of which `index` is applied:
    `x @ weight + bias + scales[index] * (x @ lora_a[index]) @ lora_b[index]`.

    `lora_a` is `(*lead, n, in_features, rank)`, `lora_b` `(*lead, n, rank, out_features)` (`lead`
    the `n_layers` axis within a stack of layers, as for `LoRALinear`), `scales` the `n` adapters'
    `alpha / rank` (static), `index` a 0-d int32 array (0-d, so that a stack of layers shares it:
    `LayerStack` scans the arrays with a leading axis alone). Adapter 0 is zeros: the base. For
    inference: no dropout (the served adapters are frozen).
    """

    lora_a: Float[Array, "*lead adapters in_features rank"]
    lora_b: Float[Array, "*lead adapters rank out_features"]
    index: Int[Array, ""]
    scales: tuple[float, ...] = eqx.field(static=True)

    def __init__(self, base: Linear, adapters: Sequence[LoRALinear | None]):
        """`base` with `adapters` at indices 1, 2, ... (None: that adapter leaves `base` as it is),
        a zero adapter at index 0; ranks zero-padded to the largest."""
        self.weight, self.bias = base.weight, base.bias
        lead = base.weight.shape[:-2]
        rank = max((a.rank for a in adapters if a is not None), default=1)

        def padded(a: LoRALinear | None, which: str):
            shape = (*lead, base.in_features, rank) if which == "a" else (*lead, rank, base.out_features)
            if a is None:
                return jnp.zeros(shape, jnp.float32)
            array = jnp.asarray(a.lora_a if which == "a" else a.lora_b, jnp.float32)
            pad = [(0, 0)] * array.ndim
            pad[-1 if which == "a" else -2] = (0, rank - a.rank)
            return jnp.pad(array, pad)

        every = [None, *adapters]
        self.lora_a = jnp.stack([padded(a, "a") for a in every], axis=-3)
        self.lora_b = jnp.stack([padded(a, "b") for a in every], axis=-3)
        self.scales = tuple(0.0 if a is None else float(a.scale) for a in every)
        self.index = jnp.zeros((), jnp.int32)

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*rows d_in"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*rows d_out"]:
        """`x @ weight + bias` plus adapter `index`'s update, for `x` `(*rows, in_features)`; `key`
        and `inference` are ignored (no dropout)."""
        a = jnp.take(self.lora_a, self.index, axis=-3, mode="clip")
        b = jnp.take(self.lora_b, self.index, axis=-3, mode="clip")
        scale = jnp.asarray(self.scales, x.dtype)[self.index]
        return super().__call__(x) + low_rank_update(x, a, b, scale)

    def columns(self, start: int, stop: int) -> "MultiLoRALinear":
        """The projection restricted to output features `start:stop`: every B is sliced with the weight."""
        sliced = super().columns(start, stop)
        return eqx.tree_at(lambda m: m.lora_b, sliced, self.lora_b[..., start:stop])


def _is_multi(node) -> bool:
    return isinstance(node, MultiLoRALinear)


def _multis(model: PyTree) -> list[MultiLoRALinear]:
    return [n for n in jax.tree.leaves(model, is_leaf=_is_multi) if _is_multi(n)]


def adapter_count(model: PyTree) -> int:
    """How many adapters `model`'s `MultiLoRALinear`s hold, the base's zero adapter counted (1 for a
    model without any: the base alone)."""
    found = _multis(model)
    return len(found[0].scales) if found else 1


def choose_adapter(model: Model, index: Int[Array, ""] | int | None) -> Model:
    """`model` with every `MultiLoRALinear` applying adapter `index` (0: the base); `model` itself
    when it holds none, or `index` is None. Traced `index`es are fine: under `jax.vmap` each
    sequence applies its own."""
    found = _multis(model)
    if not found or index is None:
        return model
    index = jnp.asarray(index, jnp.int32)
    return eqx.tree_at(lambda m: [n.index for n in _multis(m)], model, [index] * len(found))


def _adapted_projections(
    base_linears: dict[str, Linear], adapted: PyTree, name: str
) -> dict[str, LoRALinear]:
    """`adapted`'s `LoRALinear`s by path, each checked to adapt a plain `Linear` of the base of the
    same shape (a one-line `ConfigError` naming the adapter otherwise)."""
    found = {p: m for p, m in named_linears(adapted).items() if isinstance(m, LoRALinear)}
    if not found:
        raise ConfigError(
            f"adapter {name!r} holds no LoRA adapters (LoRALinear); adapt the base with apply_lora"
        )
    for path, module in found.items():
        linear = base_linears.get(path)
        if linear is None or isinstance(linear, LoRALinear) or linear.weight.shape != module.weight.shape:
            got = "no such projection" if linear is None else f"weight {tuple(linear.weight.shape)}"
            raise ConfigError(
                f"adapter {name!r} adapts {path} of weight {tuple(module.weight.shape)}, and the base has "
                f"{got}; the adapter is for another base model"
            )
    return found


def stack_adapters(base: Model, adapted: Sequence[PyTree], names: Sequence[str] | None = None) -> Model:
    """`base` with every projection that any model of `adapted` adapts made a `MultiLoRALinear`
    holding each one's adapter there: adapter `i + 1` is `adapted[i]`'s (`choose_adapter`), 0 the
    base. Each of `adapted` is `base` with `LoRALinear`s (`apply_lora`, `load_adapters`); only their
    adapters are read. One adapting a projection the base lacks, or of another shape, is a one-line
    `ConfigError` (`names`, for the message, default `adapter 1`, ...). `base` itself if
    `adapted` is empty."""
    names = [f"adapter {i + 1}" for i in range(len(adapted))] if names is None else list(names)
    linears = named_linears(base)
    per_model = [_adapted_projections(linears, m, n) for m, n in zip(adapted, names, strict=True)]
    paths = [p for p in linears if any(p in found for found in per_model)]
    if not paths:
        return base
    banks = [MultiLoRALinear(linears[p], [found.get(p) for found in per_model]) for p in paths]
    return eqx.tree_at(lambda m: [named_linears(m)[p] for p in paths], base, banks)
