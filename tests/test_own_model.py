"""A model of one's own, end to end: the GUIDE's RoPE + SwiGLU decoder (its very code, importing only
eqx_gpt's public names) trained with `train(model=...)` and `train.py --model MODULE:FUNCTION`,
stopped and resumed bit for bit, read back by `load_model`, sampled, evaluated, fine-tuned with
LoRA; the optimiser's groups found by type; bad input one line."""

import ast
import importlib.util
import json
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import forward
from doc_blocks import DOCS, python_blocks
from gen_models import GROUP, gpt

import eqx_gpt
from eqx_gpt import (
    Callback,
    ConfigError,
    Decoder,
    LanguageModel,
    Linear,
    LoRALinear,
    StopTraining,
    apply_lora,
    load_model,
    lora_trainable,
    train,
)
from eqx_gpt.training.step import decay_mask, matrix_axes, muon_labels

pytestmark = pytest.mark.xdist_group(GROUP)

ROOT = Path(__file__).resolve().parents[1]
GUIDE = DOCS[1]
HEADING = "## Your own model, end to end"
RUN = dict(max_minutes=0, batch_size=4, eval_interval=5, eval_batches=1, eval_tokens=2048, log_interval=1)


def _section_blocks() -> list[str]:
    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(f"\n{HEADING}\n")
    end = text.index("\n## ", start + 1)
    return python_blocks(text[start:end])


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A folder holding the GUIDE's `mydec.py`, exactly as written there."""
    folder = tmp_path_factory.mktemp("project")
    (folder / "mydec.py").write_text(_section_blocks()[0], encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def mydec(project):
    spec = importlib.util.spec_from_file_location("mydec", project / "mydec.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mydec"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("mydec", None)


def test_the_guides_code_imports_only_eqx_gpts_public_names():
    for block in _section_blocks():
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eqx_gpt"):
                assert node.module == "eqx_gpt", node.module
                assert {a.name for a in node.names} <= set(eqx_gpt.__all__)
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("eqx_gpt.") for a in node.names)


def test_the_decoder_follows_both_protocols(mydec):
    model = mydec.make_decoder(65, key=jax.random.key(0))
    language_model: LanguageModel = model  # what pyright checks statically
    decoder: Decoder = model
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6)  # NumPy: each `jnp` operation compiles a program
    assert forward(language_model, tokens).shape == (2, 6, 65)
    assert decoder.context_length == 64
    gpt_model: LanguageModel = gpt()
    assert gpt_model.vocab_size == 65


class StopAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step(self, record, run):
        if record.step == self.step:
            raise StopTraining


def _losses(out: Path) -> list[tuple]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "grad_norm", "train_loss", "val_loss", "final_val_loss")
    return [(r["step"], *(r.get(k) for k in keys)) for r in records]


@pytest.mark.slow  # three runs; test_callbacks.py checks the same of a GPT in the quick suite
def test_train_stopped_by_a_callback_and_resumed_gives_the_losses_of_one_run(mydec, tmp_path):
    make = lambda: mydec.make_decoder(65, key=jax.random.key(0))
    quiet = dict(log=lambda s: None, progress=False, sample_tokens=0)
    whole = train(model=make(), max_steps=10, out_dir=tmp_path / "whole", **RUN, **quiet)
    assert type(whole.model) is mydec.MyDecoder and whole.step == 10
    stopped = train(
        model=make(), max_steps=10, out_dir=tmp_path / "split", callbacks=[StopAt(5)], **RUN, **quiet
    )
    assert stopped.interrupted and stopped.step == 5
    resumed = train(model=make(), out_dir=tmp_path / "split", resume=True, **quiet)
    assert resumed.step == 10 and not resumed.interrupted
    assert _losses(tmp_path / "split") == _losses(tmp_path / "whole")
    # The best checkpoint, read into a model of its class.
    best, tokenizer, meta = load_model(tmp_path / "whole", like=make())
    assert type(best) is mydec.MyDecoder and tokenizer.vocab_size == 65
    assert (meta["model"], meta["model_config"]) == ("MyDecoder", {"vocab_size": 65, "context_length": 64})
    with pytest.raises(eqx_gpt.CheckpointError, match="passed to train\\(\\) from Python.*like=MyDecoder"):
        load_model(tmp_path / "whole")


