"""The bundled corpus, bad data files, the 90/10 split, and batches that depend only on (seed, step)."""

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest

from eqx_gpt.streams import TRAIN_BATCHES
from eqx_gpt.training.corpus import (
    SHAKESPEARE_SHA256,
    DataError,
    get_batch,
    load_text,
    shakespeare_path,
    split_text,
    to_ids,
)


def test_bundled_shakespeare_is_the_known_text():
    text = load_text()
    assert len(text) == 1_115_394
    assert hashlib.sha256(shakespeare_path().read_bytes()).hexdigest() == SHAKESPEARE_SHA256
    train, val = split_text(text)
    assert len(train) == 1_003_854 and train + val == text


def test_bad_data_files_give_one_line_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Roméo".encode("latin-1"))
    cases = [
        (tmp_path / "missing.txt", "does not exist"),
        (tmp_path, "is a directory"),
        (empty, "is empty"),
        (latin1, "is not UTF-8"),
    ]
    for path, message in cases:
        with pytest.raises(DataError, match=message) as info:
            load_text(path)
        assert "\n" not in str(info.value)
    assert load_text(_write(tmp_path / "ok.txt", "héllo")) == "héllo"


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_a_split_shorter_than_one_window_is_rejected():
    assert to_ids(list(range(17)), "validation", 16, "f").shape == (17,)
    with pytest.raises(DataError, match="fewer than one window of context_length \\+ 1 = 17"):
        to_ids(list(range(16)), "validation", 16, "f")


def test_batches_are_a_pure_function_of_seed_and_step():
    data = jnp.arange(1000, dtype=jnp.int32)

    def batch(seed, step):
        return np.asarray(get_batch(data, step, seed=seed, stream=TRAIN_BATCHES, batch_size=8, length=17))

    a = batch(0, 5)
    assert a.shape == (8, 17)
    np.testing.assert_array_equal(a, batch(0, 5))
    np.testing.assert_array_equal(a, batch(0, jnp.int32(5)))  # traced or Python step: same batch
    assert not np.array_equal(a, batch(0, 6))
    assert not np.array_equal(a, batch(1, 5))
    # Each row is a window of consecutive tokens that lies inside the data.
    np.testing.assert_array_equal(a - a[:, :1], np.broadcast_to(np.arange(17), a.shape))
    assert a.min() >= 0 and a.max() < 1000
