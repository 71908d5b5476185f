"""The stages of `bench/gpu_check.py`: `python bench/gpu_stages.py RESULTS_DIR STAGE...` runs them in
turn in one process (one start-up of JAX), each between two marker lines by which `gpu_check.py`
gives it its time limit (it stops this process at a stage's limit and starts another for the rest).

Each stage records its figures in RESULTS_DIR/STAGE.json as it goes (`Record`), so a stage stopped at
its time limit still leaves what it had measured. `--dry-run` runs the same code at tiny sizes, on the CPU
(`JAX_PLATFORMS=cpu`). The sides that need torch or transformers are skipped, with the reason
recorded, where those are not installed; everything else in the stage still runs.

- peaks: the device's matmul rates, bf16 and fp32 (at JAX's default precision, which is TF32 on an
  NVIDIA GPU, and at "highest"), timed here: MFU's denominators.
- tests: the tests that mean most on a GPU (`GPU_TESTS`), fp32 matmuls at full precision.
- train: `train.py --preset shakespeare-char` for `--train-steps` steps: tokens/s, MFU, final val.
- nanogpt: the shakespeare-char model and step against `bench/torch_gpt.py` under nanoGPT's GPU
  recipe (`torch.compile`, bf16 autocast, TF32, fused AdamW), both in bf16, side by side.
- gpt2: GPT-2-124M's shapes against `transformers` (same weights, logits compared first):
  greedy generation tokens/s, and a bf16 training step with its MFU.
- dtype: the eqx_gpt training step at `compute_dtype` float32 and bfloat16, interleaved.

Every model comes from names `eqx_gpt` exports; `bench/common.py` counts model FLOPs.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

# The tests that mean most on a GPU: model and sampling equivalence (cached decoding against the
# full forward, GPT-2 against transformers' logits), training exactness (steps grouped any way,
# accumulation), one-device sharding (the data mesh the trainer builds), bf16 (fused cuDNN
# attention against the per-head path, bf16 loss and gradients against fp32), the embedding's
# fixed-order gradient against the scatter-add, the attention kernels (compiled, not interpreted).
GPU_TESTS = [
    "tests/test_gpt.py",
    "tests/test_generate.py",
    "tests/test_sampling.py",
    "tests/test_gpt2.py",
    "tests/test_training.py",
    "tests/test_parallel.py",
    "tests/test_mixed_precision.py",
    "tests/test_loss.py",
    "tests/test_embedding.py",
    "tests/test_flash_attention.py",
]
# The dry run collects every test above, and runs this one, which builds a one-device mesh.
DRY_TEST = "test_batches_that_devices_cannot_share_are_rejected_with_the_fix"  # in test_parallel.py


@dataclass(frozen=True)
class Sizes:
    """What each stage runs: the real sizes, or the dry run's tiny ones."""

    peak_n: int  # n of the n x n matmuls timed for the peaks
    train_steps: int
    train_flags: tuple[str, ...]  # train.py flags beside --preset shakespeare-char
    char_model: dict  # overrides of the shakespeare-char preset's model
    char_batch: int
    gpt2_model: dict  # GPT-2's shape: layers, width, heads, positions
    gpt2_batch: int  # sequences of a training step, each of the whole context
    prompt: int  # generation: prompt tokens, new tokens
    new_tokens: int
    block: int  # steps dispatched back to back between synchronisations
    blocks: int  # timed blocks per side and round
    rounds: int  # alternations of the two sides


REAL = Sizes(
    peak_n=8192, train_steps=600, train_flags=("--eval-interval", "300", "--log-interval", "50"),
    char_model={}, char_batch=64, gpt2_model=dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
    gpt2_batch=8, prompt=64, new_tokens=256, block=10, blocks=4, rounds=2,
)  # fmt: skip
TINY_CHAR = dict(context_length=32, d_model=32, n_heads=2, n_layers=1, scan_unroll=1)
DRY = Sizes(
    peak_n=128, train_steps=2,
    train_flags=(
        "--eval-interval", "2", "--log-interval", "1", "--eval-batches", "1", "--eval-tokens", "1024",
        "--batch-size", "4", *(f"--{k.replace('_', '-')}={v}" for k, v in TINY_CHAR.items()),
    ),
    char_model=TINY_CHAR, char_batch=4, gpt2_model=dict(n_layer=1, n_embd=32, n_head=2, n_positions=32),
    gpt2_batch=2, prompt=4, new_tokens=8, block=2, blocks=1, rounds=1,
)  # fmt: skip
GPT2_VOCAB = 50257
BEGIN, END = "@@ stage begins: ", "@@ stage ends: "  # the lines bench/gpu_check.py times stages by
MIN_STAGE_S = 15  # a stage with less of the budget left is skipped


