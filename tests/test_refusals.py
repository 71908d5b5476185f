"""Issue 32's classes of defect, each tested across its class: formats told apart by a marker they
check; checkpoint writes ordered so a kill never leaves `best` behind; integers range-checked where
they enter; a folder holding a run never overwritten; an older checkpoint's missing field taking
the flag or refusing it; paths compared resolved. Bad input is one line and exit code 2."""

import functools
import importlib.util
import json
import shutil
from pathlib import Path

import compiled
import jax
import numpy as np
import pytest
from runs_family import BATCH_SIZE, GROUP, MODEL, corpus, quick_runs

from eqx_gpt import (
    GPT,
    CharTokenizer,
    CheckpointError,
    GPTConfig,
    Transformer,
    TransformerConfig,
    generate,
    load_model,
    padding_mask,
    save_checkpoint,
    translate,
)
from eqx_gpt.checkpoint import BEST, LATEST, checkpoint_file, read_metadata
from eqx_gpt.gpt2 import GPT2FormatError, is_gpt2_directory, load_gpt2, read_gpt2_config
from eqx_gpt.training import run as run_module
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.options import ConfigError, resolve_options
from eqx_gpt.training.run import train
from eqx_gpt.training.run_dir import TrainingError, check_run_dir, kept_records

pytestmark = GROUP
__all__ = ["corpus", "quick_runs"]  # fixtures, used by name

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = ROOT / "tests" / "fixtures" / "tiny-gpt2"
TINY = dict(**MODEL, batch_size=BATCH_SIZE, eval_batches=1)
TINY_RUN = dict(**TINY, max_minutes=0.0, warmup_steps=2, log_interval=1)


def _cli(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"{name}_refusals", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


export_cli, sample_cli, train_cli = (
    _cli("export", "export.py"),
    _cli("sample", "sample.py"),
    _cli("train", "train.py"),
)


@functools.cache
def _translate_cli():
    """The translation example, loaded when a test needs it (it imports matplotlib: 1 s, which every
    test process would pay while collecting)."""
    return _cli("translate", "examples/translate.py")


def _one_line(capsys, *words):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


def _char_checkpoint(folder: Path, *, gpt2_shape: bool, n_chars: int = 40) -> Path:
    """A checkpoint of a character model (written directly: no training needed to test refusals)."""
    tokenizer = CharTokenizer.from_text("".join(chr(0x100 + i) for i in range(n_chars)))
    shape = dict(positions="learned", bias=True, norm="layer", tie_embeddings=True) if gpt2_shape else {}
    config = GPTConfig(vocab_size=tokenizer.vocab_size, **MODEL, **shape)  # the family's block shapes
    folder.mkdir(parents=True, exist_ok=True)
    save_checkpoint(folder, LATEST, compiled.zero_weights(GPT, config), None, step=1, tokenizer=tokenizer,
                    train_config={})  # fmt: skip
    return folder


# -- a format is identified by a marker it checks ----------------------------------------------


def test_export_refuses_a_character_model_even_of_gpt2_shape(tmp_path, capsys):
    run = _char_checkpoint(tmp_path / "run", gpt2_shape=True, n_chars=358)
    assert export_cli.main(["--checkpoint", str(run), "--out-dir", str(tmp_path / "hf")]) == 2
    _one_line(capsys, "char tokenizer, not GPT-2's BPE")
    assert not (tmp_path / "hf").exists()


def test_a_run_folder_is_read_as_its_own_checkpoints_whatever_config_json_it_holds(tmp_path):
    run = _char_checkpoint(tmp_path / "run", gpt2_shape=False)
    for config in ({"model_type": "llama"}, json.loads((TINY_GPT2 / "config.json").read_text())):
        (run / "config.json").write_text(json.dumps(config))
        model, tokenizer, meta = load_model(run)
        assert meta["format"] == "eqx_gpt-checkpoint" and tokenizer.name == "char"
    assert not is_gpt2_directory(tmp_path) and is_gpt2_directory(TINY_GPT2)
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "config.json").write_text('{"model_type": "bert"}')
    assert not is_gpt2_directory(stray)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_model(stray)


def test_folders_holding_a_model_are_never_written_into(tmp_path, capsys):
    run = _char_checkpoint(tmp_path / "run", gpt2_shape=True)
    # export into a run folder, even with --overwrite
    assert export_cli.main(["--checkpoint", str(run), "--out-dir", str(run), "--overwrite"]) == 2
    _one_line(capsys, "holds a training run")
    # a fresh run into a GPT-2 folder (so --init-from D --out-dir D too)
    hf = tmp_path / "hf"
    shutil.copytree(TINY_GPT2, hf)
    with pytest.raises(TrainingError, match="holds a Hugging Face GPT-2"):
        check_run_dir(hf, resume=False, overwrite=True)
    # the translate example into a character run's folder
    assert _translate_cli().main(["--out-dir", str(run), "--max-steps", "1"]) == 2
    _one_line(capsys, "already holds a model", "--overwrite")
    assert read_metadata(checkpoint_file(run, LATEST)).get("model", "GPT") == "GPT"


