"""Which datasets a run reads: direct paths, or names in LLaMA-Factory's ``dataset_info.json``.

With ``data.dataset_dir`` set, every name in ``data.dataset``/``data.eval_dataset`` is an entry
of ``<dataset_dir>/dataset_info.json`` in LLaMA-Factory's format::

    {"my_sft": {"file_name": "sft.jsonl", "formatting": "alpaca",
                "columns": {"prompt": "question", "response": "answer"}},
     "my_chat": {"file_name": "chat", "formatting": "sharegpt",
                 "columns": {"messages": "turns"}, "tags": {"role_tag": "speaker"}},
     "my_pairs": {"file_name": "pairs.parquet", "ranking": true,
                  "columns": {"prompt": "q", "chosen": "good", "rejected": "bad"}}}

Columns and tags are mapped onto the record fields :mod:`.records` and :mod:`.preference`
parse (alpaca: instruction, input, output, history, system, chosen, rejected; sharegpt:
``messages`` of role/content turns, system, chosen, rejected), so the rest of the pipeline is
the same as for a direct path. pt entries take their text from the ``prompt`` column.

``num_samples`` draws that many records from the file as LLaMA-Factory does (a permutation,
then random repeats when it asks for more than the file has) with a generator seeded by
``training.seed`` (LLaMA-Factory seeds NumPy's global generator with it before loading, so a
run's first such dataset gets the same records there), before ``data.max_samples`` cuts.
Without ``data.dataset_dir``, a name that is not a file is looked up, as with LLaMA-Factory's
default dataset_dir, in ``data/dataset_info.json`` under the working directory.
An ``images`` column (a path or a list of paths per record) is read for a vision-language
template; relative paths are looked up in ``data.media_dir``, else the dataset_dir
(:mod:`.vision`). ``videos``/``audios`` columns are refused in one line.
``split`` may only name ``train``, the one split a local file has; ``subset`` and ``folder``
are read and ignored for a local file, as LLaMA-Factory does. ``history``, ``system`` and
``tools`` columns are read only when the entry names them (LLaMA-Factory's defaults), and
``tools`` (JSON text of tool definitions) goes to the template's tool format. An entry with a
hub, script or cloud source is read from its ``file_name`` when it has one (nothing is
downloaded), else refused; any other key is refused. ``columns.kto_tag`` (a boolean column:
true = desirable answer) makes the entry unpaired feedback: read by the stages whose rows are
feedback only (kto), which need it.

Which entries fit a stage follows how the stage reads its rows (its registry row's ``reads``),
never its name: ``ranking: true`` entries are preference pairs, a :data:`MARKER_COLUMNS`
column makes an entry its kind's, and plain-text stages take the ``prompt`` column.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.stages import FEEDBACK, PREFERENCE_PAIR, TEXT, get_stage, stages_where

from .errors import DataError
from .records import (
    MEDIA_UNSUPPORTED,
    SFT_FORMATS,
    UNSUPPORTED_MEDIA,
    Record,
    check_dataset_source,
    columns_of,
    read_records,
)

if TYPE_CHECKING:
    from .arguments import DataArguments

ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output",
                  "history": "history", "system": "system", "tools": "tools", "chosen": "chosen",
                  "rejected": "rejected", "kto_tag": "kto_tag", "images": "images"}
"""LLaMA-Factory's alpaca column names -> the record field each maps to (also the defaults)."""
OPTIONAL_COLUMNS = ("history", "system", "tools", "kto_tag", "images")
"""Columns LLaMA-Factory reads only when the entry names them (its default is none)."""
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "tools": "tools",
                    "chosen": "chosen", "rejected": "rejected", "kto_tag": "kto_tag", "images": "images"}
"""LLaMA-Factory's sharegpt column names and their defaults."""
SHAREGPT_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                 "assistant_tag": "gpt", "observation_tag": "observation",
                 "function_tag": "function_call", "system_tag": "system"}
"""LLaMA-Factory's sharegpt tags and their defaults."""
ENTRY_KEYS = ("file_name", "formatting", "ranking", "columns", "tags", "num_samples", "split",
              "subset", "folder")
