"""The training data: the bundled corpus, the 90/10 split, batches that depend only on (seed, step)
and are read from the shards, and the bounded validation windows."""

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_gpt.data.manifest import TRAIN_FRACTION
from eqx_gpt.data.prepare import prepare
from eqx_gpt.data.shards import TokenSpan
from eqx_gpt.evaluation import final_plan, periodic_plan, plan_sample, plan_whole
from eqx_gpt.streams import TRAIN_BATCHES, batch_key
from eqx_gpt.tokenizer import CharTokenizer
from eqx_gpt.training.config import TrainConfig
from eqx_gpt.training.data import (
    SHAKESPEARE_SHA256,
    DataError,
    batch_reader,
    check_split,
    fixed_batches,
    get_batch,
    load_corpus,
    load_text,
    shakespeare_path,
)
from eqx_gpt.training.parallel import data_mesh, shard_rows


@functools.partial(jax.jit, static_argnames=("seed", "stream", "batch_size", "length"))
def _batch_the_old_way(data, step, *, seed, stream, batch_size, length):
    """How batches were drawn before the shards: from the whole corpus on the device."""
    starts = jax.random.randint(batch_key(seed, stream, step), (batch_size,), 0, data.shape[0] - length + 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(data, s, length))(starts)


def split_text(text: str, train_fraction: float = TRAIN_FRACTION) -> tuple[str, str]:
    """The first `train_fraction` of the characters for training, the rest for validation (for a
    char tokenizer, the split `Corpus.train` and `Corpus.val` must make)."""
    n = int(len(text) * train_fraction)
    return text[:n], text[n:]


def test_the_bundled_corpus_tokenizes_and_splits_as_the_text_did():
    text = load_text()
    assert len(text) == 1_115_394
    assert hashlib.sha256(shakespeare_path().read_bytes()).hexdigest() == SHAKESPEARE_SHA256
    corpus = load_corpus(None, {"kind": "char"})
    assert corpus.identity == SHAKESPEARE_SHA256 and corpus.folder is None  # small: in memory
    tokenizer = CharTokenizer.from_text(text)
    assert corpus.tokenizer == tokenizer
    train, val = split_text(text)
    assert len(train) == 1_003_854 and train + val == text
    np.testing.assert_array_equal(corpus.train.to_array(), tokenizer.encode(train))
    np.testing.assert_array_equal(corpus.val.to_array(), tokenizer.encode(val))


def test_batches_from_the_shards_are_the_batches_drawn_from_the_whole_array(tmp_path, monkeypatch):
    monkeypatch.setattr("eqx_gpt.data.chunks.CHUNK_BYTES", 1000)  # many shards: windows cross them
    ids = np.random.default_rng(0).integers(0, 7, 20_000)
    (tmp_path / "c.txt").write_text("".join("abcdefg"[i] for i in ids))
    corpus = prepare(tmp_path / "c.txt", {"kind": "char"}, cache=tmp_path / "cache", in_memory_bytes=0)
    assert len(corpus.manifest.shards) == 20
    whole = jnp.asarray(corpus.train.to_array())
    for step in (0, 1, 77):
        kw = dict(seed=3, stream=TRAIN_BATCHES, batch_size=64, length=17)
        a = get_batch(corpus.train, step, **kw)
        np.testing.assert_array_equal(a, np.asarray(_batch_the_old_way(whole, step, **kw)))
        np.testing.assert_array_equal(a, get_batch(corpus.train, step, **kw))  # the same every time
    assert not np.array_equal(get_batch(corpus.train, 1, **kw), get_batch(corpus.train, 2, **kw))
    fixed = fixed_batches(corpus.train, n_batches=3, **kw)
    assert fixed.shape == (3, 64, 17) and np.array_equal(fixed[1], get_batch(corpus.train, 1, **kw))


def test_a_span_reads_windows_across_shards_and_refuses_windows_outside_it():
    flat = np.arange(100, dtype=np.uint16)
    span = TokenSpan([flat[:30], flat[30:31], flat[31:]]).span(10, 90)
    starts = np.array([0, 15, 19, 20, 21, 70])
    np.testing.assert_array_equal(span.rows(starts, 10), flat[10 + starts[:, None] + np.arange(10)])
    assert span.rows(starts, 10).dtype == np.int32 and len(span) == 80
    with pytest.raises(ValueError, match="leave the span"):
        span.rows(np.array([71]), 10)


def test_each_process_reads_only_its_rows_and_an_unused_slot_is_zeros():
    span = TokenSpan([np.arange(50, dtype=np.uint16)])
    starts = np.array([[3, 5, 7, 9], [-1, -1, -1, -1]])
    read = batch_reader(span, starts, 4)
    whole = read((slice(None), slice(None), slice(None)))
    assert whole.shape == (2, 4, 4) and not whole[1].any()
    np.testing.assert_array_equal(whole[0, 2], [7, 8, 9, 10])
    np.testing.assert_array_equal(read((slice(0, 1), slice(2, 4))), whole[:1, 2:4])
    asked = []
    array = jax.make_array_from_callback(  # the multi-process path of `shard_rows`, in one process
        whole.shape, jax.sharding.NamedSharding(data_mesh(), jax.sharding.PartitionSpec(None, "data")),
        lambda index: asked.append(index) or read(index),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(array), whole)
    assert len(asked) == data_mesh().size
    np.testing.assert_array_equal(np.asarray(shard_rows(read, whole.shape, data_mesh(), 1)), whole)


def test_a_split_shorter_than_one_window_is_refused():
    check_split(TokenSpan([np.zeros(17, np.uint16)]), "validation", 16, "f")
    with pytest.raises(DataError, match="fewer than one window of context_length \\+ 1 = 17"):
        check_split(TokenSpan([np.zeros(16, np.uint16)]), "validation", 16, "f")


def test_evaluation_windows_cover_the_split_within_the_budget():
    default = TrainConfig().eval_tokens
    ts = periodic_plan(111_540, 64, default)  # Tiny Shakespeare's split: whole, as it always was
    assert ts.whole and ts.n_predicted == 111_539 and ts.stride == 64
    final = final_plan(111_540, 64, default)
    assert final.whole and final.stride == 32 and final.n_predicted == 111_539
    big = periodic_plan(10**8, 64, default)  # a large split: the same evenly spread windows each time
    assert not big.whole and big.n_predicted <= default and len(big) == default // 64
    assert big.starts[0] == 0 and big.starts[-1] == 10**8 - 65 and np.all(np.diff(big.starts) >= 64)
    np.testing.assert_array_equal(big.starts, periodic_plan(10**8, 64, default).starts)
    final = final_plan(10**8, 64, default)
    assert not final.whole and final.n_predicted == 4 * big.n_predicted
    assert plan_whole(5, 64, 32).n_predicted == 4 and plan_sample(5, 64, 10).whole  # shorter than a window
