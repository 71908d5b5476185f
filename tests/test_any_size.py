"""Any size: past 2^31 and 2^32 tokens, window starts, spans and evaluation windows stay exact
(int64). The corpus is sparse shard files: 6.4e9 tokens that take no disk."""

import jax
import numpy as np
import pytest

from eqx_gpt.data.cache import Snapshot
from eqx_gpt.data.shards import ShardFile, TokenSpan
from eqx_gpt.evaluation import final_plan, periodic_plan
from eqx_gpt.streams import TRAIN_BATCHES, batch_key
from eqx_gpt.training.data import get_batch, window_starts

SHARD = 1 << 31  # tokens per shard: three make 6,442,450,944, past 2^32


@pytest.fixture
def huge(tmp_path):
    """A span over three sparse shards of 2^31 `uint16` tokens (4 GiB each, none of it on disk),
    with a few known ids written around 2^32."""
    for k in range(3):
        with open(tmp_path / f"shard-{k}.bin", "wb") as f:
            f.truncate(SHARD * 2)
    with open(tmp_path / "shard-1.bin", "r+b") as f:  # the last 3 tokens of shard 1: ids 7, 8, 9
        f.seek(SHARD * 2 - 6)
        f.write(np.array([7, 8, 9], np.uint16).tobytes())
    with open(tmp_path / "shard-2.bin", "r+b") as f:  # the first 2 of shard 2 (token 2^32): 10, 11
        f.write(np.array([10, 11], np.uint16).tobytes())
    snapshot = Snapshot.open(tmp_path)
    assert snapshot is not None
    yield TokenSpan([ShardFile(snapshot, f"shard-{k}.bin", "uint16", SHARD) for k in range(3)])
    snapshot.close()


def test_windows_past_2_to_the_32_read_the_right_tokens(huge):
    assert len(huge) == 3 * SHARD > 1 << 32
    across = (1 << 32) - 3  # a window across the boundary of shards 1 and 2
    np.testing.assert_array_equal(
        huge.rows(np.array([across, across + 2]), 4), [[7, 8, 9, 10], [9, 10, 11, 0]]
    )
    val = huge.span(int(0.9 * len(huge)), len(huge))  # a split starting past 2^32
    assert val.start > 1 << 32 and len(val) == len(huge) - val.start
    tail = huge.span((1 << 32) - 1, len(huge))
    np.testing.assert_array_equal(tail.read(tail.start, tail.start + 3), [9, 10, 11])


def test_window_starts_past_2_to_the_31_are_64_bit_uniform_and_reproducible(huge):
    kw = dict(n_tokens=len(huge), seed=3, stream=TRAIN_BATCHES, batch_size=4096, length=65)
    starts = window_starts(5, **kw)
    assert starts.dtype == np.int64 and starts.min() >= 0 and starts.max() <= len(huge) - 65
    assert (starts >= 1 << 32).mean() > 0.25  # a third of the corpus lies past 2^32 (expect 1/3)
    np.testing.assert_array_equal(window_starts(5, **kw), starts)  # a pure function of the step
    assert not np.array_equal(window_starts(6, **kw), starts)
    batch = get_batch(huge, 5, seed=3, stream=TRAIN_BATCHES, batch_size=8, length=65)
    assert batch.shape == (8, 65)


def test_window_starts_below_2_to_the_31_are_the_int32_draw_they_always_were():
    for n_tokens in (1_003_854, (1 << 31) - 1 + 64):  # Tiny Shakespeare's split; the largest narrow
        kw = dict(seed=1, stream=TRAIN_BATCHES, batch_size=64, length=65)
        old = jax.random.randint(batch_key(1, TRAIN_BATCHES, 9), (64,), 0, n_tokens - 65 + 1)
        np.testing.assert_array_equal(window_starts(9, n_tokens=n_tokens, **kw), np.asarray(old))


def test_evaluation_windows_of_a_split_past_2_to_the_32_are_int64(huge):
    n = len(huge)
    for plan in (periodic_plan(n, 64, 1 << 20), final_plan(n, 64, 1 << 20)):
        assert plan.starts.dtype == np.int64 and plan.starts.max() == n - 1 - 64
        assert plan.n_predicted == len(plan) * 64
        assert huge.rows(plan.starts[-3:], 65).shape == (3, 65)
