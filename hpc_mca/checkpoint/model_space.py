"""The distributed optimizer's state in model space, written by the rank that holds it.

Megatron's distributed optimizer keeps, on each data-parallel rank, a contiguous slice of every
gradient bucket: for each parameter, a flat range ``[start, stop)`` of its (TP-local) elements,
with the fp32 main weight and the Adam moments of exactly that range. Megatron offers two ways
to checkpoint that state, and each costs something here:

* ``fully_reshardable`` all-gathers every rank's slices over DP into whole model-space tensors
  before writing (a copy of the full optimizer state on every DP rank, and the gather itself:
  two thirds of the 1.1 s save of a 405 MB checkpoint on 2 CPU ranks); on load every rank
  reads the whole tensors again and slices;
* ``dp_reshardable`` writes the bucket slices as they are, with no gather, but in bucket space:
  a resume may change DP only.

``model_space`` (this module) writes the slices as they are AND in model space. A flat range of
a row-major tensor is a union of at most ``2 * ndim - 1`` boxes (a partial first row, whole
rows, a partial last row; recursively for more dimensions), each contiguous in memory; each box
becomes a ShardedTensor of the parameter's global (TP/PP/EP-assembled) tensor at its own global
offset. Boxes of different ranks never overlap and together tile each tensor, so there is no
gather and no copy on save, and any later layout (TP/PP/EP/DP) reads exactly the boxes it needs:
torch.distributed.checkpoint resolves the overlaps of saved and wanted boxes. Megatron-Core 0.19
supports such uneven shards (``axis_fragmentations=None``) on torch >= 2.6 and defers their
validation to torch DCP; it no longer supports ``flattened_range``, which its own deprecated
``fully_sharded_model_space`` format depended on.

The optimizer's common state (param groups with the step, grad scaler) is Megatron's own
``DistributedOptimizer.state_dict()``, stored once, as for the other formats.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

FORMAT = "model_space"
Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a box inside a tensor."""


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes that tile the row-major flat range ``[start, stop)`` of a tensor of ``shape``, in
    flat order; each is contiguous in memory, so box i is the next ``prod(sizes)`` elements."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = len(shape) - 1
    (row0, col0), (row1, col1) = divmod(start, inner), divmod(stop, inner)

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *off), (1, *size)) for off, size in flat_boxes(shape[1:], lo, hi)]

    if row0 == row1:
        return in_row(row0, col0, col1)
    boxes = []
    if col0:
        boxes += in_row(row0, col0, inner)
        row0 += 1
    if row1 > row0:
        boxes.append(((row0, *[0] * rest), (row1 - row0, *shape[1:])))
    if col1:
        boxes += in_row(row1, 0, col1)
    return boxes


@dataclass
class _Piece:
    """One model-space ShardedTensor of a parameter (a parameter may have several, e.g. the
    gate and up halves of a SwiGLU fc1), placed in the parameter's flat local elements."""

    shard: Any  # megatron ShardedTensor whose data is a contiguous view of the parameter
    offset: int  # its first element, counted in the parameter's elements


def _leaves(item: object) -> Iterator[object]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        yield from _leaves(item.build())
    elif isinstance(item, dict):
        for value in item.values():
            yield from _leaves(value)
    elif isinstance(item, (list, tuple)):
        for value in item:
            yield from _leaves(value)
    else:
        yield item


