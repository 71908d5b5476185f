"""A stack of identical layers, stored either stacked (scanned) or as separate modules (looped).

The one place that knows the difference. Stacked, the layers are one module whose arrays carry a
leading `n` axis (built with `eqx.filter_vmap`) and run with `jax.lax.scan`: the compiled program,
and compile time, do not grow with depth. Unstacked (`unstack`), they are a tuple of `n` separate
modules run as a Python loop: each weight is then read once per call, which is what a
memory-bound one-token decode step wants. (Haliax's `Stacked` keeps scan, fold and unstack in one
class the same way.)

Values that travel with the layers (per-layer dropout keys in, KV caches in and out) follow the
same form: pytrees with a leading `n` axis when stacked, tuples of `n` items when unstacked.

The scan is compiled once per layer function, structure and shapes (`_scan_layers`), so a model
called outside `jax.jit`, as in a notebook, compiles its layers on the first call only. That needs a
layer function that is the same object at every call: a function defined at module level, with the
values it closes over (masks, a start position) passed in as `eqx.Partial(function, mask=mask)`. A
lambda still works, but is new at every call and so compiles again at every call.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


def _per_layer(x) -> bool:
    """Whether a leaf of stacked layers is one of their arrays, with the leading `n` axis. A 0-d
    array is not: it is what a flag such as `inference` becomes when the whole model is an
    argument of `jax.jit` or `jax.make_jaxpr`, and it is shared by every layer."""
    return eqx.is_array(x) and x.ndim > 0


@eqx.filter_jit
def _scan_layers(layer: Callable, x, arrays, static, per_layer, n: int, unroll: int) -> tuple[Any, Any]:
    """`jax.lax.scan` of `layer` over stacked layers (`arrays` with a leading `n` axis, `static` the
    rest of their structure). Compiled by itself, so an eager call of a model reuses its program; an
    `eqx.Partial` `layer`'s arrays are traced arguments, its function and other values the cache key.
    Within `jax.jit` it is traced into the caller's program as any function is."""

    def step(x, xs):
        arrays_i, per_layer_i = xs
        return layer(eqx.combine(arrays_i, static), x, per_layer_i)

    return jax.lax.scan(step, x, (arrays, per_layer), length=n, unroll=unroll)


class LayerStack(eqx.Module):
    """`n` layers of the same structure; `run` applies them in order, whichever the storage.

    It has no mode of its own: `eqx.nn.inference_mode` reaches the `inference` field of its
    layers (one flag for a stacked module, one per module unstacked), and `run` passes them as
    they are (a flag is not one of the per-layer arrays: it stays with the static part).
    """

    layers: Any  # one module with a leading `n` axis on its arrays, or a tuple of `n` modules
    n: int = eqx.field(static=True)
    unroll: int = eqx.field(static=True)

    def __init__(self, make_layer: Callable, keys, *, unroll: int = 1):
        """`make_layer(key)` built once per key of `keys` `(n,)`, stacked. `unroll`: layers per
        iteration of the scan (speed against compile time)."""
        self.layers = eqx.filter_vmap(make_layer)(keys)
        self.n = int(keys.shape[0])
        self.unroll = unroll

    @property
    def stacked(self) -> bool:
        return not isinstance(self.layers, tuple)

    def run(self, layer: Callable, x, per_layer=None) -> tuple[Any, Any]:
        """`x, out = layer(module, x, per_layer[i])` for each layer in order; returns `x` and the
        outs (stacked or a tuple, like the storage; see the module docstring). Stacked, the scan
        compiles once per `layer`: give a module-level function, or an `eqx.Partial` of one holding
        the arrays it needs, rather than a lambda (see the module docstring)."""
        if not self.stacked:
            outs = []
            for i, module in enumerate(self.layers):
                x, out = layer(module, x, None if per_layer is None else per_layer[i])
                outs.append(out)
            return x, tuple(outs)
        dynamic, static = eqx.partition(self.layers, _per_layer)
        return _scan_layers(layer, x, dynamic, static, per_layer, self.n, self.unroll)

    def unstack(self) -> "LayerStack":
        """The same layers as a tuple of `n` separate modules (a copy; itself if already so)."""
        if not self.stacked:
            return self
        return eqx.tree_at(lambda s: s.layers, self, self.split(self.layers))

    def split(self, stacked_values) -> tuple[Any, ...]:
        """A pytree with a leading `n` axis as a tuple of its `n` slices."""
        dynamic, static = eqx.partition(stacked_values, _per_layer)
        return tuple(eqx.combine(jax.tree.map(lambda a, i=i: a[i], dynamic), static) for i in range(self.n))

    def per_layer(self, make: Callable[[tuple[int, ...]], Any]) -> Any:
        """One value per layer in the storage's form: `make((n,))` (arrays with a leading `n`
        axis) when stacked, a tuple of `n` values `make(())` when unstacked."""
        return make((self.n,)) if self.stacked else tuple(make(()) for _ in range(self.n))

    def first(self, values) -> Any:
        """Layer 0's value of a per-layer pytree (a slice when stacked)."""
        return jax.tree.map(lambda a: a[0], values) if self.stacked else values[0]

    def as_array(self, outs) -> Any:
        """Per-layer outs with a leading `n` axis, whichever the storage."""
        return outs if self.stacked else jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