"""The dataset_info.json entry keys read here (``subset`` and ``folder`` choose a hub
dataset's configuration and directory; LLaMA-Factory ignores them for a local file, and so
does this reader)."""
_REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
"""LLaMA-Factory's keys of entries fetched from a hub, a script or the cloud: an entry that
also has a local ``file_name`` is read from that file (jobs run offline), one without is
refused."""
MARKER_COLUMNS = {"kto_tag": (FEEDBACK, "its boolean feedback column")}
"""Entry columns that make an entry one kind of rows' data (:attr:`hpc_mca.stages.Stage.reads`):
column key -> (the kind, what the column is, for the message). An entry naming the column is
read only by the stages of that kind, which need it."""
_TAG_ROLES = {"user_tag": "user", "assistant_tag": "assistant", "system_tag": "system",
              "observation_tag": "observation", "function_tag": "function_call"}


@dataclass(frozen=True)
class DatasetSource:
    """One dataset of a run: a direct path, or a dataset_info.json entry resolved to a path."""

    name: str
    """The name as written in the config."""
    path: str
    """The file, directory or indexed prefix to read."""
    formatting: str | None = None
    """alpaca or sharegpt for a dataset_info entry; None for a direct path."""
    ranking: bool = False
    """Pairwise (chosen/rejected) data, for dpo."""
    columns: dict[str, str] = field(default_factory=dict)
    """Column names, LLaMA-Factory's keys -> the file's columns (defaults filled in)."""
    given: tuple[str, ...] = ()
    """The column keys the entry set itself (those must exist in the file)."""
    tags: dict[str, str] = field(default_factory=dict)
    """sharegpt tags (defaults filled in)."""
    num_samples: int | None = None
    """Records drawn from the file (the entry's ``num_samples``); None = all, in file order."""
    seed: int = 0
    """Seed of the ``num_samples`` draw (``training.seed``)."""
    media_root: str = ""
    """Where relative image paths are looked up first: the dataset_dir of an entry; for a
    direct path, its file's directory."""

    def settings(self) -> dict[str, Any]:
        """What the tokenization cache key must include beyond the file contents."""
        if self.formatting is None:
            return {}
        drawn = {} if self.num_samples is None else {"num_samples": self.num_samples,
                                                     "seed": self.seed}
        return {"formatting": self.formatting, "ranking": self.ranking,
                "columns": self.columns, "tags": self.tags, **drawn}


def resolve_sources(data: DataArguments, field_name: str = "dataset", seed: int = 0) -> list[DatasetSource]:
    """The datasets of ``data.dataset`` (or ``eval_dataset``) as sources; DataError (one
    line) for a missing dataset_info.json, a name it lacks or an entry it cannot read.
    ``seed`` seeds the draw of entries with ``num_samples``."""
    names = list(getattr(data, field_name) or ())
    dataset_dir: str | None = getattr(data, "dataset_dir", None)
    if not dataset_dir:
        return [_path_or_default_entry(name, field_name, seed) for name in names]
    info_path = Path(dataset_dir) / "dataset_info.json"
    if not info_path.is_file():
        raise DataError(f"data.dataset_dir={dataset_dir!r} has no dataset_info.json")
    info = _read_info(info_path)
    for name in names:
        if name not in info:
            raise DataError(f"data.{field_name}: dataset {name!r} is not in {info_path}"
                            + _closest(name, list(info)))
    return [_entry(name, info[name], Path(dataset_dir), info_path, seed) for name in names]


LF_DATASET_DIR = "data"
"""LLaMA-Factory's dataset_dir when none is given, relative to the working directory."""


