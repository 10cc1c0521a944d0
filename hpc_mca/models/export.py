"""Export Megatron model chunks, in any TP/PP/EP/VP layout, to a Hugging Face directory.

Every rank runs :func:`save_hf_checkpoint`. The same plans that import weights
(:func:`~hpc_mca.models.weights.local_plans`) say which slice of which HF tensor each rank
holds; each HF element has exactly one exporting rank (see :mod:`.mapping`). After one
``all_gather_object`` of that (small) metadata, every rank checks that the pieces tile each HF
tensor exactly - so a bad plan fails on all ranks alike instead of hanging one of them - and
then rank 0 assembles the tensors one at a time in file order, receiving each remote piece with
a point-to-point ``recv`` while the owners ``send`` their pieces in the same order. Rank 0
holds at most one output shard plus one tensor, no rank ever materialises the whole model.

The directory gets ``config.json`` (the source config, with the dtype updated), safetensors
files (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` beyond ``max_shard_bytes``) in transformers' own naming, so
``AutoModelForCausalLM.from_pretrained`` loads it, and the files every export of either
backend has beside its weights (:func:`write_companion_files`).

MTP modules (deepseek_v3, glm4_moe): the model's MTP layers are written as HF layers
``num_hidden_layers + k``, their copies of the vocabulary matrices from the main embedding and
head; modules the source checkpoint holds past the model's MTP layers (a run without them) are
copied from the source files unchanged, so that such a checkpoint round-trips whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_mca.models.checkpoint import INDEX_FILE, SINGLE_FILE
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import MTP_TYPES, HFModelSpec, read_hf_config
from hpc_mca.models.hf_files import file_key
from hpc_mca.models.mapping import MTP_COPIES, Piece, hf_tensor_shapes, mtp_prefix
from hpc_mca.models.vl_config import NESTED_KEY_TYPES
from hpc_mca.models.weights import local_plans, unwrap

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "GENERATION_CONFIG", "TOKENIZER_FILES", "ExportItem",
           "SourceItem", "export_spec", "export_tensors", "mtp_export_note", "save_hf_checkpoint",
           "write_companion_files"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",  # a VL model's image processor
    "processor_config.json",
    "video_preprocessor_config.json",
)
"""Files copied from the source model directory when present."""

GENERATION_CONFIG = "generation_config.json"

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


@dataclass(frozen=True)
class ExportItem:
    """One piece this rank exports: where it goes and the parameter it comes from."""

    piece: Piece
    param: torch.Tensor

    def tensor(self) -> torch.Tensor:
        p = self.piece
        data = self.param.detach()
        return data if p.dim is None else data.narrow(p.dim, p.local_start, p.length)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor().shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype


@dataclass(frozen=True)
class SourceItem:
    """A whole tensor copied from the source checkpoint (rank 0 reads it when it is written,
    one at a time): an MTP module the exported model does not hold."""

    piece: Piece
    path: Path
    """The safetensors file holding it."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    def tensor(self) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(self.piece.hf_name)


@dataclass(frozen=True)
class _Meta:
    """What rank 0 needs to know about a remote piece to receive and place it."""

    rank: int
    piece: Piece
    shape: tuple[int, ...]
    dtype: str


def save_hf_checkpoint(
    chunks: Sequence[torch.nn.Module],
    out_dir: str | Path,
    source: str | Path | HFModelSpec,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    merge_adapters: bool = False,
) -> None:
    """Write this model as an HF checkpoint into ``out_dir`` (called on every rank).

    ``source`` is the HF model (directory or spec) the chunks were built from: its config is
    written back and its tokenizer files copied. ``dtype`` defaults to the config's declared
    dtype, else the parameters' dtype. Old ``model*.safetensors`` files in ``out_dir`` are
    removed first; ``out_dir`` must not be the source directory. ``merge_adapters``: write
    each LoRA base weight with its adapters merged in (``W + scaling * B @ A``, computed in
    float32 out of place: the model's own weights are not touched).
    """
    spec = source if isinstance(source, HFModelSpec) else read_hf_config(source)
    out = Path(out_dir)
    if spec.directory is not None and out.resolve() == spec.directory.resolve():
        raise ModelLoadError(f"{out}: export directory is the source model directory")
    merged = _merged_weights(chunks) if merge_adapters else {}
    built = _mtp_depths(chunks)
    spec, source_spec = export_spec(spec, built), spec
    items: list[ExportItem | SourceItem] = [
        ExportItem(piece, merged.get(id(param), param)) for chunk in chunks
        for plan, param in local_plans(chunk, spec) if plan.exported
        for piece in plan.pieces + plan.copies]
    if _rank() == 0:
        items += _source_mtp_items(source_spec, built)
    shapes = hf_tensor_shapes(spec)
    nested = spec.vision is not None and spec.vision.model_type in NESTED_KEY_TYPES
    with _ShardWriter(out, max_shard_bytes) if _rank() == 0 else contextlib.nullcontext() as writer:
        sink = None if writer is None else \
            (lambda name, tensor: writer.add(file_key(name, nested), tensor))
        out_dtype = export_tensors(items, shapes, dtype or _declared_dtype(spec), sink)
    if _rank() == 0:
        _write_config(out, spec, out_dtype, source_spec)
        if spec.directory is not None:
            write_companion_files(out, spec.directory)
    if dist.is_initialized():
        dist.barrier()


