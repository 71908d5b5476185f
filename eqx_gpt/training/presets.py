"""Named recipes: a model shape and a training config that go together.

A preset is a set of overrides of `GPTConfig`'s and `TrainConfig`'s field defaults; command-line
flags override the preset in turn (`options.preset_values`, where every merge happens).
"""

from dataclasses import dataclass, field

DEFAULT_PRESET = "cpu"
FINETUNE_PRESET = "finetune-shakespeare"  # the default preset of `train.py --init-from DIR`


@dataclass(frozen=True)
class Preset:
    description: str
    model: dict = field(default_factory=dict)  # GPTConfig fields except vocab_size
    train: dict = field(default_factory=dict)  # TrainConfig fields
    gpu: dict = field(default_factory=dict)  # fields that differ when the run's device is a GPU

    def values(self, *, gpu: bool = False) -> dict:
        """The preset's own values, model and training fields together; `gpu`: with its GPU ones."""
        return {**self.model, **self.train, **(self.gpu if gpu else {})}


_CPU_MODEL = dict(context_length=64, d_model=128, n_heads=4, n_layers=4, dropout=0.0, scan_unroll=4)
# scan_unroll=6 runs the 6 layers as straight-line code: a rolled scan stacks every layer's
# activations into zero-filled (n_layers, ...) buffers for the backward pass, which cost about
# 17% of the step on 2 cores (bench/vs_pytorch.py); compile time is unchanged.
_NANOGPT_MODEL = dict(context_length=256, d_model=384, n_heads=6, n_layers=6, dropout=0.2, scan_unroll=6)
_NANOGPT_TRAIN = dict(
    batch_size=64, max_steps=5000, max_minutes=0.0, lr=1e-3, min_lr=1e-4, warmup_steps=100, weight_decay=0.1,
    beta2=0.99, eval_interval=250, eval_batches=20,
)  # fmt: skip

# The AdamW recipe of the cpu-adamw preset; the cpu preset changes what the speedrun changed.
_CPU_ADAMW_TRAIN = dict(
    batch_size=16, max_steps=7000, max_minutes=9.0, lr=4e-3, min_lr=4e-4, warmup_steps=30, weight_decay=0.1,
    beta2=0.99, eval_interval=500, eval_batches=16,
)  # fmt: skip

# GPT-2 small's shape, trained from scratch with nanoGPT's recipe (config/train_gpt2.py).
_GPT2_124M_MODEL = dict(
    context_length=1024, d_model=768, n_heads=12, n_layers=12, positions="learned", activation="gelu_tanh",
    norm="layer", bias=True, tie_embeddings=True, dropout=0.0,
)  # fmt: skip

