"""Rank program of tests/test_vl_models.py: build VL models in Megatron layouts and report.

Usage (every rank, under torchrun or as a single process):
    python tests/vl_models_worker.py MODELS_DIR OUT_DIR JOBS_JSON

``MODELS_DIR`` holds one HF directory per model and ``inputs.pt`` (input_ids [2, S],
pixel_values, image_grid_thw, mrope position_ids [3, 2, S]); ``JOBS_JSON`` is a list of
``{"name", "layout": {...Layout fields}, "models": [...], "overrides": {...}, "export": bool,
"packed": bool}``. The rank holding the full logits saves ``OUT_DIR/<job>/<model>.logits.pt``;
``packed`` saves the two rows run as one packed (THD) stream, without and with per-document
padding (``.packed.pt``); ``export`` writes the model back to ``OUT_DIR/<job>/<model>.export``;
``grads`` saves the gradients of the vision tower for a fixed linear loss of the logits.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def _holder() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0 and \
        parallel_state.get_tensor_model_parallel_rank() == 0


def packed_rows(chunks, inputs: dict, vocab: int) -> torch.Tensor | None:
    """The batch's rows as one THD stream (positions restart per row, as the data side packs
    them): logits [2, S, V] unpadded and [2, S, V] with 2 random padding slots after each row."""
    from hpc_mca.models.inference import forward_logits, thd_packed_seq_params

    device = next(chunks[0].parameters()).device
    ids, pos = inputs["input_ids"], inputs["position_ids"]
    rows, length = ids.shape
    images = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
    cu = (torch.arange(rows + 1) * length).to(device)
    out = forward_logits(chunks, ids.reshape(1, -1), vocab, position_ids=pos.reshape(3, 1, -1),
                         packed_seq_params=thd_packed_seq_params(cu), model_inputs=images)
    pad = 2
    filler = torch.randint(0, 100, (rows, pad), generator=torch.Generator().manual_seed(5))
    padded_ids = torch.cat([ids, filler], dim=1).reshape(1, -1)
    padded_pos = torch.cat([pos, torch.zeros(3, rows, pad, dtype=pos.dtype)], dim=2).reshape(3, 1, -1)
    cu_pad = (torch.arange(rows + 1) * (length + pad)).to(device)
    out_pad = forward_logits(chunks, padded_ids, vocab, position_ids=padded_pos,
                             packed_seq_params=thd_packed_seq_params(cu, cu_pad), model_inputs=images)
    if out is None or out_pad is None:
        return None
    return torch.stack([out.reshape(rows, length, -1),
                        out_pad.reshape(rows, length + pad, -1)[:, :length]])


def tower_grads(chunks, inputs: dict, vocab: int) -> dict[str, torch.Tensor] | None:
    """Gradients of the vision tower (first stage) for sum(logits * w), one training step's
    backward through the pipeline schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    weights = torch.randn(*inputs["input_ids"].shape, vocab, generator=torch.Generator().manual_seed(9))

    def step(iterator, model):
        data = next(iterator)
        output = model(data["input_ids"], data["position_ids"], None,
                       pixel_values=data["pixel_values"], image_grid_thw=data["image_grid_thw"])

        def loss(logits):
            full = gather_from_tensor_model_parallel_region(logits, group=model.pg_collection.tp)
            value = (full[..., :vocab] * weights).sum()
            return value, {}

        return output, loss

    for chunk in chunks:
        chunk.zero_grad()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([inputs]),
                                model=chunks[0], num_microbatches=1,
                                seq_length=inputs["input_ids"].size(1),
                                micro_batch_size=inputs["input_ids"].size(0), forward_only=False)
    tower = chunks[0].visual
    if tower is None:
        return None
    return {name: param.grad.detach().clone() for name, param in tower.named_parameters()}


def run_model(job: dict, model: str, models: Path, out: Path, ctx) -> None:
    from hpc_mca.models.build import build_model
    from hpc_mca.models.export import save_hf_checkpoint
    from hpc_mca.models.inference import forward_logits

    source = models / model
    inputs = torch.load(models / "inputs.pt")
    vocab = 200
    chunks = build_model(source, ctx, config_overrides=job.get("overrides"))
    images = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
    logits = forward_logits(chunks, inputs["input_ids"], vocab,
                            position_ids=inputs["position_ids"], model_inputs=images)
    if logits is not None and _holder():
        torch.save(logits.cpu(), out / f"{model}.logits.pt")
    if job.get("packed"):
        packed = packed_rows(chunks, inputs, vocab)
        if packed is not None and _holder():
            torch.save(packed.cpu(), out / f"{model}.packed.pt")
    if job.get("grads"):
        grads = tower_grads(chunks, inputs, vocab)
        if grads is not None and _holder():
            torch.save(grads, out / f"{model}.grads.pt")
    if job.get("export"):
        save_hf_checkpoint(chunks, out / f"{model}.export", source)


def main(models: Path, out_root: Path, jobs: list[dict]) -> None:
    from hpc_mca.runtime.distributed import init_distributed, shutdown
    from hpc_mca.topology import Layout

    for job in jobs:
        ctx = init_distributed(Layout(**job["layout"]))
        out = out_root / job["name"]
        out.mkdir(parents=True, exist_ok=True)
        for model in job["models"]:
            run_model(job, model, models, out, ctx)
        dist.barrier()
    shutdown()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
