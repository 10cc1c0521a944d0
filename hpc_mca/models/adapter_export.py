"""Export LoRA adapters, from any TP/PP/EP/DP layout, as a standard PEFT adapter directory.

The directory holds what ``peft.PeftModel.from_pretrained`` reads onto the transformers model:
``adapter_config.json`` (peft's own ``LoraConfig``: rank, alpha, dropout, the HF target
modules and, for MoE experts, target parameters, the base model's path) and
``adapter_model.safetensors`` with peft's tensor names
(``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``), and the base model's
tokenizer files and generation config, as every export has them
(:func:`~hpc_mca.models.export.write_companion_files`).

Every rank runs :func:`save_peft_adapter`. Each adapter tensor is a set of pieces of an HF
adapter tensor, as for the base weights (:mod:`.mapping`), assembled on rank 0 by
:func:`~hpc_mca.models.export.export_tensors`:

* column-parallel bases: A is whole (TP rank 0 sends it), B holds this rank's rows;
* row-parallel bases: A holds this rank's input columns, B is whole;
* one sender per piece: the first (expert-)data-parallel replica.

transformers keeps an MoE layer's experts as 3-D parameters, and peft adapts them with one
``ParamWrapper`` per parameter (nested when both are targeted), whose factors stack the
experts: A as ``[E * r, in]`` (expert-major rows), B as ``[out, r * E]`` (column ``k * E + e``
is expert e's k-th). Experts are assembled one by one and stacked that way on rank 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hpc_mca.config.sections import FinetuningArguments
from hpc_mca.models.export import ExportItem, export_tensors, write_companion_files
from hpc_mca.models.hf_config import HFModelSpec
from hpc_mca.models.lora import MegatronLoraLinear, lora_alpha, lora_layers
from hpc_mca.models.mapping import Piece, ShardCoords
from hpc_mca.models.vl_config import LORA_EXCLUDED, lora_module_name
from hpc_mca.models.weights import shard_coords, unwrap
from hpc_mca.topology.lora import LoraTargets

if TYPE_CHECKING:  # peft is imported lazily, inside the function that uses it
    from peft import LoraConfig

__all__ = ["ADAPTER_FILE", "layer_pieces", "save_peft_adapter"]

ADAPTER_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def save_peft_adapter(chunks: Sequence[torch.nn.Module], out_dir: str | Path, spec: HFModelSpec,
                      targets: LoraTargets, finetuning: FinetuningArguments, base_model: str) -> None:
    """Write the adapters of ``chunks`` as a PEFT adapter directory (every rank calls it).
    ``finetuning``: the run's FinetuningArguments; ``base_model``: recorded as the adapter's
    ``base_model_name_or_path``."""
    import torch.distributed as dist

    items: list[ExportItem] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for chunk in chunks:
        coords = shard_coords(unwrap(chunk))
        for _, layer in lora_layers([chunk]):
            for name, shape, piece, param, owner in layer_pieces(layer, coords, spec.num_experts):
                shapes[name] = shape
                if owner:
                    items.append(ExportItem(piece, param))
    # Every rank must agree on the tensors' order: each gathers the others' names.
    shapes = _all_shapes(shapes)
    tensors: dict[str, torch.Tensor] = {}
    export_tensors(items, shapes, torch.float32, tensors.__setitem__ if _rank() == 0 else None)
    if _rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        _save_lora_config(_lora_config(spec, targets, finetuning, base_model), out)
        from safetensors.torch import save_file

        save_file(_peft_tensors(tensors, targets, spec), str(out / ADAPTER_FILE),
                  metadata={"format": "pt"})
        if spec.directory is not None:
            write_companion_files(out, spec.directory)
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _all_shapes(mine: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every rank's adapter tensors, in one agreed (sorted) order."""
    import torch.distributed as dist

    merged = dict(mine)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for shapes in everyone:
            merged.update(shapes)
    return dict(sorted(merged.items()))