class Record(dict):
    """The stage's figures, written to its result file whenever one is added."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def put(self, quiet: bool = False, **figures) -> None:
        self.update(figures)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=1, default=str))
        tmp.replace(self.path)
        if not quiet:
            print("  " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def median_ms(seconds: list[float]) -> float:
    return round(1e3 * statistics.median(seconds), 3)


def time_blocks(step, sync, block: int, blocks: int) -> list[float]:
    """Seconds per step of `blocks` blocks of `block` calls of `step()` dispatched back to back, each
    block ending with `sync(last result)`: one step's time without a host round trip per step."""
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(block):
            out = step()
        sync(out)
        times.append((time.perf_counter() - start) / block)
    return times


def peaks_of(result_dir: Path) -> dict:
    path = result_dir / "peaks.json"
    return json.loads(path.read_text()) if path.exists() else {}


def mfu(flops_per_step: float, step_s: float, peak_tflops: float | None) -> float | None:
    return round(flops_per_step / step_s / 1e12 / peak_tflops, 4) if peak_tflops else None


# --- peaks ---------------------------------------------------------------------------------------


def matmul_tflops(n: int, dtype, precision=None, reps: int = 10) -> float:
    """TFLOP/s of a jitted `(n, n) @ (n, n)` on random data: median of `reps` after 3 warm-ups
    (time a size that fills the device: 8192 on an H100)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))
    for _ in range(3):
        matmul(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return round(2 * n**3 / statistics.median(times) / 1e12, 3)


def stage_peaks(record: Record, sizes: Sizes, args) -> None:
    import jax
    import jax.numpy as jnp
    from common import cpu_description

    device = jax.devices()[0]
    record.put(backend=jax.default_backend(), device=device.device_kind, devices=len(jax.devices()),
               jax=jax.__version__, cpu=cpu_description(), matmul_n=sizes.peak_n)  # fmt: skip
    if jax.default_backend() == "gpu" and shutil.which("nvidia-smi"):  # the clocks, as found
        query = "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm"
        smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True)
        record.put(nvidia_smi=smi.stdout.strip() or smi.stderr.strip())
    record.put(bf16_tflops=matmul_tflops(sizes.peak_n, jnp.bfloat16))
    record.put(fp32_tflops=matmul_tflops(sizes.peak_n, jnp.float32))  # JAX's default precision
    record.put(fp32_highest_tflops=matmul_tflops(sizes.peak_n, jnp.float32, precision="highest"))


# --- tests ---------------------------------------------------------------------------------------


OUTCOME = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
TEST_ID = re.compile(r"(tests/\S+::\S+)")


def stage_tests(record: Record, sizes: Sizes, args) -> None:
    # fp32 matmuls at full precision: on an NVIDIA GPU JAX's default is TF32, about 1e-3 relative,
    # past the tests' fp32 tolerances; the bf16 tests set their own dtypes.
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # tests/conftest.py keeps one per session
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=-ra", "-m", "not slow", "-p", "no:cacheprovider"]
    cmd += ["-v", "--no-header", *GPU_TESTS]
    if args.dry_run:  # every test of the selection is collected (a missing one is an error); one runs
        cmd += ["-k", DRY_TEST]
    elif find_spec("xdist"):  # several test processes share the GPU, none taking most of its memory
        cmd += ["-n", "8", "--dist", "loadgroup"]
    record.put(
        selection=GPU_TESTS, matmul_precision="highest", ran="one test (dry run)" if args.dry_run else "all"
    )
    counts, failures = dict.fromkeys(("passed", "failed", "skipped"), 0), []
    run = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for line in run.stdout:  # each test's outcome as it comes, so a stage stopped early keeps them
        print(line, end="", flush=True)
        outcome, test = OUTCOME.search(line), TEST_ID.search(line)
        if outcome and test and "::" in line and not line.startswith(("FAILED ", "ERROR ", "SKIPPED ")):
            kind = {"PASSED": "passed", "XPASS": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}
            counts[kind.get(outcome[1], "failed")] += 1
            failures += [test[1]] if kind.get(outcome[1]) is None else []
            record.put(**counts, failures=failures, quiet=True)
        elif collected := re.search(r"collected (\d+) items(?: / (\d+) deselected)?", line):
            record.put(collected=int(collected[1]), deselected=int(collected[2] or 0))
        elif collected := re.search(r"(\d+) workers \[(\d+) items\]", line):  # pytest-xdist's
            record.put(workers=int(collected[1]), collected=int(collected[2]))
    record.put(pytest_rc=run.wait(), **counts, failures=failures)
    if run.returncode != 0:
        raise SystemExit(f"pytest exit {run.returncode}")


# --- train ---------------------------------------------------------------------------------------


def char_config(sizes: Sizes, compute_dtype: str | None = None):
    from eqx_gpt import PRESETS, GPTConfig

    model = {**PRESETS["shakespeare-char"].model, **sizes.char_model}
    if compute_dtype:
        model["compute_dtype"] = compute_dtype
    return GPTConfig(vocab_size=65, **model)


def run_train(sizes: Sizes, env: dict, record: Record, prefix: str = "") -> float:
    """`train.py --preset shakespeare-char` for `sizes.train_steps` steps under `env`: its figures
    recorded (names prefixed by `prefix`); returns its tokens/s."""
    from common import flops_per_token

    out_dir = Path(tempfile.mkdtemp(prefix="gpu-check-train-")) / "run"
    cmd = [sys.executable, "train.py", "--preset", "shakespeare-char", "--max-steps", str(sizes.train_steps),
           "--sample-tokens", "0", "--out-dir", str(out_dir), *sizes.train_flags]  # fmt: skip
    record.put(**{f"{prefix}command": " ".join(cmd[1:]), f"{prefix}xla_flags": env.get("XLA_FLAGS", ""),
                  f"{prefix}out_dir": str(out_dir)})  # fmt: skip
    # Its own memory as it needs it: this process holds JAX's share and what torch cached beside it
    # (the first H200 run's train.py, preallocating, ran out of memory for its CUDA graphs).
    env = {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    start = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, env=env)
    record.put(
        **{f"{prefix}train_rc": run.returncode, f"{prefix}wall_s": round(time.perf_counter() - start, 1)}
    )
    if run.returncode != 0:
        raise SystemExit(f"train.py exit {run.returncode}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    # The first rate read can still hold the compile; the trainer measures from after it.
    tokens_per_s = statistics.median(rates[1:] or rates)
    # The dtype the run took (the preset's on this device: bf16 on a GPU), as its checkpoint says.
    ran = json.loads((out_dir / "latest.json").read_text())["model_config"]["compute_dtype"]
    config = char_config(sizes, ran)
    flops_per_s = flops_per_token(config) * tokens_per_s
    peaks = peaks_of(record.path.parent)
    final = [r["final_val_loss"] for r in rows if "final_val_loss" in r]
    record.put(**{prefix + k: v for k, v in dict(
        steps=max(r["step"] for r in rows), tokens_per_s=round(tokens_per_s, 1),
        compute_dtype=config.compute_dtype, mfu_fp32=mfu(flops_per_s, 1.0, peaks.get("fp32_tflops")),
        mfu_bf16=mfu(flops_per_s, 1.0, peaks.get("bf16_tflops")),
        val_loss=[r["val_loss"] for r in rows if "val_loss" in r][-1:],
        final_val_loss=final[-1] if final else None,
    ).items()})  # fmt: skip
    return tokens_per_s


def stage_train(record: Record, sizes: Sizes, args) -> None:
    run_train(sizes, dict(os.environ), record)


# --- the eqx_gpt training step, timed ------------------------------------------------------------


class EqxStep:
    """The trainer's jitted step (`eqx_gpt.make_train_step`) on fixed batches: `()` runs one step."""

    def __init__(self, model, train_config, batches: np.ndarray):
        import jax
        import jax.numpy as jnp

        from eqx_gpt import init_optimizer_state, make_optimizer, make_train_step

        optimizer = make_optimizer(train_config)
        self.state = (model, init_optimizer_state(optimizer, model))
        self.step_fn = make_train_step(optimizer, train_config, dropout=model.config.dropout > 0)
        self.batches = [jax.device_put(jnp.asarray(b)) for b in batches]
        self.lr, self.i = np.float32(train_config.lr), 0

    def __call__(self):
        batch = self.batches[self.i % len(self.batches)]
        model, opt_state, loss = self.step_fn(*self.state, batch, np.int32(self.i), self.lr)
        self.state, self.i = (model, opt_state), self.i + 1
        return loss

    @staticmethod
    def sync(loss) -> None:
        loss.block_until_ready()

    def first(self) -> float:
        """Seconds of the first step (it compiles)."""
        start = time.perf_counter()
        self.sync(self())
        return round(time.perf_counter() - start, 2)


