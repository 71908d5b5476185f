"""Where a jitted step's time goes on the device: its kernels ranked by time, read from JAX's own
profiler (`jax.profiler.trace(..., create_perfetto_trace=True)` writes a Perfetto JSON trace that
needs no TensorBoard to read). `bench/gpu_stages.py`'s `profile` stage prints these.

    top = top_kernels(step, sync, steps=5)  # {"device_ms_per_step", "kernels": [[name, ms, %, calls]]}

On a GPU the kernels are the events of the `/device:GPU:N` processes; a CPU has no device process,
so its XLA operations (the host's events) stand in, which is what the dry run reads.
"""

import collections
import glob
import gzip
import json
import tempfile


def _events(trace_dir: str) -> tuple[list[dict], dict[int, str]]:
    paths = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not paths:
        raise RuntimeError(f"JAX's profiler wrote no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(sorted(paths)[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return events, names


def top_kernels(step, sync, steps: int = 5, top: int = 12) -> dict:
    """Run `step()` `steps` times under JAX's profiler (then `sync` its last result) and rank the
    device's kernels by their total time: `{"device_ms_per_step", "kernels": [[name, ms per step,
    percent of device time, calls per step], ...]}`, the `top` longest first."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="gpu-check-profile-")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        out = None
        for _ in range(steps):
            out = step()
        sync(out)
    events, names = _events(trace_dir)
    device = {pid for pid, name in names.items() if "/device:" in name}
    if not device:  # a CPU: its operations run as the host's events
        device = set(names)
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        # (Python's own frames, "$file:line name", are the host's, not kernels.)
        if e.get("ph") == "X" and e.get("pid") in device and "dur" in e and not e["name"].startswith("$"):
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    overall = sum(total.values()) or 1
    kernels = [
        [name[:120], round(us / steps / 1e3, 3), round(100 * us / overall, 1), round(calls[name] / steps, 1)]
        for name, us in total.most_common(top)
    ]
    return {"device_ms_per_step": round(overall / steps / 1e3, 3), "kernels": kernels}
