"""Corpora as people keep them: compressed text and .jsonl, Parquet, and Hugging Face `datasets`
folders give the tokens of the same plain text; a damaged one is one line and leaves no cache."""

import gzip
import json
import lzma
import sys

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import zstandard

import eqx_gpt.data.chunks
import eqx_gpt.data.formats
from eqx_gpt.data.chunks import chunk_weight, plan_chunks
from eqx_gpt.data.prepare import prepare
from eqx_gpt.data.sources import find_sources, sha256_of
from eqx_gpt.errors import DataError
from eqx_gpt.training.data import load_text

PARAGRAPHS = [p for p in load_text()[:40_000].split("\n\n")[:-1]]  # the last one may be cut short
TEXT = "\n\n".join(PARAGRAPHS)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch):
    """Chunks of 1,000 bytes and decompressed blocks of 777, so pieces are cut across blocks."""
    monkeypatch.setattr(eqx_gpt.data.chunks, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(eqx_gpt.data.formats, "BLOCK", 777)
    monkeypatch.setattr(eqx_gpt.data.formats, "ZSTD_BLOCK", 333)


def _prepare(path, tmp_path, **kw):
    return prepare(path, {"kind": "char"}, cache=tmp_path / "cache", **kw)


def _text(corpus) -> str:
    return corpus.tokenizer.decode(corpus.tokens.to_array())


def _zstd(raw: bytes) -> bytes:
    """Two zstd frames, as `pzstd` writes a large file."""
    half = len(raw) // 2
    compress = zstandard.ZstdCompressor(write_checksum=True).compress
    return compress(raw[:half]) + compress(raw[half:])


def _parquet(path, columns: dict, **kw) -> None:
    pq.write_table(pa.table(columns), path, row_group_size=7, **kw)


def _entries(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache").glob("*") if not p.name.endswith(".lock"))


def _refused(path, message, tmp_path, **kw) -> str:
    with pytest.raises(DataError, match=message) as info:
        _prepare(path, tmp_path, in_memory_bytes=0, **kw)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    assert _entries(tmp_path) == []  # no entry, no temporary folder
    return str(info.value)


def test_every_format_gives_the_tokens_of_the_plain_text_in_memory_and_cached(tmp_path):
    raw = TEXT.encode()
    files = {
        "plain.txt": raw,
        "a.txt.gz": gzip.compress(raw),
        "a.txt.xz": lzma.compress(raw),
        "a.txt.zst": _zstd(raw),
        "a.jsonl.gz": gzip.compress("".join(json.dumps({"text": p}) + "\n" for p in PARAGRAPHS).encode()),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    _parquet(tmp_path / "a.parquet", {"text": PARAGRAPHS})
    plain = _prepare(tmp_path / "plain.txt", tmp_path, in_memory_bytes=0)
    assert len(plain.manifest.shards) > 30 and _text(plain) == TEXT
    expected = plain.tokens.to_array()
    for name in [*files, "a.parquet"]:
        for in_memory_bytes in (None, 0):
            corpus = _prepare(tmp_path / name, tmp_path, in_memory_bytes=in_memory_bytes)
            assert (corpus.folder is None) == (in_memory_bytes is None), name
            assert corpus.tokenizer == plain.tokenizer, name
            np.testing.assert_array_equal(corpus.tokens.to_array(), expected, err_msg=name)
            assert corpus.identity == sha256_of(tmp_path / name)  # the bytes stored
    for name in ("a.txt.gz", "a.txt.xz", "a.txt.zst"):  # cut where the plain text is: the same shards
        assert _prepare(tmp_path / name, tmp_path, in_memory_bytes=0).manifest.shards == plain.manifest.shards
    again = _prepare(tmp_path / "a.parquet", tmp_path, in_memory_bytes=0)
    assert not again.prepared and again.summary == "read 1 file (1 .parquet)"


def test_a_compressed_file_is_planned_as_it_decompresses_not_read_whole(tmp_path, monkeypatch):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(TEXT.encode()))
    read = []
    decompressed = eqx_gpt.data.formats.decompressed
    monkeypatch.setattr(
        eqx_gpt.data.formats,
        "decompressed",
        lambda *a: (read.append(b) or (b, n) for b, n in decompressed(*a)),
    )
    sources = find_sources(tmp_path / "a.txt.gz").sources  # its first 8 KiB, for a NUL byte
    read.clear()
    chunks = plan_chunks(sources)
    first = next(chunks)
    assert 1000 <= sum(len(p.text()) for p in first) < 2000
    assert sum(map(len, read)) < 5 * 777  # the next piece's blocks too, of 50 blocks
    assert "".join(p.text() for c in [first, *chunks] for p in c) == TEXT
    assert sum(map(len, read)) == len(TEXT.encode())


def test_the_progress_of_a_compressed_file_or_a_table_counts_its_bytes_as_stored(tmp_path):
    raw = TEXT.encode()
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress(raw))
    (tmp_path / "a.txt.zst").write_bytes(_zstd(raw))
    _parquet(tmp_path / "a.parquet", {"text": PARAGRAPHS})
    _arrow(tmp_path / "a.arrow", PARAGRAPHS)
    for name in ("a.txt.xz", "a.txt.zst", "a.parquet", "a.arrow"):
        chunks = list(plan_chunks(find_sources(tmp_path / name).sources))
        weights = [chunk_weight(c) for c in chunks]
        assert len(chunks) > 20 and sum(weights) == (tmp_path / name).stat().st_size, name


def test_damaged_compressed_files_are_one_line_and_leave_nothing_in_the_cache(tmp_path):
    raw = TEXT.encode()
    cases = {
        "early.txt.gz": (gzip.compress(raw)[:200], "is truncated: its gzip data ends before its end marker"),
        "late.txt.gz": (gzip.compress(raw)[:-20], "is truncated: its gzip data ends"),  # while tokenized
        "a.txt.xz": (lzma.compress(raw)[:-100], "is truncated: its xz data ends"),
        "a.txt.zst": (_zstd(raw)[:-50], "is truncated: its zstd data ends"),
        "bad.txt.zst": (b"not zstd at all", "is not valid zstd data"),
        "bad.txt.gz": (b"not gzip at all", "is not valid gzip data"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        _refused(tmp_path / name, message, tmp_path)
    flipped = bytearray(_zstd(raw))
    flipped[len(flipped) // 4] ^= 0xFF  # a bad frame: its checksum fails
    (tmp_path / "flipped.txt.zst").write_bytes(bytes(flipped))
    _refused(tmp_path / "flipped.txt.zst", "is not valid zstd data", tmp_path)
    (tmp_path / "archive.tar.gz").write_bytes(gzip.compress(b"a.txt\0\0\0\0" + raw))
    _refused(
        tmp_path / "archive.tar.gz", "is binary \\(a NUL byte at byte 5 of its decompressed text\\)", tmp_path
    )


def test_a_bad_record_in_a_compressed_jsonl_is_named_by_its_line(tmp_path):
    lines = [json.dumps({"text": p}) for p in PARAGRAPHS]
    lines[70] = json.dumps({"body": "no text field"})
    (tmp_path / "a.jsonl.xz").write_bytes(lzma.compress(("\n".join(lines) + "\n").encode()))
    _refused(tmp_path / "a.jsonl.xz", 'line 71 is not a JSON object with a "text" string', tmp_path)


def test_a_table_without_the_column_or_with_non_strings_is_refused_in_one_line(tmp_path):
    _parquet(tmp_path / "body.parquet", {"body": PARAGRAPHS})
    error = _refused(tmp_path / "body.parquet", "has no column 'text' \\(its columns: body\\)", tmp_path)
    assert "--text-field NAME" in error
    _parquet(tmp_path / "ids.parquet", {"text": list(range(len(PARAGRAPHS)))})
    _refused(tmp_path / "ids.parquet", "its column 'text' holds int64, not text", tmp_path)
    _parquet(tmp_path / "whole.parquet", {"text": PARAGRAPHS})
    (tmp_path / "cut.parquet").write_bytes((tmp_path / "whole.parquet").read_bytes()[:-100])
    _refused(tmp_path / "cut.parquet", "is not a readable parquet file", tmp_path)
    _arrow(tmp_path / "whole.arrow", PARAGRAPHS)
    (tmp_path / "cut.arrow").write_bytes((tmp_path / "whole.arrow").read_bytes()[:-200])
    _refused(tmp_path / "cut.arrow", "is not a readable arrow file", tmp_path)


def test_a_missing_extra_is_one_line_naming_the_install_command(tmp_path, monkeypatch):
    _parquet(tmp_path / "a.parquet", {"text": PARAGRAPHS})
    (tmp_path / "a.txt.zst").write_bytes(_zstd(TEXT.encode()))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "zstandard", None)
    for name, extra, module in [("a.parquet", "parquet", "pyarrow"), ("a.txt.zst", "zstd", "zstandard")]:
        error = _refused(tmp_path / name, f"needs the optional package {module}", tmp_path)
        assert f"`uv sync --extra {extra}`" in error and f"pip install 'eqx_gpt[{extra}]'" in error


def _arrow(path, rows: list[str]) -> None:
    """An Arrow IPC stream of a text and an id column, in batches of 5 rows (as `datasets` writes)."""
    table = pa.table({"text": rows, "id": list(range(len(rows)))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)


def _save_to_disk(folder, shards: list[list[str]]) -> None:
    """A folder as `datasets.Dataset.save_to_disk` lays it out: Arrow IPC streams and metadata."""
    folder.mkdir()
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, rows in zip(names, shards, strict=True):
        _arrow(folder / name, rows)
    features = {"text": {"dtype": "string", "_type": "Value"}, "id": {"dtype": "int64", "_type": "Value"}}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features, "description": "x" * 5000}))
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0a1b", "_split": "train"}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card, not training text\n")