def random_batches(vocab: int, batch: int, window: int, n: int = 4) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (n, batch, window), dtype=np.int32)


# --- nanogpt ------------------------------------------------------------------------------------


def torch_available() -> str | None:
    """None where torch can run here, else why not."""
    return None if find_spec("torch") else "torch is not installed"


def stage_nanogpt(record: Record, sizes: Sizes, args) -> None:
    import equinox as eqx
    import jax
    from common import flops_per_token
    from vs_pytorch import check_same_work, export

    from eqx_gpt import GPT, loss_fn

    # nanoGPT's GPU recipe computes in bf16 (autocast); so does our side here.
    config = char_config(sizes, "bfloat16")
    train_config = train_config_of("shakespeare-char", sizes.char_batch)
    batches = random_batches(65, sizes.char_batch, config.context_length + 1)
    model = GPT(config, key=jax.random.key(0))
    with jax.default_matmul_precision("highest"):  # against torch's loss in full fp32
        loss0 = float(loss_fn(eqx.nn.inference_mode(model), jax.numpy.asarray(batches[0])))
    flops_step = flops_per_token(config) * sizes.char_batch * config.context_length
    shape = f"L{config.n_layers} d{config.d_model} T{config.context_length} B{sizes.char_batch}"
    record.put(
        model=f"shakespeare-char {shape} dropout {config.dropout}", compute="bf16", loss0=round(loss0, 6)
    )
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-nanogpt-"))
    export(model, batches, workdir / "weights.npz")  # before the step donates the model's buffers
    ours = EqxStep(model, train_config, batches)
    record.put(eqx_first_step_s=ours.first())
    eqx_times = time_blocks(ours, ours.sync, sizes.block, sizes.blocks)
    peak = peaks_of(record.path.parent).get("bf16_tflops")
    if why_not := torch_available():
        ours_s = statistics.median(eqx_times)
        record.put(
            eqx_step_ms=median_ms(eqx_times), eqx_mfu_bf16=mfu(flops_step, ours_s, peak), torch=why_not
        )
        return
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = {
        "weights": str(workdir / "weights.npz"), "threads": os.cpu_count(), "compile": True,
        "config": {**config.to_dict(), "d_hidden": config.d_hidden}, "warmup": 3,
        "steps": sizes.block * sizes.blocks * sizes.rounds, "block": sizes.block, "device": device,
        "autocast": "bfloat16", "tf32": True, "fused": device == "cuda",
        "train": {k: getattr(train_config, k) for k in ("lr", "beta1", "beta2", "weight_decay", "grad_clip")},
    }  # fmt: skip
    (workdir / "spec.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    cmd = [sys.executable, str(ROOT / "bench" / "torch_gpt.py"), str(workdir / "spec.json")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the PyTorch side failed:\n{out.stderr[-3000:]}")
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    record.put(torch_s=round(time.perf_counter() - start, 1), torch=theirs["torch"], on=theirs["device"])
    check_same_work("shakespeare-char", model, loss0, theirs)
    eqx_times += time_blocks(ours, ours.sync, sizes.block, sizes.blocks)  # after, as load may change
    ours_s, theirs_s = statistics.median(eqx_times), statistics.median(theirs["step_s"])
    record.put(
        eqx_step_ms=median_ms(eqx_times), torch_compiled_step_ms=median_ms(theirs["step_s"]),
        ratio=round(ours_s / theirs_s, 3), eqx_mfu_bf16=mfu(flops_step, ours_s, peak),
        torch_mfu_bf16=mfu(flops_step, theirs_s, peak),
    )  # fmt: skip


