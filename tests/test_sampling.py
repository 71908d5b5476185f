"""Next-token choice: greedy, temperature, top-k and nucleus (top-p) semantics."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gen_models import GROUP
from oracles import np_softmax

from eqx_gpt.generation.sampling import check_sampling_args, sample_next_token, top_k_filter, top_p_filter

pytestmark = pytest.mark.xdist_group(GROUP)

VOCAB = 12
DRAWN = 20_000  # keys per call of `_draws` at least, whatever the draws kept: one program per vocabulary


@jax.jit
def _draws(logits, keys, temperature, top_k, top_p):
    pick = lambda k: sample_next_token(logits, k, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.vmap(pick)(keys)


def draws(logits, n, temperature=1.0, top_k=None, top_p=None):
    """`n` independent samples from one row of logits (one compiled program for all settings and,
    up to `DRAWN`, every `n`: the first `n` of `DRAWN` draws). Fewer than `VOCAB` logits are padded
    to `VOCAB` with `-inf` (ids never drawn, and ranked last by the filters), so they share the
    program of `VOCAB` ids; the keys are NumPy's random words (`jax.random.split` compiles a program
    for every count)."""
    logits = np.asarray(logits, np.float32)
    vocab = logits.shape[0]
    if vocab < VOCAB:
        logits = np.concatenate([logits, np.full(VOCAB - vocab, -np.inf, np.float32)])
    words = np.random.default_rng(0).integers(0, 2**32, (max(n, DRAWN), 2), dtype=np.uint32)
    keys = jax.random.wrap_key_data(jax.device_put(words))
    top_k = vocab if top_k is None else top_k  # keeping every id = no filter
    top_p = 1.0 if top_p is None else top_p
    drawn = np.asarray(
        _draws(jax.device_put(logits), keys, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
    )[:n]
    assert drawn.max() < vocab  # never a padding id
    return drawn


def random_logits(seed, scale=2.0):
    # NumPy's generator: JAX's, run eagerly, compiles a program of its own.
    return jax.device_put(scale * np.random.default_rng(seed).standard_normal(VOCAB, np.float32))


def test_temperature_zero_is_argmax_whatever_the_key():
    for seed in range(5):
        logits = random_logits(seed)
        assert set(draws(logits, 50, temperature=0.0)) == {int(np.argmax(logits))}


def test_top_k_one_equals_greedy_even_with_ties():
    logits = np.array(
        [0.0, 3.0, 1.0, 3.0, -2.0], np.float32
    )  # a tie: argmax takes the lower id, so must top_k=1
    assert set(draws(logits, 50, top_k=1)) == {1}
    for seed in range(5):
        logits = random_logits(seed)
        assert set(draws(logits, 50, temperature=1.7, top_k=1)) == {int(np.argmax(logits))}


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = random_logits(1)
    top3 = set(np.argsort(-np.asarray(logits))[:3].tolist())
    filtered = np.asarray(top_k_filter(logits, 3))
    assert set(np.flatnonzero(np.isfinite(filtered)).tolist()) == top3
    np.testing.assert_array_equal(filtered[list(top3)], np.asarray(logits)[list(top3)])
    assert set(draws(logits, 400, top_k=3)) == top3  # all three do come out


def nucleus_reference(logits, p):
    """The smallest set of most likely ids whose probability reaches p (NumPy, float64)."""
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    kept, mass = set(), 0.0
    for i in np.argsort(-probs, kind="stable"):
        kept.add(int(i))
        mass += probs[i]
        if mass >= p:
            break
    return kept


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Padded to VOCAB with -inf ids (probability 0, never kept as finite): the filter's program for
    # VOCAB ids, which the tests below compile anyway, serves these 4 too.
    logits = np.full(VOCAB, -np.inf, np.float32)
    logits[:4] = np.log(np.array([0.05, 0.5, 0.15, 0.3], np.float32))
    logits = jax.device_put(logits)
    kept = lambda p: set(np.flatnonzero(np.isfinite(np.asarray(top_p_filter(logits, p)))).tolist())
    assert kept(0.01) == {1}  # the top token always survives
    assert kept(0.49) == {1}
    assert kept(0.51) == {1, 3}
    assert kept(0.79) == {1, 3}
    assert kept(0.81) == {1, 3, 2}
    assert kept(1.0) == {0, 1, 2, 3}
    for seed in range(10):
        logits = random_logits(seed)
        for p in (0.1, 0.5, 0.75, 0.9, 0.99):
            got = set(np.flatnonzero(np.isfinite(np.asarray(top_p_filter(logits, p)))).tolist())
            assert got == nucleus_reference(np.asarray(logits, np.float64), p), (seed, p)


def test_top_p_sampling_stays_in_the_nucleus_and_renormalises():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    samples = draws(np.log(probs), 4000, top_p=0.7)
    assert set(samples) == {1, 3}
    # Within the nucleus the odds are unchanged: 0.5 : 0.3 -> 0.625 : 0.375.
    assert abs(np.mean(samples == 1) - 0.625) < 0.03


def test_top_k_then_top_p_measures_mass_after_top_k():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    # top_k=2 leaves 0.4 : 0.3 -> 0.571 : 0.429; p=0.5 then keeps only id 0.
    assert set(draws(np.log(probs), 200, top_k=2, top_p=0.5)) == {0}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution(temperature):
    logits = np.array([1.0, 0.0, -1.0, 0.5], np.float32)
    samples = draws(logits, 20000, temperature=temperature)
    expected = np_softmax(np.asarray(logits, np.float64) / temperature)
    observed = np.bincount(samples, minlength=4) / len(samples)
    np.testing.assert_allclose(observed, expected, atol=0.015)


def test_settings_are_traced_values_not_recompiles():
    traces = []

    @jax.jit
    def pick(logits, key, t, k, p):
        traces.append(1)
        return sample_next_token(logits, key, temperature=t, top_k=k, top_p=p)

    logits = random_logits(3)
    for t, k, p in [(1.0, 3, 0.9), (0.0, 5, 0.5), (0.7, 1, 1.0)]:
        pick(logits, jax.random.key(0), jnp.float32(t), jnp.int32(k), jnp.float32(p))
    assert len(traces) == 1
    # A traced temperature of 0 is still greedy.
    greedy = pick(logits, jax.random.key(9), jnp.float32(0.0), jnp.int32(VOCAB), jnp.float32(1.0))
    assert int(greedy) == int(np.argmax(logits))


@pytest.mark.parametrize(
    "temperature, top_k, top_p, needle",
    [
        (-0.1, None, None, "temperature"),
        (float("nan"), None, None, "temperature"),
        (1.0, 0, None, "top_k"),
        (1.0, 2.5, None, "top_k"),
        (1.0, None, 0.0, "top_p"),
        (1.0, None, 1.5, "top_p"),
        (1.0, None, float("nan"), "top_p"),
    ],
)
def test_bad_settings_are_named(temperature, top_k, top_p, needle):
    with pytest.raises(ValueError, match=needle):
        check_sampling_args(temperature, top_k, top_p)


def test_good_settings_pass():
    check_sampling_args(0.0, 1, 1.0)
    check_sampling_args(2.0, None, 1e-6)


def rank_order(logits):
    """Ids by descending logit, ties by lower id first (argmax's order): the filters' ranking."""
    return np.argsort(-np.asarray(logits, np.float64), kind="stable")


def awkward_logits(seed, vocab):
    """Logits with ties (rounded to halves), -inf ids (as top-k leaves them) and signed zeros."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.normal(0, 3, vocab) * 2) / 2
    logits[rng.random(vocab) < 0.1] = -np.inf
    logits[rng.random(vocab) < 0.05] = -0.0
    logits[np.argmax(logits)] = 9.0  # at least one finite id
    return logits.astype(np.float32)


@pytest.mark.parametrize("vocab", [12, 300, 50257])
def test_top_k_keeps_the_first_k_of_the_ranking_with_ties_and_minus_inf(vocab):
    filter_jit = jax.jit(top_k_filter)  # k traced: one program for every k
    for seed in range(3):
        logits = awkward_logits(seed, vocab)
        for k in sorted({1, 2, 7, 200, vocab - 1, vocab, vocab + 5}):
            if k < 1:
                continue
            expected = np.full(vocab, -np.inf, np.float32)
            first = rank_order(logits)[:k]
            expected[first] = logits[first]
            x = jax.device_put(logits)
            for got in (top_k_filter(x, k), filter_jit(x, jnp.int32(k))):
                np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"seed {seed}, k {k}")


