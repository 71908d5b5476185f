"""Attention with dropout in the fused kernels, against cuDNN without dropout and the per-head XLA path
with it: one training step's attention, forward and backward.

    uv run python bench/flash_attention.py [--shapes 64x256x6x64 8x1024x12x64] [--rate 0.2]
        [--blocks 64x64 128x64 128x64/128x32/32x128 32x32] [--repeats 5] [--calls 20] [--json PATH]
    uv run python bench/flash_attention.py --smoke    # tiny shapes, on a CPU in interpret mode

For each shape (batch x seq x heads x d_head; bf16 inputs, a causal mask), the time of one jitted
forward pass, and of one forward and backward pass (`value_and_grad` of `sum(out * cotangent)` for
q, k and v), of:
- `kernel BLOCKS`: `flash_attention` at `--rate`, for each `--blocks`: queries x keys per block,
  one pair for every kernel or three joined by `/` (the forward's, `dq`'s, `dk`/`dv`'s:
  `BlockSizes`);
- `kernel, no dropout`: the same at rate 0 (the first blocks);
- `cudnn, no dropout`: `jax.nn.dot_product_attention(implementation="cudnn")`, what attention takes
  at rate 0 on a GPU (skipped elsewhere, or where cuDNN refuses the shape);
- `xla, dropout`: `multi_head_attention` at `--rate`, the per-head path attention took with dropout
  before the kernels.
Each is the median over `--repeats` rounds of `--calls` calls, the variants interleaved so that a
busy machine slows all alike; ratios are to cuDNN's forward + backward. Then the kernel's largest
difference from `reference_attention` given the same dropout mask (output, dq, dk, dv), in bf16
and in float32.

A variant that fails prints its error in one line and the others go on; the exit code is 1 only
when a kernel failed.
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eqx_gpt import causal_mask, multi_head_attention  # noqa: E402
from eqx_gpt.model.flash_attention import (  # noqa: E402
    BlockSizes,
    flash_attention,
    reference_attention,
    sequence_seeds,
)

SMOKE = dict(shapes=[(2, 64, 2, 16)], blocks=["16x16", "32x16/16x32/16x16"], repeats=1, calls=1)


def _numbers(what: str, n: int) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: `n` whole numbers joined by `x` (a bad one is argparse's one-line error)."""
    return lambda text: _parse(text, what, n)


def _parse(text: str, what: str, n: int) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        values = ()
    if len(values) != n or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} is {n} whole numbers joined by x, got {text!r}")
    return values


def _blocks(text: str) -> str:
    """An argparse type: `QxK` (every kernel) or `QxK/QxK/QxK` (forward, dq, dk/dv), kept as given."""
    _block_sizes(text)
    return text


def _block_sizes(text: str) -> BlockSizes:
    pairs = [_parse(part, "a block", 2) for part in text.split("/")]
    if len(pairs) not in (1, 3):
        raise argparse.ArgumentTypeError(
            f"blocks are QxK, or QxK/QxK/QxK for the three kernels, got {text!r}"
        )
    return BlockSizes.uniform(*pairs[0]) if len(pairs) == 1 else BlockSizes(*pairs)


def _inputs(shape, dtype, key):
    kq, kk, kv, kg = jax.random.split(key, 4)
    q, k, v = (jax.random.normal(kx, shape, jnp.float32).astype(dtype) for kx in (kq, kk, kv))
    return q, k, v, jax.random.normal(kg, shape, jnp.float32)


def _step(attend: Callable, cotangent) -> Callable:
    """One jitted forward and backward pass of `attend(q, k, v)`: its output and q, k, v's gradients."""

    def loss(q, k, v):
        out = attend(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent.reshape(out.shape)), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(lambda q, k, v: (lambda r: (r[0][1], *r[1]))(grad(q, k, v)))


def _variants(shape, rate: float, blocks: list[str], key) -> dict[str, Callable]:
    batch, seq = shape[0], shape[1]
    mask = causal_mask(seq)
    seeds = sequence_seeds(key, (batch,))

    def flash(rate, text):
        sizes = _block_sizes(text)
        return lambda q, k, v: flash_attention(q, k, v, mask, rate=rate, seeds=seeds, blocks=sizes)

    variants = {f"kernel {text}": flash(rate, text) for text in blocks}
    variants["kernel, no dropout"] = flash(0.0, blocks[0])
    if jax.default_backend() == "gpu":
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        variants["cudnn, no dropout"] = cudnn
    variants["xla, dropout"] = lambda q, k, v: multi_head_attention(q, k, v, mask, rate, key)[0]
    return variants


