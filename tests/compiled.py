"""What every family of test files calls through (each family runs in one process: see
tests/conftest.py): models built once per process, one forward pass compiled whole, and token ids
drawn by NumPy.

The suite's time is XLA compiling. Run eagerly, every call of a layer-scanned model compiles its
scan again (the scan's body is a new closure each call) and every operation is a program of its
own; `jax.jit(lambda ...)` inside a test makes a new cache per test. These are built once, so a
program compiled for one test serves every test of the process that calls it with a model of the
same structure and inputs of the same shapes.
"""

import functools

import equinox as eqx
import jax
import numpy as np

from eqx_gpt import GPT, GPTConfig, Transformer, TransformerConfig


@eqx.filter_jit
def forward(module, *args, **kwargs):
    """`module(*args, **kwargs)` as one compiled program: arrays among the arguments (a key) are
    traced, the rest (`inference=True`) static; one program per module structure and shapes."""
    return module(*args, **kwargs)


def token_ids(seed: int, shape: tuple[int, ...], vocab_size: int) -> jax.Array:
    """Random token ids `shape` in `[0, vocab_size)` (int32), drawn by NumPy: `jax.random.randint`
    compiles a program for every shape it draws (and so does `jnp.asarray` of a NumPy array, where
    `jax.device_put` compiles none)."""
    return jax.device_put(np.random.default_rng(seed).integers(0, vocab_size, shape).astype(np.int32))


def normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    """Standard normal float32 draws `shape`, by NumPy: `jax.random.normal` compiles a program for
    every shape it draws."""
    return jax.device_put(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


@functools.cache
def gpt(config: GPTConfig, seed: int = 0) -> GPT:
    """`GPT(config, key=jax.random.key(seed))`, built once per process (models are immutable). A test
    that trains builds its own: a training step donates the model's arrays."""
    return GPT(config, key=jax.random.key(seed))


@functools.cache
def transformer(config: TransformerConfig, seed: int = 0) -> Transformer:
    """`Transformer(config, key=jax.random.key(seed))`, built once per process."""
    return Transformer(config, key=jax.random.key(seed))


@functools.cache
def drawn_gpt(config: GPTConfig, seed: int = 0, scale: float = 0.1) -> GPT:
    """A `GPT` of `config`'s structure with `normal_weights` (NumPy's draws times `scale`), once per
    process: for a test whose assertion holds for any weights. Building it compiles nothing, where
    `GPT(config, key=...)` compiles a `jax.random.normal` program per weight shape and number of
    layers."""
    return normal_weights(eqx.filter_eval_shape(GPT, config, key=jax.random.key(0)), seed, scale)


def zero_weights(cls: type, config):
    """A `cls(config, key=...)` (a GPT, Transformer, ...) whose every array is zeros, built without
    compiling anything (its shapes traced, its arrays NumPy's): for a test that needs a model's
    structure, not its values (a refusal, a checkpoint's files). Drawing weights compiles a program
    per weight shape, `jax.random.normal`'s taking about 0.5 s each."""
    shapes = eqx.filter_eval_shape(lambda: cls(config, key=jax.random.key(0)))
    as_zeros = lambda leaf: (
        jax.device_put(np.zeros(leaf.shape, leaf.dtype)) if isinstance(leaf, jax.ShapeDtypeStruct) else leaf
    )
    return jax.tree.map(as_zeros, shapes)


def normal_weights(skeleton, seed: int = 0, scale: float = 0.1):
    """`skeleton` (a module from `eqx.filter_eval_shape`, which holds its arrays' shapes alone) with
    every array drawn standard normal times `scale` by NumPy, eagerly: a module to compute with whose
    initialiser compiled nothing (run, `jax.random.normal` compiles a program for every weight
    shape, and a stack of layers a dozen more). For tests that compute with the model and whose
    assertions hold for any weights; `zero_weights` for those that need its structure alone."""
    rng = np.random.default_rng(seed)

    def draw(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf  # what is not an array (a flag) is the module's as it was built
        if not np.issubdtype(leaf.dtype, np.floating):
            raise TypeError(f"normal_weights() draws floating arrays; the skeleton holds a {leaf.dtype} one")
        return jax.device_put((scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype))

    return jax.tree.map(draw, skeleton)
