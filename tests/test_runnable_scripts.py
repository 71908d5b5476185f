"""Code that nothing runs rots (issue 53: `bench/vs_pytorch.py` stopped at a config with dropout
after the dropout contract changed). Every `bench/*.py` and `examples/*.py` runs here, in its
smallest setting, as a user starts it: a child process from the repository root. A script that
needs a package the project does not install (torch, transformers, grain: they run in throwaway
environments) is skipped with that reason when the package is absent.

A new bench or example adds one row to `SMOKE`: its arguments, and the packages it needs. The test
refuses a script without a row, so none is added without being run.
"""

import importlib.util
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIKTOKEN = os.environ.get("TIKTOKEN_CACHE_DIR")

# script -> (arguments; "{tmp}" is a fresh folder, packages it needs beyond the project's install).
# None: not a script (a module the benches import, or a child that a bench starts).
SMOKE: dict[str, tuple[list[str], tuple[str, ...]] | None] = {
    "bench/common.py": None,  # what the training benches share
    "bench/torch_gpt.py": None,  # the PyTorch child of vs_pytorch.py, run through it
    "bench/gpu_check.py": None,  # run by bench/gpu_check.sh --dry-run in tests/test_gpu_check.py
    "bench/gpu_stages.py": None,  # the stages' child of gpu_check.py, run through it
    "bench/gpu_profile.py": None,  # the profile stage's reader of JAX's trace, run through gpu_check
    "bench/bpe_step.py": (["--smoke"], ()),
    "bench/compile_layers.py": (["--smoke"], ()),
    "bench/data_grain.py": (["--smoke"], ("grain",)),
    "bench/data_path.py": (["--smoke"], ()),
    "bench/flash_attention.py": (["--smoke"], ()),
    "bench/recipe_step.py": (["--smoke"], ()),
    "bench/sample.py": (["--smoke"], ()),
    "bench/trackers.py": (["--step-ms", "85", "--calls", "2", "--warmup", "1"], ("tensorboardX", "wandb")),
    "bench/lora_step.py": (["--smoke"], ()),
    "bench/serve.py": (["--smoke"], ("uvicorn", "httpx")),
    "bench/train.py": (["--smoke"], ()),
    "bench/train_default.py": (["--smoke", "--out-dir", "{tmp}/default"], ()),
    "bench/vs_pytorch.py": (["--smoke", "--configs", "nanogpt-cpu", "shakespeare-char"], ("torch",)),
    "bench/vs_transformers.py": (["--smoke"], ("torch", "transformers")),
    "examples/translate.py": (
        [
            "--minutes",
            "0",
            "--max-steps",
            "2",
            "--d-model",
            "8",
            "--layers",
            "1",
            "--batch-size",
            "4",
            "--held-out",
            "4",
            "--out-dir",
            "{tmp}/translate",
        ],
        (),
    ),  # fmt: skip
}


def _scripts() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for d in ("bench", "examples") for p in (ROOT / d).glob("*.py"))


def test_every_bench_and_example_has_a_smoke_setting():
    missing = [script for script in _scripts() if script not in SMOKE]
    assert not missing, f"add a row to SMOKE for {missing}"
    gone = [script for script in SMOKE if not (ROOT / script).exists()]
    assert not gone, f"SMOKE names scripts that are gone: {gone}"


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in _scripts() if SMOKE.get(s) is not None])
def test_the_script_runs_in_its_smallest_setting(script, tmp_path):
    arguments, needs = SMOKE[script]
    absent = [name for name in needs if importlib.util.find_spec(name) is None]
    if absent:
        pytest.skip(
            f"{script} needs {', '.join(absent)}, which the project does not install (a throwaway env)"
        )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, script, *(a.replace("{tmp}", str(tmp_path)) for a in arguments)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"{script}: {cpu_s:.1f} CPU seconds")  # what it costs CI, whatever else the machine runs
    assert proc.returncode == 0, (
        f"{script} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
