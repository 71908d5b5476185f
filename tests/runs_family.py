"""What the test files of whole training runs share (train(), train.py, evaluate.py, sample.py on a
run): one xdist group, so they run in one process and compile each program once; one corpus and
one model shape, so every run of one recipe reuses the same compiled training step, evaluation and
sampler; and runs spared the work no test of theirs looks at (`quick_runs`).

Two recipes run on the shape: the `cpu` preset's (train.py's default, and train()'s) and the
dataclass defaults' Muon at fixed rates (`preset=None` with `API_RECIPE`, for tests that assert
the rates). Each compiles its training step once per process (`training/setup.py` keys the step by
the settings it reads, the batch size among them)."""

import os
from pathlib import Path

import pytest

from eqx_gpt.training.data import load_text

GROUP = pytest.mark.xdist_group("runs")

# The model every run of the family trains: 2 layers of 32, 2 heads, a context of 16 characters,
# and the cpu preset's scan_unroll, which is part of a compiled program's identity: with it, runs of
# either recipe and the models tests build directly evaluate and sample with the same programs.
MODEL = dict(d_model=32, n_layers=2, n_heads=2, context_length=16, scan_unroll=4)
BATCH_SIZE = 4
# Muon at fixed rates over the dataclass defaults (`preset=None`).
API_RECIPE = dict(optimizer="muon", lr=0.02, min_lr=0.002, adam_lr=4e-3)
CORPUS_CHARACTERS = 30_000  # of Tiny Shakespeare: its characters are the vocabulary of every run


def write_corpus(folder: Path) -> Path:
    """The family's corpus, Tiny Shakespeare's first `CORPUS_CHARACTERS`, written in `folder`."""
    path = folder / "shakespeare-slice.txt"
    path.write_text(load_text()[:CORPUS_CHARACTERS], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The family's corpus, one per test file (a test may move or change it)."""
    return write_corpus(tmp_path_factory.mktemp("data"))


def _no_plot(records, path):
    """`plot_losses` for runs whose picture no test looks at: matplotlib's drawing of `loss.png` at
    each evaluation was most of a small run's time (0.3 s a drawing)."""
    return path


@pytest.fixture(scope="module", autouse=True)
def quick_runs():
    """The module's runs (autouse where imported) skip two costs no test of theirs can see: the
    drawing of `loss.png` (the tests that look at it ask for `loss_plot_drawn`; tests/test_loss_plot.py
    tests the drawing itself), and `fsync`, which makes a written file survive a power cut (about
    8 ms a file on a disk: a checkpoint is several files, and a small run writes a dozen)."""
    import eqx_gpt.visualize as visualize  # here, not at collection: matplotlib takes 0.5 s to import

    _DRAWING.setdefault("plot_losses", visualize.plot_losses)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(visualize, "plot_losses", _no_plot)
        patch.setattr(os, "fsync", lambda fd: None)
        yield


@pytest.fixture
def loss_plot_drawn(monkeypatch):
    """The run's `loss.png` drawn as a user's run draws it."""
    import eqx_gpt.visualize as visualize

    monkeypatch.setattr(visualize, "plot_losses", _DRAWING["plot_losses"])


_DRAWING = {}  # the real `plot_losses`, kept by `quick_runs` before it replaces it
