"""One resolver decides where every setting of a run comes from (`resolve_options`)."""

import dataclasses

import pytest

from eqx_gpt.model.config import GPTConfig
from eqx_gpt.training.config import TrainConfig, spoken_as_command
from eqx_gpt.training.options import INIT_FROM_OPTIONS, ConfigError, ModelSettings, resolve_options
from eqx_gpt.training.presets import PRESETS

CHECKPOINT = {
    "path": "/runs/a/latest.json",
    "preset": "cpu",
    "model_config": {**dataclasses.asdict(GPTConfig(vocab_size=65, **PRESETS["cpu"].model))},
    "train_config": TrainConfig(**PRESETS["cpu"].train).to_dict(),
}


def test_a_fresh_run_is_defaults_then_preset_then_settings():
    options = resolve_options({"preset": "cpu-adamw", "lr": 0.01, "n_layers": 2})
    assert options.train == TrainConfig(**{**PRESETS["cpu-adamw"].train, "lr": 0.01})
    assert not hasattr(options.model, "vocab_size")  # the tokenizer's, known once the data is read
    assert options.model.n_layers == 2 and options.model.d_model == PRESETS["cpu-adamw"].model["d_model"]
    assert options.preset == "cpu-adamw" and options.checkpoint is None
    default = resolve_options({})
    assert default.preset == "cpu" and default.train == TrainConfig(**PRESETS["cpu"].train)
    bare = resolve_options({"preset": None, "max_steps": 5})  # no preset: the dataclass defaults
    assert bare.train == TrainConfig(max_steps=5) and bare.model.d_model == GPTConfig(vocab_size=1).d_model


def test_a_resumed_run_is_the_checkpoint_then_the_settings_that_may_change():
    options = resolve_options({"max_steps": 30_000, "log_interval": 5}, CHECKPOINT)
    assert options.train == TrainConfig(**{**PRESETS["cpu"].train, "max_steps": 30_000, "log_interval": 5})
    assert options.model.config(65) == GPTConfig(**CHECKPOINT["model_config"])
    assert options.preset == "cpu" and options.checkpoint is CHECKPOINT
    cpu_lr = PRESETS["cpu"].train["lr"]
    assert resolve_options({"lr": cpu_lr}, CHECKPOINT).train.lr == cpu_lr  # agrees: fine
    # A Python caller is told of keywords; train.py's user of flags (`spoken_as_command`).
    with pytest.raises(ConfigError, match=rf"^lr=0.5 contradicts the checkpoint in /runs/a \(lr={cpu_lr}\)"):
        resolve_options({"lr": 0.5}, CHECKPOINT)
    with (
        spoken_as_command("train.py"),
        pytest.raises(ConfigError, match=r"^--lr 0.5 contradicts .*--out-dir"),
    ):
        resolve_options({"lr": 0.5}, CHECKPOINT)
    with pytest.raises(ConfigError, match="d_model=64 contradicts .* pass another out_dir"):
        resolve_options({"d_model": 64}, CHECKPOINT)
    # A preset named anew counts as settings for its values: cpu-adamw's batch size contradicts.
    with pytest.raises(ConfigError, match=r"preset='cpu-adamw' \(it sets batch_size=16\) contradicts"):
        resolve_options({"preset": "cpu-adamw"}, CHECKPOINT)


@pytest.mark.parametrize(
    "settings, words",
    [({"learning_rate": 1.0}, "unknown setting"), ({"preset": "gpu"}, "unknown preset"),
     ({"lr": -1.0}, "lr must be > 0, got lr=-1.0"),
     ({"preset": "finetune-shakespeare"}, "pass init_from DIR")],
)  # fmt: skip
def test_settings_that_cannot_make_a_run_are_one_line_errors(settings, words):
    with pytest.raises(ConfigError, match=words) as error:
        resolve_options(settings)
    assert "\n" not in str(error.value)


def test_a_fresh_runs_settings_are_checked_before_any_data_and_a_presets_values_named_as_its():
    # The model's settings are checked here, before a corpus (here: none) is read or tokenized.
    with pytest.raises(ConfigError, match=r"d_model=30 is not divisible by n_heads=4") as error:
        resolve_options({"d_model": 30, "n_heads": 4, "data": "/no/such/corpus"})
    assert "preset" not in str(error.value)  # both were given
    with pytest.raises(ConfigError, match=r"n_heads=6 from the shakespeare-char preset\)$"):
        resolve_options({"preset": "shakespeare-char", "d_model": 100})
    with pytest.raises(ConfigError, match=r"min_lr=0.0004 from the cpu-adamw preset\)$"):
        resolve_options({"preset": "cpu-adamw", "lr": 1e-4})


