"""Dataset files to records, and records to the two shapes the stages consume.

Files and directories are read through HF ``datasets`` (:mod:`.tables`: ``.jsonl``/``.json``,
``.parquet``, ``.arrow``, ``.csv``, ``save_to_disk`` directories, directories of data files;
local only, memory-mapped; ``.txt``: one ``text`` record per line). Every record keeps where
it came from (``path:line`` for jsonl,
``path:record N`` for json, ``path:row N`` otherwise) so a bad one is reported as
``path:line: reason`` before training starts. A json file ``datasets`` cannot read as a table
(invalid JSON, a line that is not an object) is read again line by line to name the bad line.

Shapes:

* pt: the document text in ``text_field`` (default ``text``).
* sft/dpo: alpaca records (``instruction``, optional ``input``, ``output`` or ``chosen`` and
  ``rejected``, optional ``system``, ``history`` of ``[prompt, response]`` pairs and ``tools``)
  or sharegpt records (``conversations`` of ``{"from", "value"}`` or ``messages`` of
  ``{"role", "content"}``, optional ``system`` and ``tools``), which :mod:`.conversation`
  turns into LLaMA-Factory's examples. Either may carry ``images`` (a path or a list of paths,
  one per ``<image>`` placeholder: :mod:`.vision`); ``videos`` and ``audios`` are refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.stages import CONVERSATION, FEEDBACK, PREFERENCE_PAIR, TEXT

from .cache import default_cache_dir
from .errors import DataError
from .tables import (
    BUILDERS,
    check_local,
    directory_files,
    is_saved_dataset,
    jsonl_line_numbers,
    load_table,
    table_rows,
)

if TYPE_CHECKING:
    from datasets import Dataset

FILE_SUFFIXES = tuple(BUILDERS)
SFT_FORMATS = ("alpaca", "sharegpt")
"""Formats of conversations (and of preference pairs, which add chosen/rejected answers)."""
TEXT_FORMATS = ("text", "indexed")
"""Formats of plain text: records with a text field, or a Megatron indexed corpus."""
FORMATS_BY_READS = {TEXT: TEXT_FORMATS, CONVERSATION: SFT_FORMATS, PREFERENCE_PAIR: SFT_FORMATS,
                    FEEDBACK: SFT_FORMATS}
"""The ``data.dataset_format`` values (besides auto) that fit each way a stage reads its rows
(:attr:`hpc_mca.stages.Stage.reads`)."""


@dataclass(frozen=True)
class Record:
    """One JSON object of a dataset file and its location (``path:line``)."""

    where: str
    """``path:line`` (jsonl/json) or ``path:row N`` (parquet), for error messages."""
    data: dict[str, Any]
    """The record itself."""


def indexed_prefix(path: str) -> str | None:
    """The ``.bin``/``.idx`` prefix ``path`` names (the prefix or either file), else None."""
    prefix = path[:-4] if path.endswith((".bin", ".idx")) else path
    both = os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")
    return prefix if both else None


def check_dataset_source(path: str | os.PathLike[str], field: str = "data.dataset") -> None:
    """A dataset entry the pipeline can read: a Megatron ``.bin``/``.idx`` pair (its prefix or
    either file) or a records file (:func:`check_dataset_path`); DataError (one line) otherwise.
    What the run config's ``dataset_format`` makes of it is checked when the data is read."""
    if indexed_prefix(os.fspath(path)) is None:
        check_dataset_path(path, field)


def check_dataset_path(path: str | os.PathLike[str], field: str = "data.dataset") -> Path:
    """The path if it is a readable dataset file or directory; DataError (one line) otherwise."""
    path = check_local(path, field)
    if path.is_dir():
        if not is_saved_dataset(path):
            directory_files(path, field)
        return path
    if path.suffix not in FILE_SUFFIXES:
        raise DataError(f"{field}: {str(path)!r} has an unknown file type {path.suffix!r}; "
                        f"valid: {', '.join(FILE_SUFFIXES)}, a directory of them or of "
                        "Dataset.save_to_disk, or a Megatron .bin/.idx prefix")
    return path


def read_records(path: str | os.PathLike[str], max_samples: int | None = None,
                 field: str = "data.dataset", cache_dir: str | os.PathLike[str] | None = None
                 ) -> Iterator[Record]:
    """The records of one file or directory, in file order, at most ``max_samples`` of them.
    ``cache_dir``: where ``datasets`` keeps its Arrow copies (default: under the tokenization
    cache)."""
    path = check_dataset_path(path, field)
    for count, record in enumerate(_records(path, field, cache_dir)):
        if max_samples is not None and count >= max_samples:
            return
        yield record


