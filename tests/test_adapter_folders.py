"""PEFT adapter folders that never lose a file, refuse what eqx_gpt would compute wrongly, and
travel: `save_adapters` checks before it writes and puts the folder in place at once;
`load_adapters` refuses tensors it would ignore, cast or compute as NaN, and settings it does not
compute; the base is named relative to the folder, and what is written is readable by others."""

import json
import os
import shutil
import stat
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqx_gpt import CheckpointError, TrainingError, apply_lora, load_adapters, load_gpt2, save_adapters
from eqx_gpt.files import atomic_write_bytes
from eqx_gpt.gpt2 import save_gpt2
from eqx_gpt.peft import base_directory

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = ROOT / "tests" / "fixtures" / "tiny-gpt2"
PEFT_FIXTURE = ROOT / "tests" / "fixtures" / "tiny-gpt2-lora"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def adapters(tmp_path) -> Path:
    """A copy of the PEFT fixture beside a copy of its base, as `../tiny-gpt2` names it."""
    shutil.copytree(TINY_GPT2, tmp_path / "tiny-gpt2")
    folder = tmp_path / "adapters"
    folder.mkdir()
    for name in (CONFIG, WEIGHTS):
        shutil.copy(PEFT_FIXTURE / name, folder / name)
    return folder


# -- save_adapters: checked first, then the folder in place at once ------------------------------


def test_saving_a_model_without_adapters_writes_nothing(adapters):
    before = _bytes(adapters)
    for model, message in [
        (load_gpt2(TINY_GPT2), "the model has no LoRA adapters"),
        ("not a model", "the str holds no LoRA adapters"),
    ]:
        with pytest.raises(TrainingError, match=message):
            save_adapters(model, adapters, base=str(TINY_GPT2))
        assert _bytes(adapters) == before
    assert sorted(p.name for p in adapters.parent.iterdir()) == ["adapters", "tiny-gpt2"]  # no temporary


def test_saving_diverged_or_mixed_adapters_writes_nothing(adapters):
    model = load_adapters(load_gpt2(TINY_GPT2), adapters)
    before = _bytes(adapters)
    nan = eqx.tree_at(
        lambda m: m.blocks.layers.attn.qkv.lora_b, model, model.blocks.layers.attn.qkv.lora_b * np.nan
    )
    with pytest.raises(TrainingError, match="attn.c_attn hold NaN or infinite values"):
        save_adapters(nan, adapters, base=str(TINY_GPT2))
    mixed = apply_lora(load_gpt2(TINY_GPT2), 2, targets="c_attn", key=jax.random.key(0))
    mixed = eqx.tree_at(
        lambda m: m.blocks.layers.mlp.up,
        mixed,
        apply_lora(load_gpt2(TINY_GPT2), 4, targets="c_fc", key=jax.random.key(1)).blocks.layers.mlp.up,
    )
    with pytest.raises(TrainingError, match="differ in \\(rank, scale, dropout\\)"):
        save_adapters(mixed, adapters, base=str(TINY_GPT2))
    assert _bytes(adapters) == before


def test_a_write_that_fails_midway_leaves_the_old_folder_whole(adapters, monkeypatch):
    model = load_adapters(load_gpt2(TINY_GPT2), adapters)
    model = eqx_tree_scale(model, 2.0)
    before = _bytes(adapters)
    real = Path.write_bytes

    def fail_on_the_config(self, data):
        if self.name == CONFIG:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", fail_on_the_config)
    with pytest.raises(OSError, match="No space left"):
        save_adapters(model, adapters, base=str(TINY_GPT2))
    assert _bytes(adapters) == before  # neither file replaced
    assert sorted(p.name for p in adapters.parent.iterdir()) == ["adapters", "tiny-gpt2"]
    monkeypatch.undo()
    save_adapters(model, adapters, base=str(TINY_GPT2))  # then written whole
    again = load_adapters(load_gpt2(TINY_GPT2), adapters)
    np.testing.assert_array_equal(again.blocks.layers.attn.qkv.lora_a, model.blocks.layers.attn.qkv.lora_a)


def eqx_tree_scale(model, factor: float):
    return eqx.tree_at(
        lambda m: m.blocks.layers.attn.qkv.lora_a, model, model.blocks.layers.attn.qkv.lora_a * factor
    )


def test_a_folder_holding_other_files_keeps_them(tmp_path):
    model = load_adapters(load_gpt2(TINY_GPT2), PEFT_FIXTURE)
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest.json").write_text("{}")
    save_adapters(model, run, base=TINY_GPT2)
    assert sorted(p.name for p in run.iterdir()) == sorted([CONFIG, WEIGHTS, "latest.json"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainingError, match="is a file; pass a folder"):
        save_adapters(model, tmp_path / "file", base=TINY_GPT2)


# -- load_adapters: nothing ignored, cast or NaN ------------------------------------------------


def _tensors_edited(folder: Path, edit) -> None:
    tensors = load_file(folder / WEIGHTS)
    edit(tensors)
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})


