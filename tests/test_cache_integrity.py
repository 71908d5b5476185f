"""The token cache cannot lie: a reader keeps the version it opened, damaged shards are prepared
again, an edited source is never taken for the old one, and nothing is left behind."""

import errno
import json
import os
import re
import zlib

import numpy as np
import pytest

import eqx_gpt.data.chunks
import eqx_gpt.data.manifest
import eqx_gpt.data.prepare
import eqx_gpt.data.shards
import eqx_gpt.data.sources
from eqx_gpt.data.cache import EntryLock
from eqx_gpt.data.manifest import MANIFEST_NAME
from eqx_gpt.data.prepare import prepare
from eqx_gpt.errors import DataError

TEXT = "".join(f"Noble Sebastian, line {i}: thou art asleep, and dost {i * 7} things\n" for i in range(400))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 2 KB, so a few-KB corpus is many shards and takes the cached path."""
    monkeypatch.setattr(eqx_gpt.data.chunks, "CHUNK_BYTES", 2000)
    monkeypatch.setattr(eqx_gpt.data.prepare, "IN_MEMORY_BYTES", 0)


def _prepare(data, cache, **kw):
    return prepare(data, {"kind": "char"}, cache=cache, **kw)


def _entries(cache):
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_a_reader_keeps_the_version_it_opened_past_max_open_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(eqx_gpt.data.shards, "MAX_OPEN", 2)  # every few reads close and reopen all
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    a = _prepare(data, cache)
    assert len(a.manifest.shards) > 10
    first = a.tokens.read(0, 10)  # one shard opened
    data.write_text(TEXT.upper())  # another text, another vocabulary, the same entry
    b = _prepare(data, cache)
    assert b.prepared and b.tokenizer.vocab_size != a.tokenizer.vocab_size and b.folder == a.folder
    assert a.tokenizer.decode(a.tokens.to_array()) == TEXT  # every shard read after b was published
    np.testing.assert_array_equal(a.tokens.read(0, 10), first)
    assert b.tokenizer.decode(b.tokens.to_array()) == TEXT.upper()
    assert len(_entries(cache)) == 2  # a's version, kept aside while a reads it
    a.close()
    with pytest.raises(ValueError, match="was closed"):
        a.tokens.read(0, 10)
    _prepare(data, cache).close()  # the next start collects it
    assert _entries(cache) == [b.folder.name]


@pytest.mark.parametrize("byte", [0x00, 0xFF])
def test_damaged_shards_are_found_and_prepared_again(tmp_path, byte):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    clean = _prepare(data, cache)
    expected, entry = clean.tokens.to_array(), clean.folder
    clean.close()
    shards = sorted(entry.glob("shard-*.bin"))
    for shard in shards:  # the usual crash: the right sizes, every byte zero (or 0xFF)
        shard.write_bytes(bytes([byte]) * shard.stat().st_size)
    lines = []
    again = _prepare(data, cache, log=lines.append)
    assert again.prepared and f"the token cache {entry} is damaged" in lines[0] and "CRC-32" in lines[0]
    np.testing.assert_array_equal(again.tokens.to_array(), expected)
    again.close()
    assert _entries(cache) == [entry.name]


def test_damaged_shards_of_a_touched_source_are_prepared_again(tmp_path):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    clean = _prepare(data, cache)
    expected, entry = clean.tokens.to_array(), clean.folder
    clean.close()
    shard = sorted(entry.glob("shard-*.bin"))[-1]
    shard.write_bytes(bytes(shard.stat().st_size))
    os.utime(data, ns=(1, 1))  # hashed again: the same text, so its shards are checked, not trusted
    lines = []
    again = _prepare(data, cache, log=lines.append)
    assert again.prepared and f"{shard.name} fails its CRC-32 check" in lines[0]
    np.testing.assert_array_equal(again.tokens.to_array(), expected)


def test_ids_outside_the_vocabulary_are_damage_even_with_a_right_checksum(tmp_path):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    corpus = _prepare(data, cache)
    entry, vocab_size = corpus.folder, corpus.tokenizer.vocab_size
    corpus.close()
    manifest = json.loads((entry / MANIFEST_NAME).read_text())
    shard = manifest["shards"][3]
    ids = np.fromfile(entry / shard["name"], np.uint16)
    ids[5] = vocab_size  # one id past the vocabulary, its checksum made to match
    ids.tofile(entry / shard["name"])
    shard["crc32"] = zlib.crc32(ids.tobytes())
    (entry / MANIFEST_NAME).write_text(json.dumps(manifest))
    lines = []
    assert _prepare(data, cache, log=lines.append).prepared
    assert f"holds id {vocab_size}, outside the vocabulary of {vocab_size}" in lines[0]


def test_an_in_place_edit_with_size_and_mtime_restored_is_hashed_again(tmp_path):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    first = _prepare(data, cache)
    st = data.stat()
    edited = TEXT[:5000] + TEXT[5000:].replace("e", "a")
    data.write_text(edited)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p, rsync -t and tar x do
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
    seen = []
    with pytest.raises(DataError, match="not the corpus"):  # a resume refuses it, before tokenizing
        _prepare(data, cache, check_identity=lambda sha: seen.append(sha) or _refuse(sha, first.identity))
    again = _prepare(data, cache)
    assert seen[0] == again.identity != first.identity and again.prepared
    assert again.tokenizer.decode(again.tokens.to_array()) == edited


def _refuse(sha, old):
    if sha != old:
        raise DataError("not the corpus the checkpoint was trained on")


def test_a_full_disk_while_the_manifest_is_rewritten_is_one_line(tmp_path, monkeypatch):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    _prepare(data, cache).close()
    os.utime(data, ns=(1, 1))  # touched: the manifest is rewritten, the tokens kept

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    write = eqx_gpt.data.prepare.atomic_write_bytes
    monkeypatch.setattr(eqx_gpt.data.prepare, "atomic_write_bytes", full)
    with pytest.raises(DataError, match="no space left in the token cache") as info:
        _prepare(data, cache)
    assert "\n" not in str(info.value)
    monkeypatch.setattr(eqx_gpt.data.prepare, "atomic_write_bytes", write)
    written = []
    monkeypatch.setattr(eqx_gpt.data.prepare, "write_shard", lambda *a: written.append(a) or (0, 0))
    assert not _prepare(data, cache).prepared and written == []  # the entry was kept whole


def test_leftovers_of_a_killed_publish_are_collected_unless_a_preparer_holds_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(eqx_gpt.data.manifest, "RACY_NS", 0)  # the new file is trusted: no lock taken
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    entry = _prepare(data, cache).folder
    aside, temporary = cache / f".{entry.name}.old-999-abcd", cache / f".{entry.name}.tmp-x"
    for leftover in (aside, temporary):
        leftover.mkdir()
        (leftover / "shard-00000.bin").write_bytes(b"\0" * 100)
    with EntryLock(cache, entry.name):  # a preparer at work: its folders stay
        _prepare(data, cache).close()
        assert aside.exists() and temporary.exists()
    _prepare(data, cache).close()
    assert _entries(cache) == [entry.name]


def test_a_source_that_vanishes_or_changes_after_listing_is_one_line_naming_it(tmp_path, monkeypatch):
    folder, cache = tmp_path / "docs", tmp_path / "cache"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    (folder / "b.txt").write_text(TEXT)
    find = eqx_gpt.data.prepare.find_sources

    def listed_then_deleted(path, split=None):
        found = find(path, split)
        (folder / "b.txt").unlink()
        return found

    monkeypatch.setattr(eqx_gpt.data.prepare, "find_sources", listed_then_deleted)
    with pytest.raises(DataError, match=f"data file {folder / 'b.txt'} vanished while it was read") as info:
        _prepare(folder, cache)
    assert "\n" not in str(info.value) and "token cache" not in str(info.value)
    monkeypatch.setattr(eqx_gpt.data.prepare, "find_sources", find)
    plan = eqx_gpt.data.prepare.plan_chunks

    def edited_while_tokenized(sources, *args):
        (folder / "a.txt").write_text(TEXT.upper())
        return plan(sources, *args)

    monkeypatch.setattr(eqx_gpt.data.prepare, "plan_chunks", edited_while_tokenized)
    with pytest.raises(DataError, match=f"data file {folder / 'a.txt'} changed while it was prepared"):
        _prepare(folder, cache)
    assert _entries(cache) == []  # nothing cached from bytes other than those hashed

    def unreadable_after_hashing(sources, *args):  # a read error: the file's, not the cache's
        (folder / "a.txt").unlink()
        (folder / "a.txt").mkdir()
        return plan(sources, *args)

    monkeypatch.setattr(eqx_gpt.data.prepare, "plan_chunks", unreadable_after_hashing)
    with pytest.raises(DataError, match=f"data file {folder / 'a.txt'} cannot be read") as info:
        _prepare(folder, cache)
    assert "token cache" not in str(info.value) and _entries(cache) == []


def test_a_long_jsonl_line_is_read_without_recursion_and_a_huge_one_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(eqx_gpt.data.sources, "SCAN", 64)  # 200 KB: 3,000 scans (recursion: 1,000 deep)
    long = "a" * 200_000
    data = tmp_path / "records.jsonl"
    data.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": long}) + "\n")
    corpus = _prepare(data, tmp_path / "cache")
    assert corpus.tokenizer.decode(corpus.tokens.to_array()) == "short\n\n" + long
    monkeypatch.setattr(eqx_gpt.data.sources, "MAX_RECORD", 100_000)
    data.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": long + "b"}) + "\n")
    with pytest.raises(DataError, match="has a line longer than 0 MiB") as info:
        _prepare(data, tmp_path / "cache")
    assert "split it into records" in str(info.value)


def test_folders_follow_linked_sub_folders_and_refuse_loops(tmp_path):
    other, folder = tmp_path / "other", tmp_path / "docs"
    other.mkdir()
    folder.mkdir()
    (other / "b.txt").write_text("linked text\n")
    (folder / "a.txt").write_text("own text\n")
    (folder / "linked").symlink_to(other)
    corpus = prepare(folder, {"kind": "char"}, cache=tmp_path / "cache", in_memory_bytes=1 << 20)
    assert [s.name for s in corpus.manifest.sources] == ["a.txt", "linked/b.txt"]
    (other / "back").symlink_to(other)
    with pytest.raises(DataError, match="is a link to a folder it is in") as info:
        prepare(folder, {"kind": "char"}, cache=tmp_path / "cache")
    assert str(other / "back") in str(info.value) or str(folder / "linked" / "back") in str(info.value)


def test_unclear_inputs_get_clear_lines(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"text": "hello"}\n{"text": "there"}\n')
    for path, message in [
        (tmp_path / "loop", "is a loop of symbolic links"),
        ("/dev/null", "is not a file or a folder (a device, pipe or socket)"),
    ]:
        with pytest.raises(DataError, match=re.escape(message)):
            prepare(path, {"kind": "char"}, cache=tmp_path / "cache")
    corpus = prepare(bom, {"kind": "char"}, cache=tmp_path / "cache", in_memory_bytes=1 << 20)
    assert corpus.tokenizer.decode(corpus.tokens.to_array()) == "hello\n\nthere"  # the mark is not text


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_in_a_folder_is_named(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("fine\n")
    (folder / "secret.txt").write_text("no\n")
    (folder / "secret.txt").chmod(0)
    with pytest.raises(DataError, match=f"data file {folder / 'secret.txt'} cannot be read"):
        prepare(folder, {"kind": "char"}, cache=tmp_path / "cache")


def test_a_source_changed_just_before_it_was_listed_is_hashed_again_once(tmp_path, monkeypatch):
    data, cache = tmp_path / "corpus.txt", tmp_path / "cache"
    data.write_text(TEXT)
    first = _prepare(data, cache)
    assert first.manifest.sources[0].ctime_ns == -1  # written within RACY_NS of its listing
    hashed, sha = [], eqx_gpt.data.prepare.sha256_of
    monkeypatch.setattr(eqx_gpt.data.prepare, "sha256_of", lambda path: hashed.append(path) or sha(path))
    monkeypatch.setattr(eqx_gpt.data.manifest, "RACY_NS", 0)  # as if the clock had moved on
    again = _prepare(data, cache)
    assert hashed == [data] and not again.prepared and again.identity == first.identity
    assert again.manifest.sources[0].ctime_ns == data.stat().st_ctime_ns
    third = _prepare(data, cache)
    assert hashed == [data] and not third.prepared  # trusted by its stat now: nothing hashed
