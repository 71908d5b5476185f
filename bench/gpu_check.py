"""eqx_gpt on a GPU, in one call: the tests that mean most there, then its speed side by side with
PyTorch's nanoGPT and with `transformers`, within one time budget. `bench/gpu_check.sh` runs it.

    bash bench/gpu_check.sh --out "$OUT"                    # on a lent GPU: docs/PERFORMANCE.md
    JAX_PLATFORMS=cpu bash bench/gpu_check.sh --dry-run     # the same stages at tiny sizes, on the CPU

The stages (`bench/gpu_stages.py`) run in turn in one process, each with its own time limit, the
budget left shared in order: peaks, tests, nanogpt, gpt2, train, dtype, determinism, profile, variants
(the targets' stages first). A stage that fails is marked
so and the next one starts; one that outruns its limit is stopped with its process, and a new
process runs the rest; whatever happens, one summary table is printed last and
written with every figure to OUT/gpu_check.json, and all output to OUT/gpu_check.log.
"""

import argparse
import datetime
import json
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from gpu_stages import BEGIN, END  # noqa: E402 (bench/gpu_stages.py: imports no JAX at the top)


@dataclass(frozen=True)
class Stage:
    name: str
    limit_s: float  # at most this long (within the budget left when it begins)
    what: str


# The limits fit one call of at most 8 minutes on an H100 with room to spare: they add up to more
# than the budget, which goes to the stages in this order (those that finish early leave theirs).
STAGES = [
    Stage("peaks", 40, "bf16 and fp32 matmul rates of the device (MFU's denominators)"),
    Stage("tests", 150, "model and sampling equivalence, training exactness, the attention kernel, bf16"),
    Stage("nanogpt", 120, "the shakespeare-char step against nanoGPT's, torch.compile, bf16"),
    Stage("gpt2", 120, "GPT-2-124M's shapes against transformers: generation and a bf16 step"),
    Stage("train", 120, "train.py --preset shakespeare-char for a fixed number of steps"),
    Stage("dtype", 110, "the char step at float32 (attention in our kernels, and per head) against bf16"),
    Stage("determinism", 150, "exact resume's cost: fixed-order kernels against XLA's, and the global flag"),
    Stage("profile", 60, "the top kernels by device time of the bf16 steps"),
    Stage("variants", 120, "where the bf16 step's time goes: dropout, layer loop, loss bounds, batch"),
]
TARGETS = [
    # (stage, figure, how it compares, target, what)
    ("nanogpt", "ratio", "<=", 1.0, "shakespeare-char step / nanoGPT's compiled step"),
    ("gpt2", "train_mfu_bf16.eqx_gpt", ">=", 0.40, "GPT-2-124M bf16 training MFU of bf16 peak"),
    ("gpt2", "generation_ratio", ">=", 1.5, "generation tokens/s / transformers'"),
    ("determinism", "shakespeare-char.cost", "<=", 0.05, "exact resume's cost in the char step"),
    (
        "determinism",
        "shakespeare-char.fixed order.same_bits",
        "==",
        True,
        "two char trainings alike, same bits",
    ),
    ("determinism", "gpt2-124m.fixed order.same_bits", "==", True, "two GPT-2 trainings alike, same bits"),
    (
        "determinism",
        "again_same_losses",
        "==",
        True,
        "train.py twice, compiled afresh with the autotuning kept, same losses",
    ),
]


class Watcher:
    """Copies a stages process's output, line by line, to stdout and the log, each line prefixed
    with its stage, and notes which stage runs since when (from `gpu_stages`' marker lines)."""

    def __init__(self, process: subprocess.Popen, log):
        self.process, self.log = process, log
        self.current: tuple[str, float] | None = None  # (stage, monotonic time it began)
        self.begun: dict[str, float] = {}  # stage -> seconds it ran (so far)
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self):
        for line in self.process.stdout:
            line = line.rstrip()
            if line.startswith(BEGIN):
                self.current = (line[len(BEGIN) :], time.monotonic())
                self.begun[self.current[0]] = 0.0
            elif line.startswith(END) and self.current:
                self.begun[self.current[0]] = round(time.monotonic() - self.current[1], 1)
                self.current = None
            text = f"[{self.current[0] if self.current else 'gpu_check'}] {line}"
            print(text, flush=True)
            self.log.write(text + "\n")
            self.log.flush()


def run_stages(stages: list[Stage], deadline: float, work: Path, dry_run: bool, env: dict, log) -> dict:
    """Run `stages` in one `gpu_stages` process; one that outruns its limit (its own, or the budget
    left when it begins) is stopped with the process, and a new process runs the rest. Returns each
    stage's figures with its status, seconds and limit."""
    results, pending = {}, list(stages)
    limits = {s.name: s.limit_s for s in stages}
    while pending:
        cmd = [sys.executable, str(ROOT / "bench" / "gpu_stages.py"), str(work), *(s.name for s in pending),
               "--deadline", str(time.time() + deadline - time.monotonic())]  # fmt: skip
        process = subprocess.Popen(cmd + ["--dry-run"] * dry_run, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        watcher, stopped = Watcher(process, log), None
        while process.poll() is None:
            time.sleep(0.2)
            current = watcher.current
            limit = current and min(limits[current[0]], deadline - current[1])
            if current and time.monotonic() - current[1] > limit:
                os.killpg(process.pid, signal.SIGKILL)  # the stage and whatever it started
                stopped = (current[0], limit)
                watcher.begun[current[0]] = round(time.monotonic() - current[1], 1)
        process.wait()
        watcher.thread.join(timeout=5)
        for stage in list(pending):
            if stage.name not in watcher.begun:
                break  # not reached: the next process starts here
            pending.remove(stage)
            path = work / f"{stage.name}.json"
            figures = json.loads(path.read_text()) if path.exists() else {}
            if stopped and stage.name == stopped[0]:
                figures.update(status="timed out", reason=f"stopped at its limit of {stopped[1]:.0f} s")
            elif "status" not in figures:
                figures.update(status="failed", reason=f"its process ended (exit {process.returncode})")
            results[stage.name] = {"status": figures.pop("status"), "seconds": watcher.begun[stage.name],
                                   "limit_s": limits[stage.name], **figures}  # fmt: skip
        if process.returncode != 0 and stopped is None and not watcher.begun:
            break  # the process died before its first stage: another would too
    for stage in pending:
        results[stage.name] = {"status": "skipped", "reason": "the stages process ended before it"}
    return results


def figure(stages: dict, stage: str, path: str):
    value = stages.get(stage, {})
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def judge(stages: dict, dry_run: bool) -> list[dict]:
    """Each target with the figure measured for it and whether it is met (never on a dry run)."""
    judged = []
    for stage, path, how, target, what in TARGETS:
        value = figure(stages, stage, path)
        compare = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}[how]
        met = None if value is None else compare(value, target)
        verdict = (
            "not judged (dry run)"
            if dry_run
            else "not measured"
            if met is None
            else "met"
            if met
            else "MISSED"
        )
        judged.append({"target": f"{what} {how} {target}", "value": value, "verdict": verdict})
    return judged


def headline(name: str, r: dict) -> str:
    """The stage's main figures in one line of the summary table."""
    g = lambda key, default=None: r.get(key, default)
    if name == "peaks":
        return (f"{g('device')} ({g('backend')}): TFLOP/s bf16 {g('bf16_tflops')}, fp32 {g('fp32_tflops')} "
                f"(default precision), fp32 highest {g('fp32_highest_tflops')}")  # fmt: skip
    if name == "tests":
        return (f"{g('passed')} passed, {g('failed')} failed, {g('skipped')} skipped of {g('collected')} "
                f"collected ({g('ran')} run)")  # fmt: skip
    if name == "train":
        return (f"{g('steps')} steps in {g('compute_dtype')}, {g('tokens_per_s')} tok/s, "
                f"MFU {g('mfu_fp32')} of fp32 peak, {g('mfu_bf16')} of bf16; "
                f"final val {g('final_val_loss')}")  # fmt: skip
    if name == "nanogpt":
        theirs = g("torch_compiled_step_ms", g("torch"))
        return f"ms/step eqx_gpt {g('eqx_step_ms')}, nanoGPT compiled {theirs}: ratio {g('ratio')}"
    if name == "gpt2":
        return (f"generation tok/s {g('generation_tok_s')}, ratio {g('generation_ratio')}; bf16 step ms "
                f"{g('train_step_ms')}, MFU {g('train_mfu_bf16')}")  # fmt: skip
    if name == "dtype":
        cases = ((case, v) for case, v in r.items() if isinstance(v, dict))
        return "; ".join(
            f"{case} ms/step fp32 {v.get('fp32_step_ms')} (per-head attention "
            f"{v.get('fp32_per_head_attention_step_ms')}), bf16 {v.get('bf16_step_ms')}: ratio "
            f"{v.get('bf16_over_fp32')}"
            for case, v in cases
        )
    cases = {case: v for case, v in r.items() if isinstance(v, dict)}
    if name == "variants":
        return "; ".join(
            f"{case} "
            + ", ".join(
                f"{label} {v.get('step_ms')} ms ({v.get('over_as_timed')}x, MFU {v.get('mfu_bf16')})"
                for label, v in variants.items()
            )
            for case, variants in cases.items()
        )
    if name == "profile":
        return "; ".join(
            f"{case} {v.get('device_ms_per_step')} ms a step on the device, top: "
            + ", ".join(f"{k[0][:40]} {k[1]} ms ({k[2]}%)" for k in v.get("kernels", [])[:4])
            for case, v in cases.items()
        )
    if name == "determinism":
        text = "; ".join(
            f"{case} "
            + ", ".join(
                f"{label} {r['step_ms']} ms (same bits {r['same_bits']})"
                for label, r in v.items()
                if isinstance(r, dict)
            )
            + f": cost {v.get('cost')}"
            for case, v in cases.items()
        )
        return (f"{text}; train.py again, compiled afresh with "
                f"{g('again_autotune_results')} autotuning results kept: "
                f"same losses {g('again_same_losses')}; "
                f"train.py tok/s {g('tokens_per_s_default')}, with the global flag "
                f"{g('tokens_per_s_global_flag')}: its cost {g('global_flag_cost')}")  # fmt: skip
    return ""


def summary(report: dict) -> str:
    device = report["stages"].get("peaks", {}).get("device", "?")
    run = "DRY RUN " if report["dry_run"] else ""
    lines = [f"gpu_check {run}{report['date']} commit {report['commit']}: {device}, CPU {report['cpu']}"]
    lines.append(f"{'stage':8s} {'status':22s} {'s':>6s}  figures")
    for name, r in report["stages"].items():
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        try:
            figures = "" if r["status"] == "skipped" else headline(name, r)
        except Exception as e:  # a figure of an unexpected kind: the JSON still holds it
            figures = f"(see gpu_check.json: {type(e).__name__})"
        lines.append(f"{name:8s} {status:22s} {r.get('seconds', 0):6.1f}  {figures}")
    for t in report["targets"]:
        lines.append(f"target: {t['target']}: {t['value']} -> {t['verdict']}")
    return "\n".join(lines)


def cpu_model() -> str:
    """The host CPU's model and core count (the peaks stage records its SIMD flags too)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


def commit() -> str:
    """The checked-out commit, `+` where the working tree differs; "unknown" without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (no git)"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def cheap_cpu_compiles() -> list[str]:
    """jaxlib 0.10's flags for cheaper CPU compiles (tests/conftest.py says why); none on other
    versions, whose XLA aborts on a flag it does not know."""
    try:
        version = metadata.version("jaxlib").split(".")[:2]
    except metadata.PackageNotFoundError:
        return []
    return ["--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"] * (
        version == ["0", "10"]
    )


def write_json(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")


def stage_env(cache: Path, dry_run: bool) -> dict:
    # One compilation cache for the run: a program that two stages build is compiled once.
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(cache))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if dry_run:  # the dry run's time is XLA compiling: compile cheaply, as tests/conftest.py does
        env.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *cheap_cpu_compiles()]).strip()
    paths = [str(ROOT), str(ROOT / "bench"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # JAX takes at most half of the GPU's memory, so that torch has room beside it in one process.
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, on the CPU (JAX_PLATFORMS=cpu)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or "out/gpu-check"),
        help="folder for gpu_check.json and gpu_check.log (default: $OUT, else out/gpu-check)",
    )
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all stages (default 450)")
    p.add_argument("--stages", nargs="+", choices=[s.name for s in STAGES], help="only these stages")
    p.add_argument("--commit", help="the commit to record (default: git's, where there is a .git)")
    p.add_argument("--wheels", default="", help="what bench/gpu_check.sh installed (recorded)")
    args = p.parse_args(argv)
    budget = args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    env = stage_env(work / "jax-cache", args.dry_run)
    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": args.commit or commit(), "dry_run": args.dry_run, "budget_s": budget,
        "cpu": cpu_model(), "load_average": os.getloadavg(), "wheels": args.wheels,
        "python": sys.version.split()[0], "stages": {},
    }  # fmt: skip
    deadline = time.monotonic() + budget
    stages = [s for s in STAGES if not args.stages or s.name in args.stages]
    print(f"gpu_check: {len(stages)} stages in at most {budget:.0f} s: "
          + "; ".join(f"{s.name} ({s.what})" for s in stages), flush=True)  # fmt: skip
    with open(args.out / "gpu_check.log", "w") as log:
        report["stages"] = run_stages(stages, deadline, work, args.dry_run, env, log)
        report["targets"] = judge(report["stages"], args.dry_run)
        report["load_average_after"] = os.getloadavg()
        text = summary(report)
        log.write(text + "\n")
    write_json(args.out, report)
    shutil.rmtree(work, ignore_errors=True)
    print(text, flush=True)
    print(f"wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.log'}", flush=True)
    return 0 if all(r["status"] == "ok" for r in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
