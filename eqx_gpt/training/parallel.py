"""Data parallelism with `jax.sharding`: one mesh over every device, the batch split along it.

The training step itself has no parallel code. Its inputs carry shardings instead: the model and
optimiser state are *replicated* on every device, each batch is *sharded* along the mesh's `data`
axis, and `jit` compiles one program per device that computes the gradients of its slice of the
batch and all-reduces them (XLA inserts the collective where the batch-mean meets the replicated
parameters). With one device every placement here is a no-op, so the same code runs everywhere.

FSDP (`shard_parameters`, `train.py --fsdp`): each parameter and its optimiser moments are instead
split along the `data` axis too, over their largest axis that the device count divides, so each
device stores 1/n of them. XLA then gathers every weight where it is used and reduce-scatters its
gradient (ZeRO-3); the step is still the same code. It pays when the model, not the batch, fills
a device's memory.

Several hosts: launch one process per host with the environment variables of
`initialize_distributed`, and every process runs the same program over the global mesh.

Bit-exact training on a GPU needs no flag: the two kernels that added with atomics there add in a
fixed order now (the embedding's gradient, `model/embedding.py`; attention's backward,
`model/flash_attention.py`), so XLA's global `--xla_gpu_deterministic_ops`, which cost a quarter
of a run's GPU throughput, is not asked for (docs/PERFORMANCE.md, "On a GPU").
"""

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqx_gpt.errors import ConfigError

DATA_AXIS = "data"


def initialize_distributed() -> bool:
    """Join a multi-process run when the environment says this is one; return whether it did.

    Recognised: `JAX_COORDINATOR_ADDRESS` (host:port of process 0) with `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID`; or a SLURM or Open MPI launch of more than one task, whose variables
    `jax.distributed.initialize()` reads itself. Must run before anything touches a device.
    """
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    launched = any(int(os.environ.get(v, "1")) > 1 for v in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
    if not (coordinator or launched):
        return False
    if coordinator:
        missing = [v for v in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if v not in os.environ]
        if missing:
            raise ConfigError(
                f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not; set all three "
                f"(JAX_NUM_PROCESSES = number of hosts, JAX_PROCESS_ID = 0 .. hosts - 1) on every host"
            )
    # CPU devices of different processes all-reduce over TCP with gloo (GPUs use NCCL anyway).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    return True


def data_mesh(devices=None) -> Mesh:
    """A one-axis mesh named `data` over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def check_batch(mesh: Mesh, batch_size: int, grad_accum: int = 1) -> None:
    """Raise a one-line `ConfigError` unless every micro-batch splits evenly over the devices."""
    n = mesh.size
    if batch_size % (grad_accum * n) == 0:
        return
    if grad_accum == 1:
        raise ConfigError(
            f"batch_size={batch_size} cannot be split evenly over {n} devices; "
            f"use a batch_size that is a multiple of {n}"
        )
    raise ConfigError(
        f"batch_size={batch_size} with grad_accum={grad_accum} gives micro-batches of "
        f"{batch_size / grad_accum:g} sequences, which {n} devices cannot share evenly; "
        f"use a batch_size that is a multiple of grad_accum * {n} = {grad_accum * n}"
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, batch_axis: int = 0) -> NamedSharding:
    """Split axis `batch_axis` of an array along the mesh's `data` axis; keep the others whole."""
    return NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), DATA_AXIS))


def _place(x, sharding: NamedSharding):
    """`jax.device_put`, or, for a process-local array in a multi-process run, the global array
    built from it (every process holds the same values, so each fills its own devices' part)."""
    if jax.process_count() == 1 or not getattr(x, "is_fully_addressable", True):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _place_tree(tree, sharding_of):
    """`_place` every array of `tree` with `sharding_of(array)`; other leaves stay as they are."""
    is_array = lambda x: isinstance(x, jax.Array | np.ndarray)
    return jax.tree.map(lambda x: _place(x, sharding_of(x)) if is_array(x) else x, tree)


def replicate(tree, mesh: Mesh):
    """Place every array of `tree` (a model, an optimiser state, data) whole on every device."""
    return _place_tree(tree, lambda _: replicated(mesh))


def fsdp_axis(shape: tuple[int, ...], n_devices: int) -> int | None:
    """The axis FSDP splits an array of `shape` along: its largest axis that `n_devices` divides
    (the first one on ties), or None (keep it whole) when none does or there is one device."""
    axes = [i for i, size in enumerate(shape) if size % n_devices == 0 and size >= n_devices]
    if n_devices == 1 or not axes:
        return None
    return max(axes, key=lambda i: (shape[i], -i))


def parameter_sharding(x, mesh: Mesh) -> NamedSharding:
    """FSDP placement of one array: split along `fsdp_axis` over the mesh, else whole everywhere."""
    axis = fsdp_axis(getattr(x, "shape", ()), mesh.size)
    if axis is None:
        return replicated(mesh)
    return NamedSharding(mesh, PartitionSpec(*([None] * axis), DATA_AXIS))


def shard_parameters(tree, mesh: Mesh):
    """Place every array of `tree` (a model, an optimiser state) split over the mesh (FSDP): see
    `parameter_sharding`. The values are unchanged; only where they live."""
    return _place_tree(tree, lambda x: parameter_sharding(x, mesh))


def shard_batch(batch: jax.Array | np.ndarray, mesh: Mesh, batch_axis: int = 0) -> jax.Array:
    """Split `batch` along `batch_axis` over the mesh (asynchronous; no copy on one device)."""
    return _place(batch, batch_sharding(mesh, batch_axis))


def shard_rows(read, shape: tuple[int, ...], mesh: Mesh, batch_axis: int = 0) -> jax.Array:
    """The array of `shape` split along `batch_axis` over the mesh, built from `read(index)`, which
    returns the part `index` (a tuple of slices) of it. In a multi-process run each process reads
    only the rows of its own devices; in one process, the whole array at once."""
    sharding = batch_sharding(mesh, batch_axis)
    if jax.process_count() == 1:
        return jax.device_put(read(tuple(slice(None) for _ in shape)), sharding)
    return jax.make_array_from_callback(shape, sharding, read)
