"""Named recipes: a model shape and a training config that go together.

A preset is a set of overrides of `GPTConfig`'s and `TrainConfig`'s field defaults; command-line
flags override the preset in turn (`preset_values`).
"""

import dataclasses
from dataclasses import dataclass, field

from eqx_gpt.config import GPTConfig
from eqx_gpt.train_config import TrainConfig

DEFAULT_PRESET = "cpu"


@dataclass(frozen=True)
class Preset:
    description: str
    model: dict = field(default_factory=dict)  # GPTConfig fields except vocab_size
    train: dict = field(default_factory=dict)  # TrainConfig fields

    def values(self) -> dict:
        """The preset's own values, model and training fields together."""
        return {**self.model, **self.train}


PRESETS = {
    "cpu": Preset(
        "the default: a 0.8M-parameter model, its schedule fitted to 9 minutes on a 2-core laptop CPU",
        # Tuned by short runs on 2 cores: at equal tokens, batch 16 beat batch 32 (more updates) at
        # the same tokens/s, and lr 5e-3 beat 2e-3 and 1e-2 (the preset kept 4e-3, just below it);
        # context 64 runs about twice the tokens/s of context 128 on CPU.
        # scan_unroll=4 runs the 4 layers in one scan iteration: measured 5-10% faster steps on 2
        # cores than a rolled scan (measured side by side), with no slower compile at this depth.
        # With the batched step (about 65 ms), 9 minutes bought about 6,800 steps: val 1.58. With 8
        # steps per call (about 55 ms a step) all 8,000 fit in 7.7 minutes but ended at val 1.596
        # (best 1.586 at 7,500): past ~7,000 steps this model overfits the 1M training characters
        # faster than the longer schedule helps, so it stops at 7,000.
        model=dict(context_length=64, d_model=128, n_heads=4, n_layers=4, dropout=0.0, scan_unroll=4),
        train=dict(
            batch_size=16,
            max_steps=7000,
            max_minutes=9.0,
            lr=4e-3,
            min_lr=4e-4,
            warmup_steps=30,
            weight_decay=0.1,
            beta2=0.99,
            eval_interval=500,
            eval_batches=16,
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


def preset_values(name: str) -> dict:
    """Every `GPTConfig` (but `vocab_size`) and `TrainConfig` field's value under preset `name`:
    the dataclass default, overridden by the preset."""
    defaults = {
        f.name: f.default
        for cls in (GPTConfig, TrainConfig)
        for f in dataclasses.fields(cls)
        if f.default is not dataclasses.MISSING
    }
    return {**defaults, **PRESETS[name].values()}