def _mtp_depths(chunks: Sequence[torch.nn.Module]) -> int:
    """MTP layers of the model (its config is every rank's, whichever stage holds them)."""
    configs = [getattr(unwrap(chunk), "config", None) for chunk in chunks]
    return max((getattr(config, "mtp_num_layers", None) or 0 for config in configs), default=0)


def export_spec(spec: HFModelSpec, depths: int) -> HFModelSpec:
    """The spec of what an export of a model with ``depths`` MTP layers, built from ``spec``'s
    checkpoint, holds: as many MTP modules as the model or the source has (families with
    MTP modules only), with the source's copies of the vocabulary matrices (DeepSeek's both,
    for a source without modules)."""
    if spec.model_type not in MTP_TYPES or depths <= spec.mtp_layers:
        return spec
    return dataclasses.replace(spec, mtp_layers=depths,
                               mtp_copies=spec.mtp_copies if spec.mtp_layers else MTP_COPIES)


def _source_mtp_items(spec: HFModelSpec, depths: int) -> list[SourceItem]:
    """The source's MTP modules past the model's ``depths`` (not its copies of the
    vocabulary matrices: those come from the model's)."""
    if spec.mtp_layers <= depths or spec.directory is None:
        return []
    from hpc_mca.models.checkpoint import HFCheckpoint, read_header

    ckpt = HFCheckpoint.open(spec.directory)
    keep = [mtp_prefix(spec, depth) for depth in range(depths, spec.mtp_layers)]
    copies = tuple(mtp_prefix(spec, depth) + c for depth in range(spec.mtp_layers)
                   for c in MTP_COPIES)
    headers: dict[str, dict[str, Any]] = {}
    items = []
    for name, shape in hf_tensor_shapes(spec).items():
        if not name.startswith(tuple(keep)) or name in copies:
            continue
        file = ckpt.weight_map[name]
        if file not in headers:
            headers[file] = read_header(ckpt.directory / file)
        dtype = _SAFETENSORS_DTYPES[headers[file][name].dtype]
        items.append(SourceItem(Piece(name), ckpt.path_of(name), shape, dtype))
    return items


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16}


def mtp_export_note(spec: HFModelSpec, depths: int) -> str:
    """What the HF export of a run with ``depths`` MTP layers does with them (a log line)."""
    if spec.model_type in MTP_TYPES:
        first = spec.num_layers
        return (f"model.mtp_num_layers={depths}: the MTP layers are in the HF export as its "
                f"MTP modules (layers {first}..{first + depths - 1}, num_nextn_predict_layers)")
    return (f"model.mtp_num_layers={depths}: the MTP layers are not in the HF export (HF "
            "checkpoints of this family have none); the run's checkpoints keep them")


def export_tensors(items: Sequence[ExportItem | SourceItem], shapes: dict[str, tuple[int, ...]],
                   dtype: torch.dtype | None, sink: Callable[[str, torch.Tensor], None] | None
                   ) -> torch.dtype:
    """Assemble the HF tensors ``shapes`` (in that order) from every rank's ``items`` on rank
    0 and hand each to ``sink`` (called on every rank; rank 0 passes the sink). Returns the
    dtype written (``dtype``, else the parameters')."""
    order = {name: i for i, name in enumerate(shapes)}
    items = sorted(items, key=lambda item: (order[item.piece.hf_name], item.piece.hf_start))
    plan = _gather_plan(items, shapes)
    out_dtype = dtype or (items[0].dtype if items else torch.float32)
    if _rank() != 0:
        for item in items:
            dist.send(item.tensor().contiguous(), dst=0)
    elif sink is None:
        raise ValueError("export_tensors: rank 0 assembles the tensors and needs a sink for them")
    else:
        _assemble(shapes, plan, items, out_dtype, sink)
    return out_dtype


def _merged_weights(chunks: Sequence[torch.nn.Module]) -> dict[int, torch.Tensor]:
    """id(LoRA base weight) -> that weight with its adapters merged in (its dtype)."""
    from hpc_mca.models.lora import lora_layers

    merged: dict[int, torch.Tensor] = {}
    for _, layer in lora_layers(list(chunks)):
        weight = layer.base_linear.weight
        merged[id(weight)] = (weight.detach().float() + layer.delta_weight()).to(weight.dtype)
    return merged


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather_plan(
    items: Sequence[ExportItem | SourceItem], shapes: dict[str, tuple[int, ...]]
) -> dict[str, list[_Meta]]:
    """Every rank's pieces per HF tensor, checked to tile each tensor exactly once."""
    mine = [_Meta(_rank(), it.piece, it.shape, str(it.dtype)) for it in items]
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
    plan: dict[str, list[_Meta]] = defaultdict(list)
    for metas in everyone:
        for meta in metas:
            plan[meta.piece.hf_name].append(meta)
    for name, shape in shapes.items():
        plan[name].sort(key=lambda meta: (meta.rank, meta.piece.hf_start))
        _check_tiling(name, shape, plan[name])
    return plan


