"""Issue 42's check, end to end: a `.parquet` (its text in another column, named by `--text-field`)
and a `.txt.gz` of the same text train to the same losses as the plain text, and the start's
`data:` line says what was read."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_train_cli import TINY, train_cli

from eqx_gpt.training.data import load_text

PARAGRAPHS = load_text()[:60_000].split("\n\n")[:-1]  # whole paragraphs: the last one may be cut short
STEPS = ["--max-steps", "6", "--eval-interval", "3"]


def _losses(out: Path) -> list:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("final_val_loss")) for r in records]


def _train(tmp_path, data: Path, capsys, *flags) -> tuple[list, str]:
    out = tmp_path / f"out-{data.name}"
    assert train_cli.main([*TINY, *STEPS, "--data", str(data), "--out-dir", str(out), *flags]) == 0
    data_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data:"))
    return _losses(out), data_line


@pytest.mark.slow  # three whole runs; test_formats.py checks each format gives the plain text's tokens
def test_parquet_and_gzip_train_as_the_plain_text(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EQX_GPT_DATA_CACHE", str(tmp_path / "cache"))
    text = "\n\n".join(PARAGRAPHS)
    plain = tmp_path / "plain.txt"
    plain.write_text(text, encoding="utf-8")
    zipped = tmp_path / "zipped.txt.gz"
    zipped.write_bytes(gzip.compress(text.encode()))
    table = tmp_path / "table.parquet"  # documents are joined by a blank line, as paragraphs are
    pq.write_table(pa.table({"id": list(range(len(PARAGRAPHS))), "content": PARAGRAPHS}), table)

    want, plain_line = _train(tmp_path, plain, capsys)
    got_gz, gz_line = _train(tmp_path, zipped, capsys)
    got_pq, pq_line = _train(tmp_path, table, capsys, "--text-field", "content")
    assert len(want) > 6 and want[-1][3] is not None
    assert got_gz == want and got_pq == want
    assert "read 1 file (1 .txt.gz)" in gz_line and "read 1 file (1 .parquet)" in pq_line, (gz_line, pq_line)


def test_a_table_without_the_text_field_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EQX_GPT_DATA_CACHE", str(tmp_path / "cache"))
    table = tmp_path / "table.parquet"
    pq.write_table(pa.table({"content": PARAGRAPHS}), table)
    rc = train_cli.main([*TINY, *STEPS, "--data", str(table), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no column 'text'" in err[0] and "--text-field" in err[0], err