# --- gpt2 ----------------------------------------------------------------------------------------


def gpt2_config(sizes: Sizes, compute_dtype: str = "float32"):
    """The gpt2-124m preset's model at `sizes.gpt2_model`'s shape (GPT-2-124M's in the real run)."""
    import jax

    from eqx_gpt import PRESETS, GPTConfig

    s = sizes.gpt2_model
    shape = dict(
        n_layers=s["n_layer"], d_model=s["n_embd"], n_heads=s["n_head"], context_length=s["n_positions"]
    )
    # The preset as a run on this device resolves it (on a GPU its layers unrolled).
    values = PRESETS["gpt2-124m"].values(gpu=jax.default_backend() == "gpu")
    model = {k: v for k, v in values.items() if k in GPTConfig.__dataclass_fields__}
    return GPTConfig(vocab_size=GPT2_VOCAB, **{**model, **shape, "compute_dtype": compute_dtype})


# The training configs timed: each preset's, with gradient clipping off for GPT-2 as on transformers'
# side (`vs_transformers.hf_training`). The stages that time the same model and dtype build the same
# program, so the run's compilation cache compiles it once.
STEP_CHANGES = {"shakespeare-char": {}, "gpt2-124m": {"grad_clip": 0.0}}


def train_config_of(preset: str, batch_size: int):
    from eqx_gpt import PRESETS, TrainConfig

    return TrainConfig(**{**PRESETS[preset].train, "batch_size": batch_size, **STEP_CHANGES[preset]})


def gpt2_folder(sizes: Sizes, directory: Path):
    """A random GPT-2 of `sizes.gpt2_model`'s shape saved as a Hugging Face folder in `directory`,
    and `transformers`' model of it (None without transformers: then eqx_gpt writes the folder)."""
    import jax

    from eqx_gpt import GPT, save_gpt2

    if find_spec("torch") and find_spec("transformers"):
        import torch
        import transformers

        torch.manual_seed(0)
        reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes.gpt2_model)).eval()
        reference.save_pretrained(directory, safe_serialization=True)
        return reference.to("cuda" if torch.cuda.is_available() else "cpu")
    save_gpt2(GPT(gpt2_config(sizes), key=jax.random.key(0)), directory)
    return None