def columns_of(path: str | os.PathLike[str], field: str = "data.dataset",
               cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The column names of a dataset file or directory (the keys of its first record when
    ``datasets`` cannot read it as a table)."""
    path = check_dataset_path(path, field)
    try:
        return list(load_table(path, Path(cache_dir or _default_cache()), field).column_names)
    except DataError:
        raise
    except Exception:  # noqa: BLE001 - read_records reports what is wrong with the file
        return sorted(next(_records(path, field, cache_dir)).data)


def _records(path: Path, field: str, cache_dir: str | os.PathLike[str] | None
             ) -> Iterator[Record]:
    if path.suffix == ".json" and path.is_file() and _first_byte(path) != b"[":
        # A .json file holds one list of objects; datasets would also take JSON lines or a
        # single object as rows, which the fallback reader reports as the mistake it is.
        yield from _json_list(path)
        return
    try:
        table = load_table(path, Path(cache_dir or _default_cache()), field)
    except DataError:
        raise
    except Exception:  # noqa: BLE001 - datasets' parse errors: find the line ourselves
        if path.suffix not in (".jsonl", ".json") or not path.is_file():
            raise
        yield from (_jsonl(path) if path.suffix == ".jsonl" else _json_list(path))
        return
    yield from _located(path, table)


def _located(path: Path, table: Dataset) -> Iterator[Record]:
    kind = {".jsonl": "", ".txt": "", ".json": "record "}.get(path.suffix, "row ") if path.is_file() \
        else "row "
    # A .txt file's rows are its lines, blank ones included; a jsonl file skips blank lines.
    lines = jsonl_line_numbers(path, len(table)) if path.suffix == ".jsonl" and kind == "" else None
    for index, row in enumerate(table_rows(table)):
        number = lines[index] if lines is not None else index + 1
        yield Record(f"{path}:{kind}{number}", row)


def _default_cache() -> Path:

    return default_cache_dir() / "datasets"


def _first_byte(path: Path) -> bytes:
    with path.open("rb") as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1]
    return b""


def _jsonl(path: Path) -> Iterator[Record]:
    # Only for files datasets cannot parse: the stdlib reader names the bad line.
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") \
                    from None
            yield Record(where, _object(where, data))


def _json_list(path: Path) -> Iterator[Record]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg} at column "
                        f"{err.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}:1: a .json dataset must hold a list of objects; got "
                        f"{type(data).__name__} (use .jsonl for one object per line)")
    for index, item in enumerate(data):
        where = f"{path}:record {index + 1}"
        yield Record(where, _object(where, item))


def _object(where: str, data: object) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


# --- formats -------------------------------------------------------------------------------


MEDIA_COLUMNS = ("images", "videos", "audios")
"""LLaMA-Factory's multimodal columns (dataset_info.json) and record keys."""
UNSUPPORTED_MEDIA = ("videos", "audios")
"""The multimodal columns refused (videos need torchvision/av, not installed; audios a model)."""
MEDIA_UNSUPPORTED = ("videos and audios are not supported (images are, with a vision-language "
                     "template: qwen2_vl, qwen3_vl, qwen3_vl_nothink)")


def check_media(record: Record) -> None:
    """DataError (one line) for a record that carries videos or audios: they would not reach
    the model. Images are read by :mod:`.vision`."""
    for key in UNSUPPORTED_MEDIA:
        if record.data.get(key):
            raise DataError(f"{record.where}: {key!r}: {MEDIA_UNSUPPORTED}; valid: records without "
                            f"{key!r} (or an empty list)")


def detect_sft_format(record: Record) -> str:
    """alpaca or sharegpt, from the keys of one record."""
    keys = record.data.keys()
    if "conversations" in keys or "messages" in keys:
        return "sharegpt"
    if "instruction" in keys:
        return "alpaca"
    raise DataError(f"{record.where}: cannot tell the sft format from keys "
                    f"{sorted(keys)}; valid: alpaca (instruction, input, output) or sharegpt "
                    "(conversations or messages); or set data.dataset_format")


def text_of(record: Record, text_field: str) -> str:
    """The pt document of a record."""
    if text_field not in record.data:
        raise DataError(f"{record.where}: missing field {text_field!r} (data.text_field); "
                        f"keys: {sorted(record.data)}")
    return _string(record, text_field, record.data[text_field])


def _string(record: Record, key: str, value: object) -> str:
    if not isinstance(value, str):
        raise DataError(f"{record.where}: {key!r} must be a string, got {type(value).__name__}")
    return value