def nucleus_by_rank(logits, p):
    """Ids kept by top-p, in float64 on the ranking, and how far the nearest decision is from p
    (decisions closer than float32 rounding may go either way)."""
    logits = np.asarray(logits, np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = rank_order(logits)
    mass_above = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(len(logits), bool)
    keep[order] = (mass_above < p) | (p >= 1)
    return keep, np.abs(mass_above - p).min()


@pytest.mark.parametrize("vocab", [12, 300, 50257])
def test_top_p_keeps_the_ranked_prefix_below_p_with_ties_and_minus_inf(vocab):
    filter_jit = jax.jit(top_p_filter)
    checked = 0
    for seed in range(4):
        logits = awkward_logits(seed, vocab)
        for p in (0.05, 0.3, 0.6, 0.9, 0.999, 1.0):
            keep, margin = nucleus_by_rank(logits, p)
            if margin < 1e-5 and p < 1:
                continue
            checked += 1
            expected = np.where(keep, logits, -np.inf).astype(np.float32)
            x = jnp.asarray(logits)
            for got in (top_p_filter(x, p), filter_jit(x, jnp.float32(p))):
                np.testing.assert_array_equal(np.asarray(got), expected, err_msg=f"seed {seed}, p {p}")
    assert checked >= 12  # of 24: a decision within rounding of p is rare, never most of them


def test_a_large_vocabulary_draws_from_the_softmax_in_two_stages():
    """Past 256 ids a draw picks a block of ids by its mass, then an id in it: the frequencies of
    single ids and of whole blocks must still be the softmax's, and -inf ids never come out."""
    vocab, n = 700, 60_000  # three blocks, the last one partial
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, vocab).astype(np.float32)
    logits[300:512] = -np.inf  # most of the second block filtered out, as top-k / top-p do
    logits[600] = 4.0
    samples = draws(logits, n)
    probs = np_softmax(np.asarray(logits, np.float64))
    counts = np.bincount(samples, minlength=vocab)
    assert counts[300:512].sum() == 0
    for ids in [np.arange(0, 256), np.arange(256, 512), np.arange(512, vocab), *rank_order(logits)[:8, None]]:
        expected = probs[ids].sum()
        sigma = np.sqrt(expected * (1 - expected) / n)
        observed = counts[ids].sum() / n
        assert abs(observed - expected) < 5 * sigma + 1e-9, (ids[:3], observed, expected)