def test_a_hugging_face_datasets_folder_reads_its_arrow_files_and_not_its_metadata(tmp_path):
    half = len(PARAGRAPHS) // 2
    _save_to_disk(tmp_path / "ds", [PARAGRAPHS[:half], PARAGRAPHS[half:]])
    for in_memory_bytes in (None, 0):
        corpus = _prepare(tmp_path / "ds", tmp_path, in_memory_bytes=in_memory_bytes)
        assert _text(corpus) == TEXT
        assert corpus.summary == "read 2 files (2 .arrow) of the datasets split train; skipped 3 (3 metadata)"
    splits = tmp_path / "dict"  # `DatasetDict.save_to_disk`: a folder per split, beside its metadata
    splits.mkdir()
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    (splits / "README.md").write_text("# The dataset card\n")
    _save_to_disk(splits / "train", [PARAGRAPHS])
    corpus = _prepare(splits, tmp_path)
    summary = "read 1 file (1 .arrow) of split train (splits train); skipped 5 (5 metadata)"
    assert _text(corpus) == TEXT and corpus.summary == summary
    feather.write_feather(
        pa.table({"text": PARAGRAPHS}), str(tmp_path / "feather.arrow")
    )  # Arrow's file format
    assert _text(_prepare(tmp_path / "feather.arrow", tmp_path)) == TEXT


