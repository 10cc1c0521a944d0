"""``hpc-mca export RUN_OR_CHECKPOINT [--to DIR] [--merge-lora]``: a run's checkpoint as a
Hugging Face model (or PEFT adapter), after the run."""

from __future__ import annotations

from pathlib import Path

import click

from ._rank_errors import exit_bad_input


@click.command()
@click.argument("run_or_checkpoint", type=click.Path(path_type=Path))
@click.option("--to", "out", type=click.Path(path_type=Path), default=None,
              help="Where the export goes; default: the run directory (where the run's own export "
                   "lands). A directory that already holds an export is refused unless --force.")
@click.option("--merge-lora", is_flag=True,
              help="LoRA runs: the base model with the adapters merged in, instead of the PEFT adapter.")
@click.option("--max-shard-size", default=None,
              help="Largest safetensors file of an HF model export, as transformers reads it (5GB, "
                   "500MB, 2GiB, bytes); default: the run's own, 5GiB.")
@click.option("--force", is_flag=True, help="Replace the export already in the target directory.")
@click.option("--tp", type=int, default=None, help="Under srun/torchrun: the export's tensor-parallel size.")
@click.option("--pp", type=int, default=None, help="Under srun/torchrun: the export's pipeline-parallel size.")
@click.option("--vp", type=int, default=None, help="Under srun/torchrun: the export's virtual-pipeline size.")
@click.option("--ep", type=int, default=None, help="Under srun/torchrun: the export's expert-parallel size.")
def export(run_or_checkpoint: Path, out: Path | None, merge_lora: bool, max_shard_size: str | None,
           force: bool, tp: int | None, pp: int | None, vp: int | None, ep: int | None) -> None:
    """Export RUN_OR_CHECKPOINT (a run directory: its latest complete checkpoint; or one
    checkpoints/iter_NNNNNNN) as the run's own end-of-run export would be: the HF model
    (sharded safetensors with their index, config, tokenizer and generation config), or the PEFT
    adapter of a LoRA run (--merge-lora: the merged model).

    Any checkpoint of either backend, saved under any TP/PP/EP/VP layout. On one process (a login
    node, no GPU) the model is built under TP1 PP1 EP1 in memory; for models too large for one host
    run it under srun or torchrun: the ranks then take the checkpoint's own TP/PP/VP/EP (the rest
    of the world replicating it) unless --tp/--pp/--vp/--ep say otherwise. A partial checkpoint, a
    model that cannot be built, --merge-lora without adapters: refused in one line, exit 2.
    """
    from hpc_mca.runtime.quiet import quiet_library_noise

    quiet_library_noise()  # before megatron is imported
    from hpc_mca.errors import UserError
    from hpc_mca.launch.export import ExportRequest, export_checkpoint
    from hpc_mca.launch.export_checks import ExportRefused, parse_size

    layout = {key: value for key, value in (("tp", tp), ("pp", pp), ("vp", vp), ("ep", ep)) if value is not None}
    try:
        bad = [f"--{key}={value}" for key, value in layout.items() if value < 1]
        if bad:
            raise ExportRefused(f"{', '.join(bad)}: a parallel size is at least 1")
        request = ExportRequest(run_or_checkpoint, out, merge_lora,
                                parse_size(max_shard_size) if max_shard_size is not None else None,
                                layout, force)
        export_checkpoint(request)
    except UserError as err:
        exit_bad_input("export", err)
