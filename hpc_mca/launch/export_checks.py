"""What ``hpc-mca export`` refuses before any process group or model exists, one line each.

A checkpoint is exported only when it is complete: published by the commit protocol (its
``checkpoint.json`` is written last, after every rank's files; a ``.tmp`` directory is a save
in progress or one that died) and with every file its index names, at least as long as the
index says (a shard deleted or cut short after the save). The run it belongs to must still be
buildable: its ``resolved_config.yaml``, the model directory that names, with the weights the
run started from (LoRA and freeze checkpoints hold only what trained: the rest comes from that
directory, which must not have changed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_mca.checkpoint.store import (
    CHECKPOINTS_DIR,
    HF_FORMAT,
    INFO_FILE,
    CheckpointError,
    CheckpointInfo,
    complete_checkpoints,
    latest_checkpoint,
    read_info,
    step_of,
)
from hpc_mca.config.sections import TrainConfig
from hpc_mca.errors import UserError
from hpc_mca.rundir import RESOLVED_CONFIG_FILE

__all__ = ["EXPORT_FILES", "ExportRefused", "check_base_model", "check_merge", "check_target", "clear_export",
           "find_checkpoint", "human_bytes", "parse_size", "run_config"]

EXPORT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
                "adapter_config.json", "adapter_model.safetensors")
"""Files whose presence says a directory already holds an export (HF model or PEFT adapter)."""

_TORCH_DIST_FILES = (".metadata", "metadata.json")


class ExportRefused(UserError):
    """The export cannot be made from what was given; the message is one line."""


def find_checkpoint(source: Path) -> tuple[Path, CheckpointInfo]:
    """The complete checkpoint ``source`` names (a run directory: its latest; its
    ``checkpoints`` directory; one ``iter_N``) and its ``checkpoint.json``."""
    source = Path(source)
    if not source.exists():
        raise ExportRefused(f"{source} does not exist; valid: a run directory or one of its "
                            f"checkpoints ({CHECKPOINTS_DIR}/iter_NNNNNNN)")
    if source.name.endswith(".tmp") and step_of(source.name.removesuffix(".tmp")) is not None:
        raise ExportRefused(f"{source} is a partial checkpoint (a save in progress, or one that died "
                            f"before it was published); valid: {_complete_ones(source.parent)}")
    if step_of(source.name) is not None or (source / INFO_FILE).is_file():
        path = source
    else:
        try:
            found = latest_checkpoint(source) or latest_checkpoint(source.parent)
        except CheckpointError as err:
            raise ExportRefused(str(err)) from None
        if found is None:
            raise ExportRefused(f"{source} is not a run directory with a checkpoint (no "
                                f"{CHECKPOINTS_DIR}/latest); valid: a run directory or one of its "
                                f"checkpoints ({CHECKPOINTS_DIR}/iter_NNNNNNN)")
        path = found
    try:
        info = read_info(path)
    except CheckpointError as err:
        raise ExportRefused(f"{err}; valid: {_complete_ones(path.parent)}") from None
    missing = _missing_files(path, info)
    if missing:
        raise ExportRefused(f"{path} is a partial checkpoint: {missing}; valid: "
                            f"{_complete_ones(path.parent)}")
    return path, info


def _complete_ones(root: Path) -> str:
    done = [p.name for _, p in complete_checkpoints(root)]
    if not done:
        return "a complete checkpoint (this run has none)"
    return f"a complete checkpoint ({', '.join(done[-3:])})"


def _missing_files(path: Path, info: CheckpointInfo) -> str:
    """What is missing or short in ``path`` (empty when it is whole)."""
    if info.format == HF_FORMAT:
        return _missing_hf_files(path)
    absent = [name for name in _TORCH_DIST_FILES if not (path / name).is_file()]
    if absent:
        return f"{', '.join(absent)} missing"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as err:  # noqa: BLE001 - torch raises what unpickling a broken file raises
        return f".metadata unreadable ({type(err).__name__})"
    needed: dict[str, int] = {}
    for item in storage.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    return _short_files(path, needed)


def _missing_hf_files(path: Path) -> str:
    """transformers' files: the weights (one file, an index and its shards, or a PEFT adapter),
    each as long as its safetensors header says."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = [name for name in ("model.safetensors", "adapter_model.safetensors") if (path / name).is_file()]
        if not names:
            return "no model.safetensors, model.safetensors.index.json or adapter_model.safetensors"
    needed = {}
    for name in names:
        needed[name] = _safetensors_length(path / name)
    return _short_files(path, needed)


def _safetensors_length(path: Path) -> int:
    """The bytes a safetensors file must have by its own header (0 when it cannot be read:
    then it is reported as missing)."""
    try:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
    except (OSError, ValueError):
        return -1
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    return 8 + size + max(ends, default=0)


