"""Import Hugging Face safetensors weights into the local Megatron model chunks of a rank.

Every parameter of every chunk gets a :class:`~hpc_mca.models.mapping.ParamPlan` (which pieces
of which HF tensors it holds, given this rank's TP/EP/expert-TP coordinates and the global
index of the layer it belongs to); the pieces are read with ``get_slice`` from the shards that
hold them and copied into the parameter, converting dtype and device on the way. A parameter
no plan covers, or a piece whose shape disagrees with its slot, is an error rather than a
silently random weight.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hpc_mca.models.checkpoint import HFCheckpoint, SliceReader, inspect_checkpoint
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import HFModelSpec, read_hf_config
from hpc_mca.models.mapping import ParamPlan, Piece, ShardCoords, plan_param

if TYPE_CHECKING:  # megatron is imported lazily, by the modules that build the chunks
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from torch.distributed import ProcessGroup

__all__ = ["load_hf_weights", "local_plans", "shard_coords", "unwrap"]

_LAYER_INDEX = re.compile(r"decoder\.layers\.(\d+)\.")
_MTP_INDEX = re.compile(r"mtp\.layers\.(\d+)\.")


def _rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return group.rank(), group.size()


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (their parameter names gain
    ``module.`` prefixes that the mapping does not know)."""
    model: torch.nn.Module | DistributedDataParallel | Float16Module = chunk
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def shard_coords(chunk: GPTModel) -> ShardCoords:
    """This rank's weight coordinates, from the process groups the chunk was built with."""
    pg = chunk.pg_collection
    tp_rank, tp_size = _rank_and_size(pg.tp)
    ep_rank, ep_size = _rank_and_size(getattr(pg, "ep", None))
    etp_rank, etp_size = _rank_and_size(getattr(pg, "expt_tp", None))
    dp_rank, _ = _rank_and_size(getattr(pg, "dp_cp", None))
    edp_rank, _ = _rank_and_size(getattr(pg, "expt_dp", None))
    return ShardCoords(
        padded_vocab_size=chunk.vocab_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        ep_rank=ep_rank,
        ep_size=ep_size,
        etp_rank=etp_rank,
        etp_size=etp_size,
        dp_rank=dp_rank,
        edp_rank=edp_rank,
    )


_EMBEDDING = "embedding.word_embeddings.weight"


_EXPERT_BIAS = "mlp.router.expert_bias"


