"""The fused attention kernels (`eqx_gpt.model.flash_attention`): outputs and gradients equal to the
XLA path given the same dropout mask, the mask's statistics, and `MultiHeadAttention` taking them.

On a CPU the kernels run in Pallas's interpret mode (exact, slow: the shapes here are small); on a
GPU the same tests compile them with Triton. Each distinct shape compiles the kernels afresh, so
the cases are few and each covers several things.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_gpt.model import attention as attention_module
from eqx_gpt.model import flash_attention as flash_module
from eqx_gpt.model.attention import MultiHeadAttention, multi_head_attention
from eqx_gpt.model.dropout import keep_probability
from eqx_gpt.model.flash_attention import (
    BlockSizes,
    dropout_keep,
    flash_attention,
    flash_attention_available,
    reference_attention,
    sequence_seeds,
)

ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def _exact_float32_products():
    """The kernels' products follow JAX's default precision (TF32 for float32 on a GPU), and the
    tests hold them to the exact reference: at "highest" they are IEEE float32 (on a CPU, always)."""
    with jax.default_matmul_precision("highest"):
        yield


def _normal(rng, shape, dtype=jnp.float32):
    # Drawn by NumPy: jax.random would compile a program for every shape (and dtype) drawn, and so
    # would `jnp.asarray` (`jax.device_put` compiles none).
    return jax.device_put(rng.standard_normal(shape, np.float32).astype(dtype))  # bfloat16 too (ml_dtypes)


def _qkv(seed, batch, seq, kv_seq, heads, d_head, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = _normal(rng, (batch, seq, heads, d_head), dtype)
    k = _normal(rng, (batch, kv_seq, heads, d_head), dtype)
    v = _normal(rng, (batch, kv_seq, heads, d_head), dtype)
    return q, k, v, _normal(rng, (batch, seq, heads, d_head))


def _causal(seq: int) -> jax.Array:
    """`causal_mask(seq)` `(seq, seq)`, built in NumPy (run eagerly, JAX compiles its operations)."""
    return jax.device_put(np.tril(np.ones((seq, seq), bool)))


# The kernels' seeds of a batch, in one program per batch shape (eagerly: one per operation).
_sequence_seeds = jax.jit(sequence_seeds, static_argnums=1)


def _padded_causal(seq: int, lengths) -> jax.Array:
    """Causal self-attention over sequences padded at the end to `seq`: `(batch, seq, seq)`. (Built
    in NumPy, as the test's inputs are: JAX run op by op compiles a program per operation and shape.)"""
    keys = np.arange(seq)[None, :] < np.asarray(lengths)[:, None]
    return jax.device_put(np.tril(np.ones((seq, seq), bool))[None] & keys[:, None, :])


# The XLA path without dropout, compiled whole (one program per shape, not one per operation).
_reference = jax.jit(reference_attention)


def _values_and_grads(attends, q, k, v, cotangent):
    """Each of `attends`' output and its gradients of `sum(out * cotangent)` for q, k and v, all in
    one compiled program (a program apiece would pay the compiler's fixed costs twice)."""

    def value_and_grads(attend, q, k, v):
        def loss(q, k, v):
            out = attend(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    return jax.jit(lambda q, k, v: [value_and_grads(attend, q, k, v) for attend in attends])(q, k, v)


def _assert_matches(q, k, v, cotangent, mask, rate, seeds, tolerance, **blocks):
    flash = lambda q, k, v: flash_attention(q, k, v, mask, rate=rate, seeds=seeds, **blocks)
    reference = lambda q, k, v: reference_attention(q, k, v, mask, rate=rate, seeds=seeds)
    (out, grads), (want_out, want_grads) = _values_and_grads((flash, reference), q, k, v, cotangent)
    names = ("out", "dq", "dk", "dv")
    for name, got, want in zip(names, (out, *grads), (want_out, *want_grads), strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * scale, err_msg=name)
    return out


CASES = {
    # (seq, kv lengths or None for causal alone, rate, blocks): blocks of 16 at T 64 make a 4 x 4
    # grid, so blocks above the diagonal and past a sequence's end are skipped.
    "T64 causal padded dropout": (64, [64, 37], 0.2, 16),
    "T64 causal": (64, None, 0.0, 16),
    "T256 causal padded dropout": (256, [256, 130], 0.2, 64),
    "T256 causal padded": (256, [200, 256], 0.0, 64),
}


# The T256 cases run the kernels' default blocks (64) over the same 4 x 4 grid the T64 cases cover
# with blocks of 16; each compiles its kernels for 2-3 s on a CPU, so they run with `-m slow`.
LONG = {name: pytest.mark.slow for name in CASES if name.startswith("T256")}


@pytest.mark.parametrize("case", [pytest.param(name, marks=LONG.get(name, ())) for name in CASES])
def test_outputs_and_gradients_equal_the_xla_path_given_the_same_mask(case):
    seq, lengths, rate, block = CASES[case]
    q, k, v, cotangent = _qkv(1, 2, seq, seq, 2, 16)
    mask = _causal(seq) if lengths is None else _padded_causal(seq, lengths)
    seeds = _sequence_seeds(jax.random.key(2), (2,))
    out = _assert_matches(
        q, k, v, cotangent, mask, rate, seeds, 1e-5, blocks=BlockSizes.uniform(block, block)
    )
    if rate:  # the mask made a difference: without dropout the output is another
        assert not np.allclose(out, _reference(q, k, v, mask), atol=1e-3)


def test_odd_sizes_cross_attention_and_a_sequence_that_sees_nothing():
    # 50 queries over 40 keys, d_head 8: padded to whole blocks (of 32, the largest of the kernels')
    # and to 16 features within. The second sequence has no key at all (length 0): its rows
    # attend uniformly, as the XLA path's do.
    q, k, v, cotangent = _qkv(3, 2, 50, 40, 2, 8)
    mask = jax.device_put(
        np.broadcast_to((np.arange(40)[None, :] < np.array([23, 0])[:, None])[:, None, :], (2, 50, 40))
    )
    seeds = _sequence_seeds(jax.random.key(4), (2,))
    blocks = BlockSizes(forward=(32, 16), dq=(16, 32), dkv=(16, 16))  # each kernel its own grid
    _assert_matches(q, k, v, cotangent, mask, 0.3, seeds, 1e-5, blocks=blocks)


def test_bfloat16_inputs_match_within_bfloat16_rounding():
    q, k, v, cotangent = _qkv(5, 2, 64, 64, 2, 16, jnp.bfloat16)
    seeds = _sequence_seeds(jax.random.key(6), (2,))
    blocks = BlockSizes.uniform(32, 32)
    out = _assert_matches(q, k, v, cotangent, _causal(64), 0.2, seeds, 3e-2, blocks=blocks)
    assert out.dtype == jnp.bfloat16


def _kernel_mask(seeds, seq: int, heads: int, rate: float) -> np.ndarray:
    """The kernel's own dropout mask `(batch, heads, seq, seq)`, read out through its output: with
    all-zero queries every weight is `1 / seq`, and with `v` the identity each output row is the
    row of kept weights, scaled by `1 / (seq * keep_probability)`."""
    batch = seeds.shape[0]
    q = np.zeros((batch, seq, heads, seq), np.float32)
    eye = np.broadcast_to(np.eye(seq, dtype=np.float32)[None, :, None, :], (batch, seq, heads, seq))
    attend = lambda q, eye, seeds: flash_attention(
        q, q, eye, rate=rate, seeds=seeds, blocks=BlockSizes.uniform(16, 16)
    )
    out = jax.jit(attend)(q, eye, seeds)  # one program (run op by op: one per operation)
    return np.moveaxis(np.asarray(out) * seq * keep_probability(rate), 2, 1)


def test_the_kernel_draws_dropout_keep_s_mask_per_sequence_and_head():
    seeds = _sequence_seeds(jax.random.key(7), (2,))
    drawn = _kernel_mask(seeds, 32, 2, 0.25)
    np.testing.assert_allclose(drawn, np.round(drawn), atol=1e-4)  # each weight kept whole or dropped
    idx = np.arange(32)
    per_head = lambda seed, h: dropout_keep(seed, h, idx[:, None], idx[None, :], 0.25)
    expected = jax.jit(jax.vmap(jax.vmap(per_head, in_axes=(None, 0)), in_axes=(0, None)))(
        seeds, np.arange(2)
    )
    np.testing.assert_array_equal(np.round(drawn).astype(bool), np.asarray(expected))
    assert (drawn[0] != drawn[1]).any() and (drawn[:, 0] != drawn[:, 1]).any()  # sequences, heads differ


RATES = (0.1, 0.2, 0.5)


@functools.cache
def _keep_masks() -> dict[float, np.ndarray]:
    """`dropout_keep`'s mask `(sequence, head, query, key)` of 3 sequences, 4 heads and 128
    positions at each of `RATES`: one program for the three (the rate is a Python float in it)."""
    idx = np.arange(128)

    def masks(seeds, heads):
        per_head = lambda rate: lambda seed, h: dropout_keep(seed, h, idx[:, None], idx[None, :], rate)
        return [
            jax.vmap(jax.vmap(per_head(r), in_axes=(None, 0)), in_axes=(0, None))(seeds, heads) for r in RATES
        ]

    drawn = jax.jit(masks)(_sequence_seeds(jax.random.key(8), (3,)), np.arange(4))
    return {rate: np.asarray(mask) for rate, mask in zip(RATES, drawn, strict=True)}


@pytest.mark.parametrize("rate", RATES)
def test_the_mask_keeps_one_minus_rate_independently_of_its_neighbours(rate):
    keep = _keep_masks()[rate]  # (sequence, head, query, key)
    p = keep_probability(rate)
    assert abs(keep.mean() - p) < 0.01 * p, keep.mean()
    # Pairs of neighbours (the next key, query, head, sequence) are both kept as often as chance says.
    for axis in range(4):
        n = keep.shape[axis]
        both = keep.take(range(1, n), axis) & keep.take(range(n - 1), axis)
        assert abs(both.mean() - p * p) < 0.01, (axis, both.mean())


def test_another_key_draws_another_mask_and_the_same_key_the_same():
    idx = np.arange(64)
    draw = jax.jit(
        lambda key: dropout_keep(sequence_seeds(key, ())[None][0], 0, idx[:, None], idx[None, :], 0.2)
    )
    a, b = np.asarray(draw(jax.random.key(9))), np.asarray(draw(jax.random.key(10)))
    p = keep_probability(0.2)
    assert abs(float((a != b).mean()) - 2 * p * (1 - p)) < 0.03
    np.testing.assert_array_equal(a, draw(jax.random.key(9)))


def test_sequence_seeds_of_one_key_are_those_of_its_split_keys():
    # Both in one program (run op by op, the split, reshape and draws compile one program each).
    of_key_and_split = lambda key: (
        sequence_seeds(key, (2, 3)),
        sequence_seeds(jax.random.split(key, 6).reshape(2, 3), (2, 3)),
    )
    of_key, of_split = jax.jit(of_key_and_split)(jax.random.key(11))
    np.testing.assert_array_equal(of_key, of_split)
    assert of_key.shape == (2, 3, 2)


def test_the_reference_is_the_per_head_xla_path_of_attention():
    q, k, v, _ = _qkv(12, 2, 24, 24, 3, 8)
    mask = _padded_causal(24, [24, 10])
    both = jax.jit(  # one program for the two
        lambda q, k, v, mask: (reference_attention(q, k, v, mask), multi_head_attention(q, k, v, mask)[0])
    )
    got, per_head = both(q, k, v, mask)
    np.testing.assert_allclose(got.reshape(2, 24, 24), per_head, rtol=1e-6, atol=1e-6)


def test_bad_calls_are_refused_in_one_line():
    q, k, v, _ = _qkv(13, 2, 16, 16, 1, 16)
    with pytest.raises(ValueError, match="needs seeds="):
        flash_attention(q, k, v, rate=0.1)
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, k, v, blocks=BlockSizes.uniform(48, 64))
    with pytest.raises(ValueError, match="rate must be in"):
        flash_attention(q, k, v, rate=1.0, seeds=jax.device_put(np.zeros((2, 2), np.uint32)))


def _attention_with_kernel(monkeypatch):
    """`MultiHeadAttention` taking the kernels (as on a GPU; here in interpret mode), its weights
    drawn in one program (built op by op, one program per weight shape and operation)."""
    if not ON_GPU:
        monkeypatch.setattr(attention_module, "flash_attention_available", lambda dtype, d_head: True)
    return eqx.filter_jit(lambda key: MultiHeadAttention(32, 2, dropout=0.2, key=key))(jax.random.key(14))


def _expected(mha, x, mask, key):
    """What attention computes with the kernel's mask, on the XLA path."""
    batch = x.shape[:-2]
    q, k, v = mha.project_qkv(x)
    flat = lambda a: a.reshape(-1, *a.shape[-3:])
    seeds = sequence_seeds(key, batch).reshape(-1, 2)
    out = reference_attention(flat(q), flat(k), flat(v), mask, rate=0.2, seeds=seeds)
    return mha.out(out.reshape(*batch, x.shape[-2], 32))


def test_attention_with_dropout_takes_the_kernel_for_a_batch_and_under_vmap(monkeypatch):
    mha = _attention_with_kernel(monkeypatch)
    x = _normal(np.random.default_rng(15), (2, 32, 32))
    key = jax.random.key(16)
    mask = _causal(32)

    @eqx.filter_jit  # the four in one program (each apart: four programs, two of them the kernels')
    def batch_and_vmap(mha, x, key):
        # One sequence at a time under jax.vmap (one key each): the same as the batch given those keys.
        keys = jax.random.split(key, 2)
        one = lambda x, k: mha(x, mask=mask, key=k)
        batch = (mha(x, mask=mask, key=key), _expected(mha, x, mask, key))
        return batch, (jax.vmap(one)(x, keys), _expected(mha, x, mask, keys))

    for got, expected in batch_and_vmap(mha, x, key):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _dot_precisions(jaxpr) -> set[str]:
    """The precision of every matrix product in `jaxpr`, the kernels' bodies included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.add(str(eqn.params["precision"]))
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found |= _dot_precisions(inner)
    return found


def test_the_kernels_products_follow_jax_s_default_matmul_precision():
    # As XLA's own products do: TF32 on a GPU by default (IEEE float32 in Triton is 30 times slower
    # there), exact where a caller asks for "highest", as this file's fixture does.
    q = np.ones((1, 32, 1, 16), np.float32)  # traced only: NumPy's (jnp.ones compiles a program)
    attend = lambda q: flash_attention(q, q, q, blocks=BlockSizes.uniform(16, 16))
    assert _dot_precisions(jax.make_jaxpr(attend)(q).jaxpr) == {"(Precision.HIGHEST, Precision.HIGHEST)"}
    with jax.default_matmul_precision("default"):
        assert _dot_precisions(jax.make_jaxpr(attend)(q).jaxpr) == {"(Precision.DEFAULT, Precision.DEFAULT)"}


def test_the_kernels_lower_to_triton_without_a_gpu():
    # Lowering for CUDA on any machine runs Pallas's Triton lowering, which refuses a primitive it
    # has no rule for: what interpret mode cannot tell. (Triton's own compiler runs on a GPU only.)
    q = np.ones((2, 100, 2, 8), jnp.bfloat16)  # traced only: NumPy's (jnp.ones compiles a program)
    mask = _padded_causal(100, [100, 41])
    seeds = jax.device_put(np.ones((2, 2), np.uint32))
    attend = lambda q, k, v: flash_attention(q, k, v, mask, rate=0.2, seeds=seeds, interpret=False)
    grads = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    try:
        lowered = jax.jit(grads).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # JAX 0.12 (Python 3.13's lock) lowers Pallas for CUDA only beside a GPU
        if "No supported GPU devices found" not in str(e):
            raise
        pytest.skip(f"this JAX ({jax.__version__}) lowers Pallas for CUDA only where a GPU is")
    assert lowered.count("xla.gpu.triton") == 3  # forward, dq, dk and dv


def test_the_cpu_keeps_the_per_head_path():
    assert ON_GPU or not flash_attention_available(jnp.float32, 64)


def test_the_gpu_s_trial_of_the_kernels_runs_while_a_model_is_traced_and_a_failure_falls_back(monkeypatch):
    # Attention asks `flash_attention_available` while JAX traces the model (under jit, in a scan):
    # the trial must still run for real, not be traced into the model.
    trial = flash_module._kernel_works.__wrapped__  # the uncached function; interpret mode here
    passed = []

    def layer(carry, x):
        passed.append(trial("float32", 16, True))
        return carry, x

    jax.jit(lambda xs: jax.lax.scan(layer, 0.0, xs))(np.ones(2, np.float32))
    assert passed == [True]

    def broken(*args, **kwargs):
        raise RuntimeError("Triton could not lower this\n(the rest of a long message)")

    monkeypatch.setattr(flash_module, "flash_attention", broken)
    with pytest.warns(
        UserWarning, match="failed on this GPU .*: Triton could not lower this; attention with"
    ):
        assert trial("float32", 16, True) is False


@pytest.mark.skipif(not ON_GPU, reason="the kernels compile for a GPU only there")
def test_on_a_gpu_the_kernel_compiles_and_attention_takes_it():
    assert flash_attention_available(jnp.bfloat16, 64) and flash_attention_available(jnp.float32, 64)