def _short_files(path: Path, needed: dict[str, int]) -> str:
    problems = []
    for name, length in sorted(needed.items()):
        file = path / name
        if length < 0 or not file.is_file():
            problems.append(f"{name} missing" if not file.is_file() else f"{name} unreadable")
        elif file.stat().st_size < length:
            problems.append(f"{name} has {file.stat().st_size} of its {length} bytes")
    return ", ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")


def run_config(run_dir: Path, info: CheckpointInfo) -> TrainConfig:
    """The config the run resolved (``resolved_config.yaml``), unresolved again so the export
    can set its own layout; its model directory must exist."""
    from hpc_mca.config.loading import load_config

    path = run_dir / RESOLVED_CONFIG_FILE
    if not path.is_file():
        raise ExportRefused(f"{run_dir} has no {RESOLVED_CONFIG_FILE} (the run's config, written at its "
                            f"start), so the model of its checkpoints cannot be built; valid: the run "
                            f"directory the checkpoint was saved in")
    try:
        config = load_config(path)
    except UserError as err:
        raise ExportRefused(f"{path} does not load: {'; '.join(str(err).splitlines())}") from None
    model_dir = Path(config.model.model_name_or_path)
    if not (model_dir / "config.json").is_file():
        raise ExportRefused(f"the run's model directory {model_dir} (model.model_name_or_path in {path}) "
                            f"{'has no config.json' if model_dir.is_dir() else 'does not exist'}; "
                            f"valid: the model directory the run was trained from")
    saved = info.training.get("finetuning_type")
    if saved is not None and saved != config.finetuning.finetuning_type:
        raise ExportRefused(f"{path} says finetuning_type {config.finetuning.finetuning_type!r} but the "
                            f"checkpoint at step {info.step} was saved with {saved!r}; valid: the "
                            f"checkpoint's own run directory")
    return config


def check_merge(config: TrainConfig, merged: bool) -> None:
    from hpc_mca.models.converters import converter_for

    converter = converter_for(config.finetuning)
    if merged and not converter.can_merge:
        raise ExportRefused(f"--merge-lora: the run's finetuning_type is {converter.name!r}, which has "
                            f"no adapters to merge; valid: leave it out")


def check_base_model(config: TrainConfig, info: CheckpointInfo) -> None:
    """The model directory still holds the model the checkpoint was trained on: its shape, and
    for checkpoints of only what trained (LoRA, freeze) the same base weights."""
    from hpc_mca.checkpoint.compat import incompatibilities, model_record
    from hpc_mca.models.converters import converter_for
    from hpc_mca.topology import ModelShape

    model_path = config.model.model_name_or_path
    try:
        shape = ModelShape.from_hf_config(model_path)
    except (UserError, OSError, ValueError) as err:
        raise ExportRefused(f"the run's model {model_path} cannot be built: {err}") from None
    record = converter_for(config.finetuning, config.model.adapter_name_or_path).resume_record(model_path)
    training = {**info.training, **({"base_model": record["base_model"]} if "base_model" in record else {})}
    reasons = incompatibilities(info, model_record(shape), dict(info.layout), training)
    if reasons:
        raise ExportRefused(f"cannot export {config.training.output_dir}: " + "; ".join(reasons))


def check_target(out: Path, config: TrainConfig, *, force: bool) -> None:
    """``out`` may receive the export: not the run's model directory, and without an export
    already in it unless ``force``."""
    model_dir = Path(config.model.model_name_or_path).resolve()
    if out.resolve() == model_dir:
        raise ExportRefused(f"--to {out} is the run's model directory, which the export reads; valid: "
                            f"another directory")
    if out.exists() and not out.is_dir():
        raise ExportRefused(f"--to {out} is a file; valid: a directory")
    there = [name for name in EXPORT_FILES if (out / name).is_file()]
    if there and not force:
        raise ExportRefused(f"{out} already holds an export ({', '.join(there)}); valid: --to another "
                            f"directory, or --force to replace it")
    if out.exists() and not os.access(out, os.W_OK):
        raise ExportRefused(f"--to {out} is not writable; valid: a directory you can write")


def clear_export(out: Path) -> None:
    """``--force``: remove the export files already in ``out`` (rank 0, before writing), so an
    adapter does not end up beside an older model's weights, or the reverse."""
    for name in EXPORT_FILES:
        (out / name).unlink(missing_ok=True)
    for shard in out.glob("model-*-of-*.safetensors"):
        shard.unlink()


def human_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    value = float(size)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def parse_size(text: str) -> int:
    """``5GB`` (10^9), ``5GiB`` (2^30), ``500MB``, ``100KB`` or a number of bytes, as
    transformers' ``max_shard_size`` reads them."""
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    value = text.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if value.endswith(unit) and value[:-len(unit)].strip():
            number = value[:-len(unit)].strip()
            break
    else:
        unit, number = "B", value
    try:
        size = int(float(number) * units[unit])
    except ValueError:
        size = 0
    if size <= 0:
        raise ExportRefused(f"--max-shard-size={text!r} is not a size; valid: e.g. 5GB, 500MB, 2GiB "
                            f"or a number of bytes")
    return size

