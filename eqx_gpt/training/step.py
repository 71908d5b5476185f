"""One optimisation step: the learning-rate schedule, the loss, the optimiser (AdamW, or Muon and
AdamW) and the jitted step (one step, or several per call).

The schedule: linear warm-up, then half a cosine down to `min_lr` (or, under `schedule="wsd"`, a
stable `lr` and a linear decay to `min_lr` over the run's last part), `schedule_steps` long. With
`--max-minutes`, `time_plan.TimePlan` shortens `schedule_steps` so that the schedule ends when the
time does; the optimiser is built with a unit learning rate and each step is passed its rate, so
changing the schedule's length needs no recompiling.
"""

import math
from collections.abc import Callable, Hashable
from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from eqx_gpt.model.attention import MultiHeadAttention
from eqx_gpt.model.language_model import LanguageModel
from eqx_gpt.model.linear import Linear
from eqx_gpt.model.lora import LoRALinear, trainable_filter
from eqx_gpt.model.loss import next_token_loss
from eqx_gpt.model.norm import LayerNorm, RMSNorm
from eqx_gpt.streams import DROPOUT, batch_key
from eqx_gpt.training.config import TrainConfig, setting

Model = TypeVar("Model")  # what a step trains: any PyTree its loss takes


def warmup_steps(config: TrainConfig, schedule_steps: int) -> int:
    """The warm-up actually run: `config.warmup_steps`, shortened to half the schedule if longer,
    so that a short run still reaches `lr` and decays (rather than ending mid-warm-up)."""
    return min(config.warmup_steps, schedule_steps // 2)


def decay_start(config: TrainConfig, schedule_steps: int) -> int:
    """The step where the decay to `min_lr` begins: the end of the warm-up under the cosine, the
    last `decay_fraction` of the run under `schedule="wsd"`."""
    warmup = warmup_steps(config, schedule_steps)
    if config.schedule == "cosine":
        return warmup
    return max(warmup, schedule_steps - round(config.decay_fraction * schedule_steps))


def learning_rate(step: int, config: TrainConfig, schedule_steps: int) -> float:
    """The learning rate of optimiser step `step` (0-based) in a schedule `schedule_steps` steps long.

    Linear warm-up to `lr` over `warmup_steps(config, schedule_steps)`, then half a cosine down to
    `min_lr` at `schedule_steps` (nanoGPT's schedule); `min_lr` after that. Under `schedule="wsd"`
    (warm-up, stable, decay), `lr` holds until the last `decay_fraction` of the run, which decays
    linearly to `min_lr`: refitting the schedule's length to the time then moves only the decay.
    """
    c, warmup = config, warmup_steps(config, schedule_steps)
    if step < warmup:
        return c.lr * (step + 1) / (warmup + 1)
    if step >= schedule_steps:
        return c.min_lr
    start = decay_start(c, schedule_steps)
    progress = max(0, step - start) / max(1, schedule_steps - start)
    if c.schedule == "wsd":
        return c.lr + progress * (c.min_lr - c.lr)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c.lr - c.min_lr)


# What the optimiser's groups find by type: a layer's matrix (eqx_gpt's `Linear`, `(in, out)`, and
# Equinox's `eqx.nn.Linear`, `(out, in)`), and the norms (eqx_gpt's and Equinox's).
LINEARS = (Linear, eqx.nn.Linear)
NORMS = (RMSNorm, LayerNorm, eqx.nn.RMSNorm, eqx.nn.LayerNorm)


def decay_mask(params: PyTree) -> PyTree:
    """True for the leaves AdamW decays: every `Linear`'s (and `eqx.nn.Linear`'s) weight and every
    other array that is no norm's (the embeddings), not norm scales and biases.

    Decided by type (what owns a leaf) rather than by `ndim`: the blocks are stacked with a leading
    `n_layers` axis, so their norm scales and biases are 2-D too.
    """

    def mark(node):
        if isinstance(node, LoRALinear):  # its adapters decay, as Hugging Face's Trainer decays them
            return eqx.tree_at(lambda m: (m.lora_a, m.lora_b), _only_weight(node, True, False), (True, True))
        if isinstance(node, LINEARS):
            return _only_weight(node, True, False)
        if isinstance(node, NORMS):
            return jax.tree.map(lambda _: False, node)
        return True

    return jax.tree.map(mark, params, is_leaf=lambda node: isinstance(node, LINEARS + NORMS))