def same_logits(record: Record, model, reference, prompt: np.ndarray) -> None:
    """Refuse to time two models whose logits differ (both in full fp32)."""
    import jax
    import torch

    with torch.no_grad():
        ids = torch.from_numpy(prompt[None]).long().to(reference.device)
        expected = reference(ids).logits[0].cpu().numpy()
    with jax.default_matmul_precision("highest"):
        diff = float(np.abs(np.asarray(model(jax.numpy.asarray(prompt))) - expected).max())
    record.put(logits_max_diff=diff)
    if diff > 1e-3:
        raise SystemExit(
            "eqx_gpt's and transformers' logits differ: timing them would compare different work"
        )


def compare_generation(record: Record, sizes: Sizes, model, reference, prompt: np.ndarray) -> None:
    """Batch 1, greedy, KV-cached on both sides, in fp32; each side's first call untimed."""
    import jax

    from eqx_gpt import SamplingOptions, generate

    greedy = SamplingOptions(temperature=0.0)
    sides = {
        "eqx_gpt": lambda: generate(model, prompt, sizes.new_tokens, key=jax.random.key(0), options=greedy)
    }
    if reference is not None:
        from vs_transformers import hf_generation

        sides["transformers"] = hf_generation(reference, prompt, new_tokens=sizes.new_tokens)
    first = {name: round(timed(fn), 2) for name, fn in sides.items()}
    seconds = {name: [] for name in sides}
    for _ in range(max(3, sizes.rounds)):
        for name, fn in sides.items():
            seconds[name].append(timed(fn))
    tok_s = {name: round(sizes.new_tokens / statistics.median(s), 1) for name, s in seconds.items()}
    what = f"batch 1, prompt {sizes.prompt}, {sizes.new_tokens} new tokens, greedy, fp32"
    record.put(generation=what, generation_first_call_s=first, generation_tok_s=tok_s)
    if reference is not None:
        record.put(generation_ratio=round(tok_s["eqx_gpt"] / tok_s["transformers"], 3))


def compare_training(record: Record, sizes: Sizes, directory: Path, reference) -> None:
    """A bf16 training step (AdamW, no clipping on either side) of whole-context sequences."""
    from common import flops_per_token

    from eqx_gpt import load_gpt2

    # As the gpt2-124m preset trains it on this device (on a GPU its layers unrolled): the first
    # H200 run loaded it with the default rolled scan and read 0.369 MFU where the preset's step gave 0.476.
    unroll = gpt2_config(sizes, "bfloat16").scan_unroll
    model = load_gpt2(directory, compute_dtype="bfloat16", scan_unroll=unroll)
    config = model.config
    train_config = train_config_of("gpt2-124m", sizes.gpt2_batch)
    batches = random_batches(GPT2_VOCAB, sizes.gpt2_batch, config.context_length + 1)
    ours = EqxStep(model, train_config, batches)
    record.put(
        train=f"{sizes.gpt2_batch} x {config.context_length} tokens, bf16", eqx_first_step_s=ours.first()
    )
    steps = {"eqx_gpt": (ours, ours.sync)}
    if reference is not None:
        from vs_transformers import hf_training

        hf = hf_training(reference, batches[0], autocast="bfloat16")
        hf()  # untimed first step
        steps["transformers"] = (hf, lambda loss: None)  # its step returns a float: already synced
    step_s = {name: [] for name in steps}
    for _ in range(sizes.rounds):
        for name, (step, sync) in steps.items():
            step_s[name] += time_blocks(step, sync, sizes.block, sizes.blocks)
    ms = {name: median_ms(s) for name, s in step_s.items()}
    flops_step = flops_per_token(config) * sizes.gpt2_batch * config.context_length
    peak = peaks_of(record.path.parent).get("bf16_tflops")
    record.put(train_step_ms=ms, train_mfu_bf16={k: mfu(flops_step, v / 1e3, peak) for k, v in ms.items()})
    if reference is not None:
        record.put(train_ratio=round(ms["transformers"] / ms["eqx_gpt"], 3))


def stage_gpt2(record: Record, sizes: Sizes, args) -> None:
    import equinox as eqx
    import jax

    from eqx_gpt import load_gpt2

    directory = Path(tempfile.mkdtemp(prefix="gpu-check-gpt2-"))
    reference = gpt2_folder(sizes, directory)
    model = load_gpt2(directory)
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    why_not = "torch or transformers is not installed"
    record.put(
        shape=sizes.gpt2_model,
        params_m=round(params / 1e6, 1),
        transformers=why_not if reference is None else "used",
    )
    prompt = np.random.default_rng(0).integers(0, GPT2_VOCAB, sizes.prompt).astype(np.int32)
    if reference is not None:
        same_logits(record, model, reference, prompt)
    compare_generation(record, sizes, model, reference, prompt)
    compare_training(record, sizes, directory, reference)
    if "torch" in sys.modules:  # give back what torch's allocator cached, for the stages after
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- dtype ---------------------------------------------------------------------------------------


