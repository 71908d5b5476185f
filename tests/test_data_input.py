"""Bad data is one line naming the file (and the byte or line), exit code 2, and nothing cached."""

import importlib.util
import json
from pathlib import Path

import pytest

import eqx_gpt.data.chunks
from eqx_gpt.data.prepare import prepare
from eqx_gpt.data.sources import DataError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("train_cli_data", ROOT / "train.py")
train_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_cli)

LINE = "All the world's a stage, and all the men and women merely players.\n"  # 67 bytes


def _refused(path, message, tmp_path, **kw):
    with pytest.raises(DataError, match=message) as info:
        prepare(path, {"kind": "char"}, cache=tmp_path / "cache", **kw)
    assert "\n" not in str(info.value)
    leftovers = [p.name for p in (tmp_path / "cache").glob("*") if not p.name.endswith(".lock")]
    assert leftovers == []  # no entry, no temporary folder
    return str(info.value)


def test_a_bad_byte_deep_in_a_large_file_is_named_by_its_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(eqx_gpt.data.chunks, "CHUNK_BYTES", 1000)  # 40 chunks: the bad one is the 31st
    data = tmp_path / "big.txt"
    data.write_bytes(LINE.encode() * 450 + b"caf\xe9\n" + LINE.encode() * 150)
    error = _refused(data, "is not UTF-8 text", tmp_path, in_memory_bytes=0)
    assert f"{data}" in error and f"byte {67 * 450 + 3}: b'\\xe9'" in error


def test_binary_files_empty_folders_and_bad_jsonl_lines_are_refused(tmp_path, monkeypatch):
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\0\0\0" + bytes(range(256)))
    assert "a NUL byte at offset 7" in _refused(binary, "is binary", tmp_path)
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", "holds no files", tmp_path)
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    _refused(tmp_path / "pictures", "holds only binary files", tmp_path)
    _refused(tmp_path / "nowhere", "does not exist", tmp_path)
    monkeypatch.setattr(eqx_gpt.data.chunks, "CHUNK_BYTES", 500)
    lines = [json.dumps({"text": f"record {i} " * 5}) for i in range(100)]
    lines[70] = json.dumps({"body": "no text field"})
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    error = _refused(
        tmp_path / "records.jsonl", 'line 71 is not a JSON object with a "text" string', tmp_path
    )
    assert str(tmp_path / "records.jsonl") in error
    lines[70] = "{not json"
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    _refused(tmp_path / "records.jsonl", "line 71 is not a JSON object", tmp_path, in_memory_bytes=0)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    _refused(tmp_path / "blank.jsonl", "holds no text", tmp_path)


def test_train_py_says_one_line_and_exits_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    (tmp_path / "short.txt").write_text(LINE)
    for data, message in [
        (tmp_path / "empty", "holds no files"),
        (tmp_path / "bad.jsonl", "line 2 is not a JSON object"),
        (tmp_path / "short.txt", "fewer than one window of context_length + 1 = 65"),
        (ROOT / "tests" / "fixtures" / "tiny-gpt2" / "model.safetensors", "is binary"),
    ]:
        assert train_cli.main(["--data", str(data), "--out-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and err.startswith("train.py: error:"), err
    assert not (tmp_path / "out").exists()  # a refused run leaves no folder behind (issue 53)


def test_off_a_terminal_a_refusal_after_progress_is_one_line_on_stderr(tmp_path, monkeypatch, capsys):
    import errno
    import os

    import eqx_gpt.data.prepare

    monkeypatch.setenv("EQX_GPT_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(eqx_gpt.data.prepare, "IN_MEMORY_BYTES", 0)
    monkeypatch.setattr(eqx_gpt.data.prepare, "PROGRESS_AFTER", 0.0)  # every piece of work shows its bar
    data = tmp_path / "corpus.txt"
    data.write_bytes(LINE.encode() * 3000)
    prepare(data, {"kind": "char"}).close()
    os.utime(data, ns=(data.stat().st_mtime_ns + 10**9,) * 2)  # touched: hashed, its cache verified

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eqx_gpt.data.prepare, "atomic_write_bytes", full)  # the manifest cannot be rewritten
    assert train_cli.main(["--data", str(data), "--out-dir", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("train.py: error: no space left in the token cache"), err
    assert "hashing: " in out and "MB/s" in out  # the progress, with the log


def test_train_py_reads_the_split_named_and_refuses_a_folder_of_splits_without_train(tmp_path, capsys):
    folder = tmp_path / "splits"
    folder.mkdir()
    (folder / "test.txt").write_text(LINE * 100)
    (folder / "validation.txt").write_text(LINE * 100)
    assert train_cli.main(["--data", str(folder), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "holds the splits test, validation, and no train (the split read" in err
    ), err
    from eqx_gpt.commands.train import parse

    assert parse(["--split", "test"]) == {"split": "test"}
