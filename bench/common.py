"""What the training benches share: their configs, model FLOPs per token, a matmul peak timed
in-process (the last two are the halves of an MFU figure), and the trainer's data-parallel
placement written out with `jax.sharding` (the benches use eqx_gpt's public names only).

Model FLOPs per token (forward; training is 3x: the backward pass costs two forwards), counted
from the config, as in PaLM's appendix B and nanoGPT's `estimate_mfu`:
  per layer  2 * d * 3d (QKV) + 2 * d * d (output) + 2 * 2 * d * d_hidden (MLP)
             + 2 * 2 * T * d (scores and weighted values over the whole T x T window)
  head       2 * d * vocab_size
Embedding lookups, norms, softmax, dropout and the optimiser are not counted (they are small), so
MFU slightly undercounts the work done. The peak is a dense fp32 `jnp` matmul timed on this
machine, in this process: there is no datasheet number anywhere.
"""

import argparse
import ctypes
import os
import platform
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqx_gpt import PRESETS, GPTConfig, TrainConfig

DEFAULT_PRESET = "cpu"  # what `train.py` and `train()` use unless told otherwise
STEPS_PER_CALL = 8  # the trainer's optimiser steps per dispatch (`make_train_steps`)
OPTIMIZERS = ("adamw", "muon")  # TrainConfig.optimizer's choices
GPT2_VOCAB_SIZE = 50257  # GPT-2's BPE ids


def preset_configs(name: str, vocab_size: int) -> tuple[GPTConfig, TrainConfig]:
    """The model and training configs of preset `name`: the dataclass defaults, then the preset."""
    preset = PRESETS[name]
    return GPTConfig(vocab_size=vocab_size, **preset.model), TrainConfig(**preset.train)


def count_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def data_mesh() -> Mesh:
    """A one-axis mesh named `data` over every device (one process), as the trainer's."""
    return Mesh(np.asarray(jax.devices()), ("data",))


def check_batch(mesh: Mesh, batch_size: int, grad_accum: int = 1) -> None:
    if batch_size % (grad_accum * mesh.size):
        raise SystemExit(
            f"batch {batch_size} / grad_accum {grad_accum} does not split over {mesh.size} devices"
        )


def replicate(tree, mesh: Mesh):
    """Every array of `tree` whole on every device; other leaves (flags) as they are."""
    put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    return jax.tree.map(lambda x: put(x) if isinstance(x, jax.Array | np.ndarray) else x, tree)


def shard_batch(batch, mesh: Mesh, batch_axis: int = 0) -> jax.Array:
    """`batch` split along `batch_axis` over the mesh's devices."""
    return jax.device_put(batch, NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), "data")))


CONFIGS = {
    # name: (GPTConfig fields except vocab_size, batch size)
    "default": (PRESETS[DEFAULT_PRESET].model, PRESETS[DEFAULT_PRESET].train["batch_size"]),
    # nanoGPT's CPU recipe, with its 4 layers unrolled as in the default preset
    "nanogpt-cpu": (
        dict(context_length=64, d_model=128, n_heads=4, n_layers=4, dropout=0.0, scan_unroll=4),
        12,
    ),
    "shakespeare-char": (PRESETS["shakespeare-char"].model, PRESETS["shakespeare-char"].train["batch_size"]),
}


def flops_per_token(c: GPTConfig) -> int:
    """Model FLOPs of one training token (forward + backward = 3 forwards); see the module docstring."""
    d, t = c.d_model, c.context_length
    per_layer = 2 * d * 3 * d + 2 * d * d + 2 * 2 * d * c.d_hidden + 2 * 2 * t * d
    return 3 * (c.n_layers * per_layer + 2 * d * c.vocab_size)


