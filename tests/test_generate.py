"""KV-cached generation against the naive rerun-the-window reference, sliding, determinism."""

import functools
import inspect
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gen_models import GPT_CONFIG, GROUP, gpt
from oracles import naive_generate

import eqx_gpt.generation.generate as generation
from eqx_gpt import GPT, SamplingOptions
from eqx_gpt.generation.generate import (
    decode_incrementally,
    generate,
    generate_batch,
    prompt_bucket,
    stream_batch,
)

pytestmark = pytest.mark.xdist_group(GROUP)

CFG = GPT_CONFIG  # vocab 65, context 16


def make_model(seed):
    model = gpt(seed)
    # Random init gives near-uniform logits; a larger head makes choices clear-cut (and argmax
    # ties from float rounding implausible) so the comparison tests something.
    return eqx.tree_at(lambda m: m.head.weight, model, jax.device_put(np.asarray(model.head.weight) * 50))


@pytest.fixture(scope="module")
def model():
    return make_model(0)


def random_prompt(seed, length):
    # NumPy's generator: JAX's would compile a program for every prompt length.
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, length).astype(np.int32)


@pytest.mark.parametrize("seed, prompt_len", [(1, 1), (2, 7), (3, 12)])
def test_greedy_cached_equals_naive_within_the_context(seed, prompt_len):
    model = make_model(seed)
    prompt = random_prompt(seed, prompt_len)
    n = CFG.context_length - prompt_len  # fills the window exactly, never slides
    key = jax.random.key(seed)
    cached = generate(model, prompt, n, key=key, options=SamplingOptions(temperature=0))
    naive = naive_generate(model, prompt, n, key=key, options=SamplingOptions(temperature=0))
    assert len(cached) == n
    np.testing.assert_array_equal(cached, naive)
    assert len(set(cached.tolist())) > 1  # not a degenerate constant run


def test_sampled_cached_equals_naive_with_the_same_key(model):
    prompt = random_prompt(4, 5)
    kw = dict(key=jax.random.key(7), options=SamplingOptions(temperature=1.3, top_k=20, top_p=0.95))
    np.testing.assert_array_equal(generate(model, prompt, 11, **kw), naive_generate(model, prompt, 11, **kw))


@pytest.mark.parametrize("keep", [None, 1, 5, CFG.context_length])
def test_sliding_past_the_context_matches_the_naive_policy(model, keep):
    prompt = random_prompt(5, 6)
    n = 3 * CFG.context_length + 3  # slides several times
    key = jax.random.key(1)
    cached = generate(model, prompt, n, key=key, options=SamplingOptions(temperature=0, keep=keep))
    naive = naive_generate(model, prompt, n, key=key, options=SamplingOptions(temperature=0, keep=keep))
    assert cached.shape == (n,)
    np.testing.assert_array_equal(cached, naive)