def test_export_of_an_encoder_decoder_and_a_bad_shard_index_are_one_line(tmp_path, capsys):
    config = TransformerConfig(src_vocab_size=8, tgt_vocab_size=8, max_len=8, d_model=16, n_heads=2,
                               n_encoder_layers=1, n_decoder_layers=1)  # fmt: skip
    (tmp_path / "tr").mkdir()
    save_checkpoint(tmp_path / "tr", LATEST, compiled.zero_weights(Transformer, config), None, step=1,
                    tokenizer=CharTokenizer.from_text("abcde"), train_config={})  # fmt: skip
    assert export_cli.main(["--checkpoint", str(tmp_path / "tr"), "--out-dir", str(tmp_path / "x")]) == 2
    _one_line(capsys, "encoder-decoder")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(TINY_GPT2 / "config.json", sharded)
    for weight_map in ([], {"a": "../escape.safetensors"}, {"a": 3}):
        (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(GPT2FormatError, match="weight_map must map tensor names to file names"):
            load_gpt2(sharded)


def test_gpt2_folders_given_wrongly_say_what_to_pass(tmp_path):
    with pytest.raises(GPT2FormatError, match=r"is not a folder.*pass .*tiny-gpt2/"):
        read_gpt2_config(TINY_GPT2 / "config.json")
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(TINY_GPT2 / "model.safetensors", half)
    with pytest.raises(
        CheckpointError, match="has model.safetensors but no config.json; .*download config.json"
    ):
        load_model(half)


# -- checkpoint writes: no kill leaves best behind latest ---------------------------------------


def _tiny_train(corpus, out, resume=False, **settings):
    settings = {} if resume else {**TINY_RUN, "data": str(corpus), **settings}
    return train(out_dir=out, resume=resume, sample_tokens=0, log=lambda s: None, progress=False, **settings)


def test_a_kill_between_the_best_and_latest_writes_is_redone_on_resume(corpus, tmp_path, monkeypatch):
    out, real_save = tmp_path / "run", run_module.save

    class Killed(BaseException):
        pass

    def save_then_die(run, name):
        real_save(run, name)
        if name == BEST and run.state.step == 4:
            raise Killed  # as SIGKILL would, after best and before latest

    monkeypatch.setattr(run_module, "save", save_then_die)
    with pytest.raises(Killed):
        _tiny_train(corpus, out, max_steps=4, eval_interval=2)
    best_val = read_metadata(checkpoint_file(out, BEST))["val_loss"]
    assert read_metadata(checkpoint_file(out, LATEST))["step"] == 2
    monkeypatch.setattr(run_module, "save", real_save)
    result = _tiny_train(corpus, out, max_steps=4, eval_interval=2, resume=True)
    assert not result.interrupted and result.step == 4
    assert [read_metadata(checkpoint_file(out, n))["step"] for n in (BEST, LATEST)] == [4, 4]
    assert read_metadata(checkpoint_file(out, LATEST))["val_loss"] == best_val  # the same step, redone
    assert any(
        "final_val_loss" in json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
    )


def test_a_finished_run_missing_its_final_line_finishes_on_resume(corpus, tmp_path):
    out = tmp_path / "run"
    _tiny_train(corpus, out, max_steps=4, eval_interval=2)
    # As a kill during the final validation leaves it: the checkpoints complete, no final line.
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if "final_val_loss" not in line))
    result = _tiny_train(corpus, out, max_steps=4, eval_interval=2, resume=True)
    assert result.step == 4 and not result.interrupted
    assert "final_val_loss" in json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    with pytest.raises(ValueError, match="already finished at step 4"):
        _tiny_train(corpus, out, max_steps=4, eval_interval=2, resume=True)


