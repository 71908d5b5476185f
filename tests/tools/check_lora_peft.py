"""eqx_gpt's LoRA runs against Hugging Face PEFT and `transformers`, number for number.

    TIKTOKEN_CACHE_DIR=$(realpath ../shared/data/tiktoken-cache) uv run --with peft --with transformers \
        --with /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \
        python tests/tools/check_lora_peft.py [--run DIR]

torch, transformers and peft come in a throwaway overlay (`uv run --with`), never into the project
or `uv.lock` (`--with torch` downloads it instead of the local wheel). Without `--run`, it trains
a rank-4 LoRA fine-tune of the tiny GPT-2 (tests/fixtures/tiny-gpt2) for a few steps at a high
rate, so the adapters are far from zero; then it checks:

- `peft.PeftModel.from_pretrained` on the run folder's adapters (`adapter_config.json`,
  `adapter_model.safetensors`) gives the logits of `eqx_gpt.load_model(run)`, within 1e-4;
- `export.py` writes the merged model, which `GPT2LMHeadModel.from_pretrained` loads to the same
  logits, within 1e-4; `export.py --adapters-only` writes adapters that PEFT loads to them too.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import peft
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from eqx_gpt import load_model, train  # noqa: E402
from eqx_gpt.commands.export import export  # noqa: E402
from eqx_gpt.training.data import load_text  # noqa: E402

TINY_GPT2 = ROOT / "tests" / "fixtures" / "tiny-gpt2"
PROMPT = [5, 17, 301, 42, 7, 255, 100, 3, 9, 480, 11, 64, 2]


def lora_run(folder: Path) -> Path:
    corpus = folder / "corpus.txt"
    corpus.write_text(load_text()[:20_000], encoding="utf-8")
    run = folder / "run"
    train(
        init_from=str(TINY_GPT2), data=str(corpus), out_dir=run, lora_rank=4, lora_alpha=8.0,
        lora_targets="c_attn,c_proj,c_fc", context_length=32, batch_size=4, max_steps=20, eval_interval=20,
        warmup_steps=2, lr=3e-2, min_lr=3e-3, eval_batches=1, sample_tokens=0, log=lambda s: None,
        progress=False,
    )  # fmt: skip
    return run


def torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].numpy()


def report(name: str, got: np.ndarray, want: np.ndarray) -> bool:
    diff = float(np.abs(got - want).max())
    ok = diff <= 1e-4
    print(
        f"{'ok  ' if ok else 'FAIL'} {name}: max |difference| {diff:.2e} "
        f"(logits up to {np.abs(want).max():.2f})"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, help="a LoRA run folder to check (default: train one)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run = args.run or lora_run(tmp)
        model, _, meta = load_model(run, kind="GPT")
        base = meta["train_config"]["init_from"]
        ours = np.asarray(eqx.nn.inference_mode(model)(jnp.asarray(PROMPT)))
        separate, _, _ = load_model(run, kind="GPT", lora="separate")
        b = np.asarray(separate.blocks.layers.attn.qkv.lora_b)
        print(f"run {run}: step {meta['step']}, adapters' B up to {np.abs(b).max():.3f}")
        hf_base = lambda: transformers.GPT2LMHeadModel.from_pretrained(base).eval()  # noqa: E731
        ok = report(
            "PEFT on the run's adapters vs load_model",
            torch_logits(peft.PeftModel.from_pretrained(hf_base(), run).eval()),
            ours,
        )
        untouched = torch_logits(hf_base())
        print(f"     (the base alone is {np.abs(untouched - ours).max():.3f} away: the adapters matter)")
        export(run, tmp / "merged", overwrite=False)
        merged = transformers.GPT2LMHeadModel.from_pretrained(tmp / "merged").eval()
        ok &= report("transformers on export.py's merged GPT-2 vs load_model", torch_logits(merged), ours)
        export(run, tmp / "adapters", overwrite=False, adapters_only=True)
        adapters = peft.PeftModel.from_pretrained(hf_base(), tmp / "adapters").eval()
        ok &= report("PEFT on export.py --adapters-only vs load_model", torch_logits(adapters), ours)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