def _only_weight(linear: Linear | eqx.nn.Linear, weight_value, rest_value) -> PyTree:
    """`linear`'s tree with `weight_value` at its weight and `rest_value` at every other leaf (a
    bias; a subclass's own arrays). A weight already filtered out (None, or optax's masked node)
    stays as it is."""
    marks = jax.tree.map(lambda _: rest_value, linear)
    return eqx.tree_at(lambda m: m.weight, marks, weight_value) if eqx.is_array(linear.weight) else marks


def muon_labels(params: PyTree) -> PyTree:
    """ "muon" for the weight matrices of the `Linear`s and `eqx.nn.Linear`s inside the model's
    layers, "adamw" for the rest: embeddings, every bias and norm scale, and a `Linear` the model
    holds itself (a field of the model: its head), as the speedruns keep the head on Adam. For a
    `GPT`, the weights of its blocks' projections go to Muon."""

    def label(node):
        if isinstance(node, LINEARS):
            return _only_weight(node, "muon", "adamw")
        return jax.tree.map(lambda _: "adamw", node)

    def top_level(node):  # a field of the model: a Linear there is the head (or an input's)
        if isinstance(node, LINEARS):
            return jax.tree.map(lambda _: "adamw", node)
        return jax.tree.map(label, node, is_leaf=lambda n: isinstance(n, LINEARS))

    if not isinstance(params, eqx.Module):
        return jax.tree.map(label, params, is_leaf=lambda n: isinstance(n, LINEARS))
    fields = jax.tree_util.tree_flatten(params, is_leaf=lambda n: n is not params)
    return jax.tree_util.tree_unflatten(fields[1], [top_level(child) for child in fields[0]])


def fused_qkv_mask(params: PyTree) -> PyTree:
    """True at each `MultiHeadAttention.qkv` weight (queries, keys and values side by side)."""

    def mark(node):
        if isinstance(node, MultiHeadAttention):
            marks = jax.tree.map(lambda _: False, node)
            return eqx.tree_at(lambda a: a.qkv, marks, _only_weight(node.qkv, True, False))
        return False

    return jax.tree.map(mark, params, is_leaf=lambda node: isinstance(node, MultiHeadAttention))


def _out_in_mask(params: PyTree) -> PyTree:
    """True at each `eqx.nn.Linear` weight, stored `(out, in)` (ours are `(in, out)`)."""

    def mark(node):
        if isinstance(node, eqx.nn.Linear):
            return _only_weight(node, True, False)
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(mark, params, is_leaf=lambda node: isinstance(node, eqx.nn.Linear))


def matrix_axes(split_qkv: bool):
    """Muon's axes for our `x @ W` layout: the input (reduction) axis is `-2`, the output axis
    `-1` (`eqx.nn.Linear`'s `(out, in)` weight the other way round), and a leading `n_layers` axis
    of the stacked blocks is a batch axis of the orthogonalisation (each layer's matrix is
    orthogonalised on its own). Under `split_qkv` a fused `qkv` weight arrives as `(..., d_model, 3,
    d_model)`, its `3` one more batch axis."""

    def axes(w, fused: bool, out_in: bool):
        if out_in:
            return optax.contrib.MuonDimensionNumbers(w.ndim - 1, w.ndim - 2)
        reduction = w.ndim - 3 if split_qkv and fused else w.ndim - 2
        return optax.contrib.MuonDimensionNumbers(reduction, w.ndim - 1)

    return lambda params: jax.tree.map(axes, params, fused_qkv_mask(params), _out_in_mask(params))