def test_after_a_slide_the_model_sees_only_the_kept_window(model):
    # A full window plus one new token t is cut to its last keep = 8 tokens (t included) and
    # re-prefilled at position 0, so what follows equals starting afresh from that cut.
    prompt = random_prompt(6, CFG.context_length)
    out = generate(model, prompt, 20, key=jax.random.key(0), options=SamplingOptions(temperature=0))
    cut = np.concatenate([prompt[-(CFG.context_length // 2 - 1) :], out[:1]])
    np.testing.assert_array_equal(
        out[1:], generate(model, cut, 19, key=jax.random.key(0), options=SamplingOptions(temperature=0))
    )


def test_no_recompilation_per_token_prompt_length_or_setting(model, monkeypatch):
    # The prefill and the decode loop each sample once per trace (compile), never when they run.
    traces = Counter()

    def counted(*args):
        traces["sample_rows"] += 1
        return sample_rows(*args)

    sample_rows = generation.sample_rows
    monkeypatch.setattr(generation, "sample_rows", counted)
    # The prefill and the decode loop jitted anew (a new function object: an empty compile cache),
    # so that the first call below compiles and the count is seen to work (jax.clear_caches()
    # would make every later test in this process compile all it uses again).
    for name in ("_prefill", "_decode_steps"):
        function = inspect.unwrap(getattr(generation, name))
        fresh = functools.wraps(function)(
            lambda *args, function=function, **kwargs: function(*args, **kwargs)
        )
        monkeypatch.setattr(generation, name, eqx.filter_jit(fresh))
    generate(
        model,
        random_prompt(0, 3),
        30,
        key=jax.random.key(0),
        options=SamplingOptions(temperature=1.0, top_k=5, top_p=0.9),
    )
    before = traces["sample_rows"]
    assert before >= 2  # the prefill and the decode loop
    for i, prompt_len in enumerate([1, 9, 16, 12]):  # one bucket (16 = the context here)
        out = generate(
            model,
            random_prompt(i, prompt_len),
            70,  # several chunks, several slides
            key=jax.random.key(i),
            options=SamplingOptions(temperature=0.5 + i, top_k=1 + i, top_p=0.3 + 0.2 * i),
        )
        assert out.shape == (70,)
    assert traces["sample_rows"] == before


def test_prompt_buckets_are_powers_of_two_within_the_context():
    assert [prompt_bucket(n, 256) for n in (1, 16, 17, 100, 128, 129, 256)] == [
        16,
        16,
        32,
        128,
        128,
        256,
        256,
    ]
    assert prompt_bucket(5, 8) == 8


def test_same_key_same_tokens_whatever_the_chunking(model):
    prompt = random_prompt(8, 4)
    key = jax.random.key(3)
    a = generate(model, prompt, 45, key=key)
    np.testing.assert_array_equal(a, generate(model, prompt, 45, key=key))
    np.testing.assert_array_equal(
        a, generate(model, prompt, 45, key=key, options=SamplingOptions(chunk_size=8))
    )
    assert not np.array_equal(a, generate(model, prompt, 45, key=jax.random.key(4)))


def test_batch_rows_are_independent_samples_and_row_zero_is_generate(model):
    prompt = random_prompt(9, 5)
    key = jax.random.key(2)
    rows = generate_batch(model, np.tile(prompt, (3, 1)), 20, key=key)
    assert rows.shape == (3, 20)
    np.testing.assert_array_equal(rows[0], generate(model, prompt, 20, key=key))
    assert not np.array_equal(rows[0], rows[1]) and not np.array_equal(rows[1], rows[2])


def test_stream_yields_chunks_that_add_up(model):
    prompt = random_prompt(1, 3)
    chunks = list(
        stream_batch(model, prompt[None], 70, key=jax.random.key(0), options=SamplingOptions(chunk_size=8))
    )
    assert all(c.shape[0] == 1 and 1 <= c.shape[1] <= 8 for c in chunks)
    # The first token comes alone from the prefill; 13 fill the window (16); then each slide
    # gives one token, followed by 8 = 16 - 8 steps.
    assert [c.shape[1] for c in chunks][:6] == [1, 8, 5, 1, 8, 1]
    whole = generate(model, prompt, 70, key=jax.random.key(0))
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1)[0], whole)


def test_padded_vocabulary_ids_are_never_produced(model):
    assert CFG.padded_vocab_size > CFG.vocab_size
    head = np.array(model.head.weight)  # NumPy: an eager `.at[].set` compiles a program
    head[:, CFG.vocab_size :] = 1e4
    rigged = eqx.tree_at(lambda m: m.head.weight, model, jax.device_put(head))
    out = generate(
        rigged, random_prompt(2, 4), 40, key=jax.random.key(0), options=SamplingOptions(temperature=5.0)
    )
    assert out.max() < CFG.vocab_size


def test_a_prompt_longer_than_the_context_is_cropped_to_its_end(model):
    long = random_prompt(3, 40)
    key = jax.random.key(0)
    np.testing.assert_array_equal(
        generate(model, long, 10, key=key, options=SamplingOptions(temperature=0)),
        generate(model, long[-CFG.context_length :], 10, key=key, options=SamplingOptions(temperature=0)),
    )


def test_zero_new_tokens(model):
    assert generate(model, [1, 2], 0, key=jax.random.key(0)).shape == (0,)


@pytest.mark.parametrize(
    "prompt, kwargs, needle",
    [
        ([], {}, "at least one token"),
        ([1, 99], {}, "vocab_size"),
        ([1, -1], {}, "vocab_size"),
        ([1, 2], {"keep": 0}, "keep"),
        ([1, 2], {"keep": 17}, "keep"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_k": 0}, "top_k"),
    ],
)
def test_bad_arguments_raise_named_errors(model, prompt, kwargs, needle):
    with pytest.raises(ValueError, match=needle):  # from SamplingOptions, or from generate
        generate(
            model, np.asarray(prompt, np.int32), 3, key=jax.random.key(0), options=SamplingOptions(**kwargs)
        )
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [1], -1, key=jax.random.key(0))


def test_bad_shapes_and_chunk_sizes_raise_named_errors(model):
    with pytest.raises(ValueError, match=r"shape \(seq,\)"):
        generate(model, np.ones((2, 3), np.int32), 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        generate_batch(model, np.ones(3, np.int32), 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="chunk_size"):
        generate(model, [1, 2], 3, key=jax.random.key(0), options=SamplingOptions(chunk_size=0))


class BytesTokenizer:
    """One id per byte, like the byte level of GPT-2's BPE."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_is_never_released_mid_character():
    text = "añ€b"
    data = list(text.encode())  # a, 2 bytes, 3 bytes, b
    chunks = [data[:2], data[2:4], data[4:6], data[6:]]  # splits both multi-byte characters
    pieces = list(decode_incrementally(BytesTokenizer(), chunks))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # An incomplete tail at the very end is still flushed (as a replacement character).
    assert "".join(decode_incrementally(BytesTokenizer(), [data[:2]])) == "a\ufffd"


def test_sampling_settings_work_as_keywords_beside_options():
    # The API before SamplingOptions: generate(..., temperature=..., top_k=..., top_p=...).
    model = gpt(0)
    key, prompt = jax.random.key(5), [1, 2, 3]
    as_options = generate(
        model, prompt, 12, key=key, options=SamplingOptions(temperature=0.8, top_k=5, top_p=0.9)
    )
    as_keywords = generate(model, prompt, 12, key=key, temperature=0.8, top_k=5, top_p=0.9)
    np.testing.assert_array_equal(as_keywords, as_options)
    greedy = SamplingOptions(temperature=0.0)
    np.testing.assert_array_equal(
        generate(model, prompt, 12, key=key, options=SamplingOptions(top_k=3), temperature=0.0),
        generate(model, prompt, 12, key=key, options=greedy),
    )  # a keyword overrides that field of `options`
    with pytest.raises(TypeError, match="unknown sampling setting.*'temprature'"):
        generate(model, prompt, 12, key=key, temprature=0.5)
    with pytest.raises(ValueError, match="top_k must be an integer in \\[1, "):
        generate(model, prompt, 12, key=key, top_k=0)


class _Scaled(eqx.Module):
    """A GPT whose `decode` answer is changed by `change` (logits + `added`, cache) -> answer: a
    broken decoder. `added` is an array (traced), so decoders that differ in it share programs."""

    gpt: GPT
    change: object = eqx.field(static=True)
    vocab_size: int = eqx.field(static=True, default=CFG.vocab_size)
    context_length: object = eqx.field(static=True, default=CFG.context_length)
    added: jax.Array | None = None

    def init_cache(self, *, batch):
        return self.gpt.unstack().init_cache(batch=batch)

    def decode(self, tokens, cache, start):
        logits, cache = self.gpt.unstack().decode(tokens, cache, start)
        return self.change(logits if self.added is None else logits + self.added, cache)


def _broken(change, **fields):
    return _Scaled(make_model(0), change, **fields)


def _unchanged(logits, cache):
    return logits, cache


def _logits_plus(index, value):
    """What, added to finite logits, gives `value` at `index` (every id where `index` is None)."""
    added = np.zeros(CFG.vocab_size, np.float32)
    added[slice(None) if index is None else index] = value
    return added


@pytest.mark.parametrize(
    "added, word",
    [
        (_logits_plus(3, np.nan), "NaN"),
        (_logits_plus(3, np.inf), "NaN or"),
        (_logits_plus(None, -np.inf), "all -inf"),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_with_no_distribution_are_refused_not_sampled_as_token_0(added, word, temperature):
    model = _broken(_unchanged, added=jax.device_put(added))
    for n in (1, 20):  # the prefill's token, and the decode loop's
        with pytest.raises(ValueError, match=f"_Scaled's logits for new token 0 of row 0 .*{word}"):
            generate(model, [1, 2], n, key=jax.random.key(0), temperature=temperature, top_k=5)


def test_logits_going_bad_mid_stream_are_refused_at_the_token_they_reach():
    # The id drawn as token i poisons the model (a NaN embedding row): token i is handed over,
    # token i + 1, the first drawn from NaN logits, is refused, not sampled as id 0.
    model = make_model(0)
    out = generate(model, [1, 2], 30, key=jax.random.key(0), temperature=0)
    poison = int(out[5])
    first = list(out).index(poison)
    assert poison not in (1, 2)
    embed = np.array(model.embed)
    embed[poison] = np.nan
    bad = eqx.tree_at(lambda m: m.embed, model, jax.device_put(embed))
    handed = []
    with pytest.raises(ValueError, match=f"new token {first + 1} of row 0"):
        for chunk in stream_batch(bad, np.asarray([[1, 2]]), 30, key=jax.random.key(0), temperature=0):
            handed.extend(chunk[0].tolist())
    assert handed == out[: len(handed)].tolist() and len(handed) <= first + 1


@pytest.mark.parametrize(
    "model, match",
    [
        (
            lambda: _broken(lambda lg, c: (jnp.pad(lg, [(0, 0)] * (lg.ndim - 1) + [(0, 3)]), c)),
            r"\(1, 16, 68\).*vocab_size=65",
        ),
        (lambda: _broken(lambda lg, c: (lg[..., :60], c)), r"\(1, 16, 60\).*vocab_size=65"),
        (
            lambda: _broken(lambda lg, c: (lg, c, 0)),
            r"_Scaled.decode must return \(logits, cache\), got a tuple of 3",
        ),
        (
            lambda: _broken(lambda lg, c: (lg, c), context_length=0),
            r"_Scaled.context_length must be a whole number >= 1.*got 0",
        ),
        (
            lambda: _broken(lambda lg, c: (lg, c), vocab_size="11"),
            r"_Scaled.vocab_size must be a whole number >= 1.*got '11'",
        ),
    ],
)
def test_a_broken_decoder_is_named_in_one_line(model, match):
    with pytest.raises(TypeError, match=match) as caught:
        generate(model(), [1, 2], 3, key=jax.random.key(0))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: generate(m, [1, 2], 3, key=5), "key must be one JAX PRNG key.*got int"),
        (lambda m: generate(m, [1, 2], 3, key=jax.random.split(jax.random.key(0))), "got shape \\(2,\\)"),
        (lambda m: generate(m, "ROMEO:", 3, key=jax.random.key(0)), "token ids .*got text; encode it"),
        (lambda m: generate_batch(m, ["ab", "cd"], 3, key=jax.random.key(0)), "got text"),
    ],
)
def test_a_bad_key_or_a_text_prompt_is_named_in_one_line(model, call, match):
    with pytest.raises(TypeError, match=match):
        call(model)
