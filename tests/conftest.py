"""Shared test set-up: offline GPT-2 BPE files when ../shared is beside the checkout, and a skip
with a reason for every test that needs them (marked `gpt2_bpe`) where they are not; how XLA
compiles for the tests; how many test processes `-n auto` starts, and which tests share one."""

import atexit
import functools
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
import tiktoken.load

_SHARED_TIKTOKEN = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tiktoken-cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_TIKTOKEN.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_TIKTOKEN)


def _no_download(blobpath: str) -> bytes:
    """No test may need the network: tiktoken reads its files from its cache or fails (a user's
    clone without ../shared beside it skips the tests that need them, `gpt2_bpe`)."""
    raise OSError(f"the tests never download {blobpath}")


tiktoken.load.read_file = _no_download  # what tiktoken calls for a file not in its cache


@functools.cache
def gpt2_bpe_missing() -> str | None:
    """Why GPT-2's BPE files cannot be loaded here (None: they can), tried once per process."""
    from eqx_gpt.tokenizer import GPT2Tokenizer, TokenizerError

    try:
        GPT2Tokenizer()
    except TokenizerError as error:
        return (
            f"GPT-2 BPE files unavailable (set TIKTOKEN_CACHE_DIR to a folder holding them, such as "
            f"../shared/data/tiktoken-cache): {error}"
        )
    return None


@pytest.fixture(scope="module")
def gpt2_corpus(tmp_path_factory):
    """A text file of Tiny Shakespeare's first 20,000 characters, for runs that fine-tune the tiny
    GPT-2 (its BPE tokenizer): skipped with the reason where GPT-2's BPE files are missing."""
    from eqx_gpt.training.data import load_text

    if (reason := gpt2_bpe_missing()) is not None:
        pytest.skip(reason)
    path = tmp_path_factory.mktemp("data") / "shakespeare-slice.txt"
    path.write_text(load_text()[:20_000], encoding="utf-8")
    return path


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpt2_bpe: needs GPT-2's BPE files; skipped with the reason without them"
    )


# The families of test files that share models and compiled programs (each sets its `xdist_group`),
# longest first, as measured cold on 2 cores (model 48 s, train 45 s, serve 42 s, gen 33 s, runs
# 31 s; every other file takes under 10 s). The scheduler gives a process the next group in this
# order whenever it runs dry (pyproject's `--no-loadscope-reorder` keeps the order), so the long
# ones start first and the short ones even out the end; ordered by their number of tests instead,
# the train family came last and one process ran 18 s after the other had finished.
LONGEST_FIRST = ("model", "train", "serve", "gen", "runs")


def _group(item) -> str:
    marker = item.get_closest_marker("xdist_group")
    return marker.args[0] if marker.args else marker.kwargs.get("name", "default")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` (pyproject's addopts), each test file without a group of its own is
    one: its tests run in one process, which builds its module fixtures and compiles its models once.
    Then the families go first, longest first (`LONGEST_FIRST`), and the other groups as collected."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item), len(rank)))  # stable: files keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Stop a suite whose groups pytest-xdist no longer sees. It tells its scheduler a test's group
    through the test's node id, which pytest 9.2 stopped reading (pytest-dev/pytest-xdist#1386): every
    test was then scheduled alone, silently, and each process compiled what its neighbours had."""
    grouped = any("@" in node_id.rpartition("]")[2] for node_id in ids)
    if node.config.getvalue("dist") == "loadgroup" and ids and not grouped:
        pytest.exit(
            "pytest-xdist grouped no test under --dist loadgroup: this pytest and pytest-xdist do not work "
            "together; run the versions uv.lock holds (`uv sync --locked`)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpt2_bpe") is not None and (reason := gpt2_bpe_missing()) is not None:
        pytest.skip(reason)


# The suite's time is XLA compiling small programs, not running them. Tests assert what a program
# computes, which the optimisation level does not change (exactness tests compare one program with
# itself), so compile with LLVM's cheap pipeline: about a third less CPU. Subprocesses inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# jaxlib 0.10 only (uv.lock's on Python 3.11): its CPU fusion emitters (MLIR) take about 60% more
# compile CPU per small program than the classic LLVM IR emitters (an eager primitive 28 ms against
# 17 ms), so the tests use the classic ones; and one LLVM module per program rather than several
# compiled on threads, which saves another 10-15% on a model's program where every core already
# runs a test process. jaxlib 0.12 has no emitter flag (XLA aborts on a flag it does not know), and
# splitting makes no difference there. The caller's XLA_FLAGS are kept, and win over these.
try:
    _JAXLIB = metadata.version("jaxlib").split(".")[:2]
except metadata.PackageNotFoundError:
    _JAXLIB = []
if _JAXLIB == ["0", "10"]:
    _flags = os.environ.get("XLA_FLAGS", "").split()
    for _flag in ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"):
        if not any(f.startswith(_flag.split("=")[0] + "=") for f in _flags):
            _flags.append(_flag)
    os.environ["XLA_FLAGS"] = " ".join(_flags)

# One compilation cache per test session, shared by the worker processes (which inherit the
# controller's environment) and the command-line runs they start. It is empty when the session starts,
# so a cold machine stays cold, but each distinct program is compiled once per session rather than
# once per process.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="eqx_gpt-tests-jax-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_sessionfinish(session, exitstatus):
    """The session's compilation cache goes with it, removed by the process that made it."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def _leave_at_once() -> None:
    """Leave the process now, its output flushed: what would follow is JAX freeing every program the
    process compiled (about 3 ms each, 3 s for a family's thousand), which the session waits for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest-xdist worker has sent its last report by now (the controller reads no exit status of
    its own from a worker), so it skips the clean-up at exit, JAX's included: handlers registered last
    run first."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        atexit.register(_leave_at_once)


def pytest_xdist_auto_num_workers(config):
    """One test process per core, at most 4: each compiles with XLA and runs JAX's own threads, so
    more processes than that only add memory."""
    return max(
        1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    )
