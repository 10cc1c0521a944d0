"""LoRA adapters on Megatron-Core's parallel linear layers, injected by peft.

peft finds the target modules, swaps in the LoRA layer, freezes everything that is not an
adapter, and switches adapters off and on (the dpo reference); this module supplies the LoRA
layer peft cannot: :class:`MegatronLoraLinear`, registered with ``LoraConfig``'s custom-module
API for Megatron's ``ColumnParallelLinear`` and ``RowParallelLinear``.

One Megatron linear may fuse several HF modules (see :mod:`hpc_mca.topology.lora`); the layer keeps one
adapter pair per HF module (``lora_A[adapter][part]``, ``lora_B[adapter][part]``), so the
trainable parameters and their values are exactly those of peft on the transformers model:

* column-parallel base (``linear_qkv``, ``linear_fc1``): every A is whole (replicated over TP),
  every B holds this rank's rows of its HF module, which are contiguous in HF order; the parts'
  outputs are laid out the way Megatron lays out the fused output (q, k, v interleaved per local
  query group; [gate; up]). A's output crosses a copy-to-TP region, so its gradient is summed
  over the TP ranks' rows, as Megatron's own column linear does for its input.
* row-parallel base (``linear_proj``, ``linear_fc2``): A holds this rank's input columns, its
  output is all-reduced over TP (identity backward), B is whole.
* under TP sequence parallelism the base column linear gathers its input over the sequence
  and the base row linear reduce-scatters its output: A's output does the same (gathered after
  a column A, r wide, so cheaper than gathering the input again; reduce-scattered after a row
  A). The replicated factor (A of a column base, B of a row base) then sees only this rank's
  tokens, so it is marked ``sequence_parallel`` like Megatron's norms: ``finalize_model_grads``
  sums its gradient over TP.
* experts under expert-TP > 1 talk through the token dispatcher instead (it gathers their
  input and reduce-scatters their output): the activations cross no collective here, and the
  gradients of the replicated factor (A of fc1, B of fc2) are summed over the expert-TP group.

A starts from peft's default, a Kaiming-uniform draw (bound ``1/sqrt(fan_in)``), drawn from a
generator seeded by the run's seed and the adapter's HF name over the whole HF shape and then
sliced, so the same adapter starts the same in every layout; B starts at zero. Adapter weights
stay float32 whatever the model is cast to (their updates would vanish in bf16; LLaMA-Factory
and peft upcast them too): the adapter path casts its input up and its output back.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self, cast

import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer

from hpc_mca.config.sections import FinetuningArguments
from hpc_mca.topology.lora import LoraTargets

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from torch.distributed import ProcessGroup

    from hpc_mca.models.hf_config import HFModelSpec
    from hpc_mca.models.mapping import ShardCoords

__all__ = ["LoraSite", "MegatronLoraLinear", "adapters_disabled", "initial_a", "linears", "lora_alpha", "lora_layers",
           "lora_sites"]

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LoraSite:
    """One Megatron linear that gets adapters: where its parts sit in HF and in Megatron."""

    hf_module: str
    """HF name of the module (``model.layers.3.self_attn``, ``model.layers.3.mlp``,
    ``model.layers.3.mlp.experts``) the parts belong to."""
    kind: str
    """qkv | fc1 | expert_fc1 | column (one HF module: multi-latent attention's projections;
    column-parallel bases) or row (linear_proj, linear_fc2)."""
    parts: tuple[str, ...]
    """HF names of the adapted parts (q_proj, ..., gate_up_proj, down_proj)."""
    expert: int | None = None
    """Global index of the expert (experts only)."""
    query_groups: int = 0
    """qkv: local query groups; heads_per_group and head_dim give each part's rows."""
    heads_per_group: int = 0
    head_dim: int = 0

    def hf_name(self, part: str) -> str:
        """The HF adapter's name (experts: the fused parameter and the expert index)."""
        name = f"{self.hf_module}.{part}"
        return name if self.expert is None else f"{name}[{self.expert}]"