class MatmulPeak:
    """A jitted `(n, n) @ (n, n)` in fp32; `sample()` times one and records GFLOP/s."""

    def __init__(self, n: int):
        self.flops = 2 * n**3
        self.a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
        self.b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
        self.matmul = jax.jit(jnp.matmul)
        self.matmul(self.a, self.b).block_until_ready()
        self.rates: list[float] = []

    def sample(self) -> float:
        """Time one matmul; record and return its GFLOP/s."""
        start = time.perf_counter()
        self.matmul(self.a, self.b).block_until_ready()
        self.rates.append(self.flops / (time.perf_counter() - start) / 1e9)
        return self.rates[-1]


def mfu(step_s: float, config: GPTConfig, batch_size: int, peak_gflops: float) -> float:
    """Model FLOPs utilisation of a training step of `batch_size` sequences taking `step_s`."""
    tokens = batch_size * config.context_length
    return flops_per_token(config) * tokens / step_s / 1e9 / peak_gflops


def cpu_description() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return f"{model} [{' '.join(simd) or 'no avx2'}], {os.cpu_count()} cores"


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_MALLOC_ENVIRONMENT = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")


def reuse_host_memory() -> bool:
    """Have glibc's malloc keep the memory that XLA's CPU programs free, for the next call to reuse;
    return whether it was set (glibc only, and only where the environment sets no allocator of its own).
    For a whole process, called before JAX starts its threads; the benches' `--reuse-host-memory`.

    Each call of a compiled program allocates its scratch as one buffer (164 MB for 8 steps of the
    default model) from one of XLA's worker threads. glibc maps a buffer that large afresh from the
    kernel in every call and unmaps it at the end, so every call zero-fills it again, page by page:
    42,000 page faults and about 100 ms of system time per call of the default step on a 2-core
    EPYC. One arena for every thread, no mmap for large buffers and no trimming of the heap keep a
    freed buffer for the next call: one step a call then ran as fast as eight.

    The costs, measured there: the process keeps its peak memory until it exits, and every thread
    allocates from one arena, which slowed GPT-2-124M's batch-1 generation by 11-20% and its
    training step by 9-24%. So the training loop amortises the faults instead, with up to 8
    steps a call (`training.run.SECONDS_PER_CALL`); `bench/vs_transformers.py --reuse-host-memory`
    shows that torch's CPU allocator gains more from it than XLA does.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(os.environ.get(name) for name in _MALLOC_ENVIRONMENT):  # the user's own choice stands
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(
        mallopt(param, value)
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    )


def add_malloc_argument(parser: argparse.ArgumentParser) -> None:
    """`--reuse-host-memory`: time with glibc's malloc set by `reuse_host_memory`, not as it comes."""
    parser.add_argument(
        "--reuse-host-memory", action="store_true",
        help="set glibc's malloc to keep freed buffers (common.reuse_host_memory)",
    )  # fmt: skip


def set_malloc(args: argparse.Namespace) -> str:
    """Set the host memory as asked (before JAX starts its threads); say which, for the figures."""
    if args.reuse_host_memory and reuse_host_memory():
        return "malloc: freed buffers kept (reuse_host_memory)"
    return "malloc: glibc's defaults"


# `--smoke`: each bench in its smallest setting, so that tests/test_runnable_scripts.py runs every
# one in seconds and none rots unnoticed; its figures mean nothing. Models keep their every option
# (dropout, norms, positions) at this size.
SMOKE_SHAPE = dict(d_model=16, n_heads=2, n_layers=1, context_length=16)
SMOKE_PEAK = 64  # n of the smoke run's n x n matmul


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--smoke", action="store_true",
        help="the smallest setting (tiny models, one short round): checks that the bench runs; no figures",
    )  # fmt: skip


def smoke_shape(options: dict) -> dict:
    """`options` (GPTConfig fields) at `SMOKE_SHAPE`'s size, every other option kept."""
    return {**options, **SMOKE_SHAPE, **({"scan_unroll": 1} if "scan_unroll" in options else {})}


def smoke_config(config: GPTConfig) -> GPTConfig:
    """`config` at `SMOKE_SHAPE`'s size (its hidden width recomputed), every other option kept."""
    return GPTConfig(**{**smoke_shape(config.to_dict()), "d_hidden": None})
