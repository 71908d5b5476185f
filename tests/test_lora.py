"""LoRA: adapters on a frozen GPT-2 (the committed tiny one), trained alone, in PEFT's format both
ways, resumed bit for bit; bad settings are one line before any work."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import forward
from runs_family import quick_runs
from train_family import FAMILY

from eqx_gpt import (
    CheckpointError,
    ConfigError,
    Linear,
    LoRALinear,
    TrainingError,
    apply_lora,
    load_adapters,
    load_checkpoint,
    load_gpt2,
    load_model,
    lora_trainable,
    merge_lora,
    save_adapters,
    save_checkpoint,
    train,
)
from eqx_gpt.checkpoint import LATEST, checkpoint_file, read_metadata
from eqx_gpt.model.dropout import dropout
from eqx_gpt.training import run as run_module

pytestmark = FAMILY  # one process for the family: programs compiled once
# The module's runs skip the drawing of `loss.png` at each evaluation (0.3 s a drawing, and no test
# here looks at it) and `fsync`: tests/runs_family.py's `quick_runs`, autouse.
__all__ = ["quick_runs"]  # a fixture, used by name

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = ROOT / "tests" / "fixtures" / "tiny-gpt2"
PEFT_FIXTURE = ROOT / "tests" / "fixtures" / "tiny-gpt2-lora"
RUN = dict(
    context_length=32, batch_size=2, eval_batches=1, max_steps=4, eval_interval=2, log_interval=1,
    warmup_steps=1, lr=1e-2, min_lr=1e-3,
)  # fmt: skip
# With LoRA dropout, so that the run tests below (step 0 is the base, resume is bit-exact, PEFT's
# folder) hold with the adapters' input dropped out in training. The targets are the PEFT
# fixture's (PEFT's "c_attn,c_proj"), so that a run continuing it with this dropout steps alike:
# one compiled step for the module's LoRA runs.
LORA = dict(lora_rank=4, lora_alpha=8.0, lora_targets="attn.c_attn,attn.c_proj,mlp.c_proj", lora_dropout=0.1)


def _cli(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_lora_cli", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(out, gpt2_corpus=None, resume=False, **settings):
    settings = {} if resume else {"init_from": str(TINY_GPT2), "data": str(gpt2_corpus), **RUN, **settings}
    return train(out_dir=out, resume=resume, sample_tokens=0, log=lambda s: None, progress=False, **settings)


def _losses(out: Path) -> list[tuple]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "train_loss", "val_loss", "final_val_loss")
    return [(r["step"], *(r.get(k) for k in keys)) for r in records]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, gpt2_corpus):
    out = tmp_path_factory.mktemp("lora") / "run"
    _train(out, gpt2_corpus, **LORA)
    return out


# -- the module --------------------------------------------------------------------------------


def _adapter_bs(model) -> list:
    nodes = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, LoRALinear))
    return [n.lora_b for n in nodes if isinstance(n, LoRALinear)]


def _random_b(model, seed: int):
    """`model` with every adapter's B drawn at random (B starts at zero, which would check nothing),
    by NumPy: `jax.random.normal` and the scaling compile a program per shape."""
    rng = np.random.default_rng(seed)
    draws = [jax.device_put(0.1 * rng.standard_normal(b.shape, np.float32)) for b in _adapter_bs(model)]
    return eqx.tree_at(_adapter_bs, model, draws)


def _next_token_loss(logits, tokens) -> float:
    """The mean cross-entropy of `logits[i]` against `tokens[i + 1]`, in NumPy (float64)."""
    logits, tokens = np.asarray(logits, np.float64)[:-1], np.asarray(tokens)[1:]
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(log_z - logits[np.arange(len(tokens)), tokens]))


def test_lora_starts_as_the_base_and_merges_to_what_it_computes():
    base = load_gpt2(TINY_GPT2)
    # PEFT's names, and the PEFT fixture's adapters (so its forward, compiled below, serves
    # test_the_adapter_peft_saved_gives_the_logits_peft_gave too): c_proj is attn.out and mlp.down.
    model = apply_lora(base, 4, alpha=8, targets="c_attn,c_proj", key=jax.random.key(0))
    layers = model.blocks.layers
    assert [type(m) for m in (layers.attn.qkv, layers.attn.out, layers.mlp.up, layers.mlp.down)] == [
        LoRALinear, LoRALinear, Linear, LoRALinear
    ]  # fmt: skip
    assert isinstance(layers.attn.qkv, Linear) and layers.attn.qkv.lora_a.shape == (2, 32, 4)
    x = jax.device_put(np.arange(12, dtype=np.int32))
    from_base = forward(eqx.nn.inference_mode(base), x)
    # Step 0 is the base model: B is zero. (The loss taken in NumPy from the logits of the two
    # forwards below, each compiled once: a loss of its own would compile two programs more.)
    at_start = forward(eqx.nn.inference_mode(model), x)
    assert _next_token_loss(at_start, x) == pytest.approx(_next_token_loss(from_base, x), rel=1e-6)
    adapted = eqx.nn.inference_mode(_random_b(model, 1))
    merged = merge_lora(adapted)
    assert not any(
        isinstance(n, LoRALinear) for n in jax.tree.leaves(merged, is_leaf=lambda n: isinstance(n, Linear))
    )
    from_merged, from_adapted = forward(merged, x), forward(adapted, x)
    np.testing.assert_allclose(from_merged, from_adapted, atol=2e-5)
    assert np.abs(np.asarray(from_adapted) - np.asarray(from_base)).max() > 1e-2
    # Only the adapters are trainable.
    params = eqx.filter(model, lora_trainable(model))
    assert sum(x.size for x in jax.tree.leaves(params)) == 2 * (
        32 * 4 + 4 * 96 + 32 * 4 + 4 * 32 + 128 * 4 + 4 * 32
    )


def test_lora_dropout_drops_out_the_adapters_input_alone_in_training():
    # 16 by 16 at rank 2: test_compose.py's and test_lora_targets.py's weight shapes, whose
    # initialising programs the family compiles anyway.
    base = Linear(16, 16, key=jax.random.key(0), use_bias=True)
    lora = LoRALinear(base, 2, alpha=4.0, dropout=0.5, key=jax.random.key(1))
    # Drawn, and the expected outputs computed, in NumPy: no program of their own. The module runs
    # eagerly: its operations' programs are shared by its calls (all of one shape).
    rng = np.random.default_rng(2)
    lora = eqx.tree_at(lambda m: m.lora_b, lora, jax.device_put(rng.standard_normal((2, 16), np.float32)))
    x, key = jax.device_put(rng.standard_normal((3, 5, 16), np.float32)), jax.random.key(4)
    with pytest.raises(ValueError, match="LoRALinear has dropout 0.5 and is in training mode, so it needs"):
        lora(x)
    dropped = np.asarray(dropout(x, 0.5, key))
    frozen, a, b = np.asarray(base(x)), np.asarray(lora.lora_a), np.asarray(lora.lora_b)
    expected = frozen + 2.0 * (dropped @ a) @ b  # PEFT's: the frozen path keeps x
    np.testing.assert_allclose(lora(x, key=key), expected, rtol=1e-5, atol=1e-6)
    plain = frozen + 2.0 * (np.asarray(x) @ a) @ b
    np.testing.assert_allclose(lora(x, inference=True), plain, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(eqx.nn.inference_mode(lora)(x, key=key), plain, rtol=1e-5, atol=1e-6)
    assert not np.allclose(lora(x, key=key), plain)
    # One key per sequence: each sequence gets the output it gets alone, as under jax.vmap.
    keys = jax.random.split(key, 3)
    alone = jax.jit(jax.vmap(lambda x, k: lora(x, key=k)))(x, keys)  # one program, not one per operation
    np.testing.assert_allclose(lora(x, key=keys), alone, rtol=1e-5, atol=1e-6)


# The four projections a GPT block holds, by the name `apply_lora` takes and where the adapter sits.
PROJECTIONS = {
    "c_attn": lambda m: m.blocks.layers.attn.qkv,
    "attn.out": lambda m: m.blocks.layers.attn.out,
    "c_fc": lambda m: m.blocks.layers.mlp.up,
    "mlp.down": lambda m: m.blocks.layers.mlp.down,
}


def _random_b_at(model, projection, seed: int):
    """`model` with the adapter at `projection` given a B drawn at random (by NumPy), every other
    adapter's B left at zero."""
    b = projection(model).lora_b
    draw = jax.device_put(0.1 * np.random.default_rng(seed).standard_normal(b.shape, np.float32))
    return eqx.tree_at(lambda m: projection(m).lora_b, model, draw)


