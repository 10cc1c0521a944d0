"""``hpc-mca export``: a finished (or interrupted) run's checkpoint as a Hugging Face model,
after the run, on every rank of the export (one process, or the ranks of ``srun``/``torchrun``).

A run exports at its end only where it was asked to; this writes the same export afterwards,
from any complete checkpoint of either backend, whatever layout it was saved in:

* Megatron-Core checkpoints: the run's model is built again from its ``resolved_config.yaml``
  and the model directory it names (base weights, finetuning type), in the export's layout
  (one rank: TP1 PP1 EP1), the checkpoint's model weights (no optimizer) are loaded into it,
  resharded by dist_checkpointing, and the finetuning type's converter writes the export: the
  code of the end-of-run export (:meth:`hpc_mca.checkpoint.checkpointer.Checkpointer.export`),
  so the files are the same, byte for byte;
* the standard backend's checkpoints (transformers' files): the run's transformers model is
  built as the run built it, the checkpoint's weights (or PEFT adapter) put in, and
  :func:`hpc_mca.standard.model.export_model` writes it, as at the run's end.

Everything that can be refused is refused before a process group or a model exists, in one
line (:class:`ExportRefused`): a path that is no checkpoint, a partial one (a ``.tmp`` save,
no ``checkpoint.json``, files missing or shorter than its index says: :mod:`.export_checks`),
a model directory that is gone or holds other weights than the run's, ``--merge-lora`` on a
run without adapters, a target that already holds an export (unless ``force``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from hpc_mca.checkpoint.store import HF_FORMAT, CheckpointInfo
from hpc_mca.config.sections import TrainConfig
from hpc_mca.errors import UserError

from .export_checks import (
    ExportRefused,
    check_base_model,
    check_merge,
    check_target,
    clear_export,
    find_checkpoint,
    human_bytes,
    run_config,
)

__all__ = ["ExportRefused", "ExportRequest", "export_checkpoint"]


@dataclass(frozen=True)
class ExportRequest:
    """What ``hpc-mca export`` was asked."""

    source: Path
    """A run directory (its latest complete checkpoint), its ``checkpoints/`` directory or
    one ``iter_NNNNNNN`` checkpoint."""
    out: Path | None = None
    """Where the export goes; None: the run directory (where the run's own export lands)."""
    merged: bool = False
    """LoRA runs: the base model with the adapters merged in instead of the PEFT adapter."""
    max_shard_bytes: int | None = None
    """Largest safetensors file of an HF model export; None: the run's own (5 GiB)."""
    layout: dict[str, int] = field(default_factory=dict)
    """Parallel sizes of the export's ranks given on the command line (tp, pp, vp, ep)."""
    force: bool = False
    """Replace an export already in ``out``."""


def export_checkpoint(request: ExportRequest) -> Path:
    """Export the checkpoint ``request`` names (every rank calls it); returns the directory.
    Raises :class:`ExportRefused` (one line, the same on every rank) before any collective."""
    from hpc_mca.runtime.env import from_environ

    env = from_environ()
    started = time.perf_counter()
    try:
        path, info = find_checkpoint(request.source)
        run_dir = path.parent.parent
        config = run_config(run_dir, info)
        check_merge(config, request.merged)
        check_base_model(config, info)
        out = (request.out or run_dir).resolve()
        check_target(out, config, force=request.force)
        if info.format == HF_FORMAT and env.world_size > 1:
            raise ExportRefused(f"{path} is a standard-backend checkpoint (the whole model in one "
                                f"file set): export it on one process; valid: no srun/torchrun")
        if request.max_shard_bytes is not None and _writes_adapter(config, request.merged):
            raise ExportRefused("--max-shard-size: a PEFT adapter is written as one file; valid: "
                                "leave it out, or --merge-lora for the merged HF model")
        if request.max_shard_bytes is not None and info.format == HF_FORMAT:
            raise ExportRefused("--max-shard-size: a standard-backend checkpoint exports through "
                                "transformers' save_pretrained in the run's shards (5 GiB); valid: "
                                "leave it out")
    except UserError as err:
        err.on_every_rank = True  # every rank read the same files
        raise
    if env.rank == 0:
        print(f"export: {path} (step {info.step}, {_saved_under(info)}) -> {out}", flush=True)
        if request.force:
            clear_export(out)
    if info.format == HF_FORMAT:
        from .export_standard import export_standard

        what = export_standard(config, path, out, merged=request.merged)
    else:
        what = _export_megatron(config, info, path, out, request)
    if env.rank == 0:
        _report_files(out, started)
        print(f"exported {what} of step {info.step} to {out} in {time.perf_counter() - started:.1f} s",
              flush=True)
    return out


def _writes_adapter(config: TrainConfig, merged: bool) -> bool:
    from hpc_mca.models.converters import converter_for

    return converter_for(config.finetuning).trains_adapters and not merged


def _saved_under(info: CheckpointInfo) -> str:
    if info.format == HF_FORMAT:
        return "standard backend"
    lay = info.layout
    sizes = " ".join(f"{name.upper()}{lay[name]}" for name in ("tp", "pp", "vp", "ep", "cp", "dp")
                     if lay.get(name) is not None)
    return f"Megatron-Core, saved under {sizes} on {lay.get('world_size')} rank(s)"


def _report_files(out: Path, started: float) -> None:
    """One line per file of the export, with its size (written since the export started)."""
    for path in sorted(p for p in out.iterdir() if p.is_file()):
        stat = path.stat()
        if stat.st_mtime >= time.time() - (time.perf_counter() - started) - 1:
            print(f"  wrote {path.name} ({human_bytes(stat.st_size)})", flush=True)


# ---- Megatron-Core ----------------------------------------------------------------------------


def _export_megatron(config: TrainConfig, info: CheckpointInfo, path: Path, out: Path,
                     request: ExportRequest) -> str:
    """Build the run's model in the export's layout, load the checkpoint's model weights, and
    write the finetuning type's export with the end-of-run export's code."""
    from hpc_mca.api.model import pretrained_model
    from hpc_mca.api.session import close_session, open_session

    from .export_megatron import export_config, load_weights, write_export

    stamp = time.perf_counter()
    try:
        config = export_config(config, info, request.layout)
        session = open_session(config, checked=True)
    except UserError as err:
        err.on_every_rank = True  # the same config and world on every rank
        raise
    try:
        ctx = session.ctx
        model = pretrained_model(session, config.model.model_name_or_path)
        if ctx.is_main:
            lay = ctx.layout
            print(f"  built the model ({config.finetuning.finetuning_type}) under TP{lay.tp} PP{lay.pp} "
                  f"EP{lay.ep} on {ctx.env.world_size} rank(s), {ctx.device.type}, in "
                  f"{time.perf_counter() - stamp:.1f} s", flush=True)
        stamp = time.perf_counter()
        chunks = load_weights(list(model.models), path)
        if ctx.is_main:
            print(f"  loaded the model weights of {path.name} in {time.perf_counter() - stamp:.1f} s",
                  flush=True)
        return write_export(config, chunks, out, merged=request.merged,
                            max_shard_bytes=request.max_shard_bytes)
    finally:
        close_session()
