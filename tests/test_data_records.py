"""hpc_mca.data.records: reading dataset files, format detection, one-line errors."""

import json
from pathlib import Path

import pytest

from hpc_mca.data.conversation import Example, example_of
from hpc_mca.data.errors import DataError
from hpc_mca.data.records import (
    Record,
    detect_sft_format,
    read_records,
    text_of,
)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


def test_jsonl_records_carry_their_line(tmp_path: Path):
    path = _write(tmp_path / "d.jsonl", ['{"text": "a"}', "", '{"text": "b"}'])
    records = list(read_records(path))
    assert [r.where for r in records] == [f"{path}:1", f"{path}:3"]
    assert [text_of(r, "text") for r in records] == ["a", "b"]
    assert len(list(read_records(path, max_samples=1))) == 1


def test_malformed_jsonl_line_reports_file_and_line(tmp_path: Path):
    path = _write(tmp_path / "d.jsonl", ['{"text": "a"}', '{"text": "b"}', '{"text": "c",}'])
    with pytest.raises(DataError) as err:
        list(read_records(path))
    assert _one_line(err).startswith(f"{path}:3: invalid JSON (")


def test_non_object_line(tmp_path: Path):
    path = _write(tmp_path / "d.jsonl", ['{"text": "a"}', "[1, 2]"])
    with pytest.raises(DataError, match=r"d.jsonl:2: expected a JSON object, got list"):
        list(read_records(path))


def test_missing_file_and_unknown_type(tmp_path: Path):
    with pytest.raises(DataError) as err:
        list(read_records(tmp_path / "nope.jsonl"))
    assert _one_line(err) == f"data.dataset: dataset file '{tmp_path / 'nope.jsonl'}' does not exist"
    # .txt is readable since issue #39 (LLaMA-Factory reads it with datasets' text builder).
    (tmp_path / "d.xml").write_text("a,b\n")
    with pytest.raises(DataError) as err:
        list(read_records(tmp_path / "d.xml"))
    assert "unknown file type '.xml'; valid: .jsonl, .json, .parquet, .arrow, .csv, .txt" in _one_line(err)


def test_json_list_file(tmp_path: Path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"instruction": "hi", "output": "yo"}]))
    (record,) = read_records(path)
    assert record.where == f"{path}:record 1"
    path.write_text('[{"a": 1},\n {"a": }]')
    with pytest.raises(DataError, match=r"d.json:2: invalid JSON"):
        list(read_records(path))


def test_parquet_reads_records(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["x", "y"]}), path)
    assert [text_of(r, "text") for r in read_records(path)] == ["x", "y"]


def test_alpaca_to_an_example():
    # Issue #39: records become LLaMA-Factory's examples (prompt turns, response, system, tools).
    record = Record("f:1", {"instruction": "Add", "input": "1+2", "output": "3",
                            "system": "be exact", "history": [["hi", "hello"]]})
    assert detect_sft_format(record) == "alpaca"
    assert example_of(record, "alpaca", False) == Example(
        "f:1", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "Add\n1+2"}],
        [{"role": "assistant", "content": "3"}], "be exact", "")


def test_sharegpt_both_spellings():
    a = Record("f:1", {"conversations": [{"from": "human", "value": "q"},
                                         {"from": "gpt", "value": "a"}]})
    b = Record("f:1", {"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}]})
    assert detect_sft_format(a) == detect_sft_format(b) == "sharegpt"
    assert example_of(a, "sharegpt", False) == example_of(b, "sharegpt", False)


def test_broken_turn_order_is_invalid_not_an_error():
    """LLaMA-Factory drops a conversation whose turns do not alternate (or that ends on the
    prompt side) with a warning; the pipeline drops and counts it ("invalid N")."""
    for turns in ([{"role": "user", "content": "q"}],
                  [{"role": "user", "content": "q"}, {"role": "user", "content": "again"}],
                  [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]):
        assert example_of(Record("f:1", {"messages": turns}), "sharegpt", False) is None


@pytest.mark.parametrize("data, fmt, message", [
    ({"question": "q"}, None, "f:7: cannot tell the sft format from keys ['question']"),
    ({"instruction": "q"}, "alpaca", "f:7: alpaca record lacks 'output'"),
    ({"conversations": [{"from": "bot", "value": "a"}]}, "sharegpt", "unknown role 'bot'"),
    ({"instruction": 3, "output": "x"}, "alpaca", "f:7: 'instruction' must be a string"),
    ({"instruction": "q", "output": "x", "tools": 3}, "alpaca", "f:7: 'tools' must be JSON text"),
])
def test_bad_sft_records(data: dict, fmt: str | None, message: str):
    record = Record("f:7", data)
    with pytest.raises(DataError) as err:
        example_of(record, fmt, False) if fmt else detect_sft_format(record)
    assert message in _one_line(err)


def test_missing_text_field():
    with pytest.raises(DataError, match=r"f:1: missing field 'body' \(data.text_field\)"):
        text_of(Record("f:1", {"text": "x"}), "body")
