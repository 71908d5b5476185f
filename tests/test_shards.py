"""Preparing a corpus into token shards: once, cached, detected when changed, never half-used."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import eqx_gpt.data.chunks
import eqx_gpt.data.prepare
from eqx_gpt.data.manifest import MANIFEST_NAME
from eqx_gpt.data.prepare import prepare
from eqx_gpt.data.shards import ShardFile
from eqx_gpt.data.sources import DataError
from eqx_gpt.tokenizer import CharTokenizer, GPT2Tokenizer, TokenizerError
from eqx_gpt.training.data import load_corpus

TEXT = "".join(f"line {i}: the quick brown fox, ünïcödé ∑ {i * i}\n" for i in range(400))  # ~22 KB


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 2 KB, so a few-KB corpus is many shards and takes the cached path."""
    monkeypatch.setattr(eqx_gpt.data.chunks, "CHUNK_BYTES", 2000)
    monkeypatch.setattr(eqx_gpt.data.prepare, "IN_MEMORY_BYTES", 0)


def _prepare(data, cache, **kw):
    return prepare(data, {"kind": "char"}, cache=cache, **kw)


def _count_writes(monkeypatch) -> list:
    """Record every shard written from now on."""
    written, write = [], eqx_gpt.data.prepare.write_shard
    monkeypatch.setattr(eqx_gpt.data.prepare, "write_shard", lambda *a: written.append(a[3]) or write(*a))
    return written


def test_a_corpus_is_tokenized_once_into_shards_and_mapped_after(tmp_path, small_chunks, monkeypatch):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    lines = []
    first = _prepare(data, tmp_path / "cache", log=lines.append)
    assert first.prepared and len(first.manifest.shards) > 5 and "prepared" in lines[0]
    expected = CharTokenizer.from_text(TEXT)
    assert first.tokenizer == expected and first.manifest.dtype == "uint16"
    np.testing.assert_array_equal(first.tokens.to_array(), expected.encode(TEXT))
    assert len(first.train) == int(0.9 * len(TEXT))
    manifest = json.loads((first.folder / MANIFEST_NAME).read_text())
    assert (
        manifest["sources"][0]["sha256"] == first.identity
        and manifest["sources"][0]["size"] == data.stat().st_size
    )
    written = _count_writes(monkeypatch)
    again = _prepare(data, tmp_path / "cache")
    assert not again.prepared and written == [] and again.folder == first.folder
    np.testing.assert_array_equal(again.tokens.to_array(), first.tokens.to_array())
    assert all(isinstance(s, ShardFile) for s in again.tokens.shards)  # read as needed, never whole


def test_a_touched_source_is_rehashed_not_retokenized_and_a_changed_one_is_redone(
    tmp_path, small_chunks, monkeypatch
):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    first = _prepare(data, tmp_path / "cache")
    written = _count_writes(monkeypatch)
    os.utime(data, ns=(1, 1))  # the same bytes, another modification time
    touched = _prepare(data, tmp_path / "cache")
    assert not touched.prepared and written == [] and touched.identity == first.identity
    again = _prepare(data, tmp_path / "cache")
    assert again.manifest.sources[0].mtime_ns == 1  # the manifest learned it
    data.write_text(TEXT.replace("fox", "cat"))
    refused = []
    with pytest.raises(ValueError, match="changed"):  # a resumed run refuses before tokenizing anything
        _prepare(data, tmp_path / "cache", check_identity=lambda sha: _raise("changed", refused, sha))
    assert written == [] and refused[0] != first.identity
    changed = _prepare(data, tmp_path / "cache")
    assert changed.prepared and written and changed.identity == refused[0]
    assert "cat" in changed.tokenizer.decode(changed.tokens.to_array()[:200])
    assert "fox" in first.tokenizer.decode(first.tokens.to_array()[:200])  # its readers keep the old one
    entries = lambda: sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock"))
    assert len(entries()) == 2
    for corpus in (first, touched, again):
        corpus.close()
    _prepare(data, tmp_path / "cache").close()
    assert entries() == [changed.folder.name]  # no second entry, no leftovers once no one reads it


def _raise(message, seen, sha):
    seen.append(sha)
    raise ValueError(message)