def stage_dtype(record: Record, sizes: Sizes, args) -> None:
    import jax
    from common import flops_per_token

    from eqx_gpt import GPT

    # The char model alone: its three first steps take about 70 s to compile on an H200, and GPT-2's
    # three more would outrun the stage (its bf16 step is the gpt2 stage's).
    cases = {"shakespeare-char": (lambda dtype: char_config(sizes, dtype), sizes.char_batch)}
    peaks = peaks_of(record.path.parent)
    for name, (make_config, batch) in cases.items():
        train_config = train_config_of(name, batch)
        steps = {}
        # float32 twice: attention in our kernels (TF32 products, JAX's default precision) and on
        # the per-head XLA path. With IEEE float32 products (no tensor cores in Triton) the kernels
        # made the float32 step 30x the bf16 step on an H200; with TF32, 0.89x the per-head path's.
        variants = (("float32", "float32", None), ("float32_per_head", "float32", PER_HEAD_PATH),
                    ("bfloat16", "bfloat16", None))  # fmt: skip
        for label, dtype, patch in variants:
            config = make_config(dtype)
            batches = random_batches(config.vocab_size, batch, config.context_length + 1)
            steps[label] = EqxStep(GPT(config, key=jax.random.key(0)), train_config, batches)
            with patched(*patch) if patch else nullcontext():
                record.put(**{f"{name}_{label}_first_step_s": steps[label].first()})
        times = {label: [] for label in steps}
        for _ in range(sizes.rounds):  # interleaved, so that a change of clock hits both alike
            for dtype, step in steps.items():
                times[dtype] += time_blocks(step, step.sync, sizes.block, sizes.blocks)
        flops_step = flops_per_token(config) * batch * config.context_length  # the same in either dtype
        fp32_s, bf16_s = statistics.median(times["float32"]), statistics.median(times["bfloat16"])
        figures = dict(
            batch=batch, fp32_step_ms=median_ms(times["float32"]), bf16_step_ms=median_ms(times["bfloat16"]),
            fp32_per_head_attention_step_ms=median_ms(times["float32_per_head"]),
            bf16_over_fp32=round(bf16_s / fp32_s, 3),
            bf16_mfu_bf16=mfu(flops_step, bf16_s, peaks.get("bf16_tflops")),
            fp32_mfu_fp32=mfu(flops_step, fp32_s, peaks.get("fp32_tflops")),
        )  # fmt: skip
        record.put(**{name: figures})
        del steps  # its models and optimiser states, before the next case's


# --- variants ------------------------------------------------------------------------------------


@contextmanager
def patched(target: str, value):
    """`target` ("module:attribute") set to `value` within the block: a variant's step is traced
    (on its first call) inside it, and jit keeps what it traced."""
    import importlib

    module_name, attribute = target.split(":")
    module = importlib.import_module(module_name)
    saved = getattr(module, attribute)
    setattr(module, attribute, value)
    try:
        yield
    finally:
        setattr(module, attribute, saved)


# (what a variant replaces, with what), for `patched`.
CPU_LOSS_BOUNDS = (
    "eqx_gpt.model.loss:chunk_limits",
    lambda: __import__("eqx_gpt.model.loss").model.loss.CPU_LIMITS,
)
SCATTER_ADD = ("eqx_gpt.model.embedding:one_hot_gradient_default", lambda: False)
CUDNN_AT_RATE_0 = ("eqx_gpt.model.attention:KERNELS_WITHOUT_DROPOUT", False)
PER_HEAD_PATH = ("eqx_gpt.model.attention:flash_attention_available", lambda dtype, d_head: False)


def variant_cases(sizes: Sizes) -> dict:
    """Each model's step as timed elsewhere, and the variants that show where its time goes:
    {model: (preset, batch, config, {label: (config changes, batch, patch or None)})}."""
    char, gpt2 = char_config(sizes, "bfloat16"), gpt2_config(sizes, "bfloat16")
    return {
        "shakespeare-char": ("shakespeare-char", sizes.char_batch, char, {
            "dropout 0": (dict(dropout=0.0), sizes.char_batch, None),
            "dropout 0, cuDNN": (dict(dropout=0.0), sizes.char_batch, CUDNN_AT_RATE_0),
            "per-head dropout path": ({}, sizes.char_batch, PER_HEAD_PATH),
        }),
        "gpt2-124m": ("gpt2-124m", sizes.gpt2_batch, gpt2, {
            "cuDNN attention": ({}, sizes.gpt2_batch, CUDNN_AT_RATE_0),
            "layers rolled": (dict(scan_unroll=1), sizes.gpt2_batch, None),
            "CPU loss bounds": ({}, sizes.gpt2_batch, CPU_LOSS_BOUNDS),
            "batch x2": ({}, 2 * sizes.gpt2_batch, None),
        }),
    }  # fmt: skip


