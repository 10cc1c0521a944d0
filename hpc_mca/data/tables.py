"""Local dataset files and directories read through HF ``datasets``, never from the network.

Readable: ``.jsonl``/``.json``, ``.parquet``, ``.arrow``, ``.csv``, ``.txt`` files; a directory written by
``Dataset.save_to_disk`` (read with ``datasets.load_from_disk``); a directory of data files of
one type (read in name order). The tables are Arrow files that ``datasets`` memory-maps; the
Arrow copies it makes of json/csv files live under the tokenization cache
(``<preprocessing_cache_dir>/datasets``), so a job writes nowhere but that cache.

Only local paths are accepted: a name that is not an existing path (a Hub dataset id, say) is
refused before ``datasets`` is called, and the call itself runs with ``datasets``' offline flag
set, so nothing is fetched even by accident.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import DataError

if TYPE_CHECKING:
    from datasets import Dataset, Features

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
            ".csv": "csv", ".txt": "text"}
"""File suffix -> the ``datasets`` packaged builder that reads it (``.txt``: one document per
line in column ``text``, as LLaMA-Factory reads it)."""


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return path.is_dir() and ((path / "state.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def directory_files(path: Path, field: str) -> list[Path]:
    """The data files of a plain directory, in name order; all must be of one readable type."""
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    suffixes = sorted({p.suffix for p in files})
    if len(suffixes) != 1 or suffixes[0] not in BUILDERS:
        raise DataError(f"{field}: directory {str(path)!r} must hold data files of one type "
                        f"({', '.join(BUILDERS)}) or a datasets.save_to_disk dataset; found "
                        f"suffixes {suffixes or 'none'}")
    return files


def check_local(path: str | os.PathLike[str], field: str) -> Path:
    """``path`` if it exists on this machine; a one-line DataError otherwise. A name that is
    not a path is refused here rather than looked up on the Hub (jobs run offline)."""
    local = Path(path)
    if local.exists():
        return local
    text = os.fspath(path)
    if "/" in text.strip("/") and not text.startswith((".", "/", "~")) and not local.suffix:
        raise DataError(f"{field}: {text!r} is not a local path; datasets are read from local "
                        "files or directories only (nothing is downloaded): download it first "
                        "and give its path")
    raise DataError(f"{field}: dataset file {text!r} does not exist")


@contextlib.contextmanager
def _offline_and_quiet() -> Iterator[ModuleType]:
    """``datasets`` with its offline flag set and its log below errors (a file it cannot type
    is reported by us, not as a library traceback line), both restored afterwards."""
    import datasets

    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE,
             os.environ.get("HF_DATASETS_OFFLINE"), datasets.logging.get_verbosity())
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    datasets.logging.set_verbosity(logging.CRITICAL)
    progress = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved[:2]
        if saved[2] is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = saved[2]
        datasets.logging.set_verbosity(saved[3])
        if not progress:
            datasets.enable_progress_bars()


def load_table(path: Path, cache_dir: Path, field: str) -> Dataset:
    """The ``datasets.Dataset`` of a local file or directory (memory-mapped Arrow).

    Raises ``datasets``' own errors for a file it cannot parse; :func:`..records.read_records`
    turns those into ``path:line`` errors."""
    with _offline_and_quiet() as datasets:
        if is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise DataError(f"{field}: {str(path)!r} holds splits {list(loaded)} and "
                                    "no 'train' split; give the split's directory instead")
                loaded = loaded["train"]
            return loaded
        files = directory_files(path, field) if path.is_dir() else [path]
        builder = BUILDERS[files[0].suffix]
        # csv cells are text: without dtype=str, pandas would turn an answer "42" into 42.
        options = {"features": _text_features(datasets, files[0])} if builder == "csv" else {}
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",
                                     cache_dir=str(cache_dir), **options)


def _text_features(datasets: ModuleType, path: Path) -> Features:
    """Every column of a csv file (named by its header line) as a string column."""
    import csv

    with path.open(encoding="utf-8", newline="") as handle:
        header = next(csv.reader(handle), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def table_rows(table: Dataset, batch_size: int = 1024) -> Iterator[dict[str, Any]]:
    """The rows of a ``datasets.Dataset`` as plain dicts, without the nulls Arrow adds."""
    for batch in table.iter(batch_size=batch_size):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield _drop_nulls(dict(zip(columns, values)))


def _drop_nulls(value: object) -> Any:
    # Arrow gives every row every column of the file (and every struct every key seen in
    # any row), as None where the record had none. The parsers treat a missing key as
    # absent, so the nulls go and the record reads as it was written.
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def jsonl_line_numbers(path: Path, count: int) -> list[int] | None:
    """The file line of each of the ``count`` records of a jsonl file (blank lines skipped),
    or None when record ``i`` is on line ``i + 1`` (no blank lines: the common case, found
    without reading the file line by line)."""
    lines, last = 0, b"\n"
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    lines += last != b"\n"
    if lines == count:
        return None
    with path.open("rb") as handle:
        return [number for number, line in enumerate(handle, start=1) if line.strip()]