def test_a_partial_cache_is_never_used(tmp_path, small_chunks, monkeypatch):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    entry = _prepare(data, cache).folder
    # A crash before the rename leaves a temporary folder; one in between leaves an entry without
    # its manifest; a damaged shard has the wrong size.
    leftover = cache / f".{entry.name}.tmp-crashed"
    leftover.mkdir()
    (leftover / "shard-00000.bin").write_bytes(b"\0\0")
    shard = entry / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    redone = _prepare(data, cache)
    assert redone.prepared and not leftover.exists()
    expected = redone.tokens.to_array()
    redone.close()  # its version can go now
    (redone.folder / MANIFEST_NAME).unlink()
    assert _prepare(data, cache).prepared
    written, write = [], eqx_gpt.data.prepare.write_shard

    def interrupted(*args):  # Ctrl-C after two shards
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(1)
        return write(*args)

    (entry / MANIFEST_NAME).unlink()
    monkeypatch.setattr(eqx_gpt.data.prepare, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _prepare(data, cache)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # its folder removed
    monkeypatch.setattr(eqx_gpt.data.prepare, "write_shard", write)
    np.testing.assert_array_equal(_prepare(data, cache).tokens.to_array(), expected)


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, small_chunks, monkeypatch):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(eqx_gpt.data.prepare, "write_shard", full)
    with pytest.raises(DataError, match="no space left in the token cache") as info:
        _prepare(data, cache)
    assert "\n" not in str(info.value) and "EQX_GPT_DATA_CACHE" in str(info.value)
    assert [p.name for p in cache.iterdir()] == [p.name for p in cache.glob("*.lock")]


PREPARE = """
import sys
import eqx_gpt.data.chunks, eqx_gpt.data.prepare
eqx_gpt.data.chunks.CHUNK_BYTES = 2000
c = eqx_gpt.data.prepare.prepare(sys.argv[1], {"kind": "char"}, cache=sys.argv[2], in_memory_bytes=0)
print(c.prepared, len(c.tokens), c.identity)
"""


@pytest.mark.slow  # two new Python processes; the tests below prepare caches in this one
def test_two_processes_preparing_one_corpus_leave_one_valid_cache(tmp_path):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT * 20)
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", PREPARE, str(data), str(cache)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300)[0].split() for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    assert sorted(o[0] for o in outputs) == [
        "False",
        "True",
    ]  # one prepared it, the other waited and mapped it
    assert outputs[0][1:] == outputs[1][1:] == [str(len(TEXT) * 20), outputs[0][2]]
    entries = [p for p in cache.iterdir() if not p.name.endswith(".lock")]
    assert len(entries) == 1 and (entries[0] / MANIFEST_NAME).exists()


def test_a_folder_of_text_and_jsonl_files_in_the_cache_not_beside_the_data(tmp_path, small_chunks):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(TEXT[:5000])
    (folder / "sub" / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["first doc", "", "second\ndoc"]))
        + "\n\n"
    )
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("hidden files are left out")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (folder / "empty.txt").write_text("")
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    corpus = _prepare(folder, tmp_path / "cache")
    assert [s.name for s in corpus.manifest.sources] == ["b.txt", "sub/a.jsonl"]
    assert corpus.manifest.skipped_binary == 1
    assert corpus.tokenizer.decode(corpus.tokens.to_array()) == TEXT[:5000] + "\n\nfirst doc\n\nsecond\ndoc"
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # nothing written there
    assert len(corpus.identity) == 64 and corpus.identity != corpus.manifest.sources[0].sha256


def test_gpt2_shards_hold_gpt2_ids(tmp_path, small_chunks):
    try:
        tokenizer = GPT2Tokenizer()
    except TokenizerError as error:
        pytest.skip(f"GPT-2 BPE files unavailable (set TIKTOKEN_CACHE_DIR): {error}")
    (tmp_path / "c.txt").write_text(TEXT)
    corpus = prepare(tmp_path / "c.txt", tokenizer.to_dict(), cache=tmp_path / "cache")
    assert corpus.manifest.dtype == "uint16" and corpus.tokenizer == tokenizer
    assert corpus.tokenizer.decode(corpus.tokens.to_array()) == TEXT  # chunks end at newlines


def test_the_bundled_corpus_is_checked_against_its_sha256(monkeypatch, tmp_path):
    fake = tmp_path / "tinyshakespeare.txt"
    fake.write_text("not Shakespeare at all\n" * 10)
    monkeypatch.setattr("eqx_gpt.training.data.shakespeare_path", lambda: Path(fake))
    with pytest.raises(DataError, match="does not match its sha256; reinstall"):
        load_corpus(None, {"kind": "char"})