def stage_variants(record: Record, sizes: Sizes, args) -> None:
    """Where the bf16 step's time goes, each variant against the step as timed above (interleaved):
    shakespeare-char without dropout (in our kernels, and in cuDNN's), with dropout on the per-head
    path the kernels replace; GPT-2-124M with cuDNN's attention instead of ours, with its layers in a
    rolled scan (the CPU's way),
    with the CPU's loss bounds (393 blocks of 128 columns at 8 x 1,024 tokens: the first H200
    profile's largest cost) and at twice the batch. Each with its MFU of the bf16 peak."""
    import dataclasses

    import jax
    from common import flops_per_token

    from eqx_gpt import GPT

    peak = peaks_of(record.path.parent).get("bf16_tflops")
    for name, (preset, batch, config, changes) in variant_cases(sizes).items():
        variants = {"as timed": ({}, batch, None), **changes}
        steps, batches_of = {}, {}
        for label, (change, n, patch) in variants.items():
            c = dataclasses.replace(config, **change)
            steps[label] = EqxStep(GPT(c, key=jax.random.key(0)), train_config_of(preset, n),
                                   random_batches(c.vocab_size, n, c.context_length + 1))  # fmt: skip
            batches_of[label] = n
            with patched(*patch) if patch else nullcontext():
                steps[label].first()
        times = {label: [] for label in steps}
        for _ in range(sizes.rounds):
            for label, step in steps.items():
                times[label] += time_blocks(step, step.sync, sizes.block, sizes.blocks)
        base = statistics.median(times["as timed"])
        figures = {}
        for label, t in times.items():
            step_s = statistics.median(t)
            flops_step = flops_per_token(config) * batches_of[label] * config.context_length
            figures[label] = dict(step_ms=median_ms(t), over_as_timed=round(step_s / base, 3),
                                  mfu_bf16=mfu(flops_step, step_s, peak))  # fmt: skip
        record.put(**{name: figures})
        del steps


# --- profile -------------------------------------------------------------------------------------


def stage_profile(record: Record, sizes: Sizes, args) -> None:
    """The top kernels by device time of the bf16 steps timed above (JAX's profiler,
    `bench/gpu_profile.py`): where the time goes, for the next change to aim at."""
    import jax
    from gpu_profile import top_kernels

    from eqx_gpt import GPT

    cases = {"gpt2-124m": (gpt2_config(sizes, "bfloat16"), sizes.gpt2_batch),
             "shakespeare-char": (char_config(sizes, "bfloat16"), sizes.char_batch)}  # fmt: skip
    for name, (config, batch) in cases.items():
        step = EqxStep(GPT(config, key=jax.random.key(0)), train_config_of(name, batch),
                       random_batches(config.vocab_size, batch, config.context_length + 1))  # fmt: skip
        step.first()
        for _ in range(3):
            step.sync(step())
        profile = top_kernels(step, step.sync, steps=5, top=12)
        record.put(quiet=True, **{name: profile})
        print(f"  {name}: device time {profile['device_ms_per_step']} ms a step; its top kernels:")
        for kernel, ms, percent, calls in profile["kernels"]:
            print(f"    {ms:8.3f} ms {percent:5.1f}% x{calls:<6} {kernel}")
        del step


# --- determinism ---------------------------------------------------------------------------------


def same_bits(a, b) -> tuple[bool, int]:
    """Whether two models' arrays are equal bit for bit, and how many entries differ."""
    import equinox as eqx
    import jax

    leaves = zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_array)),
        jax.tree.leaves(eqx.filter(b, eqx.is_array)),
        strict=True,
    )
    differing = sum(
        int(np.sum(np.asarray(x).view(np.uint8) != np.asarray(y).view(np.uint8))) for x, y in leaves
    )
    return differing == 0, differing


def twice(config, preset: str, batch: int, steps: int, patch) -> tuple[bool, int, list[float]]:
    """Train two models built alike for `steps` steps on the same batches: whether they end equal
    bit for bit (and how many bytes differ), and the seconds per step of the second, timed."""
    import jax

    from eqx_gpt import GPT

    runs, times = [], []
    for _ in range(2):
        step = EqxStep(GPT(config, key=jax.random.key(0)), train_config_of(preset, batch),
                       random_batches(config.vocab_size, batch, config.context_length + 1))  # fmt: skip
        with patched(*patch) if patch else nullcontext():
            step.first()
        times = time_blocks(step, step.sync, steps, 1)
        runs.append(step.state[0])
    return (*same_bits(*runs), times)


