"""`train.py` end to end on a tiny model: outputs, kill-and-resume, Ctrl-C, and every bad input."""

import dataclasses
import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import pytest
from runs_family import GROUP, MODEL, corpus, loss_plot_drawn, quick_runs

import eqx_gpt.training.run as run_module
from eqx_gpt import GPT, CharTokenizer, GPTConfig, TrainResult, load_model, save_checkpoint, train
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.options import resolve_options
from eqx_gpt.training.presets import DEFAULT_PRESET, FINETUNE_PRESET, PRESETS

pytestmark = GROUP
__all__ = ["corpus", "loss_plot_drawn", "quick_runs"]  # fixtures, used by name

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
train_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_cli)

TINY = [  # runs_family's model and batch: the family's runs share their compiled programs
    "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--context-length", "16",
    "--batch-size", "4", "--eval-batches", "2", "--warmup-steps", "5", "--max-minutes", "0",
    "--sample-tokens", "0", "--log-interval", "1",
]  # fmt: skip
RESUME_STEPS = ["--max-steps", "300", "--eval-interval", "10"]


def _records(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _losses(out):
    """Per-step training losses and per-evaluation losses: what must match bit for bit."""
    records = _records(out)
    train = {r["step"]: r["loss"] for r in records if "loss" in r}
    evals = {r["step"]: (r["train_loss"], r["val_loss"]) for r in records if "val_loss" in r}
    return train, evals


def test_a_tiny_run_writes_metrics_plot_checkpoints_and_a_sample(tmp_path, corpus, capsys, loss_plot_drawn):
    out = tmp_path / "run"
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(out), "--max-steps", "12", "--eval-interval", "6"]
    assert train_cli.main([*argv, "--sample-tokens", "40"]) == 0
    stdout = capsys.readouterr().out
    assert "parameters" in stdout and "schedule: Muon (momentum 0.95" in stdout and "sample" in stdout
    # The cpu preset's speedrun changes (issue 33) reach the optimiser the run builds.
    assert "3 Newton-Schulz steps, query, key and value apart" in stdout and "no gradient clipping" in stdout
    assert "block matrices: lr 0.04, weight decay 0.15;" in stdout
    records = _records(out)
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 13))
    assert all(r["tokens_per_s"] > 0 and r["lr"] > 0 for r in logged)
    assert [r["step"] for r in records if "val_loss" in r] == [0, 6, 12]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, tokenizer, meta = load_model(out)
    assert meta["step"] in (6, 12) and tokenizer.vocab_size == model.config.vocab_size


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("uninterrupted")
    assert train_cli.main([*TINY, *RESUME_STEPS, "--data", str(corpus), "--out-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A finished run, for the refusals to resume it: 12 steps (the kill-and-resume tests' 300-step
    run is longer than they need)."""
    out = tmp_path_factory.mktemp("finished")
    argv = [*TINY, "--max-steps", "12", "--eval-interval", "6", "--data", str(corpus), "--out-dir", str(out)]
    assert train_cli.main(argv) == 0
    return out


def _start_and_stop(out, corpus, sig, while_running=None, extra=()):
    """Run train.py in a subprocess and send `sig` once its checkpoint at step >= 10 exists
    (after calling `while_running(proc)`)."""
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, *RESUME_STEPS, *extra]
    cmd += ["--data", str(corpus), "--out-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((out / "latest.json").read_text())["step"] >= 10:
                if while_running is not None:
                    while_running(proc)
                proc.send_signal(sig)
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.002)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


@pytest.mark.slow
def test_a_run_killed_and_resumed_matches_one_never_stopped(tmp_path, corpus, uninterrupted, capsys):
    out = tmp_path / "killed"
    argv = [*TINY, *RESUME_STEPS, "--data", str(corpus), "--out-dir", str(out)]

    def while_running(proc):  # a second run into the folder of a live one is refused, naming it
        _fails(argv, capsys, f"is in use by a live run (pid {proc.pid} on")
        _fails([*argv, "--resume"], capsys, f"is in use by a live run (pid {proc.pid} on")

    rc, _, _ = _start_and_stop(out, corpus, signal.SIGKILL, while_running)
    assert rc == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = json.loads((out / "latest.json").read_text())["step"]
    assert 10 <= killed_at < 300
    assert train_cli.main([*argv, "--resume"]) == 0  # the killed run's lock is taken over
    assert "took over" in capsys.readouterr().out
    # The default optimiser is Muon: its checkpoint loads in sample.py.
    from test_sample_cli import load_cli, sample

    code, text, err = sample(
        load_cli(), capsys, "--checkpoint", str(out), "--prompt", "RO", "--max-new-tokens", "9"
    )
    assert code == 0 and text.startswith("RO") and len(text) == 2 + 9 + 1, err
    expected, resumed = _losses(uninterrupted), _losses(out)
    assert resumed == expected  # every step's loss and every evaluation, bit for bit
    assert sorted(resumed[0]) == list(range(1, 301))


@pytest.mark.slow
def test_ctrl_c_saves_and_says_how_to_resume(tmp_path, corpus, uninterrupted):
    out = tmp_path / "interrupted"
    # Steps logged every 7 (a flag a resume may change): the interrupted step is logged anyway.
    rc, stdout, stderr = _start_and_stop(out, corpus, signal.SIGINT, extra=["--log-interval", "7"])
    assert rc == 130, stderr
    assert f"Resume with: uv run train.py --resume --out-dir {out}" in stdout
    assert "Traceback" not in stderr
    # The interrupt checkpoint names the step its loss belongs to, and the last step is logged.
    meta, records = json.loads((out / "latest.json").read_text()), _records(out)
    last_eval = [r for r in records if "val_loss" in r][-1]
    assert (meta["val_loss_step"], meta["val_loss"]) == (last_eval["step"], last_eval["val_loss"])
    assert max(r["step"] for r in records) == meta["step"]
    assert (
        train_cli.main([*TINY, *RESUME_STEPS, "--data", str(corpus), "--out-dir", str(out), "--resume"]) == 0
    )
    resumed, expected = _losses(out), _losses(uninterrupted)
    assert resumed[1] == expected[1]  # every evaluation, bit for bit
    assert resumed[0] == {s: loss for s, loss in expected[0].items() if s in resumed[0]}
    assert meta["step"] in resumed[0] and set(range(meta["step"] + 1, 301)) <= set(resumed[0])


def test_an_abort_says_whether_there_is_a_checkpoint_to_resume(tmp_path, corpus, monkeypatch, capsys):
    # A Ctrl-C during start-up reaches train.py as KeyboardInterrupt, before any checkpoint exists.
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "_train", interrupted)
    out = tmp_path / "run"
    assert train_cli.main([*TINY, "--data", str(corpus), "--out-dir", str(out)]) == 130
    err = capsys.readouterr().err
    assert "nothing to resume" in err and "--resume" not in err, err
    out.mkdir()
    (out / "latest.json").write_text("{}")
    assert train_cli.main([*TINY, "--data", str(corpus), "--out-dir", str(out)]) == 130
    assert f"uv run train.py --resume --out-dir {out}" in capsys.readouterr().err


def _fails(argv, capsys, message):
    try:
        rc = train_cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]  # progress lines may precede it
    assert len(errors) == 1 and message in errors[0] and err.splitlines()[-1] == errors[0], err
    assert "Traceback" not in err


def test_bad_data_files(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("To be, or not to be: that is the question.")
    (tmp_path / "latin1.txt").write_bytes("Roméo et Juliette".encode("latin-1"))
    for name, message in [
        ("missing.txt", "does not exist"),
        ("empty.txt", "is empty"),
        ("short.txt", "fewer than one window of context_length + 1 = 17"),
        ("latin1.txt", "is not UTF-8"),
    ]:
        _fails([*TINY, "--data", str(tmp_path / name), "--out-dir", str(tmp_path / "out")], capsys, message)


def test_bad_flags_and_output_folders(tmp_path, corpus, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    data = ["--data", str(corpus)]
    _fails([*TINY, *data, "--out-dir", str(a_file / "out")], capsys, "cannot write to output folder")
    _fails([*TINY, *data, "--out-dir", str(tmp_path / "none"), "--resume"], capsys, "no checkpoint in")
    _fails([*TINY, "--bogus", "1"], capsys, "unrecognized arguments: --bogus")
    _fails([*TINY, "--preset", "gpu"], capsys, "invalid choice: 'gpu'")
    _fails([*TINY, "--d-model", "30", "--n-heads", "4"], capsys, "not divisible by n_heads=4")
    _fails([*TINY, "--batch-size", "6", "--grad-accum", "4"], capsys, "not divisible by grad_accum")
    # Integers range-checked where they enter, not when the run ends and the sample is drawn.
    _fails([*TINY, "--sample-tokens", "99999999999"], capsys, "must be an integer in [0, 2147483647]")
    _fails([*TINY, "--warmup-steps", "-1"], capsys, "warmup_steps must be an integer in [0, 2147483647]")
    with pytest.raises(ValueError, match="sample_tokens must be an integer in"):
        train(out_dir=tmp_path / "never", sample_tokens=-1)
    assert not (tmp_path / "never").exists()


def test_resume_rejects_flags_that_contradict_the_checkpoint(finished, corpus, capsys):
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(finished), "--resume"]
    _fails([*argv, "--d-model", "64"], capsys, "--d-model 64 contradicts the checkpoint")
    _fails([*argv, "--lr", "0.5"], capsys, "--lr 0.5 contradicts the checkpoint")
    _fails(argv, capsys, "already finished at step 12")


def test_resume_refuses_what_it_cannot_honour_and_touches_nothing(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = ["--out-dir", str(out), "--resume"]
    # A preset named on resume is blamed for its own values, not a flag that was never given.
    blame = "--preset shakespeare-char (it sets context_length="
    _fails([*argv, "--preset", "shakespeare-char"], capsys, blame)
    # A flag whose field an older checkpoint lacks is compared with the default it ran with.
    latest = out / "latest.json"
    meta = json.loads(latest.read_text())
    for name in ("schedule", "decay_fraction"):
        del meta["train_config"][name]
    latest.write_text(json.dumps(meta))
    _fails([*argv, "--schedule", "wsd", "--decay-fraction", "0.9"], capsys,
           "--schedule wsd contradicts the checkpoint")  # fmt: skip
    latest.write_bytes(before["latest.json"])
    # A hand-edited metrics.jsonl is refused before the run starts.
    metrics = out / "metrics.jsonl"
    metrics.write_bytes(before["metrics.jsonl"] + b'{"step": "x"}\n')
    line = len(before["metrics.jsonl"].splitlines()) + 1
    _fails(argv, capsys, f"metrics.jsonl line {line}: 'step' is 'x', not a whole number")
    metrics.write_bytes(before["metrics.jsonl"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_resuming_a_checkpoint_on_a_text_of_other_characters_says_which_text_to_pass(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    tokenizer = CharTokenizer.from_text("abcdefgh")  # a run on a text of 8 characters, no corpus recorded
    config = GPTConfig(vocab_size=8, **MODEL)
    model = GPT(config, key=jax.random.key(0))
    save_checkpoint(out, "latest", model, None, step=1, tokenizer=tokenizer, train_config={"max_steps": 5})
    _fails(["--out-dir", str(out), "--resume"], capsys, "not the text the run trained on; pass that with")


# A run that diverges at once: AdamW's compiled step leaves its rates out (they scale its updates
# from outside), so these runs share the step of the preset run below instead of compiling their own.
DIVERGING = ["--preset", "shakespeare-char", *TINY, "--lr", "1e30", "--min-lr", "1e30", "--warmup-steps", "0"]


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, corpus, capsys):
    out = tmp_path / "diverged"
    argv = [*DIVERGING, "--data", str(corpus), "--out-dir", str(out)]
    _fails([*argv, "--max-steps", "20", "--eval-interval", "10"], capsys, "loss became")
    meta = json.loads((out / "latest.json").read_text())
    assert meta["step"] == 0  # the checkpoint written before training diverged
    load_model(out)


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# 14 whole runs: three in the quick suite (one step; several, with and without a time limit), all
# 14 in the slow one.
QUICK_STOPS = {(1, "0"), (9, "30"), (24, "0")}


@pytest.mark.parametrize(
    ("max_steps", "minutes"),
    [
        pytest.param(steps, minutes, marks=[] if (steps, minutes) in QUICK_STOPS else pytest.mark.slow)
        for minutes in ("0", "30")
        for steps in (1, 7, 8, 9, 20, 24, 25)
    ],
)
def test_a_run_stops_at_exactly_max_steps_with_and_without_a_time_limit(tmp_path, corpus, max_steps, minutes):
    out = tmp_path / "run"
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(out), "--max-minutes", minutes]
    assert train_cli.main([*argv, "--max-steps", str(max_steps)]) == 0
    records = _records(out)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, max_steps + 1))
    assert max(r["step"] for r in records) == max_steps
    meta = json.loads((out / "latest.json").read_text())
    assert meta["step"] == meta["schedule_steps"] == max_steps


def test_a_folder_holding_a_run_is_refused_unchanged_unless_overwrite_is_given(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(out), "--max-steps", "4"]
    assert train_cli.main(argv) == 0
    before = _snapshot(out)
    _fails(argv, capsys, f"{out}/ already holds a run (step 4, val loss")
    _fails([*argv, "--lr", "0.01"], capsys, "pass --resume to continue it, another --out-dir")
    # Checks that fail after the folder check must not touch the run either, even with --overwrite.
    _fails([*argv, "--overwrite", "--context-length", "40000"], capsys, "fewer than one window")
    _fails([*argv, "--overwrite", "--data", str(tmp_path / "missing.txt")], capsys, "does not exist")
    _fails([*argv, "--overwrite", "--resume"], capsys, "pass one")
    assert _snapshot(out) == before
    assert train_cli.main([*argv, "--overwrite", "--max-steps", "2"]) == 0
    assert json.loads((out / "latest.json").read_text())["step"] == 2
    assert max(r["step"] for r in _records(out)) == 2  # the old metrics are gone too


def _configs_given_to_train(monkeypatch, argv):
    seen = {}

    def fake_train(settings, out_dir, **kwargs):
        options = resolve_options(settings)
        seen.update(model=options.model.config(65), train=options.train, preset=options.preset)
        # The model's shapes only (the preset's GPT must build; its weights would cost a compile of
        # every initialiser, 124M of them for gpt2-124m): the command reads no weight of the result.
        model = eqx.filter_eval_shape(GPT, options.model.config(65), key=jax.random.key(0))
        return TrainResult(model, CharTokenizer("ab"), 0, None, None, 0.0, False, None, out_dir)

    monkeypatch.setattr(run_module, "_train", fake_train)
    assert train_cli.main(argv) == 0
    return seen


@pytest.mark.parametrize("name", sorted(set(PRESETS) - {FINETUNE_PRESET}))
def test_a_fresh_run_builds_exactly_the_chosen_presets_configs(monkeypatch, name):
    preset = PRESETS[name]
    seen = _configs_given_to_train(monkeypatch, ["--preset", name])
    assert seen["model"] == GPTConfig(vocab_size=65, **preset.model)
    assert seen["train"] == TrainConfig(**preset.train)
    assert seen["preset"] == name
    # An explicit flag overrides the preset's value and nothing else.
    seen = _configs_given_to_train(monkeypatch, ["--preset", name, "--lr", "0.0123", "--n-layers", "3"])
    assert seen["train"] == TrainConfig(**{**preset.train, "lr": 0.0123})
    assert seen["model"] == GPTConfig(vocab_size=65, **{**preset.model, "n_layers": 3})


def test_init_from_picks_the_fine_tuning_preset_and_its_options(monkeypatch):
    preset = PRESETS[FINETUNE_PRESET]
    seen = _configs_given_to_train(monkeypatch, ["--init-from", "gpt2-dir", "--max-steps", "7"])
    assert seen["preset"] == FINETUNE_PRESET
    init_from = str(Path("gpt2-dir").resolve())  # recorded absolute: the run resumes from anywhere
    assert seen["train"] == TrainConfig(**{**preset.train, "init_from": init_from, "max_steps": 7})
    assert seen["model"].context_length == preset.model["context_length"]


def test_without_preset_the_default_preset_is_used(monkeypatch):
    seen = _configs_given_to_train(monkeypatch, [])
    assert seen["train"] == TrainConfig(**PRESETS[DEFAULT_PRESET].train) and seen["preset"] == DEFAULT_PRESET


def _resolved_by_train(monkeypatch, *args, **kwargs):
    """The configs `eqx_gpt.train(*args, **kwargs)` would run with (nothing is trained)."""
    seen = {}

    def fake_train(settings, out_dir, **_):
        options = resolve_options(settings)
        seen.update(model=options.model, train=options.train, preset=options.preset)
        return None

    monkeypatch.setattr(run_module, "_train", fake_train)
    train(*args, **kwargs)
    return seen


def test_train_from_python_lays_the_fields_a_config_was_given_over_the_preset_and_keywords_over_both(
    monkeypatch,
):
    cpu = PRESETS[DEFAULT_PRESET]
    # A TrainConfig passed gives the fields it was constructed with, as keywords would: the rest
    # of the recipe (Muon, its rates, batch) is the preset's.
    config = TrainConfig(max_steps=40, lr=3e-3)
    seen = _resolved_by_train(monkeypatch, config, d_model=64)
    assert seen["train"] == TrainConfig(**{**cpu.train, "max_steps": 40, "lr": 3e-3})
    assert seen["train"].optimizer == "muon" and seen["preset"] == DEFAULT_PRESET
    assert seen["model"].config(65) == GPTConfig(vocab_size=65, **{**cpu.model, "d_model": 64})
    assert _resolved_by_train(monkeypatch, max_steps=40, lr=3e-3, d_model=64) == seen  # the same run
    # A field given its default value is given all the same: the preset's Muon is overridden.
    seen = _resolved_by_train(monkeypatch, TrainConfig(optimizer="adamw", beta1=0.9))
    assert seen["train"].optimizer == "adamw" and seen["train"].beta1 == 0.9
    assert seen["train"].lr == cpu.train["lr"]
    # Keywords override the config and the preset; a GPTConfig gives the fields it was given.
    model = GPTConfig(vocab_size=1, d_model=48, n_heads=4, n_layers=1)
    seen = _resolved_by_train(monkeypatch, config, model, max_steps=7, context_length=32)
    assert seen["train"] == TrainConfig(**{**cpu.train, "max_steps": 7, "lr": 3e-3})
    expected = {**cpu.model, "d_model": 48, "n_heads": 4, "n_layers": 1, "context_length": 32}
    assert seen["model"].config(1) == GPTConfig(vocab_size=1, **expected)
    # preset=None: the dataclass defaults under what is given.
    seen = _resolved_by_train(monkeypatch, config, preset=None)
    assert seen["train"] == config and seen["preset"] is None
    seen = _resolved_by_train(monkeypatch, preset=None)
    assert seen["train"] == TrainConfig() and seen["preset"] is None


def test_the_readme_python_example_trains_the_cpu_presets_muon_recipe(monkeypatch):
    # The README's "Train from Python" config and keywords, as written there.
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = text[text.index("### Train from Python") :]
    config_line = re.search(r"^config = (TrainConfig\(.*\))$", block, re.M)
    call_line = re.search(r"^result = train\(config, (.*)\)$", block, re.M)
    assert config_line and call_line, "the README's example changed shape: update this test"
    config = eval(config_line.group(1), {"TrainConfig": TrainConfig})
    keywords = eval(f"dict({call_line.group(1)})")
    keywords = {k: v for k, v in keywords.items() if k in {f.name for f in dataclasses.fields(GPTConfig)}}
    seen = _resolved_by_train(monkeypatch, config, **keywords)
    cpu = TrainConfig(**PRESETS[DEFAULT_PRESET].train)
    assert seen["preset"] == DEFAULT_PRESET and seen["train"].optimizer == "muon"
    for name in ("lr", "adam_lr", "min_lr", "beta1", "beta2", "weight_decay", "muon_ns_steps", "grad_clip"):
        assert getattr(seen["train"], name) == getattr(cpu, name), name


def test_help_shows_the_defaults_of_the_preset_named(capsys):
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--help", "--preset", "shakespeare-char"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(defaults: the shakespeare-char preset)" in text
    assert "(default: 384)" in text and "(default: 0.2)" in text


def test_a_preset_run_records_its_configs_and_resume_keeps_them(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    argv = ["--preset", "shakespeare-char", *TINY, "--data", str(corpus), "--out-dir", str(out)]
    assert train_cli.main([*argv, "--max-steps", "2"]) == 0
    assert "6 layers" not in capsys.readouterr().out  # TINY's sizes override the preset's
    meta = json.loads((out / "latest.json").read_text())
    assert meta["preset"] == "shakespeare-char"
    assert meta["train_config"]["lr"] == PRESETS["shakespeare-char"].train["lr"]
    assert meta["model_config"]["dropout"] == PRESETS["shakespeare-char"].model["dropout"]
    # --resume without --preset continues with the checkpoint's values, not the default preset's.
    resume = ["--out-dir", str(out), "--resume", "--max-steps", "4", "--sample-tokens", "0"]
    assert train_cli.main(resume) == 0
    meta = json.loads((out / "latest.json").read_text())
    assert meta["step"] == 4 and meta["preset"] == "shakespeare-char"
    assert meta["train_config"]["lr"] == PRESETS["shakespeare-char"].train["lr"]


ADAMW = ["--optimizer", "adamw", "--lr", "0.004", "--min-lr", "0.0004"]


@pytest.mark.slow
def test_an_adamw_run_killed_and_resumed_matches_one_never_stopped(tmp_path, corpus, capsys):
    never, out = tmp_path / "never", tmp_path / "killed"
    argv = [*TINY, *RESUME_STEPS, *ADAMW, "--data", str(corpus)]
    assert train_cli.main([*argv, "--out-dir", str(never)]) == 0
    assert "schedule: AdamW, lr warm-up 0 -> 0.004" in capsys.readouterr().out
    rc, _, _ = _start_and_stop(out, corpus, signal.SIGKILL, extra=ADAMW)
    assert rc == -signal.SIGKILL, "the run finished before it could be killed"
    assert train_cli.main([*argv, "--out-dir", str(out), "--resume"]) == 0
    assert _losses(out) == _losses(never)  # bit for bit: the AdamW state is in the checkpoint


def test_a_split_qkv_run_resumes_with_its_split_muon_state(tmp_path, corpus, capsys):
    # Under --muon-split-qkv Muon's momentum of w_qkv is kept as (layers, d, 3, d): a resumed run
    # must rebuild that optimiser from the checkpoint's config to read its state back.
    argv = [*TINY, "--data", str(corpus), "--out-dir", str(tmp_path / "run"), "--eval-interval", "4"]
    assert train_cli.main([*argv, "--muon-split-qkv", "--max-steps", "4"]) == 0
    assert "query, key and value apart" in capsys.readouterr().out
    _fails(
        [*argv, "--resume", "--no-muon-split-qkv"],
        capsys,
        "--muon-split-qkv False contradicts the checkpoint",
    )
    assert train_cli.main([*argv, "--resume", "--max-steps", "8"]) == 0
    assert "query, key and value apart" in capsys.readouterr().out
    assert [r["step"] for r in _records(tmp_path / "run") if "loss" in r] == list(range(1, 9))
