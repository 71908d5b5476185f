"""The position-wise feed-forward network (Vaswani et al. 2017, section 3.3)."""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Key, PRNGKeyArray

from eqx_gpt._checks import check_last_dim, check_size, typechecked
from eqx_gpt.model.config import ACTIVATION_KINDS
from eqx_gpt.model.linear import Linear
from eqx_gpt.streams import projection_keys


@jax.custom_vjp
def gelu(x: Array) -> Array:
    """`jax.nn.gelu` (tanh approximation), with a backward pass that keeps only `x`.

    Autodiff of the tanh formula saves four intermediates per element for the backward pass; in
    the scanned layer stack each one is stacked and sliced per layer, which cost more than the
    MLP's matrix multiplies on CPU. Recomputing the derivative from `x` is cheaper.
    """
    return jax.nn.gelu(x, approximate=True)


def _gelu_forward(x):
    return jax.nn.gelu(x, approximate=True), x


def _gelu_backward(x, grad):
    c = math.sqrt(2.0 / math.pi)
    x2 = x * x
    t = jnp.tanh(c * x * (1.0 + 0.044715 * x2))
    return (grad * (0.5 * (1.0 + t) + 0.5 * c * x * (1.0 - t * t) * (1.0 + 3 * 0.044715 * x2)),)


gelu.defvjp(_gelu_forward, _gelu_backward)

# The MLP's non-linearity by name: "gelu_tanh" (GPT-2's, and the default), "gelu" (the exact,
# erf-based GELU of BERT and PyTorch's default), "relu" (the paper's), "relu2" (relu squared:
# modded-nanogpt's and nanochat's, sparse like relu with a smooth kink) and "silu" (x * sigmoid(x),
# SwiGLU's gate).
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu_tanh": gelu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "silu": jax.nn.silu,
}
# The gated MLPs by name (Shazeer 2020, "GLU Variants Improve Transformer"), each the activation
# of its gate: SwiGLU (Llama's, Mistral's) and GeGLU (T5 v1.1's and Gemma's, with GELU's tanh form).
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu_tanh"}
assert (*ACTIVATIONS, *GATED_ACTIVATIONS) == ACTIVATION_KINDS, "config.ACTIVATION_KINDS names them all"


class MLP(eqx.Module):
    """`down(act(up(x)))`, two `Linear`s around a non-linearity, applied to every position
    independently; gated (`gated=True`, or `activation="swiglu"` / `"geglu"`), `down(act(gate) *
    value)` with `gate, value` the two halves of `up(x)`.

    Not `eqx.nn.MLP`: this is the transformer's two-layer feed-forward network, built from
    `(d_model, d_hidden)` (no `depth`, `in_size`/`out_size` or activation function argument), and
    acting on a whole sequence `(seq, d_model)` rather than one vector. It has no dropout (the
    `Block` drops out its output; a `key` passed reaches the projections, for LoRA's dropout).

    `up` maps `d_model -> d_hidden`, `down` maps back; each is a `Linear`, one matrix multiply for
    a whole sequence (or batch of sequences). Biases are optional (`bias=True`, GPT-2's; zeros at
    first): by default there are none, since the norm before the MLP makes them nearly redundant.
    `activation` names the non-linearity (`ACTIVATIONS`: "gelu_tanh", the default, "gelu", "relu",
    "relu2", relu squared, or "silu"). Weights start as N(0, init_std^2).

    Gated (a GLU): "swiglu" is `gated=True` with "silu" (Llama's MLP), "geglu" is `gated=True` with
    "gelu_tanh"; any activation may be gated. The gate and the value are one matrix multiply:
    `up` maps `d_model -> 2 * d_hidden`, its first `d_hidden` output columns the gate (through the
    activation), the last `d_hidden` the value they scale; `down` maps `d_hidden -> d_model`. (A
    Llama checkpoint's `gate_proj` and `up_proj`, transposed to `(in, out)` and concatenated in
    that order, are `up.weight`.) Parameters: `3 * d_model * d_hidden` (plus `2 * d_hidden +
    d_model` biases), against `2 * d_model * d_hidden` ungated; Llama keeps the count of a plain
    `4 * d_model` MLP with `d_hidden = 8 * d_model / 3`.
    """

    up: Linear  # d_model -> d_hidden, or d_model -> 2 * d_hidden (gate, value) when gated
    down: Linear  # d_hidden -> d_model
    d_model: int = eqx.field(static=True)
    d_hidden: int = eqx.field(static=True)
    activation: str = eqx.field(static=True)  # the non-linearity, a key of ACTIVATIONS
    gated: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        key: PRNGKeyArray,
        init_std: float = 0.02,
        bias: bool = False,
        activation: str = "gelu_tanh",
        gated: bool = False,
    ):
        check_size(d_model, "MLP: d_model")
        check_size(d_hidden, "MLP: d_hidden")
        if not isinstance(init_std, int | float) or not 0 <= init_std < math.inf:
            raise ValueError(f"MLP: init_std must be a finite number >= 0, got {init_std!r}")
        if activation not in ACTIVATION_KINDS:
            raise ValueError(f"MLP activation must be one of {ACTIVATION_KINDS}, got {activation!r}")
        if not isinstance(gated, bool):
            raise ValueError(f"MLP: gated must be True or False, got {gated!r}")
        k_in, k_out = jax.random.split(key)
        self.gated = gated or activation in GATED_ACTIVATIONS
        self.activation = GATED_ACTIVATIONS.get(activation, activation)
        self.d_model, self.d_hidden = d_model, d_hidden
        up_width = 2 * d_hidden if self.gated else d_hidden
        self.up = Linear(d_model, up_width, key=k_in, use_bias=bias, init_std=init_std)
        self.down = Linear(d_hidden, d_model, key=k_out, use_bias=bias, init_std=init_std)

    @typechecked
    def __call__(
        self,
        x: Float[Array, "*batch seq d_model"],
        *,
        key: PRNGKeyArray | Key[Array, "*batch"] | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "*batch seq d_model"]:
        """Map `x` of shape `(seq, d_model)` (or a batch `(batch, seq, d_model)`) to the same shape.

        The MLP itself is deterministic; `key` (one, or one per sequence) and `inference` reach
        its projections, for those that drop out (`LoRALinear`)."""
        check_last_dim(x, self.d_model, "MLP", "d_model")
        k_up, k_down = projection_keys(key, x.shape[:-2], 2)
        act = ACTIVATIONS[self.activation]
        up = self.up(x, key=k_up, inference=inference)
        if self.gated:
            gate, value = jnp.split(up, 2, axis=-1)
            hidden = act(gate) * value
        else:
            hidden = act(up)
        return self.down(hidden, key=k_down, inference=inference)