@jax.jit
def _draw_of_top_2(logits, key, temperature):
    return sample_next_token(logits, key, temperature=temperature, top_k=2)


@pytest.mark.parametrize(
    "logits, kind",
    [
        (np.array([0.5, np.nan, 1.0], np.float32), "NaN"),  # NumPy: nothing compiled to collect them
        (np.array([0.5, np.inf, 1.0], np.float32), r"\+inf"),
        (np.full((3,), -np.inf, np.float32), "only -inf"),
    ],
)
def test_logits_with_no_distribution_are_refused_where_concrete_and_unusable_under_jit(logits, kind):
    from eqx_gpt.generation.sampling import UNUSABLE

    key, logits = jax.random.key(0), jax.device_put(logits)
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match=f"sample_next_token got logits holding {kind}"):
            sample_next_token(logits, key, temperature=temperature)
        drawn = _draw_of_top_2(logits, key, jnp.float32(temperature))  # one program for every case
        assert int(drawn) == UNUSABLE  # never id 0 or any real id


def test_sample_rows_marks_each_row_without_a_distribution_and_draws_the_others():
    from eqx_gpt.generation.sampling import UNUSABLE, sample_rows

    inf, nan = np.inf, np.nan
    logits = np.array([
        [0.0, 3.0, 1.0, 2.0],     # usable: argmax 1
        [5.0, nan, 1.0, 2.0],     # a NaN below the row's largest value
        [-nan, 0.0, 1.0, 2.0],    # a NaN with the sign bit set
        [0.0, 1.0, inf, 2.0],     # +inf
        [-inf, -inf, -inf, -inf], # nothing above -inf
        [-inf, -inf, 0.5, -inf],  # one id left: usable, always id 2
    ], np.float32)  # fmt: skip
    want_unusable = [False, True, True, True, True, False]
    rows = jax.jit(sample_rows)
    for temperature in (0.0, 1.0):
        drawn = np.asarray(rows(logits, jax.random.key(3), 0, jnp.float32(temperature), None, None))
        assert list(drawn == UNUSABLE) == want_unusable
        assert drawn[5] == 2 and (temperature > 0 or drawn[0] == 1)