def _read_info(info_path: Path) -> dict[str, Any]:
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{info_path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(info, dict):
        raise DataError(f"{info_path}: must hold an object of dataset entries")
    return info


def _path_or_default_entry(name: str, field_name: str, seed: int) -> DatasetSource:
    """Without data.dataset_dir: a path that exists, else, as with LLaMA-Factory's default
    dataset_dir, an entry of ``data/dataset_info.json`` under the working directory. A bare
    name (no directory, no suffix) that is neither is refused naming where it was looked for;
    any other path is left to the path checks (which say it does not exist)."""
    if any(Path(f"{name}{suffix}").exists() for suffix in ("", ".idx", ".bin")):
        return DatasetSource(name, name)
    root = Path(LF_DATASET_DIR).resolve()
    info_path = root / "dataset_info.json"
    info = _read_info(info_path) if info_path.is_file() else None
    if info is not None and name in info:
        return _entry(name, info[name], root, info_path, seed)
    if "/" in name or Path(name).suffix:
        return DatasetSource(name, name)
    if info is None:
        raise DataError(f"data.{field_name}: {name!r} is neither a file nor a dataset_info.json entry: "
                        "data.dataset_dir is unset and LLaMA-Factory's default, data/ under the working "
                        f"directory ({root}), has no dataset_info.json; valid: a data file or directory, "
                        "or data.dataset_dir set to the directory whose dataset_info.json lists it")
    raise DataError(f"data.{field_name}: {name!r} is neither a file nor an entry of {info_path} "
                    f"(data.dataset_dir unset: LLaMA-Factory's default 'data')" + _closest(name, list(info)))


def _closest(name: str, known: list[str], n: int = 3, cutoff: float = 0.6) -> str:
    """"; did you mean ..." with up to ``n`` close names, else the names (when few)."""
    close = difflib.get_close_matches(name, known, n=n, cutoff=cutoff)
    if close:
        return f"; did you mean {' or '.join(map(repr, close))}?"
    if len(known) <= 10:
        return f"; valid: {', '.join(sorted(known)) or 'none'}"
    return f"; valid: one of its {len(known)} names (none is close to this one)"


def _check_entry_keys(entry: dict[str, Any], where: str) -> None:
    remote = [key for key in _REMOTE_KEYS if key in entry]
    if remote and "file_name" not in entry:
        raise DataError(f"{where} has {', '.join(remote)}: hub, script and cloud entries are "
                        "not read (nothing is downloaded); valid: a local 'file_name' entry")
    for key in entry:
        if key not in ENTRY_KEYS + _REMOTE_KEYS:
            raise DataError(f"{where}: unknown key {key!r}"
                            + _closest(key, list(ENTRY_KEYS), n=1, cutoff=0.8))
    split = entry.get("split", "train")
    if split != "train":
        raise DataError(f"{where}: split={split!r}; a local file has one split; valid: train")
    count = entry.get("num_samples")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise DataError(f"{where}: num_samples={count!r} must be a positive integer")


def _entry(name: str, entry: object, root: Path, info_path: Path, seed: int) -> DatasetSource:
    where = f"{info_path}: dataset {name!r}"
    if isinstance(entry, dict):
        _check_entry_keys(entry, where)
    if not isinstance(entry, dict) or "file_name" not in entry:
        raise DataError(f"{where} needs a 'file_name' (local file or directory; hub, "
                        "script and cloud entries are not read: nothing is downloaded)")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in SFT_FORMATS:
        raise DataError(f"{where}: formatting={formatting!r}; valid: {', '.join(SFT_FORMATS)}")
    defaults = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    given = dict(entry.get("columns") or {})
    media = [key for key in UNSUPPORTED_MEDIA if key in given]
    if media:
        raise DataError(f"{where}: columns.{media[0]}: {MEDIA_UNSUPPORTED}; valid: "
                        f"{', '.join(defaults)}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise DataError(f"{where}: unknown columns key {unknown[0]!r} for {formatting}; "
                        f"valid: {', '.join(defaults)}")
    tags = {**SHAREGPT_TAGS, **(entry.get("tags") or {})}
    if set(tags) - set(SHAREGPT_TAGS):
        raise DataError(f"{where}: unknown tags key {sorted(set(tags) - set(SHAREGPT_TAGS))[0]!r}"
                        f"; valid: {', '.join(SHAREGPT_TAGS)}")
    columns = {key: given.get(key, default) for key, default in defaults.items()
               if key in given or key not in OPTIONAL_COLUMNS}
    return DatasetSource(name, str(root / entry["file_name"]), formatting,
                         bool(entry.get("ranking", False)), columns, tuple(sorted(given)), tags,
                         entry.get("num_samples"), seed, str(root))


def check_sources(data: DataArguments) -> None:
    """Every dataset of the config exists (read nothing): for plan/submit and rank start."""
    for field_name in ("dataset", "eval_dataset"):
        for source in resolve_sources(data, field_name):
            check_dataset_source(source.path, f"data.{field_name}")


def source_records(source: DatasetSource, stage: str, max_samples: int | None, field_name: str,
                   cache_dir: str | os.PathLike[str] | None = None) -> list[Record]:
    """The records of one source, mapped onto the fields the parsers expect: the entry's
    ``num_samples`` drawn first, then the first ``max_samples`` kept."""
    if source.num_samples is None:
        records = list(read_records(source.path, max_samples, field_name, cache_dir))
    else:
        records = _drawn(list(read_records(source.path, None, field_name, cache_dir)),
                         source.num_samples, source.seed)[:max_samples]
    if source.formatting is None:
        return records
    if source.ranking != (get_stage(stage).reads == PREFERENCE_PAIR):
        pairs = " and ".join(stages_where("reads", PREFERENCE_PAIR))
        raise DataError(f"{field_name}: dataset {source.name!r} has ranking={source.ranking}, "
                        f"which does not fit finetuning.stage={stage!r} ({pairs} needs ranking: "
                        "true, the other stages ranking: false)")
    _check_markers(source, stage, field_name)
    present = columns_of(source.path, field_name, cache_dir)
    for key in _needed(source, stage):
        column = source.columns[key]
        if column not in present:
            raise DataError(f"{field_name}: dataset {source.name!r} column {key}={column!r} "
                            f"is not in {source.path}; its columns: {', '.join(present)}")
    if get_stage(stage).reads == TEXT:
        return [Record(r.where, {"text": r.data.get(source.columns["prompt"])}) for r in records]
    convert = _alpaca if source.formatting == "alpaca" else _sharegpt
    return [Record(r.where, convert(source, r)) for r in records]


def _check_markers(source: DatasetSource, stage: str, field_name: str) -> None:
    """An entry with a :data:`MARKER_COLUMNS` column is its kind's, and the stages of that kind
    read no other (one line each)."""
    reads = get_stage(stage).reads
    for column, (kind, what) in MARKER_COLUMNS.items():
        marked, wanted = column in source.columns, reads == kind
        if marked == wanted:
            continue
        readers = " and ".join(stages_where("reads", kind))
        raise DataError(f"{field_name}: dataset {source.name!r} "
                        + (f"has columns.{column}, which finetuning.stage={stage!r} does not read; "
                           f"valid: stage {readers}, or an entry without {column}" if marked else
                           f"lacks columns.{column}, which finetuning.stage={stage!r} needs; valid: "
                           f"an entry naming {what} as columns.{column}"))


def _drawn(records: list[Record], count: int, seed: int) -> list[Record]:
    """``count`` records: every record once in a random order, cut to ``count``, then random
    repeats for the rest (LLaMA-Factory's draw for an entry's num_samples)."""
    import numpy as np  # here: the login node's plan checks sources without drawing

    rng = np.random.RandomState(seed)
    order = rng.permutation(len(records))[:count]
    if count > len(order):
        order = np.concatenate([order, rng.choice(len(records), count - len(order))])
    return [records[int(i)] for i in order]


def _needed(source: DatasetSource, stage: str) -> list[str]:
    """Column keys that must exist: the entry's own, and the ones a record cannot lack."""
    if get_stage(stage).reads == TEXT:
        required = ["prompt"]
    elif source.formatting == "alpaca":
        required = ["prompt", *(["chosen", "rejected"] if source.ranking else ["response"])]
    else:
        required = ["messages", *(["chosen", "rejected"] if source.ranking else [])]
    return sorted(set(required) | set(source.given))


def _alpaca(source: DatasetSource, record: Record) -> dict[str, Any]:
    fields = {"prompt": "instruction", "query": "input", "response": "output",
              "history": "history", "system": "system", "tools": "tools", "chosen": "chosen",
              "rejected": "rejected", "kto_tag": "kto_tag", "images": "images"}
    return {fields[key]: record.data[column] for key, column in source.columns.items()
            if column in record.data}


def _sharegpt(source: DatasetSource, record: Record) -> dict[str, Any]:
    data, cols = record.data, source.columns
    out: dict[str, Any] = {"messages": data.get(cols["messages"])}
    if isinstance(out["messages"], list):
        out["messages"] = [_turn(source, record, turn) for turn in out["messages"]]
    for key in ("system", "tools", "chosen", "rejected", "kto_tag", "images"):
        if key in cols and cols[key] in data:
            value = data[cols[key]]
            out[key] = _turn(source, record, value) if key in ("chosen", "rejected") else value
    return out


def _turn(source: DatasetSource, record: Record, turn: object) -> dict[str, Any]:
    role_tag, content_tag = source.tags["role_tag"], source.tags["content_tag"]
    if not (isinstance(turn, dict) and role_tag in turn and content_tag in turn):
        raise DataError(f"{record.where}: a turn must have {role_tag!r} and {content_tag!r} "
                        f"(dataset_info tags); got {turn!r:.80}")
    roles = {source.tags[tag]: role for tag, role in _TAG_ROLES.items()}
    if turn[role_tag] not in roles:
        raise DataError(f"{record.where}: unknown {role_tag} {turn[role_tag]!r}; valid "
                        f"(dataset_info tags): {', '.join(roles)}")
    return {"role": roles[turn[role_tag]], "content": turn[content_tag]}
