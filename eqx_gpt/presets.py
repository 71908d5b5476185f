"""Named recipes: a model shape and a training config that go together.

A preset is a set of overrides of `GPTConfig`'s and `TrainConfig`'s field defaults; command-line
flags override the preset in turn.
"""

from dataclasses import dataclass, field

DEFAULT_PRESET = "cpu"


@dataclass(frozen=True)
class Preset:
    description: str
    model: dict = field(default_factory=dict)  # GPTConfig fields except vocab_size
    train: dict = field(default_factory=dict)  # TrainConfig fields


PRESETS = {
    "cpu": Preset(
        "the default: a small model fitted to about 9 minutes on a 2-core laptop CPU",
        model=dict(context_length=128, d_model=192, n_heads=6, n_layers=4, dropout=0.0),
        train=dict(
            batch_size=32,
            max_steps=3000,
            max_minutes=9.0,
            lr=2e-3,
            min_lr=2e-4,
            warmup_steps=50,
            weight_decay=0.1,
            beta2=0.99,
            eval_interval=250,
            eval_batches=8,
        ),
    ),
    "shakespeare-char": Preset(
        "nanoGPT's GPU recipe for Tiny Shakespeare characters (val loss about 1.47)",
        model=dict(context_length=256, d_model=384, n_heads=6, n_layers=6, dropout=0.2),
        train=dict(
            batch_size=64,
            max_steps=5000,
            max_minutes=0.0,
            lr=1e-3,
            min_lr=1e-4,
            warmup_steps=100,
            weight_decay=0.1,
            beta2=0.99,
            eval_interval=250,
            eval_batches=20,
        ),
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