A0 = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({A0.replace("h.0", "h.7"): t[A0]}), "is for layer 7, but the base has 2 layers"),
        (lambda t: t.update({A0: np.full_like(t[A0], np.nan)}), "holds NaN or infinite values"),
        (lambda t: t.update({A0: np.where(t[A0] > 0, np.inf, t[A0])}), "holds NaN or infinite values"),
        (lambda t: t.update({A0: t[A0].astype(np.int32)}), "holds int32, not floating-point"),
        (lambda t: t.update({A0: t[A0] > 0}), "holds bool, not floating-point"),
        (lambda t: t.update({A0.replace(".lora_A", ".default.lora_A"): t[A0]}), "is there twice"),
        (lambda t: t.update({A0: t[A0][:, :5]}), "has shape \\(4, 5\\) per layer"),
    ],
)
def test_tensors_eqx_gpt_would_ignore_cast_or_compute_as_nan_are_refused(adapters, edit, message):
    _tensors_edited(adapters, edit)
    with pytest.raises(CheckpointError, match=message):
        load_adapters(load_gpt2(TINY_GPT2), adapters)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("layer_replication", [[0, 2]]),
        ("lora_bias", True),
        ("use_qalora", True),
        ("trainable_token_indices", [3, 4]),
        ("target_parameters", ["attn.c_attn.weight"]),
        ("alora_invocation_tokens", [1, 2]),
        ("a_setting_of_a_newer_peft", 1),
        ("init_lora_weights", "pissa"),
    ],
)
def test_settings_that_change_what_an_adapter_computes_are_refused(adapters, setting, value):
    config = json.loads((adapters / CONFIG).read_text())
    config[setting] = value
    (adapters / CONFIG).write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"eqx_gpt reads plain LoRA on GPT-2.*{setting}"):
        load_adapters(load_gpt2(TINY_GPT2), adapters)


# -- a folder that travels, files others can read ------------------------------------------------


def test_the_base_is_named_relative_to_the_folder_so_both_travel_together(tmp_path, monkeypatch):
    model = load_adapters(load_gpt2(TINY_GPT2), PEFT_FIXTURE)
    home = tmp_path / "home"
    shutil.copytree(TINY_GPT2, home / "models" / "gpt2")
    monkeypatch.chdir(home)
    save_adapters(model, home / "runs" / "lora", base="models/gpt2")  # relative to the working directory
    config = json.loads((home / "runs" / "lora" / CONFIG).read_text())
    assert config["base_model_name_or_path"] == "../../models/gpt2"
    moved = tmp_path / "elsewhere"
    shutil.move(home, moved)  # another machine, another user's home
    assert base_directory(moved / "runs" / "lora") == moved / "models" / "gpt2"
    again = load_adapters(load_gpt2(moved / "models" / "gpt2"), moved / "runs" / "lora")
    np.testing.assert_array_equal(again.blocks.layers.attn.qkv.lora_b, model.blocks.layers.attn.qkv.lora_b)
    save_adapters(model, tmp_path / "hub", base="openai-community/gpt2")  # a Hub name, as given
    assert (
        json.loads((tmp_path / "hub" / CONFIG).read_text())["base_model_name_or_path"]
        == "openai-community/gpt2"
    )


def test_written_files_and_folders_follow_the_umask_as_ordinary_files_do(tmp_path):
    from eqx_gpt.files import atomic_folder

    old = os.umask(0o022)
    try:
        model = load_adapters(load_gpt2(TINY_GPT2), PEFT_FIXTURE)
        save_adapters(model, tmp_path / "adapters", base=TINY_GPT2)
        save_gpt2(load_gpt2(TINY_GPT2), tmp_path / "gpt2")
        atomic_write_bytes(tmp_path / "file", b"x")
        with atomic_folder(tmp_path / "folder") as new:
            (new / "a").write_bytes(b"a")
        (tmp_path / "ordinary").write_bytes(b"x")
        os.umask(0o077)
        atomic_write_bytes(tmp_path / "private", b"x")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "ordinary") == 0o644
    for path in [
        tmp_path / "adapters" / CONFIG, tmp_path / "adapters" / WEIGHTS, tmp_path / "gpt2" / "config.json",
        tmp_path / "gpt2" / "model.safetensors", tmp_path / "file", tmp_path / "folder" / "a",
    ]:  # fmt: skip
        assert mode(path) == 0o644, path
    assert mode(tmp_path / "adapters") == mode(tmp_path / "folder") == 0o755
    assert mode(tmp_path / "private") == 0o600


def test_a_lora_checkpoint_moved_with_its_base_loads_from_the_new_place(tmp_path):
    from eqx_gpt import CharTokenizer, save_checkpoint
    from eqx_gpt.checkpoint import load_model, read_metadata
    from eqx_gpt.gpt2 import gpt2_identity

    home = tmp_path / "home"
    shutil.copytree(TINY_GPT2, home / "gpt2")
    model = load_adapters(load_gpt2(home / "gpt2"), PEFT_FIXTURE)
    targets = "attn.c_attn,attn.c_proj,mlp.c_proj"
    train_config = {
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "lora_targets": targets,
        "init_from": str(home / "gpt2"),
    }
    tokenizer = CharTokenizer("".join(map(chr, range(256, 256 + model.config.vocab_size))))
    (home / "run").mkdir()
    saved = save_checkpoint(
        home / "run", "latest", model, None, step=1, tokenizer=tokenizer, train_config=train_config,
        lora_base=gpt2_identity(home / "gpt2"),
    )  # fmt: skip
    assert read_metadata(saved)["lora_base"]["relative_path"] == "../gpt2"
    shutil.move(home, tmp_path / "moved")  # the run and its base, together, elsewhere
    again, _, _ = load_model(tmp_path / "moved" / "run", lora="separate")
    np.testing.assert_array_equal(again.blocks.layers.attn.qkv.lora_a, model.blocks.layers.attn.qkv.lora_a)
    np.testing.assert_array_equal(again.blocks.layers.attn.qkv.weight, model.blocks.layers.attn.qkv.weight)
    (tmp_path / "moved" / "gpt2" / "config.json").write_text(
        (tmp_path / "moved" / "gpt2" / "config.json").read_text() + " "
    )  # other bytes there: not the base the adapters are for
    with pytest.raises(CheckpointError, match="holds LoRA adapters for the GPT-2 in .*, which is gone"):
        load_model(tmp_path / "moved" / "run")