def test_a_gpt_passes_its_key_to_lora_dropout_in_attention_and_the_mlp():
    base = load_gpt2(TINY_GPT2)
    tokens = jax.device_put(np.arange(16, dtype=np.int32) % 100)
    # Every projection adapted (one structure, so three compiled forwards for the four cases), B
    # drawn at one at a time: an adapter whose B is zero adds nothing, dropped out or not, so each
    # case's dropout is its projection's alone; and one left without a key would raise.
    targets = ",".join(PROJECTIONS)
    dropped = apply_lora(base, 4, alpha=8, targets=targets, dropout=0.5, key=jax.random.key(0))
    undropped_all = apply_lora(base, 4, alpha=8, targets=targets, key=jax.random.key(0))
    for name, projection in PROJECTIONS.items():
        model = _random_b_at(dropped, projection, 1)
        undropped = _random_b_at(undropped_all, projection, 1)
        plain = forward(model, tokens, inference=True)
        one, two = (
            forward(model, tokens, key=jax.random.key(2)),
            forward(model, tokens, key=jax.random.key(3)),
        )
        assert not np.allclose(one, plain) and not np.allclose(one, two), name
        np.testing.assert_array_equal(one, forward(model, tokens, key=jax.random.key(2)))
        # another program than `plain`'s (it traces the unused keys), so equal within rounding
        np.testing.assert_allclose(
            forward(undropped, tokens, key=jax.random.key(2)), plain, rtol=1e-6, atol=1e-6
        )