def _pieces_by_param(model_state: dict[str, Any]) -> dict[int, list[_Piece]]:
    """id(parameter) -> its model-space pieces, from the model's sharded state dict (factories
    are built: their pieces are views of the parameter, located by storage offset)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    pieces: dict[int, list[_Piece]] = {}
    for item in nested_values(model_state):
        if not isinstance(item, (ShardedTensor, ShardedTensorFactory)):
            continue
        param = item.data
        for shard in _leaves(item):
            if not isinstance(shard, ShardedTensor):
                continue
            data = shard.data
            same = data.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
            if not (same and data.is_contiguous()):
                raise RuntimeError(f"optimizer format {FORMAT}: the sharded tensor {shard.key} "
                                   "is not a contiguous view of its parameter; use "
                                   "training.save_optimizer_format=fully_reshardable")
            pieces.setdefault(id(param), []).append(
                _Piece(shard, data.storage_offset() - param.storage_offset()))
    return pieces


def _box_tensor(piece: _Piece, key: str, flat: torch.Tensor, box: Box, instance: int) -> Any:
    """A ShardedTensor under ``key`` for ``flat`` (the elements of one box of ``piece``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shard = piece.shard
    lead = shard.prepend_axis_num
    offsets, sizes = box
    replica = shard.replica_id
    if not (isinstance(replica, tuple) and len(replica) == 3):
        raise RuntimeError(f"optimizer format {FORMAT}: unexpected replica id {replica!r} of "
                           f"{shard.key} (want (PP, TP, DP))")
    # Prepended axes (the layer index of stacked layers, the expert index) become leading
    # size-1 dimensions of the box itself: torch DCP takes an uneven shard's local shape as its
    # chunk size, which must have as many dimensions as the global tensor.
    local_shape = (1,) * lead + tuple(sizes)
    return ShardedTensor(
        key=key, data=flat.view(local_shape), dtype=flat.dtype, local_shape=local_shape,
        global_shape=shard.global_shape,
        global_offset=(*shard.global_offset[:lead],
                       *(g + o for g, o in zip(shard.global_offset[lead:], offsets))),
        axis_fragmentations=None,
        # Each DP rank holds other boxes: the DP coordinate is the optimizer instance, while
        # TP-replicated parameters (norms) and tied copies (PP) stay non-main replicas.
        replica_id=(*replica[:2], instance), prepend_axis_num=0,
        allow_shape_mismatch=shard.allow_shape_mismatch)


def _param_ranges(optimizer: DistributedOptimizer) -> Iterator[tuple[torch.nn.Parameter, int, int]]:
    """(model parameter, start, stop) of this DP rank's slice of every parameter, in the
    optimizer's fixed bucket order."""
    for gbuf_range_maps in optimizer.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for param, ranges in bucket["param_map"].items():
                    yield param, ranges["param"].start, ranges["param"].end


def _states(optimizer: DistributedOptimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The 1-D tensors (main weight and moments) of ``param``'s slice, named as in the file."""
    tensors = optimizer._get_main_param_and_optimizer_states(param)
    tensors.pop("step", None)  # a 0-d count, kept in the param groups (common state)
    tensors["fp32_param"] = tensors.pop("param")
    return {name: tensors[name].view(-1) for name in sorted(tensors)}


def _box_layout(pieces: list[_Piece], start: int, stop: int) -> Iterator[tuple[_Piece, int, Box]]:
    """(piece, position in the slice, box) for the boxes of slice ``[start, stop)``."""
    for piece in pieces:
        numel = piece.shard.data.numel()
        lo, hi = max(start, piece.offset), min(stop, piece.offset + numel)
        position = lo - start
        for box in flat_boxes(tuple(piece.shard.local_shape), lo - piece.offset, hi - piece.offset):
            yield piece, position, box
            position += math.prod(box[1])


def param_state(optimizer: DistributedOptimizer, model_state: dict[str, Any]) -> dict[str, Any]:
    """Sharded state of a DistributedOptimizer's parameter state: ``{index: {name: [boxes]}}``
    whose ShardedTensors are views of the live state (the same structure serves as the load
    template; :func:`load_param_state` copies what was read into place)."""
    pieces = _pieces_by_param(model_state)
    instance = getattr(optimizer, "distributed_optimizer_instance_id", 0)
    state: dict[str, Any] = {}
    for index, (param, start, stop) in enumerate(_param_ranges(optimizer)):
        if id(param) not in pieces:
            raise RuntimeError(f"optimizer format {FORMAT}: a parameter of shape "
                               f"{tuple(param.shape)} has no entry in the model's sharded "
                               "state dict")
        entry: dict[str, list[Any]] = {}
        for name, flat in _states(optimizer, param).items():
            entry[name] = [
                _box_tensor(piece, f"optimizer.state.{name}.{piece.shard.key}",
                            flat[pos:pos + math.prod(box[1])], box, instance)
                for piece, pos, box in _box_layout(pieces[id(param)], start, stop)]
        state[str(index)] = entry
    return state


def load_param_state(optimizer: DistributedOptimizer, loaded: dict[str, Any], model_state: dict[str, Any]) -> None:
    """Put loaded boxes (the tensors :func:`param_state`'s template was filled with) back into
    the optimizer's state."""
    pieces = _pieces_by_param(model_state)
    aware = getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
    for index, (param, start, stop) in enumerate(_param_ranges(optimizer)):
        entry = loaded[str(index)]
        states = _states(optimizer, param)
        layout = list(_box_layout(pieces[id(param)], start, stop))
        for name, flat in states.items():
            for (_, pos, box), tensor in zip(layout, entry[name], strict=True):
                target = flat[pos:pos + math.prod(box[1])]
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor.reshape(-1))
        if aware:  # the state was an unscaled copy: scale it back in
            states["param"] = states.pop("fp32_param")
            optimizer._set_main_param_and_optimizer_states(param, {**states, "step": None})
