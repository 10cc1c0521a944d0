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
    """Plans with TP > 1 turn on Megatron sequence parallelism (it runs with every norm the
    trainer builds: Transformer Engine's, or torch's through hpc_mca.models.norm). Off for the
    CPU preset: over gloo its extra collectives cost more time than its activation memory is
    worth (demo model at TP2: 84 ms a step against 58). MoE models get it whatever this says:
    Megatron's MoE layer refuses to train under TP without it."""
    usable_fraction: float = 0.88
    """Share of memory the estimate may fill. The rest is for what the estimate does not model:
    the CUDA context (~0.5 GiB), NCCL buffers (~1-2 GiB), allocator fragmentation and
    temporary buffers such as all-gathered weights and communication staging."""
    # Speed figures for the step-time estimate (topology/cost.py). Peaks are the vendors'
    # dense (no sparsity) tensor-core figures; bandwidths are what NCCL's bus bandwidth
    # reaches in practice, not the link's line rate.
    peak_tflops: float = 989.0
    """Dense bf16/fp16 tensor-core peak, TFLOP/s (H100 SXM: 989)."""
    fp32_tflops: float = 67.0
    """Plain fp32 (no TF32) peak, TFLOP/s: what fp32 runs get, since torch leaves TF32 off."""
    memory_gbps: float = 3350.0
    """HBM bandwidth, GB/s (bounds element-wise kernels and the optimizer step)."""
    intra_node_gbps: float = 360.0
    """Collective bus bandwidth between GPUs of one node, GB/s (NVLink 4: 450 GB/s a
    direction; NCCL all-reduce sustains ~360 without NVLink SHARP)."""
    inter_node_gbps: float = 40.0
    """Collective bus bandwidth per GPU across nodes, GB/s (one 400 Gb/s NIC a GPU)."""
    intra_node_latency_us: float = 3.0
    """Latency of one ring step inside a node, microseconds."""
    inter_node_latency_us: float = 8.0
    """Latency of one ring step across nodes, microseconds."""
    sm_count: int = 132
    """Streaming multiprocessors (H100 SXM: 132, A100: 108): an attention kernel call with
    fewer thread blocks than this leaves some idle. 0: not a GPU (no such limit)."""

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)


GPU_PRESETS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("H100-80GB", 81559 * MiB, fp8=True),
        GpuSpec("H200-141GB", 143771 * MiB, fp8=True, memory_gbps=4800.0),
        # A100: 312 TFLOP/s bf16, NVLink 3 (300 GB/s a direction), one 200 Gb/s NIC a GPU.
        GpuSpec("A100-40GB", 40536 * MiB, peak_tflops=312.0, fp32_tflops=19.5,
                memory_gbps=1555.0, intra_node_gbps=230.0, inter_node_gbps=20.0, sm_count=108),
        GpuSpec("A100-80GB", 81920 * MiB, peak_tflops=312.0, fp32_tflops=19.5,
                memory_gbps=2039.0, intra_node_gbps=230.0, inter_node_gbps=20.0, sm_count=108),
        # Local CPU runs: one gloo process per "device"; 16 GiB of host memory per process is a
        # conservative laptop/CI figure; pass gpu_memory_gib to plan for a bigger machine. The
        # speed figures are rough (a few cores' vector units, gloo over shared memory): they
        # order CPU layouts, they do not predict CPU step times.
        GpuSpec("CPU", 16 * GiB, gpus_per_node=1, sequence_parallel=False, usable_fraction=0.8,
                peak_tflops=0.1, fp32_tflops=0.1, memory_gbps=10.0, intra_node_gbps=2.0,
                inter_node_gbps=1.0, intra_node_latency_us=50.0, inter_node_latency_us=100.0,
                sm_count=0),
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
