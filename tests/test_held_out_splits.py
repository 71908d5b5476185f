"""A held-out split never becomes training text unless asked for: a file or folder named for
validation or test (any case, inside a word, under any folder) is skipped, and the summary names
it; a table's rows are handed on by bytes, not by count, so a small file of long rows stays small
in memory; `--split all` reads a DatasetDict's every split."""

import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eqx_gpt.data import formats
from eqx_gpt.data.sources import find_sources, split_of
from eqx_gpt.errors import DataError


def _files(root, names: list[str]):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"the text of {name}\n")
    return root


def _read(root, split=None) -> list[str]:
    return [s.name for s in find_sources(root, split).sources]


@pytest.mark.parametrize(
    ("names", "read", "held_out"),
    [
        (["corpus.txt", "test.txt"], ["corpus.txt"], "test.txt"),
        (["Train.txt", "Test.txt"], ["Train.txt"], None),  # a folder of splits, in another case
        (["TRAIN", "TEST", "VALID"], ["TRAIN"], None),
        (["trainSet.txt", "testSet.txt"], ["trainSet.txt"], None),
        (["train/a.txt", "heldout/test/b.txt"], ["train/a.txt"], None),
        (["corpus/a.txt", "corpus/more/devSet.jsonl"], ["corpus/a.txt"], "corpus/more/devSet.jsonl"),
        (["a.txt", "extra/test/b.txt", "extra/c.txt"], ["a.txt", "extra/c.txt"], "extra/test/"),
        (["notes.txt", "held-out.txt", "myTestData.txt"], ["notes.txt"], "held-out.txt"),
    ],
)
def test_no_file_named_for_a_held_out_split_is_read_unless_asked(tmp_path, names, read, held_out):
    root = _files(tmp_path / "data", names)
    listing = find_sources(root)
    assert [s.name for s in listing.sources] == read
    if held_out is not None:
        assert "held out" in listing.summary and held_out in listing.summary, listing.summary
    assert sorted(_read(root, "all")) == sorted(names)  # every file, asked for


def test_a_held_out_split_alone_is_read_when_asked_and_words_that_hold_test_are_not_splits(tmp_path):
    root = _files(tmp_path / "data", ["corpus.txt", "test.txt", "latest.txt", "LATEST.md", "contest.txt"])
    assert _read(root) == ["LATEST.md", "contest.txt", "corpus.txt", "latest.txt"]
    assert _read(root, "test") == ["test.txt"]  # asked: the split alone, not the text beside it
    only = _files(tmp_path / "only", ["test.txt", "valid.txt"])
    with pytest.raises(DataError, match="holds the splits test, validation, and no train"):
        find_sources(only)
    one = _files(tmp_path / "one", ["Test.txt"])
    with pytest.raises(
        DataError, match="holds only files named for a held-out split .*Test.txt.*--split NAME"
    ):
        find_sources(one)
    names = ("wiki.valid.raw", "XMLTest.txt", "latest", "LATEST", "val2017", "train_test.txt")
    assert [split_of(n) for n in names] == ["validation", "test", None, None, "validation", "test"]


def _dataset_dict(folder, splits: dict[str, list[str]]):
    """A folder as `datasets.DatasetDict.save_to_disk` lays it out."""
    folder.mkdir()
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for name, rows in splits.items():
        (folder / name).mkdir()
        table = pa.table({"text": rows})
        with pa.OSFile(str(folder / name / "data-00000-of-00001.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
        (folder / name / "state.json").write_text(json.dumps({"_split": name}))
        (folder / name / "dataset_info.json").write_text("{}")
    return folder


def test_split_all_reads_every_split_of_a_dataset_dict(tmp_path):
    root = _dataset_dict(tmp_path / "dd", {"train": ["a"], "test": ["b"], "validation": ["c"]})
    listing = find_sources(root, "all")
    assert [s.name for s in listing.sources] == [
        "test/data-00000-of-00001.arrow", "train/data-00000-of-00001.arrow",
        "validation/data-00000-of-00001.arrow",
    ]  # fmt: skip
    assert "all splits (test, train, validation)" in listing.summary
    assert _read(root) == ["train/data-00000-of-00001.arrow"]


# -- tables by bytes ----------------------------------------------------------------------------


def _long_rows(path, how: str, value_bytes: int, n: int) -> None:
    """A table of `n` rows repeating one value of `value_bytes`: a few hundred bytes of file."""
    column = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["x" * value_bytes]))
    if how == "parquet":
        pq.write_table(pa.table({"text": column}), path, compression="zstd", row_group_size=n)
        return
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, pa.schema([("text", column.type)]), options=options) as w,
    ):
        w.write_batch(pa.record_batch([column], names=["text"]))


@pytest.mark.parametrize("how", ["parquet", "arrow"])
def test_a_small_table_of_long_rows_is_handed_on_a_few_bytes_at_a_time(tmp_path, how):
    path = tmp_path / f"long.{how}"
    _long_rows(path, how, value_bytes=3 * formats.SLICE_BYTES // 2, n=600)
    assert path.stat().st_size < 4096  # 900 MiB of text
    batches = formats.column_batches(path, how, "text")
    for values, _ in itertools.islice(batches, 5):
        assert len(values) == 1 and len(values[0]) == 3 * formats.SLICE_BYTES // 2  # one row at a time
    short = tmp_path / f"short.{how}"
    _long_rows(short, how, value_bytes=1000, n=3000)
    sizes = [sum(map(len, values)) for values, _ in formats.column_batches(short, how, "text")]
    assert sum(sizes) == 3_000_000 and max(sizes) <= formats.SLICE_BYTES  # many rows at a time, bounded


def test_a_table_value_over_the_record_bound_is_refused_as_a_jsonl_line_is(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "MAX_RECORD", 1 << 16)
    _long_rows(tmp_path / "long.parquet", "parquet", value_bytes=1 << 17, n=3)
    with pytest.raises(DataError, match="row 1 of its column 'text' holds 0 MiB of text, over 0 MiB"):
        next(formats.column_batches(tmp_path / "long.parquet", "parquet", "text"))