def test_text_field_reads_another_field_and_never_reuses_the_first_fields_cache(tmp_path):
    records = [{"text": p.upper(), "content": p} for p in PARAGRAPHS]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _parquet(tmp_path / "code.parquet", {"content": PARAGRAPHS})
    content = _prepare(tmp_path / "code.jsonl", tmp_path, in_memory_bytes=0, text_field="content")
    assert _text(content) == TEXT and content.manifest.text_field == "content"
    text = _prepare(tmp_path / "code.jsonl", tmp_path, in_memory_bytes=0)
    assert _text(text) == TEXT.upper() and text.prepared  # its own entry, not the other field's
    assert len(_entries(tmp_path)) == 2 and text.identity != content.identity
    again = _prepare(tmp_path / "code.jsonl", tmp_path, in_memory_bytes=0, text_field="content")
    assert not again.prepared and _text(again) == TEXT and again.identity == content.identity
    assert _text(_prepare(tmp_path / "code.parquet", tmp_path, text_field="content")) == TEXT
    (tmp_path / "plain.txt").write_text(TEXT)  # no records: the field changes nothing, nor the identity
    assert _prepare(tmp_path / "plain.txt", tmp_path, text_field="content").identity == (
        _prepare(tmp_path / "plain.txt", tmp_path).identity
    )