def split_qkv(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` seeing each fused `qkv` weight `(..., d_model, 3 * d_model)` as three matrices
    `(..., d_model, 3, d_model)`: Muon then orthogonalises the query, key and value projections
    each on its own (the `3` is a batch axis of `matrix_axes`), as it would separate layers."""

    def apart(tree):
        split = lambda x, fused: x.reshape(*x.shape[:-1], 3, x.shape[-1] // 3) if fused else x
        return jax.tree.map(split, tree, fused_qkv_mask(tree))

    def together(tree):
        join = lambda x, fused: x.reshape(*x.shape[:-2], -1) if fused else x
        return jax.tree.map(join, tree, fused_qkv_mask(tree))

    def init(params):
        return inner.init(apart(params))

    def update(updates, state, params=None):
        updates, state = inner.update(apart(updates), state, None if params is None else apart(params))
        return together(updates), state

    return optax.GradientTransformation(init, update)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW (or Muon and AdamW) with a unit learning rate; the step
    scales by the schedule.

    optax's `adamw` is `scale_by_adam`, `add_decayed_weights`, then `scale(-learning_rate)`; with
    `learning_rate=1` the step multiplies by the scheduled rate itself, so the schedule's length can
    be fitted to the time a run has without rebuilding the optimiser or recompiling. Under
    `optimizer="muon"` the scheduled rate is Muon's; the AdamW group runs at `adam_lr / lr` of it,
    so one schedule drives both rates.
    """
    c = config
    if c.optimizer == "adamw":
        opt = optax.adamw(1.0, b1=c.beta1, b2=c.beta2, weight_decay=c.weight_decay, mask=decay_mask)
    else:
        muon = optax.contrib.muon(
            1.0, beta=c.muon_momentum, ns_steps=c.muon_ns_steps, weight_decay=c.weight_decay, nesterov=True,
            muon_weight_dimension_numbers=matrix_axes(c.muon_split_qkv),
        )  # fmt: skip
        adam_scale = (c.adam_lr or c.lr) / c.lr
        adamw = optax.adamw(
            adam_scale, b1=c.beta1, b2=c.beta2, weight_decay=c.adam_weight_decay, mask=decay_mask
        )
        groups: dict[Hashable, optax.GradientTransformation] = {
            "muon": split_qkv(muon) if c.muon_split_qkv else muon,
            "adamw": adamw,
        }
        opt = optax.partition(groups, muon_labels)
    return optax.chain(optax.clip_by_global_norm(c.grad_clip), opt) if c.grad_clip > 0 else opt


def init_optimizer_state(optimizer: optax.GradientTransformation, model: PyTree) -> PyTree:
    """The optimiser's state for what the step trains (`trainable_filter`): every float array, or
    a LoRA model's adapters alone (the frozen base has none)."""
    return optimizer.init(eqx.filter(model, trainable_filter(model)))


def count_params(model: PyTree) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def loss_fn(
    model: LanguageModel, batch: Int[Array, "batch window"], keys: Array | None = None
) -> Float[Array, ""]:
    """Mean next-token cross-entropy (nats) of `batch`, windows of `context_length + 1` tokens, for
    any `LanguageModel` (a `GPT`, or a model of your own).

    `keys` (one PRNG key per sequence) turns dropout on. The model takes the whole batch at once
    rather than `jax.vmap` over sequences: same result, but each projection is one matrix multiply
    (see `eqx_gpt.model.linear`): 1.74x faster per training step at nanoGPT's CPU recipe
    (docs/PERFORMANCE.md). With a large vocabulary the logits are never held whole
    (`eqx_gpt.model.loss.next_token_loss`).
    """
    return next_token_loss(model, batch[:, :-1], batch[:, 1:], key=keys, gradient=True)


def step_figures(loss: Float[Array, ""], grads: PyTree) -> dict[str, Float[Array, ""]]:
    """What a step reports, by name: the loss, and the global norm of the gradient before clipping.
    A figure added here reaches metrics.jsonl, the trackers, `TrainResult.history` and the
    callbacks' `on_step` with nothing else changed (name its tracker tag in `trackers.TAGS`)."""
    return {"loss": loss, "grad_norm": optax.tree.norm(grads)}  # as `clip_by_global_norm` computes it


def _step_body(optimizer: optax.GradientTransformation, config: TrainConfig, dropout: bool, loss):
    """The un-jitted optimiser step `(model, opt_state, batch, step, lr) -> (model, opt_state,
    figures)` that `make_train_step` and `make_train_steps` compile (`figures`: `step_figures`)."""
    n_micro = config.grad_accum
    # Differentiated: the trainable part (`trainable_filter`); the rest (a LoRA model's frozen
    # base) is a constant of the loss, so no gradient of it is ever computed.
    grad_of_loss = eqx.filter_value_and_grad(
        lambda params, frozen, *xs: loss(eqx.combine(params, frozen), *xs)
    )

    def step_fn(model, opt_state, batch, step, lr):
        n, window = batch.shape
        keys = jax.random.split(batch_key(config.seed, DROPOUT, step), n) if dropout else None
        params, frozen = eqx.partition(model, trainable_filter(model))
        if n_micro == 1:
            loss, grads = grad_of_loss(params, frozen, batch, keys)
        else:
            # Micro-batch i takes rows i, i + n_micro, ...: with the batch split over devices in
            # contiguous blocks, every micro-batch then stays spread over all of them.
            micro_batches = batch.reshape(n // n_micro, n_micro, window).swapaxes(0, 1)
            micro_keys = None if keys is None else keys.reshape(n // n_micro, n_micro).T

            def accumulate(carry, xs):
                loss_sum, grad_sum = carry
                loss, grads = grad_of_loss(params, frozen, *xs)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, eqx.filter(params, eqx.is_inexact_array))
            (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros(()), zeros), (micro_batches, micro_keys))
            loss, grads = loss / n_micro, jax.tree.map(lambda g: g / n_micro, grads)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(params, eqx.is_inexact_array))
        updates = jax.tree.map(lambda u: lr * u, updates)
        return eqx.apply_updates(model, updates), opt_state, step_figures(loss, grads)

    return step_fn


def make_train_step(
    optimizer: optax.GradientTransformation,
    config: TrainConfig,
    *,
    dropout: bool,
    loss: Callable[[Model, Array, Array | None], Array] = loss_fn,
) -> Callable[..., tuple[Model, PyTree, Array]]:
    """`train_step(model, opt_state, batch, step, lr) -> (model, opt_state, loss)`, jitted: `loss`
    is the batch's mean next-token loss before the update (a 0-d array). The trainer's own steps
    (`make_train_steps`) return every figure of `step_figures` by name, the gradient norm too.

    `batch` is `(batch_size, context_length + 1)` token ids; `step` (int32) and `lr` (float32) are
    0-d arrays, so every step runs the same compiled program. The model and optimiser buffers are
    donated (updated in place); the batch is not. With `grad_accum > 1` the batch is split into
    micro-batches whose gradients are averaged by `lax.scan`; each sequence keeps its dropout key,
    so the update is the full batch's (up to float rounding). Dropout keys are a function of `(seed, step)`.
    The model is any PyTree `loss` takes: `loss(model, batch, keys)` is `loss_fn` (the next-token
    loss of a `LanguageModel`: a `GPT`, or a model of your own) unless another model's loss is given
    (`examples/translate.py` trains an encoder-decoder, a `Transformer`, with this same step).
    """
    body = _step_body(optimizer, config, dropout, loss)

    # The first argument (the inputs) is not donated: callers may reuse a batch.
    @eqx.filter_jit(donate="all-except-first")
    def step_fn(inputs, model, opt_state):
        model, opt_state, figures = body(model, opt_state, *inputs)
        return model, opt_state, figures["loss"]

    def train_step(model, opt_state, batch, step, lr):
        return step_fn((batch, step, lr), model, opt_state)

    return train_step


def make_train_steps(
    optimizer: optax.GradientTransformation,
    config: TrainConfig,
    *,
    dropout: bool,
    loss: Callable[[Model, Array, Array | None], Array] = loss_fn,
) -> Callable[..., tuple[Model, PyTree, dict[str, Array]]]:
    """`train_steps(model, opt_state, batches, steps, lrs, n) -> (model, opt_state, figures)`: the
    first `n` of a stack of `make_train_step` steps in one dispatch; `figures[name]` is `(k,)`,
    step `i`'s figure at `i`: the figures of `step_figures`, `loss` first and the others by name.

    `batches` is `(k, batch_size, context_length + 1)`, `steps` and `lrs` are `(k,)`, and `n <= k`
    is a 0-d int32 array, so one compiled program serves any count up to `k`; a figure at
    `i >= n` is 0. The result is exactly that of `n` calls of `train_step`. Why: on CPU each call
    of a small model's step carries a cost that a loop inside one program does not pay (8 steps per
    call ran 1.26-1.29x faster than 1 at d_model 128: docs/PERFORMANCE.md).
    """
    body = _step_body(optimizer, config, dropout, loss)

    @eqx.filter_jit(donate="all-except-first")
    def steps_fn(inputs, model, opt_state):
        batches, steps, lrs, n = inputs
        # The loop carries the model's arrays only: a carried Python bool (the `inference` flags)
        # would become a traced array, which dropout cannot branch on.
        params, static = eqx.partition(model, eqx.is_array)

        def one(i, carry):
            params, opt_state, figures = carry
            model = eqx.combine(params, static)
            model, opt_state, step = body(model, opt_state, batches[i], steps[i], lrs[i])
            figures = {name: figures[name].at[i].set(value) for name, value in step.items()}
            return eqx.filter(model, eqx.is_array), opt_state, figures

        # One slot per step for each of the step's figures, whatever `step_figures` names.
        names = jax.eval_shape(step_figures, jnp.zeros(()), eqx.filter(params, eqx.is_inexact_array))
        zeros = {name: jnp.zeros(steps.shape, jnp.float32) for name in names}
        params, opt_state, figures = jax.lax.fori_loop(0, n, one, (params, opt_state, zeros))
        return eqx.combine(params, static), opt_state, figures

    def train_steps(model, opt_state, batches, steps, lrs, n):
        model, opt_state, figures = steps_fn((batches, steps, lrs, n), model, opt_state)
        return model, opt_state, {"loss": figures["loss"], **figures}  # JAX returns a dict's keys sorted

    return train_steps


def describe_optimizer(config: TrainConfig, schedule_steps: int) -> str:
    """The line a run prints: the optimiser, and what `learning_rate` does over `schedule_steps` steps."""
    c, warmup = config, warmup_steps(config, schedule_steps)
    clip = f"gradient clip {c.grad_clip:g}" if c.grad_clip > 0 else "no gradient clipping"
    shortened = (
        f" ({setting('warmup_steps', c.warmup_steps)} shortened to half the run)"
        if warmup < c.warmup_steps
        else ""
    )
    if c.optimizer == "adamw":
        decay = _decay(c, schedule_steps, f"{c.min_lr:g}")
        return (
            f"AdamW, lr warm-up 0 -> {c.lr:g} over {warmup} steps{shortened}, {decay}; "
            f"betas ({c.beta1:g}, {c.beta2:g}), weight decay {c.weight_decay:g} on matrices, "
            f"{clip}"
        )
    adam_lr, decay = c.adam_lr or c.lr, _decay(c, schedule_steps, f"{c.min_lr / c.lr:g} of their peak")
    split = ", query, key and value apart" if c.muon_split_qkv else ""
    return (
        f"Muon (momentum {c.muon_momentum:g}, Nesterov, {c.muon_ns_steps} Newton-Schulz steps{split}) on the "
        f"block matrices: lr {c.lr:g}, weight decay "
        f"{c.weight_decay:g}; AdamW on embedding, head and norm scales: lr {adam_lr:g}, betas "
        f"({c.beta1:g}, {c.beta2:g}), weight decay {c.adam_weight_decay:g} (not on norm scales); both "
        f"warmed up over {warmup} steps{shortened}, then {decay}; "
        f"{clip}"
    )


def _decay(config: TrainConfig, schedule_steps: int, floor: str) -> str:
    """What the schedule does after the warm-up, in words (`floor`: where it ends)."""
    if config.schedule == "cosine":
        return f"a cosine to {floor} at step {schedule_steps}"
    stable = decay_start(config, schedule_steps)
    return f"stable until step {stable}, then linear to {floor} at step {schedule_steps}"
