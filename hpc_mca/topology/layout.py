"""Layout: how the GPUs of a job are split into parallel dimensions.

The dense grid is Megatron-Core's: world = TP·PP·CP·DP (RankGenerator with ep=1). The expert
grid reuses the same ranks as world = ETP·EP·EDP·PP, so EP does not cost data parallelism; it
only has to divide the TP·CP·DP ranks of one pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from .errors import raise_if

# Megatron-style names used in every violation message, so a message can be pasted into a
# search of the Megatron docs or our YAML configs.
FIELD_NAMES: dict[str, str] = {
    "tp": "tensor_parallel_size",
    "pp": "pipeline_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "vp": "virtual_pipeline_parallel_size",
    "dp": "data_parallel_size",
}


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one training job; 1 means the dimension is unused."""

    tp: int = 1
    """Tensor parallel: splits every matmul (and, with sequence parallel, the activations)."""
    pp: int = 1
    """Pipeline parallel: splits the layers into consecutive stages."""
    cp: int = 1
    """Context parallel: splits each sequence across ranks (ring attention)."""
    ep: int = 1
    """Expert parallel: spreads the routed experts of MoE layers across ranks."""
    etp: int = 1
    """Expert tensor parallel: splits each expert's matmuls (1 is usual with EP)."""
    vp: int | None = None
    """Virtual pipeline chunks per PP rank (interleaved 1F1B); None = no interleaving."""
    dp: int | None = None
    """Data parallel replicas; None = derive from the world size (see :meth:`resolved`)."""
    pipeline_layout: tuple[int, ...] | None = None
    """Explicit transformer layers per virtual stage, in schedule order (length PP·VP, rank
    r's chunks at r, r+PP, ...); None = split the layers evenly, which needs PP·VP | layers."""

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_layout, list):  # accept lists from YAML/CLI; keep hashable
            object.__setattr__(self, "pipeline_layout", tuple(self.pipeline_layout))
        raise_if(_size_violations(self))

    @property
    def model_parallel_size(self) -> int:
        """GPUs holding one copy of the model (TP·PP·CP): world / DP."""
        return self.tp * self.pp * self.cp

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * (self.vp or 1)

    def resolved(self, world_size: int) -> Layout:
        """This layout with ``dp`` filled in for ``world_size`` GPUs.

        Raises LayoutError when TP·PP·CP does not divide the world, or a given ``dp`` disagrees.
        """
        raise_if(world_violations(self, world_size))
        return replace(self, dp=world_size // self.model_parallel_size)

    def describe(self) -> str:
        """Compact form for reports, e.g. ``TP4 PP2 VP4 CP2 DP1`` (EP/ETP only for MoE)."""
        stages = "" if self.pipeline_layout is None else f"({_run_length(self.pipeline_layout)})"
        parts = [f"TP{self.tp}", f"PP{self.pp}{stages}"]
        if self.vp is not None:
            parts.append(f"VP{self.vp}")
        parts.append(f"CP{self.cp}")
        if self.ep > 1 or self.etp > 1:
            parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        parts.append(f"DP{self.dp if self.dp is not None else '?'}")
        return " ".join(parts)


def _size_violations(layout: Layout) -> list[str]:
    """Each degree must be a positive integer (vp/dp may also be None)."""
    lines = []
    for short, long in FIELD_NAMES.items():
        value = getattr(layout, short)
        if value is None and short in ("vp", "dp"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            lines.append(f"{long}={value!r} must be a positive integer")
    stages = layout.pipeline_layout
    if stages is not None and not (isinstance(stages, tuple) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in stages)):
        lines.append(f"pipeline_layout={stages!r} must be a tuple of layer counts >= 0")
    return lines


def world_violations(layout: Layout, world_size: int) -> list[str]:
    """world = TP·PP·CP·DP: the model-parallel product must divide the world (and match dp)."""
    if not isinstance(world_size, int) or world_size < 1:
        return [f"world_size={world_size!r} must be a positive integer"]
    mp = layout.model_parallel_size
    if world_size % mp:
        valid = ", ".join(str(d) for d in nearest(mp, divisors(world_size)))
        return [
            f"tensor×pipeline×context parallel size={layout.tp}×{layout.pp}×{layout.cp}={mp} "
            f"does not divide world_size={world_size}; valid products: {valid}"
        ]
    if layout.dp is not None and layout.dp != world_size // mp:
        return [
            f"data_parallel_size={layout.dp} does not fit world_size={world_size} with "
            f"TP·PP·CP={mp}; valid: {world_size // mp}"
        ]
    return []


@lru_cache(maxsize=1024)  # pure; the planner asks for each split once per candidate
def balanced_pipeline_layout(num_layers: int, stages: int) -> tuple[int, ...] | None:
    """Layers per virtual stage when ``stages`` does not divide ``num_layers``.

    The embedding and the output layer plus loss each weigh about one transformer layer (the
    idea behind Megatron's account_for_embedding/loss_in_pipeline_split), so the first and last
    stages get one layer fewer and the rest is spread evenly. None if a stage would be empty.
    """
    units = num_layers + 2
    sizes = [units // stages + (1 if 0 < i <= units % stages else 0) for i in range(stages)]
    sizes[0] -= 1
    sizes[-1] -= 1
    if stages == 1 or min(sizes) < 1 or sum(sizes) != num_layers:
        return None
    return tuple(sizes)


def megatron_pipeline_layout(layout: Layout) -> list[list[str]] | None:
    """``pipeline_layout`` as Megatron-Core's ``pipeline_model_parallel_layout`` (a list per
    virtual stage in the same order, embedding first and loss last); None when even."""
    if layout.pipeline_layout is None:
        return None
    stages = [["decoder"] * n for n in layout.pipeline_layout]
    stages[0].insert(0, "embedding")
    stages[-1].append("loss")
    return stages


def _run_length(sizes: tuple[int, ...]) -> str:
    """15,16,16,16,15 -> '15,16×3,15'."""
    runs: list[list[int]] = []
    for n in sizes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(f"{n}×{count}" if count > 1 else str(n) for n, count in runs)


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def nearest(value: int, choices: list[int], k: int = 4) -> list[int]:
    """The k choices closest to ``value`` (ties go to the smaller), returned ascending."""
    return sorted(sorted(choices, key=lambda c: (abs(c - value), c))[:k])
