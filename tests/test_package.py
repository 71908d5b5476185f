"""The package as a user meets it: its public names, the README's Python training example, the
commands of `python -m eqx_gpt`, and a wheel installed in a fresh environment."""

import dataclasses
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from doc_blocks import DOCS, python_blocks

import eqx_gpt

ROOT = Path(__file__).resolve().parents[1]


def _readme_block(heading: str) -> str:
    """The first ```python block after `heading` in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    after = text[text.index(heading) :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```\n", start)]


def _env() -> dict:
    """The environment of a user's process: no test-only paths, this checkout not importable by accident."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_XDIST_WORKER")}


def test_every_public_name_resolves_and_nothing_private_or_a_test_oracle_is_exported():
    assert len(set(eqx_gpt.__all__)) == len(eqx_gpt.__all__)
    assert all(hasattr(eqx_gpt, name) for name in eqx_gpt.__all__)
    assert not [name for name in eqx_gpt.__all__ if name.startswith("_")]
    assert "naive_generate" not in eqx_gpt.__all__
    wanted = {"train", "TrainConfig", "TrainResult", "PRESETS", "evaluate", "Evaluation", "load_gpt2",
              "save_gpt2", "prepare", "Corpus", "load_model", "save_checkpoint", "generate",
              "EqxGptError"}  # fmt: skip
    assert wanted <= set(eqx_gpt.__all__)
    errors = [getattr(eqx_gpt, name) for name in eqx_gpt.__all__ if name.endswith("Error")]
    assert all(isinstance(e, type) and issubclass(e, eqx_gpt.EqxGptError) for e in errors), errors


def test_the_guide_lists_every_public_name():
    text = (ROOT / "docs" / "GUIDE.md").read_text(encoding="utf-8")
    table = text[text.index("## Public API") :].split("\n## ", 1)[0]
    assert not [name for name in eqx_gpt.__all__ if f"`{name}`" not in table]


