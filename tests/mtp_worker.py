"""Rank program of tests/test_mtp_weights.py: build HF checkpoints that hold MTP modules, with
and without MTP layers, in Megatron layouts; export them and measure the MTP loss.

Usage (every rank, under torchrun or as a single process):
    python tests/mtp_worker.py MODELS_DIR OUT_DIR JOBS_JSON

``JOBS_JSON`` is a list of ``{"name", "layout": {...Layout fields}, "runs": [{"model",
"mtp": n, "export": bool, "losses": bool}]}``. With ``export`` the model goes to
``OUT_DIR/<job>/<model>.mtp<n>.export``; with ``losses`` rank 0 writes
``OUT_DIR/<job>/<model>.mtp<n>.losses.json``: for the unpacked rows and the packed stream of
``MODELS_DIR/data.pt``, the MTP depth-1 (summed token loss, token count) over all
context-parallel ranks, as :data:`hpc_mca.models.mtp.MTP_LOSSES` reports them.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def batches(data: dict) -> dict:
    """The unpacked rows and the packed stream of ``data`` as the trainer's PackedBatch."""
    from hpc_mca.data.batch import PackedBatch

    ids, mask = data["rows"], data["row_mask"]
    inputs = ids[:, :-1]
    positions = torch.arange(inputs.size(1)).expand_as(inputs)
    rows = PackedBatch(inputs, ids[:, 1:], mask, positions, torch.ones_like(inputs))
    tokens, labels, masks, pos, docs = [], [], [], [], []
    for number, (doc, slots) in enumerate(zip(data["docs"], data["padded"]), start=1):
        n, pad = len(doc) - 1, slots - (len(doc) - 1)
        tokens.append(torch.cat([doc[:-1], torch.zeros(pad, dtype=doc.dtype)]))
        labels.append(torch.cat([doc[1:], torch.full((pad,), -100, dtype=doc.dtype)]))
        masks.append(torch.cat([torch.ones(n), torch.zeros(pad)]))
        pos.append(torch.arange(slots))
        docs.append(torch.cat([torch.full((n,), number), torch.zeros(pad, dtype=torch.long)]))
    lengths = [len(d) - 1 for d in data["docs"]]
    packed = PackedBatch(torch.cat(tokens)[None], torch.cat(labels)[None], torch.cat(masks)[None],
                         torch.cat(pos)[None], torch.cat(docs)[None],
                         torch.tensor([0, *lengths]).cumsum(0).int(),
                         torch.tensor([0, *data["padded"]]).cumsum(0).int())
    return {"unpacked": rows, "packed": packed}


def mtp_loss(chunks, batch, ctx) -> list[float]:
    """(summed loss, token count) of MTP depth 1 over every context-parallel rank."""
    from megatron.core import parallel_state as mpu

    from hpc_mca.models.mtp import MTP_LOSSES
    from hpc_mca.trainer.step import model_inputs

    share = batch.cp_shard(mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank())
    inputs = model_inputs(share, ctx.device)
    chunk = chunks[0]
    chunk.eval()
    MTP_LOSSES.take(1, ctx.device)
    with torch.no_grad():
        chunk(inputs["input_ids"], inputs["position_ids"], None, labels=inputs["labels"],
              loss_mask=inputs["loss_mask"], packed_seq_params=inputs["packed_seq_params"])
    sums = MTP_LOSSES.take(1, ctx.device)
    if mpu.get_tensor_model_parallel_rank() != 0:
        sums.zero_()  # every TP rank reports the same sums
    dist.all_reduce(sums)
    return [float(v) for v in sums[0]]


def run(job: dict, spec: dict, models: Path, out: Path, ctx) -> None:
    from hpc_mca.models.build import build_model
    from hpc_mca.models.export import save_hf_checkpoint

    source = models / spec["model"]
    overrides = {"mtp_num_layers": spec["mtp"]} if spec["mtp"] else None
    chunks = build_model(source, ctx, config_overrides=overrides)
    stem = f"{spec['model']}.mtp{spec['mtp']}"
    if spec.get("losses"):
        data = batches(torch.load(models / "data.pt"))
        losses = {name: mtp_loss(chunks, batch, ctx) for name, batch in data.items()}
        if dist.get_rank() == 0:
            (out / f"{stem}.losses.json").write_text(json.dumps(losses))
    if spec.get("export"):
        save_hf_checkpoint(chunks, out / f"{stem}.export", source)


def main(models: Path, out_root: Path, jobs: list[dict]) -> None:
    from hpc_mca.runtime.distributed import init_distributed, shutdown
    from hpc_mca.topology import Layout

    for job in jobs:
        ctx = init_distributed(Layout(**job["layout"]))
        out = out_root / job["name"]
        out.mkdir(parents=True, exist_ok=True)
        for spec in job["runs"]:
            run(job, spec, models, out, ctx)
    shutdown()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