def _check_tiling(name: str, shape: tuple[int, ...], metas: list[_Meta]) -> None:
    if not metas:
        raise ModelLoadError(f"export: no rank holds tensor {name}")
    if metas[0].piece.dim is None:
        if len(metas) != 1:
            raise ModelLoadError(f"export: tensor {name} is exported by {len(metas)} ranks")
        return
    dim = metas[0].piece.dim
    spans = sorted((m.piece.hf_start, m.piece.hf_stop) for m in metas)
    edges = [0] + [stop for _, stop in spans]
    if any(m.piece.dim != dim for m in metas) or [s for s, _ in spans] != edges[:-1] or \
            edges[-1] != shape[dim]:
        raise ModelLoadError(
            f"export: the pieces of tensor {name} along dim {dim} ({spans}) do not tile "
            f"[0, {shape[dim]})"
        )


def _declared_dtype(spec: HFModelSpec) -> torch.dtype | None:
    value = getattr(torch, spec.dtype, None) if spec.dtype else None
    return value if isinstance(value, torch.dtype) else None


def _assemble(
    shapes: dict[str, tuple[int, ...]],
    plan: dict[str, list[_Meta]],
    items: Sequence[ExportItem | SourceItem],
    dtype: torch.dtype,
    sink: Callable[[str, torch.Tensor], None],
) -> None:
    """Rank 0: assemble each tensor from local and received pieces and hand it to ``sink``."""
    local = iter(items)
    params = [item.param for item in items if isinstance(item, ExportItem)]
    device = params[0].device if params else torch.device("cpu")
    for name, shape in shapes.items():
        full = torch.empty(shape, dtype=dtype)
        for meta in plan[name]:
            if meta.rank == 0:
                part = next(local).tensor()
            else:
                part = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype.split(".")[-1]),
                                   device=device)
                dist.recv(part, src=meta.rank)
            p = meta.piece
            target = full if p.dim is None else full.narrow(p.dim, p.hf_start, p.length)
            target.copy_(part)
        sink(name, full)


class _ShardWriter:
    """Accumulates tensors and writes a safetensors shard whenever ``max_bytes`` would be
    exceeded; names the files the way transformers does once the shard count is known."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def __enter__(self) -> _ShardWriter:
        self.out.mkdir(parents=True, exist_ok=True)
        for old in [*self.out.glob("model*.safetensors"), self.out / INDEX_FILE]:
            old.unlink(missing_ok=True)
        return self

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"model-part-{len(self.files) + 1:05d}.safetensors.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            return
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            self.files[0][0].rename(self.out / SINGLE_FILE)
            return
        weight_map, count = {}, len(self.files)
        for i, (path, names) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _write_config(out: Path, spec: HFModelSpec, dtype: torch.dtype, source: HFModelSpec) -> None:
    """The source config as read, with the dtype key (whichever spelling it used) updated, and
    ``num_nextn_predict_layers`` raised to the MTP modules written where it was lower."""
    config = dict(spec.raw)
    if spec.mtp_layers > source.mtp_layers and \
            spec.mtp_layers > int(config.get("num_nextn_predict_layers") or 0):
        config["num_nextn_predict_layers"] = spec.mtp_layers
    # transformers 5 writes "dtype", 4.x "torch_dtype"; both read "torch_dtype".
    key = "dtype" if "dtype" in config else "torch_dtype"
    config[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_companion_files(out: Path, source: Path) -> None:
    """What every export (full, PEFT adapter, merged) of either backend holds beside its
    weights and config: the tokenizer files of the ``source`` model directory, and its
    generation config. That is the source's ``generation_config.json`` when it has one, else
    the one transformers derives from its ``config.json`` when it loads the model (what
    ``save_pretrained`` of ``AutoModelForCausalLM.from_pretrained(source)`` writes): training
    changes neither, and an adapter gets them too, so whoever loads any export to generate
    text finds the same tokenizer and generation settings (rank 0 only)."""
    from transformers import GenerationConfig

    from hpc_mca.models.vocab_growth import vocab_growth

    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    growth = vocab_growth(source)  # model.resize_vocab: the tokenizer with the template's tokens
    if growth is not None:
        growth.tokenizer.save_pretrained(str(out))
    if (source / GENERATION_CONFIG).is_file():
        shutil.copyfile(source / GENERATION_CONFIG, out / GENERATION_CONFIG)
        return
    # transformers' own fallback for a directory without one, from the config as written
    # (a dict: a config object would add its class defaults, e.g. output_attentions).
    raw = json.loads((source / "config.json").read_text())
    GenerationConfig.from_model_config(raw).save_pretrained(str(out))
