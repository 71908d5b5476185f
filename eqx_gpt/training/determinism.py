"""Bit-exact training on a GPU: XLA's deterministic GPU kernels, asked for before JAX starts.

On a CPU one compiled step gives the same bits every time it runs. On a GPU it does not: some of
XLA's kernels add with atomics (the scatter-add of the embedding's gradient, for one), so the sum's
order, and its last bit, depends on which threads finish first. A resumed run would then not
continue the bits of the run it resumes, and two runs of one command would differ. The flag
`--xla_gpu_deterministic_ops=true` makes XLA pick kernels that add in a fixed order. It is read
once, when JAX first starts its backends, so `train.py` sets it before it touches a device. A user
who prefers the last few percent of GPU speed to exact resume sets
`XLA_FLAGS=--xla_gpu_deterministic_ops=false` (docs/PERFORMANCE.md, "On a GPU", has the cost).
"""

import os
from collections.abc import MutableMapping

DETERMINISTIC_GPU_OPS = "--xla_gpu_deterministic_ops"


def request_deterministic_gpu_ops(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Add `--xla_gpu_deterministic_ops=true` to `XLA_FLAGS` unless it names that flag already
    (the user's choice stands); return whether it was added. It changes nothing on a CPU, and
    nothing at all once JAX has started its backends: call it first."""
    flags = environ.get("XLA_FLAGS", "")
    if DETERMINISTIC_GPU_OPS in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_GPU_OPS}=true".strip()
    return True