def initial_a(hf_name: str, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """The starting A ``[rank, fan_in]`` of the adapter on HF module ``hf_name``: peft's default
    Kaiming-uniform draw from a generator seeded by the run's seed and the name (the standard
    backend starts its peft adapters from the same values)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf_name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(rank, fan_in).uniform_(-bound, bound, generator=gen)


def lora_alpha(finetuning: FinetuningArguments) -> float:
    """``finetuning.lora_alpha``, which the config rules set (None there: 2 * lora_rank)
    before any model is built."""
    if finetuning.lora_alpha is None:
        raise ValueError("finetuning.lora_alpha is unset: the config rules set it before a model is built")
    return finetuning.lora_alpha


def linears(factors: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """A LoRA ``ModuleDict`` of factors by key (a layer's ``lora_A``/``lora_B``, or one adapter's
    parts in :class:`MegatronLoraLinear`), typed: ``update_layer``, peft's and ours, builds
    them as torch Linears."""
    return cast("dict[str, torch.nn.Linear]", dict(cast(torch.nn.ModuleDict, factors).items()))


class _GroupCtx(Protocol):
    """The autograd context of :class:`_SumGradOver`: torch's, carrying the group."""

    group: ProcessGroup | None


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` (a weight replicated over the
    expert-TP ranks, each of which sees part of its gradient)."""

    @staticmethod
    def forward(ctx: _GroupCtx, weight: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: _GroupCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class MegatronLoraLinear(torch.nn.Module, LoraLayer):
    """LoRA on a Megatron ``ColumnParallelLinear``/``RowParallelLinear`` (see the module
    docstring). Built by peft through ``LoraConfig._register_custom_module``."""

    def __init__(self, base_layer: torch.nn.Module, adapter_name: str, *, config: LoraConfig,
                 r: int, lora_alpha: float, sites: dict[str, LoraSite], seed: int,
                 target_name: str, ephemeral_gpu_offload: bool = False, **kwargs: object) -> None:
        super().__init__()
        LoraLayer.__init__(self, base_layer, ephemeral_gpu_offload=ephemeral_gpu_offload, **kwargs)
        self.site = sites[target_name]
        self.seed = seed
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    # ---- construction -------------------------------------------------------------------------

    @property
    def column(self) -> bool:
        return self.site.kind != "row"

    @property
    def base_linear(self) -> ColumnParallelLinear | RowParallelLinear:
        """The Megatron linear the adapters sit on (peft's ``get_base_layer``)."""
        return self.get_base_layer()

    def factors(self, kind: str, adapter: str) -> dict[str, torch.nn.Linear]:
        """``adapter``'s A (``kind`` "A") or B factors, by part."""
        return linears((self.lora_A if kind == "A" else self.lora_B)[adapter])

    @property
    def tp_group(self) -> ProcessGroup | None:
        return self.base_linear.tp_group

    @property
    def tp_size(self) -> int:
        group = self.tp_group
        return group.size() if group is not None else 1

    @property
    def sequence_parallel(self) -> bool:
        """The base linear moves the sequence over TP (gathers the input of a column linear,
        reduce-scatters the output of a row linear); experts' linears never do."""
        base = self.base_linear
        return (bool(getattr(base, "sequence_parallel", False)) and self.tp_size > 1
                and not getattr(base, "explicit_expert_comm", False))

    @property
    def through_dispatcher(self) -> bool:
        """Expert linears under expert-TP > 1: the token dispatcher does the TP communication."""
        return bool(getattr(self.base_linear, "explicit_expert_comm", False)) and self.tp_size > 1

    def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config: LoraConfig,
                     **kwargs: object) -> None:
        if r <= 0:
            raise ValueError(f"LoRA rank r={r} must be a positive integer")
        self.r[adapter_name], self.lora_alpha[adapter_name] = r, lora_alpha
        self.scaling[adapter_name] = lora_alpha / r
        self.lora_dropout[adapter_name] = (torch.nn.Dropout(config.lora_dropout)
                                           if config.lora_dropout > 0 else torch.nn.Identity())
        base = self.base_linear
        in_local = base.input_size_per_partition if not self.column else base.input_size
        self.lora_A[adapter_name] = torch.nn.ModuleDict(
            {p: torch.nn.Linear(in_local, r, bias=False) for p in self.site.parts})
        self.lora_B[adapter_name] = torch.nn.ModuleDict(
            {p: torch.nn.Linear(r, self._rows(p), bias=False) for p in self.site.parts})
        self._init_weights(adapter_name)
        self._mark_parallel(adapter_name)
        self._move_adapter_to_device_of_base_layer(adapter_name)
        for module in (self.lora_A[adapter_name], self.lora_B[adapter_name]):
            module.float()  # whatever the base's dtype (see the module docstring)
        self.set_adapter(self.active_adapters)

    def _rows(self, part: str) -> int:
        """Output rows of ``part``'s B on this rank."""
        base, site = self.base_linear, self.site
        if site.kind == "qkv":
            heads = site.heads_per_group if part == "q_proj" else 1
            return site.query_groups * heads * site.head_dim
        if site.kind == "fc1":
            return base.output_size_per_partition // 2
        if site.kind in ("expert_fc1", "column"):
            return base.output_size_per_partition
        return base.output_size  # row-parallel: B is whole

    @torch.no_grad()
    def _init_weights(self, adapter_name: str) -> None:
        base, b_factors = self.base_linear, self.factors("B", adapter_name)
        for part, a in self.factors("A", adapter_name).items():
            fan_in = base.input_size
            full = initial_a(self.site.hf_name(part), a.weight.shape[0], fan_in, self.seed)
            if not self.column:
                rank = self.tp_group.rank() if self.tp_group is not None else 0
                full = full.narrow(1, rank * a.weight.shape[1], a.weight.shape[1])
            a.weight.copy_(full)
            b_factors[part].weight.zero_()

    def _mark_parallel(self, adapter_name: str) -> None:
        """The attributes Megatron's DDP, optimizer and gradient clipping read: which tensors
        are split over TP (counted once per rank in the norm), which are expert parameters
        (reduced over the expert-data-parallel group)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        expert = bool(getattr(self.base_linear, "is_expert", False))
        for kind in ("A", "B"):
            split = kind == ("B" if self.column else "A") and self.tp_size > 1
            for linear in self.factors(kind, adapter_name).values():
                if split:
                    set_tensor_model_parallel_attributes(linear.weight, True, 0 if self.column else 1, 1)
                elif self.sequence_parallel:
                    # Replicated, fed this rank's tokens only: summed over TP by Megatron. (Marks
                    # Megatron reads off the tensor, which torch's types do not declare.)
                    setattr(linear.weight, "sequence_parallel", True)
                if expert:
                    setattr(linear.weight, "allreduce", False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        """Module casts (Float16Module's bf16 cast) leave the adapter weights in float32."""
        super()._apply(fn, recurse)
        for name in ("lora_A", "lora_B"):
            for param in getattr(self, name).parameters():
                if param.dtype in _HALF:
                    param.data = param.data.float()
        return self

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # args/kwargs: the base linear's own (a column linear's weight, runtime_gather_output).
        result, bias = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return result, bias
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            delta = self._delta(adapter, self.lora_dropout[adapter](x.float()))
            result = result + delta.to(result.dtype)
        return result, bias

    def _delta(self, adapter: str, x: torch.Tensor) -> torch.Tensor:
        tp, group = self.tp_size, self.tp_group
        out: dict[str, torch.Tensor] = {}
        b_factors = self.factors("B", adapter)
        for part, a in self.factors("A", adapter).items():
            b = b_factors[part]
            if self.through_dispatcher:
                # The replicated factor's gradient is partial on each expert-TP rank.
                a_w = a.weight if not self.column else _SumGradOver.apply(a.weight, group)
                b_w = b.weight if self.column else _SumGradOver.apply(b.weight, group)
                out[part] = torch.nn.functional.linear(torch.nn.functional.linear(x, a_w), b_w)
                continue
            u = a(x)
            out[part] = b(self._across_tp(u, group) if tp > 1 else u)
        # Under sequence parallelism the output's sequence length is not the input's.
        return self._assemble(out, next(iter(out.values())).shape[:-1]) * self.scaling[adapter]

    def _across_tp(self, u: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        """A's output ``u`` as B needs it: the TP communication of the base linear, on r
        columns (see the module docstring)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        if self.column:
            return (gather_from_sequence_parallel_region(u, True, group) if self.sequence_parallel
                    else copy_to_tensor_model_parallel_region(u, group))
        return (reduce_scatter_to_sequence_parallel_region(u, group) if self.sequence_parallel
                else reduce_from_tensor_model_parallel_region(u, group))

    def _assemble(self, parts: dict[str, torch.Tensor], lead: torch.Size) -> torch.Tensor:
        """The parts' outputs (last dim) laid out as the base linear's local output."""
        site = self.site
        if site.kind in ("row", "expert_fc1", "column"):
            return next(iter(parts.values()))

        def part(name: str) -> torch.Tensor:
            if name in parts:
                return parts[name]
            return next(iter(parts.values())).new_zeros(*lead, self._rows(name))

        if site.kind == "fc1":
            return torch.cat([part("gate_proj"), part("up_proj")], dim=-1)
        groups = site.query_groups
        pieces = [part(p).unflatten(-1, (groups, -1)) for p in ("q_proj", "k_proj", "v_proj")]
        return torch.cat(pieces, dim=-1).flatten(-2)

    @torch.no_grad()
    def delta_weight(self, adapter: str = "default") -> torch.Tensor:
        """``scaling * B @ A`` of every part, laid out as this rank's base weight (float32)."""
        b_factors = self.factors("B", adapter)
        deltas = {p: b_factors[p].weight @ a.weight for p, a in self.factors("A", adapter).items()}
        if not self.column:
            return next(iter(deltas.values())) * self.scaling[adapter]
        # Assemble along the rows: the same layout as the output's last dimension.
        in_dim = next(iter(deltas.values())).shape[1]
        moved = {p: d.t() for p, d in deltas.items()}
        return self._assemble(moved, torch.Size([in_dim])).t() * self.scaling[adapter]

    # ---- checkpoints --------------------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """The base layer's entries under its own module key (``base_layer.``) but the checkpoint
        key of the plain linear; the adapters as ``<linear>.lora_A.<part>.weight`` (TP-split
        like their HF module, experts' fused gate/up B like Megatron's own fc1)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        base = self.base_linear.sharded_state_dict(prefix, sharded_offsets, metadata)
        out = {f"{prefix}base_layer.{k[len(prefix):]}": v for k, v in base.items()}
        adapter = "default" if "default" in self.lora_A else next(iter(self.lora_A))
        tensors: dict[str, torch.Tensor] = {}
        axes: dict[str, int] = {}
        for kind in ("A", "B"):
            for part, linear in self.factors(kind, adapter).items():
                key = f"lora_{kind}.{part}.weight"
                tensors[key] = linear.weight
                if kind == ("B" if self.column else "A"):
                    axes[key] = 0 if self.column else 1
        sharded = make_sharded_tensors_for_checkpoint(
            tensors, prefix, axes, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"))
        for key, value in sharded.items():
            if self.site.kind == "expert_fc1" and ".lora_B." in key:
                value = apply_swiglu_sharded_factory(value, sharded_offsets, tp_group=self.tp_group)
            module_key = key.replace(".lora_A.", f".lora_A.{adapter}.").replace(
                ".lora_B.", f".lora_B.{adapter}.")
            out[module_key] = value
        return out


def lora_layers(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, MegatronLoraLinear]]:
    """(name, layer) of every LoRA layer of the chunks (unwrapped or not)."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, MegatronLoraLinear):
                yield name, module


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Run the base model: every LoRA layer of ``chunks`` passes its input to the base linear
    alone (peft's switch; leaving restores the adapters and their trainability)."""
    layers = [layer for _, layer in lora_layers(chunks)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


_LAYER = re.compile(r"(?:.*\.)?decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])")


def site_of(name: str, rest: str, layer: int, targets: LoraTargets, spec: HFModelSpec,
            coords: ShardCoords) -> LoraSite | None:
    """The site of Megatron linear ``rest`` (its name inside global layer ``layer``), or None
    when it gets no adapter. ``spec``: the HFModelSpec; ``coords``: this rank's ShardCoords."""
    parts = targets.parts(rest)
    if not parts:
        return None
    prefix = f"model.layers.{layer}"
    if rest.endswith("linear_qkv"):
        return LoraSite(f"{prefix}.self_attn", "qkv", parts,
                        query_groups=spec.num_query_groups // coords.tp_size,
                        heads_per_group=spec.num_attention_heads // spec.num_query_groups,
                        head_dim=spec.head_dim)
    if rest.endswith("linear_proj"):
        return LoraSite(f"{prefix}.self_attn", "row", parts)
    if rest.startswith("self_attention."):  # multi-latent attention: one HF module each
        return LoraSite(f"{prefix}.self_attn", "column", parts)
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        index = coords.ep_rank * (spec.num_experts // coords.ep_size) + int(expert.group(1))
        kind = "expert_fc1" if expert.group(2) == "linear_fc1" else "row"
        return LoraSite(f"{prefix}.{spec.moe_prefix}.experts", kind, parts, expert=index)
    return LoraSite(f"{prefix}.mlp", "fc1" if rest.endswith("linear_fc1") else "row", parts)


def apply_lora(chunks: list[torch.nn.Module], finetuning: FinetuningArguments, *,
               model_path: str, seed: int) -> list[torch.nn.Module]:
    """Inject the adapters ``finetuning`` asks for into this rank's chunks (peft's
    ``inject_adapter_in_model`` with the layer above as its custom module) and freeze the
    rest. ``model_path``: the HF model directory the chunks were built from (its config.json
    names the modules); ``seed``: the run's seed, which draws the A factors."""
    import functools

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from peft import LoraConfig, inject_adapter_in_model

    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.topology.lora import resolve_lora_targets

    ft = finetuning
    spec = read_hf_config(model_path)
    targets = resolve_lora_targets(ft.lora_target, spec.lora_model(), model_type=spec.model_type)
    for chunk in chunks:
        sites = lora_sites(chunk, targets, spec)
        # lora_alpha: peft annotates int but takes any number (scaling = alpha / r).
        peft_config = LoraConfig(r=ft.lora_rank, lora_alpha=lora_alpha(ft),  # type: ignore[arg-type]
                                 lora_dropout=ft.lora_dropout, target_modules=sorted(sites))
        layer = functools.partial(MegatronLoraLinear, sites=sites, seed=seed)
        custom = {ColumnParallelLinear: layer, RowParallelLinear: layer}
        # peft annotates classes but only calls them: the partial binds this chunk's sites.
        peft_config._register_custom_module(custom)  # type: ignore[arg-type]
        inject_adapter_in_model(peft_config, chunk)
    return chunks


def lora_sites(chunk: GPTModel, targets: LoraTargets, spec: HFModelSpec) -> dict[str, LoraSite]:
    """Module name -> site, for the linears of this chunk's decoder layers that get adapters."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from hpc_mca.models.weights import shard_coords

    coords = shard_coords(chunk)
    numbers = [layer.layer_number - 1 for layer in chunk.decoder.layers]
    sites = {}
    for name, module in chunk.named_modules():
        match = _LAYER.fullmatch(name)
        if match is None or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        site = site_of(name, match.group(2), numbers[int(match.group(1))], targets, spec, coords)
        if site is not None:
            sites[name] = site
    return sites