def test_the_filters_refuse_nan_where_concrete_and_never_hide_it_under_jit():
    logits = np.array([2.0, -1.0, -np.nan, 0.5], np.float32)  # a NaN a filter could drop
    assert np.signbit(logits[2])  # a negative NaN, ranked below every number by its bits
    logits = jax.device_put(logits)
    for name, f in (
        ("top_k_filter", lambda lg: top_k_filter(lg, 2)),
        ("top_p_filter", lambda lg: top_p_filter(lg, 0.5)),
    ):
        with pytest.raises(ValueError, match=f"{name} got logits holding NaN"):
            f(logits)
        assert np.isnan(np.asarray(jax.jit(f)(logits))).all()
        clean = np.asarray([2.0, -1.0, -np.inf, 0.5], np.float32)  # the same shape: the same program
        clean = jax.device_put(clean)
        assert not np.isnan(np.asarray(jax.jit(f)(clean))).any()


def test_the_page_shows_the_distribution_tokens_are_drawn_from():
    from eqx_gpt.generation.sampling import filtered_logits, next_token_distribution

    # Jitted, as the server computes what its page shows (eqx_gpt/serve/inspect.py): one program
    # each, where the eager calls compiled every primitive.
    distribution = eqx.filter_jit(next_token_distribution)
    softmax_of_filtered = eqx.filter_jit(lambda *settings: jax.nn.softmax(filtered_logits(*settings)))
    logits = random_logits(4, scale=0.5)  # flat enough that top-p alone would keep more than 5
    settings = jnp.float32(0.7), jnp.int32(5), jnp.float32(0.8)
    shown = np.asarray(distribution(logits, *settings))
    assert 1 < int(np.sum(shown > 0)) <= 5
    assert len(nucleus_reference(np.asarray(logits, np.float64) / 0.7, 0.8)) > 5  # top_k does cut here
    np.testing.assert_allclose(shown, softmax_of_filtered(logits, *settings), rtol=1e-6)
    counts = np.bincount(draws(logits, 400, temperature=0.7, top_k=5, top_p=0.8), minlength=VOCAB)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(shown))
    np.testing.assert_allclose(counts / 400, shown, atol=0.08)
    greedy = np.asarray(distribution(logits, jnp.float32(0.0)))
    assert float(greedy[int(np.argmax(logits))]) == 1.0 and float(greedy.sum()) == 1.0
