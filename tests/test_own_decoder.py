"""A decoder of the user's own, built from public modules as docs/GUIDE.md builds it, sampled
through `generate` (KV-cached, by the `Decoder` protocol) against a rerun of its whole window."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from doc_blocks import DOCS, block_under
from gen_models import GROUP, TRANSFORMER_CONFIG, bind, gpt, transformer

from eqx_gpt import GPT, Decoder, SamplingOptions, generate, generate_batch, sample_next_token, translate

pytestmark = pytest.mark.xdist_group(GROUP)

GUIDE = DOCS[1]


@pytest.fixture(scope="module")
def guide():
    """The names the guide's block defines, after running it exactly as it is written."""
    namespace: dict = {}
    exec(compile(block_under(GUIDE, "### Sample from a decoder of your own"), str(GUIDE), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def decoder(guide):
    # Random init gives near-uniform logits; a larger head makes greedy choices clear-cut, so that
    # float rounding between the cached and the whole-window paths cannot flip an argmax. Smaller
    # embeddings let the blocks, and so the cache, weigh more against the token's own vector.
    model = guide["decoder"]
    head, embed = np.asarray(model.head) * 50, np.asarray(model.embed) * 0.3  # NumPy
    scaled = jax.device_put(head), jax.device_put(embed)
    return eqx.tree_at(lambda m: (m.head, m.embed), model, scaled)


@eqx.filter_jit
def _last_logits(model, window, length):
    # Causal: the padding after `length` changes nothing. `length` is traced, so one program
    # serves every window length.
    return model(window)[length - 1]


@eqx.filter_jit
def _sampled(logits, key, temperature):
    return sample_next_token(logits, key, temperature=temperature)  # one program, not one per primitive


def rerun(model, prompt, n: int, keep: int, key=None, temperature: float = 0.0) -> np.ndarray:
    """Tokens from rerunning `model.__call__` on the whole window for every token, with
    `generate`'s sliding policy (past `context_length`, keep the last `keep` tokens) and its
    documented randomness (token `i` of row 0 drawn with `fold_in(fold_in(key, 0), i)`); greedy
    without a key."""
    window, out = list(prompt), []
    for i in range(n):
        padded = np.zeros(model.context_length, np.int32)
        padded[: len(window)] = window
        logits = _last_logits(model, jax.device_put(padded), jnp.int32(len(window)))
        if key is None:
            token = int(np.argmax(np.asarray(logits)))
        else:
            token_key = jax.random.fold_in(jax.random.fold_in(key, 0), i)
            token = int(_sampled(logits, token_key, jnp.float32(temperature)))
        out.append(token)
        window.append(token)
        if len(window) > model.context_length:
            window = window[-keep:]
    return np.asarray(out)


def test_the_guide_samples_from_its_own_decoder(guide):
    assert isinstance(guide["decoder"], eqx.Module) and not isinstance(guide["decoder"], GPT)
    ids = guide["ids"]
    assert ids.shape == (40,) and 0 <= ids.min() and ids.max() < guide["decoder"].vocab_size
    assert len(set(ids.tolist())) > 1


@pytest.mark.parametrize("keep", [None, 1, 16])
def test_greedy_through_the_cache_equals_rerunning_the_window(decoder, keep):
    prompt = [5, 9, 1]
    n = 3 * decoder.context_length  # slides past the context several times
    options = SamplingOptions(temperature=0, keep=keep)
    cached = generate(decoder, prompt, n, key=jax.random.key(0), options=options)
    rerun_ = rerun(decoder, prompt, n, options.window_keep(decoder.context_length))
    np.testing.assert_array_equal(cached, rerun_)
    assert len(set(cached.tolist())) > 3  # not a degenerate constant run


def test_sampling_through_the_cache_equals_rerunning_the_window_with_the_same_key(decoder):
    prompt, key = [5, 9, 1], jax.random.key(3)
    cached = generate(decoder, prompt, 40, key=key, temperature=20.0)
    np.testing.assert_array_equal(cached, rerun(decoder, prompt, 40, 8, key=key, temperature=20.0))
    assert len(set(cached.tolist())) > 10


def test_a_batch_of_prompts_runs_every_row_through_the_cache(decoder):
    prompts = np.array([[5, 9, 1, 2], [7, 7, 3, 60]])
    rows = generate_batch(decoder, prompts, 25, key=jax.random.key(0), temperature=0)
    for row, prompt in zip(rows, prompts, strict=True):
        np.testing.assert_array_equal(row, rerun(decoder, prompt, 25, decoder.context_length // 2))
    assert not np.array_equal(rows[0], rows[1])


def test_gpt_follows_the_protocol_and_a_model_without_it_is_named():
    model: Decoder = gpt()
    assert (model.context_length, model.vocab_size) == (16, 65)
    with pytest.raises(TypeError, match="Transformer lacks context_length, vocab_size"):
        generate(transformer(), [1, 2], 3, key=jax.random.key(0))  # type: ignore[arg-type]


def test_the_transformers_decoder_bound_to_sources_is_a_decoder_translate_samples_through():
    # The family's encoder-decoder and source shape: test_toolkit.py translates the same shapes.
    config, model = TRANSFORMER_CONFIG, transformer(4)
    src = np.asarray([[5, 6, 7, 0, 0, 0], [4, 9, 11, 3, 0, 0], [12, 1, 2, 3, 4, 5]], np.int32)
    bound: Decoder = bind(model, jax.device_put(src))  # pyright checks the protocol
    assert (bound.context_length, bound.vocab_size) == (config.max_len, config.tgt_vocab_size)
    key, options = jax.random.key(2), SamplingOptions(temperature=1.5, top_k=6)
    drawn = generate_batch(bound, np.ones((3, 1), np.int32), 9, key=key, options=options)
    translated = translate(model, src, 9, bos_id=1, eos_id=2, key=key, options=options)
    for row, out in zip(drawn, translated, strict=True):  # the same tokens, padded after eos
        end = list(row).index(2) + 1 if 2 in row else len(row)
        np.testing.assert_array_equal(out[:end], row[:end])
        assert np.all(out[end:] == config.pad_id)
    one_bound = bind(model, jax.device_put(src[1:2]))
    one = generate(one_bound, [1], 9, key=jax.random.fold_in(key, 0), temperature=0)
    # Row 1 of the greedy translation of all three: test_toolkit.py translates that batch greedily.
    alone = translate(model, src, 9, bos_id=1, eos_id=2, temperature=0)[1]
    end = list(one).index(2) + 1 if 2 in one else len(one)
    np.testing.assert_array_equal(alone[:end], one[:end])
    with pytest.raises(ValueError, match="bound to 3 source"):
        generate_batch(bound, np.ones((4, 1), np.int32), 2, key=key)