def test_every_start_says_what_was_read_and_skipped(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT[:20_000])
    (folder / "b.txt").write_text(TEXT[20_000:])
    _parquet(folder / "c.parquet", {"text": PARAGRAPHS[:10]})
    (folder / "d.txt.gz").write_bytes(gzip.compress(TEXT[:5000].encode()))
    (folder / "empty.txt").write_text("")
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (folder / "backup.tar.gz").write_bytes(gzip.compress(b"a.txt\0\0\0\0" + b"x" * 100))
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD").write_text("hidden: neither read nor counted")
    summary = "read 4 files (2 .txt, 1 .parquet, 1 .txt.gz); skipped 3 (2 binary, 1 empty)"
    assert find_sources(folder).summary == summary
    first = _prepare(folder, tmp_path, in_memory_bytes=0)
    later = _prepare(folder, tmp_path, in_memory_bytes=0)
    assert first.prepared and not later.prepared and first.summary == later.summary == summary
    assert first.manifest.skipped_binary == 2
    assert _prepare(folder, tmp_path).summary == summary  # a small corpus, in memory: the same line


def test_a_folder_whose_bulk_is_skipped_is_refused_naming_what_was_skipped(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").write_text(TEXT[:2000])
    (folder / "weights.bin").write_bytes(b"\0" * 3000)
    (folder / "tokens.bin").write_bytes(b"\0" * 100)
    message = "is mostly binary files, which are skipped: 2 of 3,100 bytes \\(tokens.bin, weights.bin\\)"
    error = _refused(folder, message, tmp_path)
    assert "read 1 file (1 .md); skipped 2 (2 binary)" in error
    (folder / "weights.bin").unlink()  # less skipped than read: read, and the rest said
    assert _prepare(folder, tmp_path).summary == "read 1 file (1 .md); skipped 1 (1 binary)"


def _dataset_dict(folder, splits: dict[str, list[str]]) -> None:
    """A folder as `datasets.DatasetDict.save_to_disk` lays it out: a split folder each."""
    folder.mkdir()
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for name, rows in splits.items():
        _save_to_disk(folder / name, [rows])


def test_a_folder_of_splits_reads_one_split_train_unless_another_is_named(tmp_path):
    half = len(PARAGRAPHS) // 2
    train, test = PARAGRAPHS[:half], [p.upper() for p in PARAGRAPHS[half:]]
    _dataset_dict(tmp_path / "dd", {"train": train, "test": test, "validation": ["held out"] * 3})
    corpus = _prepare(tmp_path / "dd", tmp_path, in_memory_bytes=0)
    assert _text(corpus) == "\n\n".join(train)  # never the test split, whatever the sorted order
    assert corpus.summary.startswith("read 1 file (1 .arrow) of split train (splits test, train, validation)")
    held_out = _prepare(tmp_path / "dd", tmp_path, in_memory_bytes=0, split="test")
    assert _text(held_out) == "\n\n".join(test) and held_out.prepared  # its own entry
    assert not _prepare(tmp_path / "dd", tmp_path, in_memory_bytes=0).prepared  # train's still cached
    _dataset_dict(tmp_path / "no-train", {"test": test, "validation": train})
    error = _refused(tmp_path / "no-train", "holds the splits test, validation, and no train", tmp_path / "x")
    assert "--split NAME" in error
    _refused(
        tmp_path / "dd", "holds the splits test, train, validation, and no dev2", tmp_path / "x", split="dev2"
    )
    # A folder of splits deeper in a folder, and splits told by file names, as the Hugging Face hub has them.
    outer = tmp_path / "outer"
    outer.mkdir()
    _dataset_dict(outer / "dd", {"train": train, "test": test})
    (outer / "notes.txt").write_text("notes")
    nested = _prepare(outer, tmp_path)
    assert _text(nested) == "\n\n".join(train) + "\n\nnotes"
    assert (
        "of split train of dd/ (splits test, train)" in nested.summary and "from 2 folders" in nested.summary
    )
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    for name, text in [("wiki.train.raw", "TRAIN"), ("wiki.valid.raw", "VALID"), ("wiki.test.raw", "TEST")]:
        (wiki / name).write_text(text)
    _parquet(wiki / "test-00000-of-00001.parquet", {"text": ["TEST"]})
    (wiki / "README.md").write_text("# card")
    assert _text(_prepare(wiki, tmp_path)) == "TRAIN"
    assert _text(_prepare(wiki, tmp_path, split="valid")) == "VALID"
    assert _prepare(wiki, tmp_path, split="validation").summary == (
        "read 1 file (1 .raw) of split validation (splits test, train, validation); "
        "skipped 1 (1 outside the splits)"
    )
    assert _text(_prepare(wiki, tmp_path, split="all")).split("\n\n") == [
        "# card",
        "TEST",
        "TEST",
        "TRAIN",
        "VALID",
    ]
    code = tmp_path / "code"  # train.py beside test.py: a folder of code, not of splits
    code.mkdir()
    for name in ("train.py", "test.py", "model.py"):
        (code / name).write_text(f"# {name}")
    assert _prepare(code, tmp_path).summary == "read 3 files (3 .py)"
    (tmp_path / "one.txt").write_text(TEXT)
    _refused(
        tmp_path / "one.txt", "is one corpus, with no splits; --split test", tmp_path / "x", split="test"
    )
    _save_to_disk(tmp_path / "single", [train])  # one split's folder: its own split only
    _refused(tmp_path / "single", "one split of a datasets dataset \\(train\\)", tmp_path / "x", split="test")


def test_a_compressed_file_goes_to_the_cache_by_the_text_it_holds_not_its_size(tmp_path, monkeypatch):
    import eqx_gpt.data.prepare as prepare_module

    line = "All the world's a stage, and all the men and women merely players.\n"
    # 134 KB of text, twice the limit set below (the text's size, not its cost, is what matters)
    (tmp_path / "big.txt.gz").write_bytes(gzip.compress((line * 2000).encode(), 9))
    assert (tmp_path / "big.txt.gz").stat().st_size * 4 < 16_000  # what the old rule took for its text
    monkeypatch.setattr(prepare_module, "IN_MEMORY_BYTES", 64_000)
    read_in_memory = []
    tokens = prepare_module.tokens
    monkeypatch.setattr(prepare_module, "tokens", lambda c, *a: read_in_memory.append(c) or tokens(c, *a))
    first = _prepare(tmp_path / "big.txt.gz", tmp_path)
    assert first.folder is not None and first.prepared and _text(first) == line * 2000
    assert sum(eqx_gpt.data.chunks.chunk_bytes(c) for c in read_in_memory) <= 64_000 + 1000  # then it stopped
    monkeypatch.setattr(eqx_gpt.data.prepare, "write_shard", None)  # a second start tokenizes nothing
    monkeypatch.setattr(eqx_gpt.data.prepare, "plan_chunks", None)
    again = _prepare(tmp_path / "big.txt.gz", tmp_path)
    assert not again.prepared and again.folder == first.folder and _text(again) == line * 2000


def test_a_null_text_is_no_document_in_every_format(tmp_path):
    texts = [PARAGRAPHS[0], None, PARAGRAPHS[1], "", PARAGRAPHS[2]]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress((tmp_path / "a.jsonl").read_bytes()))
    _parquet(tmp_path / "a.parquet", {"text": texts})
    _arrow(tmp_path / "a.arrow", texts)
    expected = "\n\n".join(PARAGRAPHS[:3])
    for name in ("a.jsonl", "a.jsonl.gz", "a.parquet", "a.arrow"):
        for in_memory_bytes in (None, 0):
            assert _text(_prepare(tmp_path / name, tmp_path, in_memory_bytes=in_memory_bytes)) == expected, (
                name
            )
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n")
    _refused(
        tmp_path / "b.jsonl", 'line 2 is not a JSON object with a "text" string \\(or null\\)', tmp_path / "x"
    )
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": 5}) + "\n")
    _refused(tmp_path / "c.jsonl", 'line 1 is not a JSON object with a "text" string', tmp_path / "x")


def test_a_dictionary_encoded_string_column_is_text(tmp_path):
    column = pa.array(PARAGRAPHS).dictionary_encode()  # what a pandas categorical column writes
    pq.write_table(pa.table({"text": column}), tmp_path / "cat.parquet", row_group_size=7)
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "cat.parquet").field("text").type)
    feather.write_feather(pa.table({"text": pa.array(PARAGRAPHS, pa.large_string()).dictionary_encode()}),
                          str(tmp_path / "cat.arrow"))  # fmt: skip
    for name in ("cat.parquet", "cat.arrow"):
        assert _text(_prepare(tmp_path / name, tmp_path, in_memory_bytes=0)) == TEXT
    feather.write_feather(
        pa.table({"text": pa.array([1, 2, 1]).dictionary_encode()}), str(tmp_path / "ids.arrow")
    )
    _refused(tmp_path / "ids.arrow", "its column 'text' holds dictionary<values=int64", tmp_path / "x")