@pytest.mark.slow  # five commands end to end (train, sample, evaluate, resume, a LoRA run); the bad-model
# refusals below and test_train_cli.py's quick runs check the command line in the quick suite
def test_a_model_built_by_module_function_trains_samples_and_evaluates_from_the_command_line(
    project, mydec, tmp_path, monkeypatch, capsys
):
    from eqx_gpt.commands import evaluate as evaluate_command
    from eqx_gpt.commands import sample as sample_command
    from eqx_gpt.commands import train as train_command

    monkeypatch.chdir(project)  # --model imports from the current folder, as uvicorn does
    out = tmp_path / "run"
    flags = ["--model", "mydec:make_decoder", "--max-steps", "4", "--max-minutes", "0", "--batch-size", "4",
             "--eval-interval", "2", "--eval-batches", "1", "--eval-tokens", "2048", "--sample-tokens", "8",
             "--out-dir", str(out)]  # fmt: skip
    assert train_command.main(flags) == 0
    printed = capsys.readouterr().out
    assert "a MyDecoder (--model mydec:make_decoder), context 64" in printed
    meta = json.loads((out / "latest.json").read_text())
    assert meta["train_config"]["model"] == "mydec:make_decoder" and meta["model"] == "MyDecoder"
    # Rebuilt by the recorded function: load_model, sample and evaluate need nothing else.
    model, _, _ = load_model(out)
    assert type(model).__name__ == "MyDecoder"
    assert sample_command.main(["--checkpoint", str(out), "--max-new-tokens", "5", "--prompt", "A"]) == 0
    assert evaluate_command.main(["--checkpoint", str(out)]) == 0
    assert "loss" in capsys.readouterr().out
    # Resumed from the command line, it goes on from its checkpoint.
    assert (
        train_command.main(["--resume", "--out-dir", str(out), "--max-steps", "6", "--sample-tokens", "0"])
        == 0
    )
    assert json.loads((out / "latest.json").read_text())["step"] == 6
    # --init-from the run, with --lora-rank: adapters on its best model, read back by its function.
    tuned = tmp_path / "lora"
    lora = ["--init-from", str(out), "--lora-rank", "2", "--lora-targets", "qkv", "--max-steps", "2",
            "--eval-interval", "2", "--eval-tokens", "2048", "--sample-tokens", "0",
            "--out-dir", str(tuned)]  # fmt: skip
    assert train_command.main(lora) == 0
    separate, _, meta = load_model(tuned, lora="separate")
    assert meta["lora"]["targets"] == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    assert isinstance(separate.blocks[1].attn.qkv, LoRALinear) and type(separate).__name__ == "MyDecoder"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "mydec"], "model must be MODULE:FUNCTION"),
        (["--model", "nowhere:make"], "module 'nowhere' cannot be imported"),
        (["--model", "mydec:missing"], "has no function 'missing'"),
        (["--model", "mydec:DecoderBlock"], "calling DecoderBlock(65, key=...) raised TypeError"),
        (["--model", "mydec:make_decoder", "--d-model", "64"], "--d-model sets a GPT's shape, but the"),
        (["--model", "mydec:make_decoder", "--init-from", "somewhere"], "pass one of them"),
    ],
)  # fmt: skip
def test_a_bad_model_is_one_line_before_any_work(
    project, mydec, tmp_path, monkeypatch, capsys, flags, message
):
    from eqx_gpt.commands import train as train_command

    monkeypatch.chdir(project)
    out = tmp_path / "run"
    assert train_command.main([*flags, "--max-steps", "1", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_model_that_returns_no_language_model_or_another_vocabulary_is_refused(mydec, project, tmp_path):
    (project / "notamodel.py").write_text("def make(vocab_size, *, key):\n    return 'text'\n")
    with pytest.raises(ConfigError, match="what make returns must be a language model .* str lacks"):
        train(model="notamodel:make", out_dir=tmp_path / "a", log=lambda s: None)
    with pytest.raises(ConfigError, match="has vocab_size 50, but the tokenizer has 65 ids"):
        train(model=mydec.make_decoder(50, key=jax.random.key(0)), out_dir=tmp_path / "b", log=lambda s: None)
    with pytest.raises(TypeError, match="train\\(\\)'s model must be a language model"):
        train(model=[1, 2], out_dir=tmp_path / "c", log=lambda s: None)  # type: ignore[arg-type]
    assert not any((tmp_path / n).exists() for n in "abc")


def test_the_optimisers_groups_are_found_by_type(mydec):
    model = mydec.make_decoder(65, key=jax.random.key(0))
    labels = muon_labels(eqx.filter(model, eqx.is_inexact_array))
    block = labels.blocks[0]
    assert (
        block.attn.qkv.weight
        == block.attn.out.weight
        == block.mlp.up.weight
        == block.mlp.down.weight
        == "muon"
    )
    assert (
        labels.embed == labels.head.weight == block.attn_norm.scale == "adamw"
    )  # the head: the model's own field
    mask = decay_mask(eqx.filter(model, eqx.is_inexact_array))
    assert mask.embed and mask.blocks[0].mlp.up.weight and not mask.blocks[0].mlp_norm.scale

    class TorchStyle(eqx.Module):  # Equinox's own layers: eqx.nn.Linear (out, in) and eqx.nn.LayerNorm
        layers: tuple
        head: eqx.nn.Linear

    def torch_style():
        k = jax.random.split(jax.random.key(0), 3)
        return TorchStyle(
            (eqx.nn.Linear(8, 16, key=k[0]), eqx.nn.LayerNorm(16)), eqx.nn.Linear(16, 4, key=k[1])
        )

    # Built from its shapes alone, its arrays NumPy zeros: the groups are found by type and shape, and
    # its initialisation, run eagerly, compiled a program per operation and shape.
    zeros = lambda s: np.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s
    params = eqx.filter(jax.tree.map(zeros, eqx.filter_eval_shape(torch_style)), eqx.is_inexact_array)
    labels = muon_labels(params)
    assert (labels.layers[0].weight, labels.layers[0].bias, labels.layers[1].weight) == (
        "muon",
        "adamw",
        "adamw",
    )
    assert labels.head.weight == "adamw"
    mask = decay_mask(params)
    assert mask.layers[0].weight and not mask.layers[0].bias and not mask.layers[1].weight
    axes = matrix_axes(split_qkv=False)(params)
    # eqx.nn.Linear's weight is (out, in): the input (reduction) axis is the last.
    assert (axes.layers[0].weight.reduction_axis, axes.layers[0].weight.output_axis) == (1, 0)


@pytest.mark.slow  # a whole LoRA run; test_lora_targets.py adapts and merges such a model in the quick suite
def test_lora_on_ones_own_model_keeps_its_type_and_trains_the_adapters_alone(mydec, tmp_path):
    base = mydec.make_decoder(65, key=jax.random.key(0))
    adapted = apply_lora(base, 4, targets="attn.qkv,mlp.up", key=jax.random.key(1))
    assert type(adapted) is mydec.MyDecoder
    assert isinstance(adapted.blocks[0].attn.qkv, LoRALinear) and type(adapted.blocks[0].attn.out) is Linear
    result = train(model=adapted, max_steps=2, out_dir=tmp_path / "lora", log=lambda s: None, progress=False,
                   sample_tokens=0, **{**RUN, "eval_interval": 2})  # fmt: skip
    arrays = lambda m, inverse: jax.tree.leaves(eqx.filter(m, lora_trainable(m), inverse=inverse))
    for before, after in zip(arrays(adapted, True), arrays(result.model, True), strict=True):
        np.testing.assert_array_equal(before, after)  # not one frozen weight moved
    pairs = zip(arrays(adapted, False), arrays(result.model, False), strict=True)
    moved = [not np.array_equal(a, b) for a, b in pairs]
    assert len(moved) == 8 and all(moved)  # A and B of two projections in two blocks
    # Read back into the base's class, merged (the checkpoint records where the adapters were).
    merged, _, meta = load_model(tmp_path / "lora", like=base)
    assert meta["lora"]["targets"] == [f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv", "mlp.up")]
    assert type(merged) is mydec.MyDecoder and type(merged.blocks[0].attn.qkv) is Linear
    tokens = jnp.arange(10) % 65
    np.testing.assert_allclose(merged(tokens), result.model(tokens), atol=2e-5)


@pytest.mark.slow  # the guide's section as written: three whole runs (train, fine-tune, LoRA)
def test_the_guides_python_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its runs write their folders here
    namespace: dict = {"__name__": "guide_own_model"}
    for block in _section_blocks():
        exec(compile(block, str(GUIDE), "exec"), namespace)
    assert type(namespace["trained"]).__name__ == type(namespace["tuned"]).__name__ == "MyDecoder"
    assert isinstance(namespace["adapted"].blocks[0].attn.qkv, LoRALinear)
    assert namespace["result"].step == 10 and (tmp_path / "out-mydec-lora" / "latest.json").is_file()


def test_adapters_of_ones_own_model_save_and_load_in_eqx_gpts_format(mydec, tmp_path):
    from eqx_gpt import load_adapters, save_adapters

    base = mydec.make_decoder(65, key=jax.random.key(0))
    adapted = apply_lora(base, 2, alpha=4.0, targets="qkv,head", key=jax.random.key(1))
    bs = lambda m: [n.lora_b for n in jax.tree.leaves(m, is_leaf=lambda n: isinstance(n, LoRALinear))
                    if isinstance(n, LoRALinear)]  # fmt: skip
    halves = [jax.device_put(np.full(b.shape, 0.5, np.float32)) for b in bs(adapted)]  # B is zero at first
    adapted = eqx.tree_at(bs, adapted, halves)
    save_adapters(adapted, tmp_path / "adapters", base="mydec:make_decoder")
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["format"] == "eqx_gpt-lora" and config["model"] == "MyDecoder" and config["r"] == 2
    assert config["target_modules"] == ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "head"]
    again = load_adapters(base, tmp_path / "adapters")
    assert type(again) is mydec.MyDecoder
    for a, b in zip(jax.tree.leaves(adapted), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(eqx_gpt.CheckpointError, match="adapters of a MyDecoder, not of a GPT"):
        load_adapters(gpt(), tmp_path / "adapters")