def _time(steps: dict, args, repeats: int, calls: int) -> dict:
    """Median ms per call of each compiled step, interleaved rounds."""
    times: dict = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            jax.block_until_ready(step(*args))
            start = time.perf_counter()
            for _ in range(calls):
                out = step(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _one_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _differences(shape, rate: float, blocks: str, key) -> dict[str, dict[str, float]]:
    """Largest |kernel - reference| of the output and each gradient, in bf16 and in float32."""
    result = {}
    mask, seeds = causal_mask(shape[1]), sequence_seeds(key, (shape[0],))
    sizes = _block_sizes(blocks)
    for dtype in (jnp.bfloat16, jnp.float32):
        q, k, v, cotangent = _inputs(shape, dtype, jax.random.key(1))
        attend = lambda q, k, v: flash_attention(q, k, v, mask, rate=rate, seeds=seeds, blocks=sizes)
        reference = lambda q, k, v: reference_attention(q, k, v, mask, rate=rate, seeds=seeds)
        got, want = _step(attend, cotangent)(q, k, v), _step(reference, cotangent)(q, k, v)
        result[jnp.dtype(dtype).name] = {
            name: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True)
        }
    return result


def bench_shape(shape, args, key) -> tuple[dict, bool]:
    """Times and differences of one shape, printed as they come; whether the kernels ran."""
    q, k, v, cotangent = _inputs(shape, jnp.bfloat16, jax.random.key(0))
    steps, failed = {}, {}
    for name, attend in _variants(shape, args.rate, args.blocks, key).items():
        try:
            for pass_, step in (("fwd", jax.jit(attend)), ("fwd+bwd", _step(attend, cotangent))):
                jax.block_until_ready(step(q, k, v))  # compile, and fail here rather than in a timing
                steps[name, pass_] = step
        except Exception as error:  # one variant failing (cuDNN's version, a lowering) spares the others
            failed[name] = _one_line(error)
            steps.pop((name, "fwd"), None)
    times = _time(steps, (q, k, v), args.repeats, args.calls) if steps else {}
    base = times.get(("cudnn, no dropout", "fwd+bwd"))
    label = "x".join(map(str, shape))
    print(f"  {label:<14} {'variant':<34} {'fwd ms':>9} {'fwd+bwd ms':>11}")
    for name in dict.fromkeys([name for name, _ in times] + list(failed)):
        if name in failed:
            print(f"  {label:<14} {name:<34} failed: {failed[name]}")
            continue
        both = times[name, "fwd+bwd"]
        ratio = f"  {both / base:5.2f}x cuDNN" if base else ""
        print(f"  {label:<14} {name:<34} {times[name, 'fwd']:9.3f} {both:11.3f}{ratio}")
    record = {
        "shape": list(shape),
        "ms": {f"{name} {pass_}": t for (name, pass_), t in times.items()},
        "failed": failed,
    }
    kernel_ran = not any(name.startswith("kernel") for name in failed)
    if kernel_ran:
        try:
            record["max_difference"] = _differences(shape, args.rate, args.blocks[0], key)
            for dtype, diffs in record["max_difference"].items():
                line = ", ".join(f"{name} {d:.2e}" for name, d in diffs.items())
                print(f"  {label:<14} max |kernel - reference| ({dtype}, same mask): {line}")
        except Exception as error:
            record["failed"]["difference"] = _one_line(error)
            print(f"  {label:<14} difference against the reference failed: {_one_line(error)}")
            kernel_ran = False
    return record, kernel_ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", type=_numbers("a shape", 4), default=[(64, 256, 6, 64), (8, 1024, 12, 64)],
        help="batch x seq x heads x d_head (default: 64x256x6x64, shakespeare-char's; 8x1024x12x64, GPT-2's)",
    )  # fmt: skip
    parser.add_argument("--rate", type=float, default=0.2, help="the attention dropout rate")
    parser.add_argument(
        "--blocks", nargs="+", type=_blocks, default=["64x64", "128x64", "128x64/128x32/32x128", "32x32"],
        help="queries x keys per block, one for all kernels or forward/dq/dkv; each timed, the first checked",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, one call: checks that the bench runs"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    interpret = " (Pallas interpret mode: no meaningful times)" if jax.default_backend() != "gpu" else ""
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}{interpret}")
    print(f"attention forward + backward, bf16, causal, dropout {args.rate} where named")
    key = jax.random.key(2)
    records, ok = [], True
    for shape in args.shapes:
        record, kernel_ran = bench_shape(shape, args, key)
        records.append(record)
        ok = ok and kernel_ran
    if args.json:
        args.json.write_text(
            json.dumps({"device": jax.devices()[0].device_kind, "shapes": records}, indent=1)
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