def stage_determinism(record: Record, sizes: Sizes, args) -> None:
    """Exact resume's cost, both ways. In one process: two trainings of the bf16 step built alike
    end with the same bits (the embedding gradient as a fixed-order product, attention in our own
    kernel), while with XLA's scatter-add instead of the product they need not; and the step time
    of each. Then `train.py` again in a new process, compiling afresh with the first's autotuning
    results: the same losses, bit for bit? And `train.py` with XLA's global
    `--xla_gpu_deterministic_ops`, against the train stage's run without it: what the flag cost."""
    cases = {"shakespeare-char": (char_config(sizes, "bfloat16"), sizes.char_batch),
             "gpt2-124m": (gpt2_config(sizes, "bfloat16"), sizes.gpt2_batch)}  # fmt: skip
    for name, (config, batch) in cases.items():
        figures = {}
        variants = [("fixed order", None), ("XLA scatter-add", SCATTER_ADD)]
        if config.dropout == 0:  # attention in cuDNN's kernel instead of ours
            variants.append(("cuDNN attention", CUDNN_AT_RATE_0))
        for label, patch in variants:
            same, differing, times = twice(config, name, batch, 2 * sizes.block, patch)
            figures[label] = dict(same_bits=same, bytes_differing=differing, step_ms=median_ms(times))
        figures["cost"] = round(
            figures["fixed order"]["step_ms"] / figures["XLA scatter-add"]["step_ms"] - 1, 4
        )
        record.put(**{name: figures})
    train = record.path.parent / "train.json"
    first = json.loads(train.read_text()) if train.exists() else {}
    # The train stage's command again in a process of its own, compiling afresh: what a resumed run
    # is, as the tests stage checks steps grouped into calls in other ways. Its cache of programs is
    # empty but for XLA's autotuning results of the runs before (the first's among them), as
    # train.py's own cache keeps them: without them XLA may time other kernels faster this time.
    cache = Path(tempfile.mkdtemp(prefix="gpu-check-again-cache-"))
    programs = Path(os.environ.get("JAX_COMPILATION_CACHE_DIR", ""))
    autotuned = programs / "xla_gpu_per_fusion_autotune_cache_dir"
    if autotuned.is_dir():
        shutil.copytree(autotuned, cache / autotuned.name)
    record.put(again_autotune_results=len(list((cache / autotuned.name).glob("*"))))
    run_train(sizes, dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache)), record, "again_")
    if first.get("out_dir"):
        record.put(
            again_same_losses=logged_losses(Path(first["out_dir"]))
            == logged_losses(Path(record["again_out_dir"]))
        )
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
    flagged = run_train(sizes, dict(os.environ, XLA_FLAGS=flags), record, "global_flag_")
    default = first.get("tokens_per_s")
    record.put(
        tokens_per_s_default=default, tokens_per_s_global_flag=flagged,
        global_flag_cost=round(1 - flagged / default, 4) if default and flagged else None,
    )  # fmt: skip


def logged_losses(out_dir: Path) -> list:
    """Every loss a run logged, in order (training and validation), as metrics.jsonl holds them:
    Python's shortest round-trip text of each float, so equal lists mean equal bits."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r.get("step"), k, r[k]) for r in rows for k in sorted(r) if "loss" in k]


STAGES = {"peaks": stage_peaks, "tests": stage_tests, "train": stage_train, "nanogpt": stage_nanogpt,
          "gpt2": stage_gpt2, "dtype": stage_dtype, "variants": stage_variants, "profile": stage_profile,
          "determinism": stage_determinism}  # fmt: skip


def run(name: str, record: Record, sizes: Sizes, args) -> None:
    """Run stage `name` between the markers that `bench/gpu_check.py` times it by; an exception
    fails this stage alone (recorded, traceback printed) and the next one runs."""
    print(f"{BEGIN}{name}", flush=True)
    if args.deadline - time.time() < MIN_STAGE_S:
        record.put(status="skipped", reason=f"{args.deadline - time.time():.0f} s of the budget left")
    else:
        try:
            STAGES[name](record, sizes, args)
            record.put(status="ok")
        except (Exception, SystemExit) as e:
            traceback.print_exc()
            record.put(
                status="failed",
                reason=str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__,
            )
    print(f"{END}{name}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="the folder each stage's NAME.json goes to")
    p.add_argument("stages", nargs="+", choices=sorted(STAGES))
    p.add_argument("--deadline", type=float, default=float("inf"), help="time.time() the budget ends")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes (on the CPU)")
    args = p.parse_args(argv)
    for name in args.stages:
        run(name, Record(args.results / f"{name}.json"), DRY if args.dry_run else REAL, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
