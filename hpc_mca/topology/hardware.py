"""Accelerator presets: how much memory a rank may plan for, and what it supports."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import LayoutError

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator kind (or a CPU process, for local gloo runs)."""

    name: str
    """Preset name, e.g. ``H100-80GB``."""
    memory_bytes: int
    """Device memory as ``nvidia-smi`` reports it (MiB × 2**20), not the marketing GB."""
    gpus_per_node: int = 8
    """Devices per node when the caller does not say (HGX boards carry 8)."""
    fp8: bool = False
    """Hopper-class FP8 tensor cores (TransformerEngine fp8 recipes)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism is available. It needs Transformer Engine's (or Apex's)
    LayerNorm; Megatron's torch LayerNorm refuses it, so CPU runs go without."""
    usable_fraction: float = 0.88
    """Share of memory the estimate may fill. The rest is for what the estimate does not model:
    the CUDA context (~0.5 GiB), NCCL buffers (~1-2 GiB), allocator fragmentation and
    temporary buffers such as all-gathered weights and communication staging."""

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)


GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("H100-80GB", 81559 * MiB, fp8=True),
        GpuSpec("H200-141GB", 143771 * MiB, fp8=True),
        GpuSpec("A100-40GB", 40536 * MiB),
        GpuSpec("A100-80GB", 81920 * MiB),
        # Local CPU runs: one gloo process per "device"; 16 GiB of host memory per process is a
        # conservative laptop/CI figure; pass gpu_memory_gib to plan for a bigger machine.
        GpuSpec("CPU", 16 * GiB, gpus_per_node=1, sequence_parallel=False, usable_fraction=0.8),
    )
}

# Unambiguous short names people type; A100 has two sizes and therefore no alias.
_ALIASES = {"H100": "H100-80GB", "H200": "H200-141GB"}


def get_gpu(name: str, memory_gib: float | None = None) -> GpuSpec:
    """Look up a preset (case-insensitive); ``memory_gib`` overrides its memory size.

    Raises LayoutError naming the valid presets for an unknown name.
    """
    by_upper = {key.upper(): spec for key, spec in GPU_PRESETS.items()}
    key = _ALIASES.get(str(name).upper(), str(name)).upper()
    if key not in by_upper:
        valid = ", ".join(sorted(GPU_PRESETS))
        raise LayoutError(f"gpu={name!r} is not a known GPU preset; valid: {valid}")
    spec = by_upper[key]
    if memory_gib is None:
        return spec
    if isinstance(memory_gib, bool) or not isinstance(memory_gib, (int, float)) or memory_gib <= 0:
        raise LayoutError(f"gpu_memory_gib={memory_gib!r} must be a positive number")
    return replace(spec, name=f"{spec.name} ({memory_gib:g} GiB)",
                   memory_bytes=int(memory_gib * GiB))