# nanoGPT's GPU recipes run in bfloat16 (its `dtype` where the GPU has it), and so do these on a
# GPU: the bf16 step is the one measured against nanoGPT's; float32 took 1.75x as long on an H100
# (docs/PERFORMANCE.md). `--compute-dtype float32` still wins.
_GPU_DTYPE = dict(compute_dtype="bfloat16")
PRESETS = {
    "cpu": Preset(
        "the default: a 0.8M-parameter model trained with Muon, its schedule fitted to 9 minutes on a "
        "2-core CPU or to 4,400 steps, past which it stops gaining, whichever comes first",
        # The CPU speedrun's recipe (docs/PERFORMANCE.md): Muon on the block matrices, the query, key
        # and value apart, AdamW on the rest, one cosine to zero fitted to the time. Batch 48 holds
        # 1.5x the tokens of 32 in 1.5x the time, so each step learns more at the same tokens/s;
        # 4,400 steps is where this model stops gaining on Tiny Shakespeare.
        model=_CPU_MODEL,
        train={
            **_CPU_ADAMW_TRAIN,
            "optimizer": "muon",
            "batch_size": 48,
            "max_steps": 4_400,
            "weight_decay": 0.15,
            "lr": 0.04,
            "min_lr": 0.0,
            "adam_lr": 6e-3,
            "muon_ns_steps": 3,
            "muon_split_qkv": True,
            "beta1": 0.8,
            "beta2": 0.95,
            "grad_clip": 0.0,
        },  # fmt: skip
    ),
    "cpu-adamw": Preset(
        "the previous default: the same model with AdamW, stopping at 7,000 steps or 9 minutes",
        # Batch 16 makes more updates than 32 at the same tokens/s; past ~7,000 steps this model
        # overfits the 1M training characters faster than a longer schedule helps.
        model=_CPU_MODEL,
        train=_CPU_ADAMW_TRAIN,
    ),
    "shakespeare-char": Preset(
        "nanoGPT's GPU recipe for Tiny Shakespeare characters (val loss about 1.47)",
        model=_NANOGPT_MODEL,
        train=_NANOGPT_TRAIN,
        gpu=_GPU_DTYPE,
    ),
    FINETUNE_PRESET: Preset(
        "fine-tune a Hugging Face GPT-2 (--init-from DIR) on the text: nanoGPT's finetune_shakespeare "
        "recipe (AdamW at a constant 3e-5, 20 steps, an evaluation every 5), at context 256 and batch 8 "
        "to suit a CPU",
        # nanoGPT runs 32 sequences of 1,024 tokens per step on a GPU; on 2 cores a 124M model takes
        # seconds per thousand tokens, so a step here holds 2,048 tokens (the position table is
        # cropped to 256, as nanoGPT's crop_block_size does).
        model=dict(context_length=256, dropout=0.0),
        train=dict(
            tokenizer="gpt2",
            optimizer="adamw",
            batch_size=8,
            max_steps=20,
            max_minutes=0.0,
            lr=3e-5,
            min_lr=3e-5,
            warmup_steps=0,
            weight_decay=0.1,
            beta2=0.95,
            eval_interval=5,
            eval_batches=4,
        ),
    ),  # fmt: skip
    "gpt2-124m": Preset(
        "GPT-2 small's shape (124M parameters, GPT-2's 50,257 ids) from scratch, with nanoGPT's AdamW "
        "recipe: lr 6e-4 warmed up over 2,000 steps, a cosine to 6e-5 at 600,000; batch 4 of 1,024 "
        "tokens to suit a CPU (--max-minutes fits the schedule to the time you have)",
        # nanoGPT steps 491,520 tokens (12 sequences x 40 accumulated, over 8 GPUs). Here a step of
        # 4 sequences plans about 10.4 GB: 1.5 GB of parameters and AdamW state, 8.9 GB of scratch,
        # most of it attention's 1,024 x 1,024 weights per head and layer (batch 8 plans 18.7 GB);
        # on a 2-core AVX2 EPYC a run peaked at 11.4 GB RSS and took 42.6 s a step (docs/PERFORMANCE.md).
        # --grad-accum restores the GPU batch where there is time for it.
        model=_GPT2_124M_MODEL,
        # On a GPU the 12 layers run as straight-line code: a rolled scan slices each layer's
        # weights out of the stack and writes its gradients back into zero-filled stacks, 13% of
        # the step on an H100 (docs/PERFORMANCE.md); on a CPU, unrolling costs compile time instead.
        gpu={**_GPU_DTYPE, "scan_unroll": 12},
        train=dict(
            tokenizer="gpt2",
            optimizer="adamw",
            batch_size=4,
            max_steps=600_000,
            max_minutes=0.0,
            lr=6e-4,
            min_lr=6e-5,
            warmup_steps=2_000,
            schedule="cosine",
            weight_decay=0.1,
            beta1=0.9,
            beta2=0.95,
            grad_clip=1.0,
            eval_interval=2_000,
            eval_batches=4,
        ),
    ),  # fmt: skip
    "shakespeare-char-muon": Preset(
        "nanoGPT's GPU recipe with Muon on the block matrices (not yet run on a GPU)",
        model=_NANOGPT_MODEL,
        train={**_NANOGPT_TRAIN, "optimizer": "muon", "lr": 0.02, "min_lr": 0.002, "adam_lr": 1e-3},
        gpu=_GPU_DTYPE,
    ),
}