# -- integers from outside are range-checked where they enter -----------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--top-k", "3000000000"], "--top-k: must be an integer in [1, 2147483647]"),
        (["--seed", "18446744073709551616"], "--seed: must be an integer in [0, 9223372036854775807]"),
        (["--max-new-tokens", "99999999999"], "--max-new-tokens: must be an integer in [0, 2147483647]"),
    ],
)
def test_sample_py_range_checks_its_integers(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        sample_cli.parse_args(argv)
    assert exit_.value.code == 2
    _one_line(capsys, words)


def test_integers_past_what_jax_holds_are_refused_by_the_library_and_train_py(tmp_path, capsys):
    model = compiled.zero_weights(GPT, GPTConfig(vocab_size=5, **MODEL))
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, 2147483647\]"):
        generate(model, [1], 2, key=jax.random.key(0), top_k=2**40)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer in"):
        generate(model, [1], 2**40, key=jax.random.key(0))
    with pytest.raises(ValueError, match="seed must be an integer in"):
        TrainConfig(seed=2**64)
    with pytest.raises(ValueError, match=r"GPTConfig.d_model must be an integer in \[1, 2147483647\]"):
        GPTConfig(vocab_size=5, d_model=2**40)
    assert train_cli.main(["--seed", str(2**64), "--out-dir", str(tmp_path / "x")]) == 2
    _one_line(capsys, "seed must be an integer in [0, 9223372036854775807]")


def test_checkpoint_metadata_and_metrics_of_the_wrong_type_are_one_line(tmp_path):
    run = _char_checkpoint(tmp_path / "run", gpt2_shape=False)
    path = checkpoint_file(run, LATEST)
    meta = json.loads(path.read_text())
    for key, bad in (("step", "20"), ("step", -1), ("step", True), ("val_loss", "low"), ("tokenizer", [])):
        path.write_text(json.dumps({**meta, key: bad}))
        with pytest.raises(CheckpointError, match=f"'{key}' is .*the file is corrupt"):
            read_metadata(path)
    for record in ({"step": "x"}, {"step": 3, "loss": "high"}, {"loss": 1.0}):
        (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        with pytest.raises(TrainingError, match="metrics.jsonl line 1: .*fix or delete that line"):
            kept_records(run / "metrics.jsonl", keep_until=5)


# -- an older checkpoint's missing field; paths compared resolved; the culprit named ------------


CHECKPOINT = {
    "path": "/runs/a/latest.json",
    "model_config": {"vocab_size": 65, "d_model": 32, "n_heads": 2, "n_layers": 1, "context_length": 16},
    "train_config": {
        "max_steps": 10,
        "init_from": str(TINY_GPT2),
        "tokenizer": "gpt2",
    },  # written before schedule existed
    "tokenizer": {"kind": "gpt2", "vocab_size": 512},
}


def test_a_flag_for_a_field_an_older_checkpoint_lacks_is_its_default_or_refused():
    assert resolve_options({"schedule": "cosine"}, CHECKPOINT).train.schedule == "cosine"
    with pytest.raises(
        ConfigError,
        match=r"schedule='wsd' contradicts .*schedule='cosine', the default of a checkpoint older than sched",
    ):
        resolve_options({"schedule": "wsd", "decay_fraction": 0.9}, CHECKPOINT)


def test_paths_compare_resolved_and_a_presets_values_are_blamed_on_the_preset(monkeypatch):
    monkeypatch.chdir(TINY_GPT2.parent)
    assert resolve_options({"init_from": "tiny-gpt2"}, CHECKPOINT).train.init_from == str(TINY_GPT2)
    with pytest.raises(ConfigError, match=r"preset='shakespeare-char' \(it sets context_length=256\)"):
        resolve_options({"preset": "shakespeare-char"}, CHECKPOINT)


# -- translate: what it cannot read ------------------------------------------------------------


def test_translate_refuses_empty_sources_and_ids_outside_the_vocabulary():
    config = TransformerConfig(src_vocab_size=8, tgt_vocab_size=8, max_len=8, d_model=16, n_heads=2,
                               n_encoder_layers=1, n_decoder_layers=1)  # fmt: skip
    model = compiled.zero_weights(Transformer, config)  # the export test's
    for src in (np.zeros((1, 0), np.int32), np.zeros((0, 3), np.int32)):
        with pytest.raises(ValueError, match="neither 0"):
            translate(model, src, 4, bos_id=1, eos_id=2, temperature=0)
    for bos, eos in ((8, 2), (1, -1), (1, 2.0)):
        with pytest.raises(ValueError, match=r"_id must be a target id in \[0, tgt_vocab_size=8\)"):
            translate(model, np.ones((1, 3), np.int32), 4, bos_id=bos, eos_id=eos, temperature=0)


def test_translate_py_refuses_bad_settings_before_work_and_text_it_cannot_read(tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "x")]
    for argv, words in (
        (["--max-steps", "0"], "--max-steps: must be an integer in [1, 2147483647]"),
        (["--no-such-flag"], "unrecognized arguments"),
    ):
        with pytest.raises(SystemExit) as exit_:
            _translate_cli().main([*argv, *out])
        assert exit_.value.code == 2
        _one_line(capsys, words)
    assert _translate_cli().main(["--d-model", "30", *out]) == 2  # before any pair is built
    _one_line(capsys, "d_model=30 must be even and divisible by n_heads")
    vocab = _translate_cli().CharVocab(["abc-0123456789"])
    with pytest.raises(ValueError, match="'3Ж' holds 'Ж', not among the 14 characters"):
        vocab.encode("3Ж", strict=True)
    assert vocab.encode("a Ж") == vocab.encode("a")  # training data: unseen characters dropped