def layer_pieces(layer: MegatronLoraLinear, coords: ShardCoords, num_experts: int
                  ) -> Iterator[tuple[str, tuple[int, ...], Piece, torch.Tensor, bool]]:
    """(HF adapter tensor, its shape, this rank's piece, the parameter, whether this rank
    sends it) for every adapter weight of ``layer``; experts' tensors are per expert
    (``...experts.gate_up_proj[3].lora_A``), stacked later."""
    site, base = layer.site, layer.base_linear
    expert = site.expert is not None
    tp_rank, tp_size = (coords.etp_rank, coords.etp_size) if expert else (coords.tp_rank, coords.tp_size)
    first_replica = (coords.edp_rank if expert else coords.dp_rank) == 0
    b_factors = layer.factors("B", "default")
    for part, a in layer.factors("A", "default").items():
        b = b_factors[part]
        name = site.hf_name(part)
        r = a.weight.shape[0]
        if layer.column:
            rows = b.weight.shape[0] * tp_size
            yield (f"{name}.lora_A", (r, base.input_size), Piece(f"{name}.lora_A"), a.weight,
                   first_replica and tp_rank == 0)
            for piece in _row_pieces(f"{name}.lora_B", site.kind, b.weight.shape[0], tp_rank, tp_size):
                yield f"{name}.lora_B", (rows, r), piece, b.weight, first_replica
        else:
            cols = a.weight.shape[1]
            yield (f"{name}.lora_A", (r, cols * tp_size),
                   Piece(f"{name}.lora_A", 1, tp_rank * cols, (tp_rank + 1) * cols, 0), a.weight,
                   first_replica)
            yield (f"{name}.lora_B", (base.output_size, r), Piece(f"{name}.lora_B"), b.weight,
                   first_replica and tp_rank == 0)


def _row_pieces(name: str, kind: str, local: int, rank: int, size: int) -> tuple[Piece, ...]:
    """This rank's rows of a column-parallel B: contiguous in HF, except an expert's fused
    gate/up B, whose local rows are [gate rows of this rank; up rows of this rank]."""
    if kind != "expert_fc1":
        return (Piece(name, 0, rank * local, (rank + 1) * local, 0),)
    half, width = local // 2, local // 2 * size
    return (Piece(name, 0, rank * half, (rank + 1) * half, 0),
            Piece(name, 0, width + rank * half, width + (rank + 1) * half, half))


def _peft_tensors(tensors: dict[str, torch.Tensor], targets: LoraTargets,
                  spec: HFModelSpec) -> dict[str, torch.Tensor]:
    """Assembled adapter tensors under peft's names (experts stacked as peft stacks them)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    vl = spec.vision is not None  # its language model's modules are under model.language_model
    for name, tensor in tensors.items():
        if "[" not in name:
            out[f"{_PEFT_PREFIX}{lora_module_name(name, vl)}.weight"] = tensor.contiguous()
            continue
        module, rest = name.split("[", 1)
        index, factor = rest.split("].")
        experts.setdefault((module, factor), {})[int(index)] = tensor
    wrapped = targets.hf_parameters(spec.moe_prefix)
    for (module, factor), per_expert in experts.items():
        stack = [per_expert[e] for e in range(spec.num_experts)]
        if factor == "lora_A":
            fused = torch.cat(stack, dim=0)  # [E * r, in], expert-major
        else:
            fused = torch.stack(stack, dim=-1).flatten(-2)  # [out, r * E], column k * E + e
        parent, param = module.rsplit(".", 2)[0], module.rsplit(".", 1)[1]
        # peft nests one wrapper per targeted parameter, the last targeted outermost.
        order = [w.rsplit(".", 1)[1] for w in wrapped]
        depth = len(order) - 1 - order.index(param)
        out[f"{_PEFT_PREFIX}{parent}.experts.{'base_layer.' * depth}{factor}.weight"] = fused.contiguous()
    return out


def _lora_config(spec: HFModelSpec, targets: LoraTargets, finetuning: FinetuningArguments,
                 base_model: str) -> LoraConfig:
    from peft import LoraConfig

    parameters = targets.hf_parameters(spec.moe_prefix)
    # lora_alpha: peft annotates int but takes any number (written as given to adapter_config.json).
    return LoraConfig(r=finetuning.lora_rank, lora_alpha=lora_alpha(finetuning),  # type: ignore[arg-type]
                      lora_dropout=finetuning.lora_dropout,
                      target_modules=targets.hf_modules() or None,
                      target_parameters=parameters or None, bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_model,
                      exclude_modules=LORA_EXCLUDED if spec.vision is not None else None)


def _save_lora_config(config: LoraConfig, out: Path) -> None:
    """peft's adapter_config.json, with the lists peft writes from sets (target_modules) sorted:
    peft writes a set in its iteration order, which follows the process's string hash seed,
    so two exports of the same adapter would differ (``hpc-mca export`` must equal the run's)."""
    config.save_pretrained(str(out))
    path = out / "adapter_config.json"
    written = json.loads(path.read_text())
    for key, value in config.to_dict().items():
        if isinstance(value, set):
            written[key] = sorted(value)
    path.write_text(json.dumps(written, indent=2, sort_keys=True))  # peft's own layout


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """adapter_config.json of an exported adapter, as a dict."""
    return json.loads((directory / "adapter_config.json").read_text())
