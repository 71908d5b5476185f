"""The commands' cache of compiled programs (`eqx_gpt/commands/compile_cache.py`): where it lives,
and that `train`, `sample` and `serve` keep their programs in it (on a GPU, what makes a resumed run compile
the step to the same kernels)."""

import os
import subprocess
import sys

import pytest

import eqx_gpt.commands.sample as sample_command
import eqx_gpt.commands.serve as serve_command
import eqx_gpt.commands.train as train_command

# Enables the cache, compiles a program worth keeping, prints the folder enable_compilation_cache named.
_PROGRAM = """
import jax, jax.numpy as jnp
from eqx_gpt.commands.compile_cache import enable_compilation_cache
print(enable_compilation_cache())
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
"""


def _run(env_changes: dict, tmp_path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "JAX_PERSISTENT"))}
    env.update(env_changes, JAX_PLATFORMS="cpu")
    run = subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.slow  # three new Python processes, each importing JAX; the next test is the quick one
def test_programs_go_to_the_user_s_cache_folder_unless_the_environment_names_one(tmp_path):
    xdg, named = tmp_path / "xdg", tmp_path / "named"
    assert _run({"XDG_CACHE_HOME": str(xdg)}, tmp_path) == str(xdg / "eqx_gpt" / "jax")
    assert any((xdg / "eqx_gpt" / "jax").iterdir())  # the quick program too: no minimum compile time
    assert _run({"XDG_CACHE_HOME": str(xdg), "JAX_COMPILATION_CACHE_DIR": str(named)}, tmp_path) == str(named)
    assert any(named.iterdir())
    # A minimum compile time the environment gives wins: this program is too quick to keep.
    elsewhere = tmp_path / "elsewhere"
    changes = {
        "JAX_COMPILATION_CACHE_DIR": str(elsewhere),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "60",
    }
    assert _run(changes, tmp_path) == str(elsewhere)
    assert not elsewhere.exists() or not any(elsewhere.iterdir())


def test_train_sample_and_serve_enable_it_before_they_compile(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(train_command, "enable_compilation_cache", lambda: calls.append("train"))
    monkeypatch.setattr(sample_command, "enable_compilation_cache", lambda: calls.append("sample"))
    monkeypatch.setattr(serve_command, "enable_compilation_cache", lambda: calls.append("serve"))
    # Each refuses its input after enabling it (a missing corpus, a missing checkpoint): nothing compiled.
    assert (
        train_command.main(["--data", str(tmp_path / "missing.txt"), "--out-dir", str(tmp_path / "run")]) == 2
    )
    assert sample_command.main(["--checkpoint", str(tmp_path / "no-run")]) == 2
    assert serve_command.main(["--checkpoint", str(tmp_path / "no-run")]) == 2
    assert calls == ["train", "sample", "serve"]
    capsys.readouterr()
