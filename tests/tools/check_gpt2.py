"""eqx_gpt's GPT-2 against Hugging Face `transformers`, number for number, on random tiny GPT-2s.

    uv run --with torch --with transformers python tests/tools/check_gpt2.py
    uv run --with torch --with transformers python tests/tools/check_gpt2.py \
        --write-fixture tests/fixtures/tiny-gpt2

torch and transformers come in a throwaway overlay (`uv run --with`), never into the project or
`uv.lock` (pass a local wheel as `--with /path/to/torch.whl` to avoid a download). For each random
model, built by `transformers` and saved with `save_pretrained`, the script checks:

- logits of `eqx_gpt.gpt2.load_gpt2` against `GPT2LMHeadModel`'s, max absolute difference <= 1e-4;
- greedy generation, 50 tokens, token for token against `generate(do_sample=False)`;
- export: `save_gpt2` -> `GPT2LMHeadModel.from_pretrained` -> the same logits again.

Every parameter is drawn at random, biases and LayerNorm parameters included (their default
initial values, zeros and ones, would check nothing). `--write-fixture DIR` also writes the
suite's fixture: a tiny GPT-2 directory (about 200 kB) and `expected.npz` with `transformers`'
logits and greedy tokens for a prompt, which `tests/test_gpt2.py` checks with no torch.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eqx_gpt.generation.generate import generate  # noqa: E402
from eqx_gpt.generation.sampling import SamplingOptions  # noqa: E402
from eqx_gpt.gpt2 import load_gpt2, save_gpt2  # noqa: E402

# (name, config) of the random models; the first is the example size.
MODELS = [
    ("tied, gelu_new", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)),
    ("untied, exact gelu, n_inner 96", dict(
        n_layer=3, n_embd=48, n_head=4, vocab_size=700, n_positions=64, tie_word_embeddings=False,
        activation_function="gelu", n_inner=96,
    )),
]  # fmt: skip
FIXTURE = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=512, n_positions=64)
FIXTURE_PROMPT = "ROMEO: soft!"
GREEDY_TOKENS = 50


def random_gpt2(seed: int, **sizes) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None, **sizes)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_scale = name.endswith(".weight") and p.ndim == 1
            p.copy_((1.0 if is_norm_scale else 0.0) + 0.15 * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


def hf_greedy(model, prompt: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(prompt[None]).long(), max_new_tokens=GREEDY_TOKENS, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[0, len(prompt) :].numpy()


def greedy_margin(model, prompt: np.ndarray, tokens: np.ndarray) -> float:
    """The smallest gap between the top two logits over the greedy steps: how far rounding would
    have to move a logit to change a token."""
    sequence = np.concatenate([prompt, tokens])[None]
    logits = hf_logits(model, sequence)[0, len(prompt) - 1 : -1]
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


def check(name: str, sizes: dict, seed: int) -> bool:
    reference = random_gpt2(seed, **sizes)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, sizes["vocab_size"], (2, sizes["n_positions"]))
    prompt = tokens[0, :8]
    with tempfile.TemporaryDirectory() as hf_dir, tempfile.TemporaryDirectory() as out_dir:
        reference.save_pretrained(hf_dir, safe_serialization=True)
        model = load_gpt2(hf_dir)
        expected = hf_logits(reference, tokens)
        ours = np.asarray(model(jnp.asarray(tokens)))
        logits_diff = float(np.abs(ours - expected).max())
        greedy = generate(model, prompt, GREEDY_TOKENS, key=jax.random.key(0), options=SamplingOptions(0.0))
        greedy_ref = hf_greedy(reference, prompt)
        save_gpt2(model, out_dir)
        reloaded = transformers.GPT2LMHeadModel.from_pretrained(out_dir).eval()
        export_diff = float(np.abs(hf_logits(reloaded, tokens) - expected).max())
    same_greedy = bool(np.array_equal(greedy, greedy_ref))
    ok = logits_diff <= 1e-4 and same_greedy and export_diff <= 1e-4
    print(
        f"{'ok  ' if ok else 'FAIL'} {name} ({json.dumps(sizes)}): logits max |diff| {logits_diff:.2e}; "
        f"greedy {GREEDY_TOKENS} tokens {'equal' if same_greedy else 'DIFFER'}; export -> transformers "
        f"logits max |diff| {export_diff:.2e}"
    )
    return ok


def write_fixture(directory: Path, seed: int = 0) -> None:
    from eqx_gpt.tokenizer import GPT2Tokenizer

    reference = random_gpt2(seed, **FIXTURE)
    directory.mkdir(parents=True, exist_ok=True)
    reference.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").unlink(missing_ok=True)  # transformers' extra; not read
    prompt = np.asarray(GPT2Tokenizer(FIXTURE["vocab_size"]).encode(FIXTURE_PROMPT))
    greedy = hf_greedy(reference, prompt)
    margin = greedy_margin(reference, prompt, greedy)
    if margin < 1e-3:
        raise SystemExit(f"seed {seed}: greedy top-2 margin {margin:.1e} is too thin for a fixture")
    np.savez(
        directory / "expected.npz", prompt=prompt, logits=hf_logits(reference, prompt[None])[0], greedy=greedy
    )
    size = sum(p.stat().st_size for p in directory.iterdir())
    print(f"wrote {directory}/ ({size / 1e3:.0f} kB): greedy top-2 margin {margin:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write-fixture", metavar="DIR", type=Path, help="also write the suite's fixture here")
    args = p.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, jax {jax.__version__}")
    ok = all([check(name, sizes, seed) for seed, (name, sizes) in enumerate(MODELS)])
    if args.write_fixture:
        write_fixture(args.write_fixture)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
