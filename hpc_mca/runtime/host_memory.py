"""How a GPU rank's pinned host memory is made: registered by threads, not ``cudaHostAlloc``.

A checkpoint save stages every tensor in host memory first: Megatron's writer copies each one
with ``tensor.to("cpu", non_blocking=True)``, which takes pinned blocks from torch's caching
host allocator. The first save of a process creates all of them; later saves reuse the cached
blocks. By default torch creates a block with ``cudaHostAlloc``, one thread. Its
``pinned_use_cuda_host_register`` setting instead mallocs the block, touches its pages from
``pinned_num_register_threads`` threads and registers it with ``cudaHostRegister``.

Measured on one H200 (torch 2.11, ``benchmarks/pinned_staging.py``), staging the 17.3 GB
state of the Llama-3.2-1B trainer: 8.10 s for the first save with ``cudaHostAlloc`` (8.04 s
of it creating blocks), 3.02 s registered with 8 threads, 0.31 s for every later save
either way; pageable copies took 12.2-12.9 s every time. In ``hpc-mca train`` on that shape
the first save spent 13.4 s creating pinned blocks (of 25.1 s); the next two took 13.7 and
7.8 s in all.

The setting is added to the allocator configuration this process hands torch (whichever of
``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` torch reads first) unless it already
says how pinned memory is made; it takes effect when torch first reads that configuration,
at the process's first CUDA allocation.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

REGISTER_THREADS = 8
"""Threads that touch a new pinned block's pages (torch wants a power of two; 8 measured)."""
SETTING = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{REGISTER_THREADS}"


def register_pinned_host_memory(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Add :data:`SETTING` to the allocator configuration in ``environ``; returns the variable
    it set, or None where the user's configuration already chooses (any ``pinned_use_`` key)."""
    # CUDA's allocator reads PYTORCH_CUDA_ALLOC_CONF if it is set, else PYTORCH_ALLOC_CONF.
    name = next((n for n in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if environ.get(n)),
                "PYTORCH_CUDA_ALLOC_CONF")
    current = environ.get(name, "").strip().strip(",")
    if "pinned_use_" in current:
        return None
    environ[name] = f"{current},{SETTING}" if current else SETTING
    return name


def pinned_host_seconds() -> float | None:
    """Seconds this process has spent so far creating pinned host memory blocks (torch's
    caching host allocator; None off CUDA or where torch keeps no such timer).

    A checkpoint save reports its share (the part of a first save that later saves skip, see
    above); ``benchmarks/pinned_staging.py`` reads it around the staging alone."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_initialized():
        return None
    total = stats().get("host_alloc_time.total")  # microseconds
    return None if total is None else total / 1e6