@pytest.mark.parametrize(
    "settings, words",
    [({"warmup_steps": 1.5}, "warmup_steps must be an integer in [0, 2147483647]"),
     ({"warmup_steps": 2**31}, "warmup_steps must be an integer"), ({"fsdp": "yes"}, "fsdp must be True"),
     ({"data": 5}, "data must be a path"), ({"seed": -1}, "seed must be an integer in [0, "),
     ({"scan_unroll": 2**40}, "scan_unroll must be an integer in [1, 2147483647]")],
)  # fmt: skip
def test_every_setting_is_range_and_type_checked_where_it_enters(settings, words):
    with pytest.raises(ConfigError) as error:
        resolve_options(settings)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_resumed_schedule_keeps_its_refitted_length_unless_given_another():
    refitted = {**CHECKPOINT, "schedule_steps": 1234}  # --max-minutes had refitted the schedule
    assert resolve_options({}, refitted).schedule_steps == 1234
    assert resolve_options({"max_minutes": 20.0}, refitted).schedule_steps == 1234
    assert resolve_options({"max_steps": 9000}, refitted).schedule_steps == 9000
    assert resolve_options({}, CHECKPOINT).schedule_steps == PRESETS["cpu"].train["max_steps"]  # none saved
    assert resolve_options({"max_steps": 77}).schedule_steps == 77
    with pytest.raises(ConfigError, match=r"schedule_steps=-5, not an integer in \[1, 2147483647\]"):
        resolve_options({}, {**CHECKPOINT, "schedule_steps": -5})
    assert resolve_options({"max_steps": 10}, {**CHECKPOINT, "schedule_steps": -5}).schedule_steps == 10


def test_a_checkpoint_that_is_not_a_gpts_is_refused_before_anything_is_compared():
    encoder_decoder = {**CHECKPOINT, "model": "Transformer", "model_config": {"src_vocab_size": 8}}
    with pytest.raises(ConfigError, match=r"holds a Transformer run, not a GPT's: .*examples/translate.py"):
        resolve_options({"lr": 0.5}, encoder_decoder)
    for bad in ({"d_model": "wide"}, {"d_model": 30, "n_heads": 4}, {"experts": 8}):
        broken = {**CHECKPOINT, "model_config": {**CHECKPOINT["model_config"], **bad}}
        with pytest.raises(ConfigError, match="latest.json has an invalid model config: ") as error:
            resolve_options({}, broken)
        assert "\n" not in str(error.value)


def test_the_model_settings_are_every_gptconfig_field_but_the_vocabulary():
    fields = {f.name: f.type for f in dataclasses.fields(GPTConfig) if f.name != "vocab_size"}
    assert {f.name: f.type for f in dataclasses.fields(ModelSettings)} == fields
    settings = resolve_options({"preset": None, "d_model": 64, "n_heads": 4}).model
    assert settings.config(65) == GPTConfig(vocab_size=65, d_model=64, n_heads=4)
    assert settings.gpt2_options() == {k: getattr(settings, k) for k in INIT_FROM_OPTIONS}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.d_model = 32  # type: ignore[misc]


def test_the_first_lines_name_the_settings_laid_over_the_preset():
    assert resolve_options({}).describe() == "settings: the cpu preset"
    given = resolve_options({"max_steps": 40, "optimizer": "muon", "n_layers": 2}).describe()
    assert given == "settings: the cpu preset, with max_steps=40, n_layers=2 given"  # muon is the preset's
    bare = resolve_options({"preset": None, "lr": 0.01}).describe()
    assert bare == "settings: the dataclass defaults (no preset), with lr=0.01 given"
    resumed = resolve_options({"max_steps": 30_000, "lr": PRESETS["cpu"].train["lr"]}, CHECKPOINT).describe()
    assert resumed == "settings: the checkpoint's, with max_steps=30000 given"
    assert resolve_options({"tracker": "tensorboard, wandb"}).trackers == ("tensorboard", "wandb")
