"""The public API of the model, generation and tokenizer wings, walked with bad values: each gives a
one-line `ValueError` or `TypeError` naming the value and its valid range, never garbage, a silent
truncation or a deep traceback."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import gpt, transformer
from model_family import TINY_GPT, TINY_TRANSFORMER, in_family

from eqx_gpt import (
    MLP,
    Block,
    CharTokenizer,
    GPT2Tokenizer,
    LayerNorm,
    MultiHeadAttention,
    RMSNorm,
    SamplingOptions,
    causal_mask,
    dropout,
    generate,
    generate_batch,
    load_gpt2,
    load_model,
    pad_vocab,
    padding_mask,
    sample_next_token,
    save_checkpoint,
    sinusoidal_positions,
    top_k_filter,
    top_p_filter,
    translate,
)

pytestmark = in_family
KEY = jax.random.key(0)
X = jnp.ones((3, 4))
LOGITS = jnp.asarray([0.5, 2.0, -1.0, 1.0])
NAN, INF = math.nan, math.inf


# The family's models (built once; the messages name the vocabulary's size, 9, not the widths).
def _gpt():
    return gpt(TINY_GPT)


def _gpt_with_dropout():
    return eqx.nn.inference_mode(gpt(dataclasses.replace(TINY_GPT, dropout=0.5)))


def _transformer():
    return transformer(TINY_TRANSFORMER)


# (call, exception, a fragment the message must contain: the value or the range)
CASES = {
    # dropout's rate is in [0, 1)
    "dropout 1.5": (lambda: dropout(X, 1.5, KEY), ValueError, "got 1.5"),
    "dropout -0.5": (lambda: dropout(X, -0.5, KEY), ValueError, "got -0.5"),
    "dropout nan": (lambda: dropout(X, NAN, KEY), ValueError, "got nan"),
    "dropout 1.0": (lambda: dropout(X, 1.0), ValueError, "[0, 1)"),
    "dropout 1 - 1e-9 rounds to 1": (lambda: dropout(X, 1 - 1e-9, KEY), ValueError, "[0, 1)"),
    "dropout True": (lambda: dropout(X, True, KEY), TypeError, "got True"),
    "dropout '0.1'": (lambda: dropout(X, "0.1", KEY), TypeError, "got '0.1'"),
    # sampling filters and settings
    "top_k 0": (lambda: top_k_filter(LOGITS, 0), ValueError, "top_k must be an integer in [1"),
    "top_k -3": (lambda: top_k_filter(LOGITS, -3), ValueError, "got -3"),
    "top_k 1.5": (lambda: top_k_filter(LOGITS, 1.5), ValueError, "got 1.5"),
    "top_k True": (lambda: top_k_filter(LOGITS, True), ValueError, "got True"),
    "top_k array 0": (lambda: top_k_filter(LOGITS, jnp.int32(0)), ValueError, "got 0"),
    "top_p 0": (lambda: top_p_filter(LOGITS, 0), ValueError, "(0, 1]"),
    "top_p 1.5": (lambda: top_p_filter(LOGITS, 1.5), ValueError, "got 1.5"),
    "top_p nan": (lambda: top_p_filter(LOGITS, NAN), ValueError, "got nan"),
    "top_p -0.1": (lambda: top_p_filter(LOGITS, -0.1), ValueError, "(0, 1]"),
    "temperature -1": (lambda: sample_next_token(LOGITS, KEY, temperature=-1.0), ValueError, ">= 0"),
    "temperature nan": (lambda: sample_next_token(LOGITS, KEY, temperature=NAN), ValueError, "got nan"),
    "temperature inf": (lambda: sample_next_token(LOGITS, KEY, temperature=INF), ValueError, "got inf"),
    "sample top_p 2": (lambda: sample_next_token(LOGITS, KEY, top_p=2.0), ValueError, "got 2.0"),
    "options temperature 'hot'": (lambda: SamplingOptions(temperature="hot"), ValueError, "got 'hot'"),
    "options top_p True": (lambda: SamplingOptions(top_p=True), ValueError, "got True"),
    "options keep 0": (lambda: SamplingOptions(keep=0), ValueError, "keep must be an integer in [1"),
    "options chunk 0": (lambda: SamplingOptions(chunk_size=0), ValueError, "chunk_size"),
    # generation
    "generate float ids": (lambda: generate(_gpt(), [1.9], 3, key=KEY), ValueError, "integers"),
    "generate id -1": (lambda: generate(_gpt(), [-1], 3, key=KEY), ValueError, "[0, vocab_size=9)"),
    "generate id 9": (lambda: generate(_gpt(), [9], 3, key=KEY), ValueError, "[0, vocab_size=9)"),
    "generate tokens 1.5": (lambda: generate(_gpt(), [1], 1.5, key=KEY), ValueError, "got 1.5"),
    "generate no rows": (
        lambda: generate_batch(_gpt(), np.zeros((0, 2), int), 3, key=KEY),
        ValueError,
        "at least one prompt row",
    ),
    "generate a Transformer": (lambda: generate(_transformer(), [1], 3, key=KEY), TypeError, "Transformer"),
    "translate float ids": (
        lambda: translate(_transformer(), np.asarray([[1.9]]), 3, bos_id=1, eos_id=2, temperature=0),
        ValueError,
        "integers",
    ),
    "translate bos_id 9": (
        lambda: translate(_transformer(), np.asarray([[1]]), 3, bos_id=9, eos_id=2, temperature=0),
        ValueError,
        "[0, tgt_vocab_size=9)",
    ),
    "translate 0 tokens": (
        lambda: translate(_transformer(), np.asarray([[1]]), 0, bos_id=1, eos_id=2, temperature=0),
        ValueError,
        "got 0",
    ),
    "init_cache batch 0": (lambda: _gpt().init_cache(batch=0), ValueError, "batch >= 1"),
    "generate bool prompt": (lambda: generate(_gpt(), [True], 3, key=KEY), ValueError, "integers"),
    # token ids into the models: integer arrays, NumPy arrays or lists of integers (issue 53)
    "GPT bool ids": (lambda: _gpt()(np.asarray([True, False])), TypeError, "GPT's tokens must be integer"),
    "GPT float ids": (lambda: _gpt()([1.0, 2.0]), TypeError, "got dtype float64"),
    "GPT float32 ids": (lambda: _gpt()(jnp.ones(3)), TypeError, "got dtype float32"),
    "GPT string ids": (lambda: _gpt()("abc"), TypeError, "got str"),
    "GPT 0-d ids": (lambda: _gpt()(jnp.int32(3)), ValueError, "got shape ()"),
    "GPT ragged ids": (lambda: _gpt()([[1, 2], [3]]), ValueError, "ragged"),
    "GPT int64 id past int32": (lambda: _gpt()(np.asarray([2**40])), ValueError, "[0, vocab_size=9)"),
    "GPT uint8 id 200": (lambda: _gpt()(np.asarray([200], np.uint8)), ValueError, "from 200 to 200"),
    "GPT empty ids": (lambda: _gpt()([]), ValueError, "GPT's tokens must hold at least one token id"),
    "GPT empty array": (lambda: _gpt()(jnp.zeros((2, 0), jnp.int32)), ValueError, "got shape (2, 0)"),
    "GPT.decode empty": (
        lambda: _gpt().decode(jnp.zeros((0,), jnp.int32), _gpt().init_cache(), 0),
        ValueError,
        "GPT.decode's tokens must hold at least one",
    ),
    "GPT.features float": (lambda: _gpt().features(np.ones(2)), TypeError, "GPT.features's tokens"),
    "Transformer float src": (lambda: _transformer()([1.5], [1]), TypeError, "Transformer's src"),
    "Transformer empty tgt": (lambda: _transformer()([1], []), ValueError, "Transformer's tgt must hold"),
    "Transformer tgt id 9": (lambda: _transformer()([1], [9]), ValueError, "[0, tgt_vocab_size=9)"),
    "Transformer.encode bool": (lambda: _transformer().encode([True]), TypeError, "dtype bool"),
    "jax.jit over dropout": (
        lambda: jax.jit(lambda m, x: m(x))(_gpt_with_dropout(), jnp.asarray([1, 2])),
        TypeError,
        "use eqx.filter_jit",
    ),
    "jax.jit over a Block's dropout": (
        # The family's block sizes: its weights are drawn by programs other tests compiled.
        lambda: jax.jit(lambda b, x: b(x))(Block(16, 2, 32, key=KEY, dropout=0.1, inference=True), X[:, :2]),
        TypeError,
        "use eqx.filter_jit",
    ),
    # paths: one line naming the argument, not pathlib's "expected str, bytes or os.PathLike object"
    "load_model 5": (lambda: load_model(5), TypeError, "a checkpoint's path must be a path"),
    "load_gpt2 None": (lambda: load_gpt2(None), TypeError, "a GPT-2 directory must be a path"),
    "save_checkpoint 5": (
        lambda: save_checkpoint(
            5, "latest", _gpt(), None, step=0, tokenizer=CharTokenizer("abc"), train_config={}
        ),
        TypeError,
        "out_dir must be a path",
    ),
    # logits of one position
    "sample empty logits": (lambda: sample_next_token(jnp.zeros(0), KEY), ValueError, "got shape (0,)"),
    "sample 2-d logits": (lambda: sample_next_token(jnp.zeros((2, 3)), KEY), ValueError, "(vocab,)"),
    "top_k empty logits": (lambda: top_k_filter(jnp.zeros(0), 1), ValueError, "top_k_filter takes"),
    "top_p empty logits": (lambda: top_p_filter(jnp.zeros(0), 0.5), ValueError, "top_p_filter takes"),
    # norms
    "LayerNorm eps -1": (lambda: LayerNorm(4, eps=-1.0), ValueError, "> 0, got -1.0"),
    "LayerNorm eps nan": (lambda: LayerNorm(4, eps=NAN), ValueError, "got nan"),
    "LayerNorm eps 0": (lambda: LayerNorm(4, eps=0.0), ValueError, "got 0.0"),
    "LayerNorm eps 'x'": (lambda: LayerNorm(4, eps="x"), TypeError, "got 'x'"),
    "LayerNorm dim 0": (lambda: LayerNorm(0), ValueError, "dim must be an integer in [1"),
    "RMSNorm eps inf": (lambda: RMSNorm(4, eps=INF), ValueError, "got inf"),
    "RMSNorm eps -1": (lambda: RMSNorm(4, eps=-1.0), ValueError, "got -1.0"),
    "RMSNorm dim 2.5": (lambda: RMSNorm(2.5), ValueError, "got 2.5"),
    # sizes
    "pad_vocab 65.5": (lambda: pad_vocab(65.5), ValueError, "got 65.5"),
    "pad_vocab 0": (lambda: pad_vocab(0), ValueError, "[1, "),
    "pad_vocab True": (lambda: pad_vocab(True), ValueError, "got True"),
    "pad_vocab multiple 0": (lambda: pad_vocab(65, multiple=0), ValueError, "multiple must be an integer"),
    "pad_vocab multiple 2.5": (lambda: pad_vocab(65, multiple=2.5), ValueError, "got 2.5"),
    "attention 10 / 3 heads": (
        lambda: MultiHeadAttention(10, 3, key=KEY),
        ValueError,
        "divisible by n_heads",
    ),
    "attention d_model -8": (lambda: MultiHeadAttention(-8, 2, key=KEY), ValueError, "got -8"),
    "attention 0 heads": (lambda: MultiHeadAttention(8, 0, key=KEY), ValueError, "n_heads must be"),
    "attention d_model 8.0": (lambda: MultiHeadAttention(8.0, 2, key=KEY), ValueError, "got 8.0"),
    "attention dropout 1": (lambda: MultiHeadAttention(8, 2, key=KEY, dropout=1.0), ValueError, "[0, 1)"),
    "MLP d_hidden 0": (lambda: MLP(4, 0, key=KEY), ValueError, "d_hidden must be an integer in [1"),
    "MLP d_model 2.5": (lambda: MLP(2.5, 4, key=KEY), ValueError, "got 2.5"),
    "MLP activation": (lambda: MLP(4, 8, key=KEY, activation="tanh"), ValueError, "'relu2'"),
    "MLP init_std nan": (lambda: MLP(4, 8, key=KEY, init_std=NAN), ValueError, "got nan"),
    "Block dropout -0.1": (lambda: Block(8, 2, 16, key=KEY, dropout=-0.1), ValueError, "got -0.1"),
    "Block norm": (lambda: Block(8, 2, 16, key=KEY, norm="batch"), ValueError, "'batch'"),
    "causal_mask 0": (lambda: causal_mask(0), ValueError, "seq_len must be an integer in [1"),
    "causal_mask 2.5": (lambda: causal_mask(2.5), ValueError, "got 2.5"),
    "padding_mask lengths past kv_seq": (
        lambda: padding_mask(jnp.asarray([1, 5]), kv_seq=4),
        ValueError,
        "[0, kv_seq=4]",
    ),
    "padding_mask float lengths": (lambda: padding_mask(np.asarray([1.5]), kv_seq=4), ValueError, "whole"),
    "padding_mask pad_id -1": (
        lambda: padding_mask(tokens=jnp.asarray([1, 0]), pad_id=-1),
        ValueError,
        "got -1",
    ),
    "padding_mask kv_seq -1": (lambda: padding_mask(jnp.asarray([0]), kv_seq=-1), ValueError, "got -1"),
    "sinusoidal odd d_model": (lambda: sinusoidal_positions(4, 3), ValueError, "even d_model"),
    # tokenizers: ids are integers in the vocabulary
    "char decode 1.9": (lambda: CharTokenizer("abc").decode([1.9]), ValueError, "[0, 3)"),
    "char decode 2.0": (lambda: CharTokenizer("abc").decode([2.0]), ValueError, "got 2.0"),
    "char decode -1": (lambda: CharTokenizer("abc").decode([-1]), ValueError, "-1 is outside"),
    "char decode 3": (lambda: CharTokenizer("abc").decode([0, 3]), ValueError, "3 is outside"),
    "char decode True": (lambda: CharTokenizer("abc").decode([True]), ValueError, "got True"),
    "char decode float array": (lambda: CharTokenizer("abc").decode(np.asarray([1.0])), ValueError, "1.0"),
    "char decode 'a'": (lambda: CharTokenizer("abc").decode(["a"]), ValueError, "got 'a'"),
    "gpt2 decode 50257": (lambda: GPT2Tokenizer().decode([50257]), ValueError, "[0, 50257)"),
    "gpt2 decode 1.5": (lambda: GPT2Tokenizer().decode([1.5]), ValueError, "got 1.5"),
    "gpt2 decode -1": (lambda: GPT2Tokenizer(300).decode([-1]), ValueError, "[0, 300)"),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.gpt2_bpe] if c.startswith("gpt2") else []) for c in CASES]
)
def test_a_bad_value_gives_a_one_line_error_naming_it(case):
    call, error, fragment = CASES[case]
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert fragment in message
    assert "\n" not in message


def test_token_ids_that_convert_exactly_give_the_logits_of_int32_ids():
    """NumPy ids of any integer dtype (uint8 included: every id it holds is a whole number) and
    lists of integers are the same ids as a JAX int32 array; so are a generate prompt's."""
    model, ids = _gpt(), [1, 2, 8]
    expected = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    for given in (
        ids,
        np.asarray(ids),
        np.asarray(ids, np.uint8),
        np.asarray(ids, np.int16),
        jnp.asarray(ids, jnp.uint8),
    ):
        np.testing.assert_array_equal(np.asarray(model(given)), expected)
    np.testing.assert_array_equal(np.asarray(model([ids, ids])), np.stack([expected, expected]))
    t = _transformer()
    # A batch of one, 6 source and 5 target ids: the shapes test_gpt calls it eagerly with.
    src, tgt = [[1, 2, 3, 4, 5, 6]], [[3, 1, 2, 4, 5]]
    np.testing.assert_array_equal(
        np.asarray(t(np.asarray(src), tgt)), np.asarray(t(jnp.asarray(src), jnp.asarray(tgt)))
    )
    np.testing.assert_array_equal(
        generate(_gpt(), np.asarray([1, 2], np.uint8), 2, key=KEY, temperature=0),
        generate(_gpt(), [1, 2], 2, key=KEY, temperature=0),
    )


def test_the_good_values_next_to_the_bad_ones_work():
    assert pad_vocab(65) == 128 and pad_vocab(65, multiple=8) == 72
    assert CharTokenizer("abc").decode([0, np.int64(2), jnp.int32(1)]) == "acb"
    np.testing.assert_array_equal(dropout(X, 0.0), X)
    assert float(dropout(X, 1 - 2**-16, KEY).max()) in (0.0, 2.0**16)  # the largest rate allowed
    assert top_k_filter(LOGITS, 1).tolist() == [-math.inf, 2.0, -math.inf, -math.inf]
    assert top_p_filter(LOGITS, 1).tolist() == LOGITS.tolist()
    assert int(sample_next_token(LOGITS, KEY, temperature=0)) == 1
    assert causal_mask(1).tolist() == [[True]]
    LayerNorm(4, eps=1e-6)
    RMSNorm(4, eps=1)