def _named_tensors(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The chunk's parameters, then the buffers that hold HF tensors: a sigmoid router's
    expert bias (transformers' ``e_score_correction_bias``, a buffer on both sides)."""
    yield from chunk.named_parameters()
    for name, buffer in chunk.named_buffers():
        if name.endswith(_EXPERT_BIAS) and buffer is not None:
            yield name, buffer


def local_plans(
    chunk: torch.nn.Module, spec: HFModelSpec
) -> Iterator[tuple[ParamPlan, torch.Tensor]]:
    """(plan, tensor) for every base-model parameter of one GPTModel chunk (its MTP layers
    too where the checkpoint holds their modules, ``spec.mtp_layers``; not LoRA adapters; a
    LoRA layer's base linear under its own name), and for the buffers that hold HF tensors
    (:func:`_named_tensors`).

    Layers are numbered model-wide through ``layer_number`` (1-based, set by Megatron from the
    pipeline/virtual-pipeline offset), which also covers uneven pipeline layouts.
    """
    chunk = unwrap(chunk)
    coords = shard_coords(chunk)
    layers = getattr(getattr(chunk, "decoder", None), "layers", [])
    global_index = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    for name, param in _named_tensors(chunk):
        if ".lora_" in name:
            continue  # not part of the base model (models.adapter_export writes them)
        mtp = _MTP_INDEX.match(name)
        if mtp is not None and int(mtp.group(1)) >= spec.mtp_layers:
            continue  # no HF module for this MTP layer: models.mtp.initialise fills it
        name = name.replace(".base_layer.", ".")  # a linear inside its LoRA layer
        match = _LAYER_INDEX.match(name)
        layer = global_index[int(match.group(1))] if match else None
        plan = plan_param(spec, coords, name, layer)
        if name == _EMBEDDING and not getattr(chunk, "pre_process", True):
            # The last stage's copy for its MTP layers: imported like the first stage's, the
            # same tensor after every step (Megatron all-reduces their gradients), exported
            # from the first stage alone.
            plan = dataclasses.replace(plan, exported=False)
        yield plan, param


def load_hf_weights(
    chunks: Sequence[torch.nn.Module],
    source: str | Path | HFModelSpec,
    *,
    checkpoint: HFCheckpoint | None = None,
) -> list[str]:
    """Fill every parameter of ``chunks`` from the HF checkpoint at ``source``.

    Returns the shard files this rank opened (only those holding pieces it needs).
    """
    spec = source if isinstance(source, HFModelSpec) else read_hf_config(source)
    ckpt = checkpoint or inspect_checkpoint(spec.stored())
    with SliceReader(ckpt) as files, torch.no_grad():
        reader = files if spec.stored_vocab_size is None else _GrownReader(files, spec)
        for chunk in chunks:
            for plan, param in local_plans(chunk, spec):
                _fill(param, plan, reader, ckpt)
        return files.opened


_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


class _GrownReader:
    """The checkpoint's pieces, except that the embedding and output layer have the grown
    vocabulary's rows (``model.resize_vocab``): computed once from the whole stored matrices,
    identically on every rank (:func:`hpc_mca.models.vocab.grown_rows`), and sliced as the
    files are."""

    def __init__(self, files: SliceReader, spec: HFModelSpec) -> None:
        self.files, self.spec = files, spec
        self.grown: dict[str, torch.Tensor] = {}

    def read(self, piece: Piece) -> torch.Tensor:
        if piece.hf_name not in _VOCAB_TENSORS:
            return self.files.read(piece)
        if not self.grown:
            self._grow()
        tensor = self.grown[piece.hf_name]
        if piece.dim is None:
            return tensor
        return tensor.narrow(piece.dim, piece.hf_start, piece.length)

    def _grow(self) -> None:
        from hpc_mca.models.vocab import grown_rows
        from hpc_mca.models.vocab_growth import vocab_growth

        growth = vocab_growth(self.spec.directory) if self.spec.directory is not None else None
        if growth is None:
            raise ModelLoadError(f"{self.spec.source}: vocab_size {self.spec.vocab_size} was grown "
                                 "but no growth is recorded for this directory")
        embed = self.files.read(Piece(_VOCAB_TENSORS[0]))
        head = None if self.spec.tie_word_embeddings else self.files.read(Piece(_VOCAB_TENSORS[1]))
        embed, head = grown_rows(embed, head, self.spec.vocab_size, growth.seed)
        self.grown[_VOCAB_TENSORS[0]] = embed
        if head is not None:
            self.grown[_VOCAB_TENSORS[1]] = head


def _fill(
    param: torch.Tensor, plan: ParamPlan, reader: SliceReader | _GrownReader, ckpt: HFCheckpoint
) -> None:
    if plan.padded:
        param.zero_()  # vocabulary padding rows: never a real token, never a real logit
    filled = 0
    for piece in plan.pieces:
        source = reader.read(piece)
        target = param if piece.dim is None else param.narrow(piece.dim, piece.local_start,
                                                              piece.length)
        if target.shape != source.shape:
            raise ModelLoadError(
                f"{ckpt.path_of(piece.hf_name)}: tensor {piece.hf_name} slice "
                f"[{piece.hf_start}:{piece.hf_stop}] has shape {list(source.shape)} but "
                f"Megatron parameter {plan.name} expects {list(target.shape)}"
            )
        target.copy_(source)
        filled += source.numel()
    if filled != param.numel() and not plan.padded:
        raise ModelLoadError(
            f"Megatron parameter {plan.name}: the checkpoint covers {filled} of its "
            f"{param.numel()} elements"
        )