def test_padding_mask_refuses_lengths_that_are_not_whole_numbers_within_the_keys():
    for lengths, kv_seq in (([-1], 4), ([2.5], 4), ([5], 4), ([1], -2)):
        with pytest.raises(ValueError, match="padding_mask"):
            padding_mask(jax.device_put(np.asarray(lengths)), kv_seq=kv_seq)  # jnp.asarray compiles
    mask = padding_mask(jax.device_put(np.asarray([0, 4])), kv_seq=4)
    np.testing.assert_array_equal(np.asarray(mask)[:, -1], [False, True])


# -- training refusals: one line, exit 2, before any work ---------------------------------------


def test_a_symlink_loop_given_as_init_from_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("loop").symlink_to("loop")
    with pytest.raises(ConfigError, match="--init-from loop: a loop of symbolic links"):
        resolve_options({"init_from": "loop"})
    with pytest.raises(ConfigError, match="--init-from loop: a loop of symbolic links"):
        resolve_options({"init_from": "loop"}, CHECKPOINT)  # on resume, compared resolved
    assert train_cli.main(["--init-from", "loop", "--out-dir", "run"]) == 2
    _one_line(capsys, "--init-from loop: a loop of symbolic links; pass a path that resolves")
    assert not Path("run").exists()


def test_init_from_under_another_preset_takes_gpt2s_tokenizer_and_blames_only_a_given_one():
    options = resolve_options({"init_from": str(TINY_GPT2), "preset": "cpu"})
    assert options.train.tokenizer == "gpt2"
    with pytest.raises(ConfigError, match="not 'char'; leave out tokenizer"):  # a Python caller's words
        resolve_options({"init_from": str(TINY_GPT2), "preset": "cpu", "tokenizer": "char"})


def test_a_resume_on_another_corpus_is_refused_in_one_line_with_no_progress_line(
    corpus, tmp_path, monkeypatch, capsys
):
    from eqx_gpt.data import prepare as prepare_module

    monkeypatch.setenv("EQX_GPT_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepare_module, "IN_MEMORY_BYTES", 0)  # through the cache: hashed, with a bar
    out, other = tmp_path / "run", tmp_path / "other.txt"
    other.write_text(corpus.read_text(encoding="utf-8").upper(), encoding="utf-8")
    tokenizer = CharTokenizer.from_text(corpus.read_text(encoding="utf-8"))
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        **{k: TINY[k] for k in ("d_model", "n_heads", "n_layers", "context_length")},
    )
    train_config = TrainConfig(data=str(corpus), batch_size=4, eval_batches=1).to_dict()
    out.mkdir()
    save_checkpoint(out, LATEST, GPT(config, key=jax.random.key(0)), None, step=1, tokenizer=tokenizer,
                    train_config=train_config, data=str(corpus), data_sha256="0" * 64)  # fmt: skip
    assert train_cli.main(["--resume", "--out-dir", str(out), "--data", str(other)]) == 2
    _one_line(capsys, f"{other} is not the corpus the checkpoint in {out}/ was trained on")


def test_a_path_the_log_cannot_print_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    import io
    import sys

    strict = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", strict)  # as a UTF-8 locale's output is
    out = tmp_path / "run\udcff"  # the bytes b"run\xff", as Python holds a name that is not UTF-8
    assert train_cli.main(["--out-dir", str(out)]) == 2
    _one_line(capsys, "run\\udcff': its name is not valid utf-8, so the run's log cannot print it; rename it")
    assert not out.exists()


@pytest.mark.slow  # a new Python process; the test above checks the same refusal in this one
def test_a_path_the_log_cannot_print_is_refused_by_train_py_under_a_strict_locale(tmp_path):
    import subprocess
    import sys

    # With the locale's strict output rather than a replaced stream.
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "PYTHONIOENCODING": "utf-8", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-X", "utf8=0", str(ROOT / "train.py"), "--out-dir", b"run\xff"],
        cwd=tmp_path, env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2 and err.count("\n") == 1 and "cannot print it" in err, err
    assert not (tmp_path / "run\udcff").exists()