def test_train_takes_typed_configs_and_no_dict():
    parameters = inspect.signature(eqx_gpt.train).parameters
    assert "dict" not in str(parameters["config"].annotation) and "dict" not in str(
        parameters["model"].annotation
    )
    with pytest.raises(TypeError, match="config must be a TrainConfig, got dict"):
        eqx_gpt.train({"max_steps": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['max_stepz'\]"):
        eqx_gpt.train(max_stepz=3)
    assert {f.name for f in dataclasses.fields(eqx_gpt.TrainResult)} >= {"model", "tokenizer", "val_loss"}


@pytest.mark.slow  # a whole training run in a new process, as a user runs the README's example
def test_the_readme_example_trains_from_python_in_an_empty_folder(tmp_path):
    code = _readme_block("### Train from Python")
    assert "from eqx_gpt import" in code and "train(" in code
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 40: val loss" in proc.stdout
    records = [
        json.loads(line) for line in (tmp_path / "tiny-run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert records[-1]["step"] == 40 and "final_val_loss" in records[-1]
    # The recipe the README benchmarks: the cpu preset's Muon, with the fields the config was given.
    train_config = json.loads((tmp_path / "tiny-run" / "latest.json").read_text())["train_config"]
    assert train_config["optimizer"] == "muon" and train_config["max_steps"] == 40
    assert "settings: the cpu preset, with max_steps=40" in proc.stdout


def test_python_m_eqx_gpt_names_its_commands_and_refuses_another(capsys):
    from eqx_gpt.__main__ import main

    assert main([], prog="python -m eqx_gpt") == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m eqx_gpt [--version] [--help] <command>")
    assert "error: name a command: train, sample, evaluate, export, serve" in err
    assert main(["fly"], prog="python -m eqx_gpt") == 2
    assert capsys.readouterr().err == (
        "python -m eqx_gpt: error: unknown command 'fly'; choose one of train, sample, evaluate, export, "
        "serve (see --help)\n"
    )
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"], prog="python -m eqx_gpt")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m eqx_gpt train")


def test_the_console_script_calls_itself_eqx_gpt_and_has_help_and_version(capsys, monkeypatch):
    """Issue 53: `eqx-gpt` named itself `python -m eqx_gpt`, took `--version` for a command and
    said nothing of what its commands do."""
    from eqx_gpt.__main__ import main
    from eqx_gpt.commands import COMMANDS

    monkeypatch.setattr(sys, "argv", ["/venv/bin/eqx-gpt", "--help"])
    assert main() == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: eqx-gpt [--version] [--help] <command> [flags]\n")
    for name, line in COMMANDS.items():  # one line each, as `git --help` lists its commands
        assert any(row.split()[:1] == [name] and row.endswith(line) for row in out.splitlines()), name
    assert "--version" in out and "python -m" not in out
    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        assert capsys.readouterr().out == f"eqx_gpt {metadata.version('eqx_gpt')}\n"
    assert main(["fly"]) == 2
    assert capsys.readouterr().err.startswith("eqx-gpt: error: unknown command 'fly'")
    with pytest.raises(SystemExit) as exit_:
        main(["sample", "--bogus"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "eqx-gpt sample: error: unrecognized arguments: --bogus (see --help)\n"


def _user_env() -> dict:
    env = _env()
    env.pop("VIRTUAL_ENV", None)
    return env


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory) -> tuple[Path, Path]:
    """`(wheel, python)`: the wheel built from this checkout, installed with the locked versions of
    its dependencies (uv's cache holds them) into a fresh environment on this Python."""
    if shutil.which("uv") is None:
        pytest.skip("needs uv")
    tmp = tmp_path_factory.mktemp("wheel")
    dist, venv, env = tmp / "dist", tmp / "venv", _user_env()

    def uv(*args: str) -> None:
        proc = subprocess.run(["uv", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    uv("build", "--wheel", "--out-dir", str(dist))
    (wheel,) = dist.glob("eqx_gpt-*.whl")
    requirements = str(tmp / "requirements.txt")
    # With the `serve` extra: issue 57's check serves a model of one's own from the wheel.
    uv("export", "--frozen", "--no-default-groups", "--extra", "serve", "--no-emit-project", "--no-hashes",
       "-o", requirements)  # fmt: skip
    uv("venv", "--quiet", "--python", sys.executable, str(venv))
    python = venv / "bin" / "python"
    uv("pip", "install", "--quiet", "--python", str(python), "-r", requirements, str(wheel))
    return wheel, python


@pytest.mark.slow
def test_a_wheel_in_a_fresh_environment_trains_and_samples_from_any_folder(installed_wheel, tmp_path):
    _, python = installed_wheel
    venv, work, env = python.parents[1], tmp_path / "elsewhere", _user_env()
    work.mkdir()

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(python), "-m", "eqx_gpt", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip

    tiny = ["--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--batch-size", "8", "--max-steps", "4",
            "--eval-interval", "4", "--eval-tokens", "2048", "--max-minutes", "0",
            "--sample-tokens", "0"]  # fmt: skip
    trained = command("train", *tiny, "--out-dir", "run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (work / "run" / "latest.json").exists()
    sampled = command("sample", "--checkpoint", "run", "--prompt", "ROMEO:", "--max-new-tokens", "20")
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.startswith("ROMEO:") and len(sampled.stdout) > len("ROMEO:")
    bad = command("sample", "--checkpoint", "nowhere")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    script = subprocess.run([str(venv / "bin" / "eqx-gpt"), "evaluate", "--checkpoint", "run"], cwd=work,
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert script.returncode == 0 and "the validation split of Tiny Shakespeare" in script.stdout, (
        script.stderr
    )


@pytest.mark.slow
def test_a_fresh_project_trains_its_own_decoder_from_the_wheel_and_passes_pyright(installed_wheel, tmp_path):
    """Issue 57's check: a project of one's own holding the GUIDE's `mydec.py` (a RoPE + SwiGLU
    decoder of public parts) trains it with `python -m eqx_gpt train --model mydec:make_decoder`,
    samples it, and its code (the model, `apply_lora` on it) passes pyright against the wheel."""
    _, python = installed_wheel
    work, env = tmp_path / "project", _user_env()
    work.mkdir()
    text = (ROOT / "docs" / "GUIDE.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Your own model, end to end\n") :]
    (work / "mydec.py").write_text(python_blocks(section)[0], encoding="utf-8")
    (work / "use.py").write_text(
        "import jax\nfrom eqx_gpt import LanguageModel, LoRALinear, apply_lora\n"
        "from mydec import MyDecoder, make_decoder\n\n"
        "model: LanguageModel = make_decoder(65, key=jax.random.key(0))\n"
        "adapted: MyDecoder = apply_lora(make_decoder(65, key=jax.random.key(0)), 4, key=jax.random.key(1))\n"
        "assert isinstance(adapted.blocks[0].attn.qkv, LoRALinear)\n",
        encoding="utf-8",
    )

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(python), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )

    trained = command("-m", "eqx_gpt", "train", "--model", "mydec:make_decoder", "--max-steps", "20",
                      "--max-minutes", "0", "--batch-size", "8", "--eval-interval", "10",
                      "--eval-tokens", "2048", "--sample-tokens", "0", "--out-dir", "run")  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "a MyDecoder (--model mydec:make_decoder)" in trained.stdout
    sampled = command(
        "-m", "eqx_gpt", "sample", "--checkpoint", "run", "--prompt", "ROMEO:", "--max-new-tokens", "9"
    )
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr[-3000:]
    served_by_the_command_line(python, work, env)
    assert command("use.py").returncode == 0
    (work / "pyrightconfig.json").write_text(json.dumps({"typeCheckingMode": "standard"}), encoding="utf-8")
    pyright = Path(sys.executable).with_name("pyright")
    proc = subprocess.run([str(pyright), "--pythonpath", str(python), "mydec.py", "use.py"], cwd=work,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "0 errors" in proc.stdout, proc.stdout[-3000:]


def served_by_the_command_line(python: Path, work: Path, env: dict) -> None:
    """`python -m eqx_gpt serve --checkpoint run` in the project's folder (where `mydec` imports
    from) answers OpenAI's client, and `/v1/inspect` gives the attention it finds by type."""
    import httpx
    import numpy as np
    import openai
    from serve_fixtures import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["-m", "eqx_gpt", "serve", "--checkpoint", "run", "--name", "mydec", "--port", str(port)]
    process = subprocess.Popen([str(python), *serve], cwd=work, env=env, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1800):  # bounded: 180 s to import, load and answer
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.communicate()[1][-3000:]
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
        assert [m.id for m in client.models.list().data] == ["mydec"]
        answer = client.completions.create(model="mydec", prompt="ROMEO:", max_tokens=8, seed=1)
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        body = {"prompt": "ROMEO:", "layer": 0, "head": 0}
        seen = httpx.post(f"{url}/v1/inspect", json=body, timeout=120).json()
        attention = np.asarray(seen["attention"])
        assert seen["attention_absent"] is None and attention.shape == (6, 6)
        np.testing.assert_allclose(attention.sum(axis=1), 1.0, atol=1e-3)
    finally:
        process.terminate()
        process.wait(timeout=60)


# What the docs' Python imports beside eqx_gpt and its dependencies: the client of `eqx-gpt serve`.
DOC_CLIENTS = ("openai",)


@pytest.mark.slow
def test_the_wheel_is_typed_and_the_docs_python_passes_pyright_downstream(installed_wheel, tmp_path):
    # A downstream project: every ```python block of the README and the guide in one file, checked
    # by pyright (standard, and a missing stub an error) against the installed wheel, not this
    # checkout. Without py.typed pyright would report eqx_gpt as untyped ("Stub file not found").
    wheel, python = installed_wheel
    assert "eqx_gpt/py.typed" in zipfile.ZipFile(wheel).namelist()
    blocks = [f"# {doc.name}, block {i}\n{block}" for doc in DOCS
              for i, block in enumerate(python_blocks(doc.read_text(encoding="utf-8")))]  # fmt: skip
    assert len(blocks) >= 10
    # The project also installs the clients the blocks use, at the versions uv.lock holds.
    constraints = tmp_path / "constraints.txt"
    export = ["export", "--frozen", "--all-groups", "--all-extras", "--no-emit-project", "--no-hashes"]
    install = ["pip", "install", "--quiet", "--python", str(python), "-c", str(constraints)]
    for args in ([*export, "-o", str(constraints)], [*install, *DOC_CLIENTS]):
        proc = subprocess.run(["uv", *args], cwd=ROOT, env=_user_env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    (tmp_path / "docs_snippets.py").write_text("\n\n".join(blocks), encoding="utf-8")
    config = {"typeCheckingMode": "standard", "reportMissingTypeStubs": "error"}
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config), encoding="utf-8")
    pyright = Path(sys.executable).with_name("pyright")
    proc = subprocess.run([str(pyright), "--pythonpath", str(python), "docs_snippets.py"], cwd=tmp_path,
                          env=_user_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "0 errors" in proc.stdout, proc.stdout[-3000:]


def test_the_readmes_start_up_lines_are_what_train_py_prints(tmp_path, monkeypatch, capsys):
    """README's output block starts with the `data:` and `model:` lines of `uv run train.py`; they
    must be the code's (issue 53: a `data:` line the code no longer printed)."""
    import importlib.util

    import eqx_gpt.training.run as run_module

    class Started(Exception):
        pass

    def stop(run, sample_tokens):
        raise Started

    monkeypatch.setattr(run_module, "train_loop", stop)  # the start-up lines only, no step
    spec = importlib.util.spec_from_file_location("train_cli_readme", ROOT / "train.py")
    train_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_cli)
    with pytest.raises(Started):
        train_cli.main(["--out-dir", str(tmp_path / "out")])
    printed = capsys.readouterr().out.splitlines()
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    for start in ("data: ", "model: "):
        line = next(line for line in printed if line.startswith(start))
        assert line in readme, (line, [r for r in readme if r.startswith(start)])
