"""GPT-2 in Hugging Face's format: the committed tiny GPT-2 (made and checked by `transformers`,
tests/tools/check_gpt2.py) loads, gives `transformers`' logits and greedy tokens, exports back,
and bad directories are one-line errors. No torch and no network."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from compiled import forward
from gen_models import GROUP, gpt

from eqx_gpt import GPT, GPTConfig, generate, load_model
from eqx_gpt.generation.sampling import SamplingOptions
from eqx_gpt.gpt2 import GPT2FormatError, load_gpt2, read_gpt2_config, save_gpt2
from eqx_gpt.model.template import model_template
from eqx_gpt.tokenizer import GPT2Tokenizer, TokenizerError

pytestmark = pytest.mark.xdist_group(GROUP)

TINY = Path(__file__).parent / "fixtures" / "tiny-gpt2"
EXPECTED = np.load(TINY / "expected.npz")


@pytest.fixture(scope="module")
def tiny() -> GPT:
    return load_gpt2(TINY)


def test_the_tiny_gpt2_is_built_as_gpt2(tiny):
    c = tiny.config
    assert (c.vocab_size, c.context_length, c.d_model, c.n_heads, c.n_layers, c.d_hidden) == (
        512,
        64,
        32,
        4,
        2,
        128,
    )
    assert (c.positions, c.bias, c.norm, c.activation, c.tie_embeddings) == (
        "learned",
        True,
        "layer",
        "gelu_tanh",
        True,
    )
    assert tiny.embed.shape == (c.padded_vocab_size, 32) and not np.asarray(tiny.embed)[512:].any()


def test_logits_are_transformers_logits(tiny):
    logits = forward(tiny, jax.device_put(EXPECTED["prompt"].astype(np.int32)))
    assert logits.shape == EXPECTED["logits"].shape  # the padded rows are never returned
    np.testing.assert_allclose(logits, EXPECTED["logits"], atol=1e-4, rtol=0)


def test_greedy_tokens_are_transformers_tokens(tiny):
    options = SamplingOptions(temperature=0.0)
    tokens = generate(
        tiny, EXPECTED["prompt"], len(EXPECTED["greedy"]), key=jax.random.key(0), options=options
    )
    np.testing.assert_array_equal(tokens, EXPECTED["greedy"])


def test_export_writes_the_same_files_back(tiny, tmp_path):
    save_gpt2(tiny, tmp_path)
    again = load_gpt2(tmp_path)
    for a, b in zip(jax.tree.leaves(tiny), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu_new"
    assert config["tie_word_embeddings"] and config["vocab_size"] == 512 and config["n_positions"] == 64


def test_an_untied_gpt2_exports_its_head(tmp_path):
    config = GPTConfig(  # the blocks of the family's GPT (tests/gen_models.py): their weights' shapes
        vocab_size=300, context_length=16, d_model=32, n_heads=4, n_layers=2, positions="learned", bias=True,
        norm="layer", activation="gelu",
    )  # fmt: skip
    model = GPT(config, key=jax.random.key(0))
    save_gpt2(model, tmp_path)
    again = load_gpt2(tmp_path)
    assert again.config == config
    tokens = np.arange(8, dtype=np.int32)  # NumPy: `jnp.arange` compiles a program
    np.testing.assert_array_equal(forward(again, tokens), forward(model, tokens))


def test_the_context_can_be_cropped(tiny):
    short = load_gpt2(TINY, context_length=16)
    assert short.pos_embed.shape == (16, 32)
    prompt = jax.device_put(EXPECTED["prompt"].astype(np.int32))
    np.testing.assert_allclose(forward(short, prompt), forward(tiny, prompt), atol=1e-6)
    with pytest.raises(GPT2FormatError, match="at most 64"):
        read_gpt2_config(TINY, context_length=65)


def test_a_model_of_another_shape_is_not_exported(tmp_path):
    with pytest.raises(GPT2FormatError, match="not GPT-2-shaped.*positions='sinusoidal'"):
        save_gpt2(gpt(), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda d: (d / "config.json").unlink(), "has no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
            "cannot be read",
        ),
        (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), "not 'gpt2'"),
        (lambda d: _edit_config(d, n_layer=3), "lacks the tensor 'h.2.ln_1.weight'"),
        (lambda d: _edit_config(d, n_embd=64), "has shape"),
        (lambda d: _edit_config(d, n_head=None), "lacks 'n_head'"),
    ],
    ids=["no-config", "no-weights", "truncated", "not-gpt2", "partial", "other-shape", "config-incomplete"],
)
def test_a_bad_directory_is_one_line_naming_what_is_wrong(tmp_path, damage, words):
    directory = tmp_path / "gpt2"
    shutil.copytree(TINY, directory)
    damage(directory)
    with pytest.raises(GPT2FormatError, match=words) as error:
        load_gpt2(directory)
    assert "\n" not in str(error.value)


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (directory / "config.json").write_text(json.dumps(config))


def test_load_model_reads_a_gpt2_directory_with_its_tokenizer():
    try:
        model, tokenizer, meta = load_model(TINY)
    except TokenizerError as error:
        pytest.skip(f"GPT-2 BPE files unavailable (set TIKTOKEN_CACHE_DIR): {error}")
    assert tokenizer == GPT2Tokenizer(512) and meta["format"] == "huggingface-gpt2"
    assert tokenizer.encode("ROMEO: soft!") == EXPECTED["prompt"].tolist()
    assert max(tokenizer.encode("Shakespeare's sonnets, all of them")) < 512


@pytest.mark.parametrize(
    "name, n_embd, n_layer, n_head, parameters",
    [("gpt2", 768, 12, 12, 124_439_808), ("gpt2-medium", 1024, 24, 16, 354_823_168),
     ("gpt2-large", 1280, 36, 20, 774_030_080), ("gpt2-xl", 1600, 48, 25, 1_557_611_200)],
)  # fmt: skip
def test_the_four_openai_sizes_build_from_their_configs(tmp_path, name, n_embd, n_layer, n_head, parameters):
    # Their config.json files as the hub serves them (the fields we read); the parameter counts are
    # transformers' for GPT2LMHeadModel (tied head), ours less the 47 padding rows of the table.
    hub = {
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "n_ctx": 1024,
        "n_positions": 1024,
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
        "vocab_size": 50257,
        "layer_norm_epsilon": 1e-5,
    }
    (tmp_path / "config.json").write_text(json.dumps(hub))
    config = read_gpt2_config(tmp_path)
    template = model_template(config)
    ours = sum(leaf.size for leaf in jax.tree.leaves(template) if not isinstance(leaf, bool))  # not the flags
    assert ours - (config.padded_vocab_size - 50257) * n_embd == parameters
    assert (config.d_head, config.context_length, config.tie_embeddings) == (64, 1024, True)


def _edited_copy(tmp_path, edit) -> Path:
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "edited"
    shutil.copytree(TINY, folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


QKV = "transformer.h.0.attn.c_attn.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update({QKV.replace("h.0", "h.7"): t[QKV]}),
            "holds the tensor 'h.7.attn.c_attn.weight'",
        ),
        (
            lambda t: t.update({"transformer.h.0.mlp.gate.weight": t[QKV]}),
            "'h.0.mlp.gate.weight', which a GPT-2",
        ),
        (lambda t: t.update({QKV: np.full_like(t[QKV], np.nan)}), "holds NaN or infinite values"),
        (lambda t: t.update({QKV: t[QKV].astype(np.int32)}), "holds int32, not floating-point weights"),
        (lambda t: t.update({QKV: t[QKV] > 0}), "holds bool, not floating-point weights"),
    ],
)
def test_weights_a_gpt2_would_leave_unread_cast_or_compute_as_nan_are_refused(tmp_path, edit, message):
    with pytest.raises(GPT2FormatError, match=message):
        load_gpt2(_edited_copy(tmp_path, edit))


def test_the_causal_mask_buffers_older_transformers_saved_are_not_weights(tmp_path):
    mask = np.tril(np.ones((1, 1, 64, 64), np.float32))
    folder = _edited_copy(tmp_path, lambda t: t.update({"transformer.h.1.attn.bias": mask}))
    np.testing.assert_array_equal(load_gpt2(folder).embed, load_gpt2(TINY).embed)


def test_a_diverged_model_is_not_saved_and_nothing_is_written(tiny, tmp_path):
    import equinox as eqx

    model = tiny
    save_gpt2(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    nans = np.full(model.final_norm.scale.shape, np.nan, np.float32)  # NumPy: JAX's `*`, eager, compiles
    nan = eqx.tree_at(lambda m: m.final_norm.scale, model, jax.device_put(nans))
    with pytest.raises(GPT2FormatError, match="ln_f.weight holds NaN or infinite values"):
        save_gpt2(nan, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
