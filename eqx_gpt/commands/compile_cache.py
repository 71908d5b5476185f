"""The commands' cache of compiled programs on disk: JAX's persistent compilation cache, which on a
GPU also keeps XLA's autotuning results (`jax_persistent_cache_enable_xla_caches`, by default the
results of each fusion).

It earns its place twice. A command run again starts sooner: its programs are read, not compiled.
And on a GPU a run resumed in a new process trains on the same bits: XLA picks each matrix
multiply's kernel by timing candidates as it compiles, so two processes compiling one training
step can pick differently and round differently. With the first compile's choices kept, a later
compile picks the same kernels (on an H200, `train.py` twice for 300 steps: the same losses to the
last bit with the results kept, other losses without; docs/PERFORMANCE.md). A cleared cache, or
another GPU, loses that, not the run.
"""

import os
from pathlib import Path


def enable_compilation_cache() -> Path:
    """Keep compiled programs (and a GPU's autotuning) in `$JAX_COMPILATION_CACHE_DIR` where the
    environment names one, else in `$XDG_CACHE_HOME/eqx_gpt/jax` (`~/.cache/eqx_gpt/jax`); every
    program, however quick to compile, unless `$JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` says
    otherwise. Call it before the first compile. Returns the folder."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # JAX read it when it started
        folder = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        folder = base / "eqx_gpt" / "jax"
        jax.config.update("jax_compilation_cache_dir", str(folder))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder
