"""`bench/gpu_check.sh --dry-run`: the GPU check's every stage, at tiny sizes on the CPU, so that the
script cannot rot between the rare runs on a lent GPU (docs/PERFORMANCE.md, "On a GPU")."""

import base64
import hashlib
import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["peaks", "tests", "nanogpt", "gpt2", "train", "dtype", "determinism", "profile", "variants"]


def probe_wheel(folder: Path) -> Path:
    """A one-module wheel, standing for the wheels carried to the GPU (beartype there)."""
    info = "gpu_check_probe-0.1.dist-info"
    files = {
        "gpu_check_probe/__init__.py": b"CARRIED = True\n",
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 0.1\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    digest = lambda data: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n" for name, data in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    folder.mkdir()
    path = folder / "gpu_check_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    probe_wheel(tmp / "wheels")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable)
    cmd = [
        "bash",
        "bench/gpu_check.sh",
        "--dry-run",
        "--out",
        str(tmp / "out"),
        "--wheels",
        str(tmp / "wheels"),
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    report = json.loads((tmp / "out" / "gpu_check.json").read_text())
    return out, report, (tmp / "out" / "gpu_check.log").read_text()


@pytest.mark.slow
def test_every_stage_runs_and_the_summary_is_printed_and_written(dry_run):
    out, report, log = dry_run
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert report["dry_run"] is True
    assert list(report["stages"]) == STAGES
    for name, stage in report["stages"].items():
        assert stage["status"] == "ok", (name, stage)
    table = out.stdout[out.stdout.index("gpu_check DRY RUN") : out.stdout.index("\nwrote ")]
    assert all(f"\n{name} " in table for name in STAGES) and table in log
    assert [t["verdict"] for t in report["targets"]] == ["not judged (dry run)"] * 7


@pytest.mark.slow
def test_each_stage_measured_what_it_measures_on_a_gpu(dry_run):
    _, report, _ = dry_run
    s = report["stages"]
    assert s["peaks"]["backend"] == "cpu" and s["peaks"]["bf16_tflops"] > 0 and s["peaks"]["fp32_tflops"] > 0
    # The whole selection is collected (a test that moved would fail here); one runs.
    assert s["tests"]["collected"] > 100 and s["tests"]["passed"] == 1 and s["tests"]["failed"] == 0
    assert (
        s["train"]["steps"] == 2
        and math.isfinite(s["train"]["final_val_loss"])
        and s["train"]["mfu_fp32"] > 0
    )
    assert s["nanogpt"]["eqx_step_ms"] > 0 and s["nanogpt"]["eqx_mfu_bf16"] > 0
    assert "ratio" in s["nanogpt"] or s["nanogpt"]["torch"] == "torch is not installed"
    assert s["gpt2"]["generation_tok_s"]["eqx_gpt"] > 0 and s["gpt2"]["train_mfu_bf16"]["eqx_gpt"] > 0
    dtype = s["dtype"]["shakespeare-char"]  # the char model alone (GPT-2's would outrun the stage)
    assert min(dtype["fp32_step_ms"], dtype["fp32_per_head_attention_step_ms"], dtype["bf16_step_ms"]) > 0
    assert s["train"]["compute_dtype"] == "float32"  # on a CPU the preset keeps float32; bf16 is a GPU's
    assert s["determinism"]["again_same_losses"] is True
    assert s["variants"]["shakespeare-char"]["as timed"]["over_as_timed"] == 1.0
    assert s["variants"]["shakespeare-char"]["dropout 0"]["step_ms"] > 0
    for label in ("layers rolled", "CPU loss bounds", "batch x2"):
        assert s["variants"]["gpt2-124m"][label]["step_ms"] > 0
    for case in ("shakespeare-char", "gpt2-124m"):
        d = s["determinism"][case]
        assert (
            d["fixed order"]["same_bits"] is True and d["XLA scatter-add"]["step_ms"] > 0
        )  # a CPU adds in order
        assert isinstance(d["cost"], float)
        profile = s["profile"][case]
        assert profile["device_ms_per_step"] > 0 and len(profile["kernels"]) > 3
        assert all(isinstance(name, str) and ms >= 0 for name, ms, _, _ in profile["kernels"])
    assert s["determinism"]["tokens_per_s_default"] == s["train"]["tokens_per_s"]
    assert s["determinism"]["again_same_losses"] is True  # one CPU process and the next: the same bits
    assert (
        s["determinism"]["global_flag_tokens_per_s"] > 0 and s["determinism"]["global_flag_cost"] is not None
    )


@pytest.mark.slow
def test_the_carried_wheels_are_installed_without_the_network(dry_run):
    out, report, _ = dry_run
    assert "installed 1 wheel(s)" in out.stdout and report["wheels"] == "gpu_check_probe-0.1-py3-none-any.whl"
    assert "gpu_check: importable from the wheels: gpu_check_probe\n" in out.stdout