def test_the_adapter_peft_saved_gives_the_logits_peft_gave():
    model = load_adapters(load_gpt2(TINY_GPT2), PEFT_FIXTURE)
    layers = model.blocks.layers
    assert isinstance(layers.attn.qkv, LoRALinear) and isinstance(layers.mlp.down, LoRALinear)
    assert not isinstance(layers.mlp.up, LoRALinear) and layers.attn.qkv.scale == 2.0
    expected = np.load(PEFT_FIXTURE / "expected.npz")
    logits = forward(eqx.nn.inference_mode(model), jax.device_put(expected["prompt"].astype(np.int32)))
    np.testing.assert_allclose(logits, expected["logits"], atol=1e-4)


def test_saved_adapters_read_back_exactly(tmp_path):
    model = load_adapters(load_gpt2(TINY_GPT2), PEFT_FIXTURE)
    save_adapters(model, tmp_path, base=str(TINY_GPT2))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["fan_in_fan_out"] and config["target_modules"] == [
        "attn.c_attn",
        "attn.c_proj",
        "mlp.c_proj",
    ]
    again = load_adapters(load_gpt2(TINY_GPT2), tmp_path)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


# -- training ------------------------------------------------------------------------------------


def test_a_lora_run_starts_at_the_base_models_loss_and_trains_the_adapters_alone(
    tmp_path, gpt2_corpus, lora_run
):
    full = tmp_path / "full"
    _train(full, gpt2_corpus, max_steps=1)
    lora_first, full_first = _losses(lora_run)[:2], _losses(full)[:2]
    # Step 0: the evaluation (train and validation loss) and the first step's loss are the base's.
    for a, b in zip(lora_first, full_first, strict=True):
        np.testing.assert_allclose(
            [x for x in a if x is not None], [x for x in b if x is not None], rtol=1e-6
        )
    separate, _, meta = load_model(lora_run, lora="separate")
    base = load_gpt2(TINY_GPT2, context_length=32)
    frozen = eqx.filter(separate, lora_trainable(separate), inverse=True)
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for a, b in zip(arrays(frozen), arrays(base), strict=True):
        np.testing.assert_array_equal(a, b)  # not one frozen weight moved
    assert np.abs(np.asarray(separate.blocks.layers.attn.qkv.lora_b)).max() > 0  # the adapters did
    # The optimiser holds AdamW's two moments for the adapters, nothing for the frozen base.
    _, opt_state, _, _ = load_checkpoint(checkpoint_file(lora_run, LATEST), _opt_like(meta))
    n_adapters = sum(x.size for x in jax.tree.leaves(eqx.filter(separate, lora_trainable(separate))))
    moments = [x for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert (
        sum(x.size for x in moments)
        == 2 * n_adapters
        == 2 * 2 * (32 * 4 + 4 * 96 + 32 * 4 + 4 * 32 + 128 * 4 + 4 * 32)
    )
    # The merged model (load_model's default) computes what the adapters do.
    merged, _, _ = load_model(lora_run)
    x = jax.device_put(np.arange(20, dtype=np.int32) % 512)
    np.testing.assert_allclose(
        forward(eqx.nn.inference_mode(merged), x), forward(eqx.nn.inference_mode(separate), x), atol=1e-5
    )


def _opt_like(meta):
    from eqx_gpt.checkpoint import run_template
    from eqx_gpt.model.config import GPTConfig
    from eqx_gpt.training.config import TrainConfig
    from eqx_gpt.training.step import init_optimizer_state, make_optimizer

    optimizer = make_optimizer(TrainConfig.from_dict(meta["train_config"]))
    template = run_template(GPTConfig.from_dict(meta["model_config"]), meta["train_config"])
    return eqx.filter_eval_shape(init_optimizer_state, optimizer, template)


def test_the_run_folder_holds_its_adapters_in_pefts_format(lora_run):
    config = json.loads((lora_run / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == os.path.relpath(TINY_GPT2, lora_run) and config["r"] == 4
    assert config["lora_dropout"] == 0.1
    assert config["target_modules"] == ["attn.c_attn", "attn.c_proj", "mlp.c_proj"]
    separate, _, _ = load_model(lora_run, lora="separate")
    from_peft = load_adapters(load_gpt2(TINY_GPT2, context_length=32), lora_run)
    for a, b in zip(jax.tree.leaves(separate), jax.tree.leaves(from_peft), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # a run killed and resumed; test_callbacks.py stops and resumes a run in the quick suite
def test_a_killed_lora_run_resumes_to_the_losses_of_one_never_stopped(
    tmp_path, gpt2_corpus, lora_run, monkeypatch
):
    out, real_save = tmp_path / "killed", run_module.save

    class Killed(BaseException):
        pass

    def save_then_die(run, name):
        real_save(run, name)
        if name == LATEST and run.state.step == 2:
            raise Killed  # as SIGKILL would, right after the checkpoint at step 2

    monkeypatch.setattr(run_module, "save", save_then_die)
    with pytest.raises(Killed):
        _train(out, gpt2_corpus, **LORA)
    monkeypatch.setattr(run_module, "save", real_save)
    assert read_metadata(checkpoint_file(out, LATEST))["step"] == 2
    result = _train(out, resume=True)
    assert result.step == 4 and not result.interrupted
    assert _losses(out) == _losses(lora_run)


def test_a_lora_checkpoint_holds_the_adapters_alone_and_reads_its_base_back(tmp_path, lora_run):
    meta = read_metadata(checkpoint_file(lora_run, LATEST))
    assert (meta["version"], meta["weights_hold"]) == (3, "adapters")
    separate, _, _ = load_model(lora_run, lora="separate")
    n_adapters = sum(x.size for x in jax.tree.leaves(eqx.filter(separate, lora_trainable(separate))))
    n_arrays = 3 * len(jax.tree.leaves(eqx.filter(separate, lora_trainable(separate))))
    # The adapters and AdamW's two moments of them (float32), each array with its .npy header, and
    # the optimiser's counters: nothing of the frozen base.
    size = (lora_run / meta["weights"]).stat().st_size
    assert 3 * 4 * n_adapters < size < 3 * 4 * n_adapters + 256 * (n_arrays + 8)
    # The same model saved whole (no base named: version 2, as before) loads to the same arrays.
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    _, opt_state, tokenizer, _ = load_checkpoint(checkpoint_file(lora_run, LATEST), _opt_like(meta))
    whole = save_checkpoint(
        tmp_path, LATEST, separate, opt_state, step=4, tokenizer=tokenizer, train_config=meta["train_config"]
    )
    whole_meta = read_metadata(whole)
    assert whole_meta["version"] == 2 and "weights_hold" not in whole_meta
    n_frozen = sum(x.size for x in arrays(eqx.filter(separate, lora_trainable(separate), inverse=True)))
    assert (tmp_path / whole_meta["weights"]).stat().st_size - size >= 4 * n_frozen  # the base, whole
    again, _, _ = load_model(tmp_path, lora="separate")
    for a, b in zip(arrays(again), arrays(separate), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resuming_on_a_changed_base_is_refused(tmp_path, gpt2_corpus):
    base, out = tmp_path / "gpt2", tmp_path / "run"
    shutil.copytree(TINY_GPT2, base)
    _train(out, gpt2_corpus, **{**LORA, "init_from": str(base)}, max_steps=2)
    weights = base / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(TrainingError, match="base model .* has changed since the run started"):
        _train(out, resume=True, max_steps=4)
    # Its checkpoints hold the adapters alone: read on another base, they are refused too.
    with pytest.raises(CheckpointError, match="holds LoRA adapters for the GPT-2 in .*, which has changed"):
        load_model(out)
    shutil.rmtree(base)
    with pytest.raises(CheckpointError, match="which is gone; restore that folder"):
        load_model(out)


def test_init_from_a_peft_folder_continues_its_adapters(tmp_path, gpt2_corpus):
    out = tmp_path / "run"
    # The run's own LoRA dropout (the folder's is 0): the step `lora_run` compiled serves this run.
    dropout = LORA["lora_dropout"]
    _train(
        out, gpt2_corpus, init_from=str(PEFT_FIXTURE), max_steps=1, lr=1e-6, min_lr=1e-6, lora_dropout=dropout
    )
    meta = read_metadata(checkpoint_file(out, LATEST))
    train_config = meta["train_config"]
    assert (train_config["init_from"], train_config["lora_adapters"]) == (str(TINY_GPT2), str(PEFT_FIXTURE))
    assert (train_config["lora_rank"], train_config["lora_alpha"]) == (4, 8.0)
    assert train_config["lora_targets"] == "attn.c_attn,attn.c_proj,mlp.c_proj"
    separate, _, _ = load_model(out, lora="separate")
    start = load_adapters(load_gpt2(TINY_GPT2, context_length=32), PEFT_FIXTURE)
    b, b0 = separate.blocks.layers.mlp.down.lora_b, start.blocks.layers.mlp.down.lora_b
    assert 0 < np.abs(np.asarray(b) - np.asarray(b0)).max() < 1e-4  # one step at 1e-6 from the PEFT adapter


# -- refusals ------------------------------------------------------------------------------------


RANK_4 = ["--init-from", str(TINY_GPT2), "--lora-rank", "4"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-rank", "4"], "--lora-rank trains adapters on a pretrained model: pass --init-from"),
        (["--init-from", str(TINY_GPT2), "--lora-rank", "0"], "lora_rank must be a whole number >= 1"),
        (["--init-from", str(TINY_GPT2), "--lora-rank", "33"], "larger than the model's width 32"),
        ([*RANK_4, "--lora-targets", "c_attn,wte"],
         "unknown LoRA target 'wte'"),
        ([*RANK_4, "--lora-alpha", "-1"], "lora_alpha must be a finite"),
        ([*RANK_4, "--lora-dropout", "1"], "lora_dropout must be in"),
        (["--init-from", str(PEFT_FIXTURE), "--lora-rank", "8"], "--lora-rank comes from the adapter folder"),
    ],
)  # fmt: skip
def test_bad_lora_settings_are_one_line_before_any_work(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert _cli("train").main([*flags, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_adapters_of_another_rank_than_the_runs_are_refused_through_train(tmp_path):
    with pytest.raises(
        ConfigError, match=r"adapters in .* are rank 4, alpha 8 on .* but the run asks for rank 8"
    ):
        train(
            init_from=str(TINY_GPT2), lora_adapters=str(PEFT_FIXTURE), lora_rank=8, lora_alpha=8.0,
            lora_targets="c_attn,c_proj", out_dir=tmp_path / "run", log=lambda s: None,
        )  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_a_nan_alpha_is_refused_through_train():
    with pytest.raises(ConfigError, match="lora_alpha must be a finite number"):
        train(
            init_from=str(TINY_GPT2),
            lora_rank=4,
            lora_alpha=float("nan"),
            out_dir="never",
            log=lambda s: None,
        )


def test_export_writes_a_lora_run_merged_or_its_adapters_alone(tmp_path, lora_run):
    merged, _, _ = load_model(lora_run)
    assert not any(
        isinstance(n, LoRALinear) for n in jax.tree.leaves(merged, is_leaf=lambda n: isinstance(n, Linear))
    )
    export = _cli("export")
    assert export.main(["--checkpoint", str(lora_run), "--out-dir", str(tmp_path / "merged")]) == 0
    x = jax.device_put(np.arange(20, dtype=np.int32) % 512)
    want = forward(eqx.nn.inference_mode(merged), x)
    got = forward(eqx.nn.inference_mode(load_gpt2(tmp_path / "merged")), x)
    np.testing.assert_array_equal(got, want)  # the merged weights, written as they are
    argv = ["--checkpoint", str(lora_run), "--out-dir", str(tmp_path / "adapters"), "--adapters-only"]
    assert export.main(argv) == 0
    adapted = load_adapters(load_gpt2(TINY_GPT2, context_length=32), tmp_path / "adapters")
    np.testing.assert_allclose(forward(eqx.nn.inference_mode(adapted), x), want, atol=1e-5)
