"""Checkpoint loads that read each tensor's bytes straight into the tensor that receives them.

torch_dist stores every tensor as a small ``torch.save`` archive inside a rank's ``.distcp``
file. PyTorch's ``FileSystemReader`` ``torch.load``\\ s each archive into a fresh CPU tensor
(zip parsing, weights-only unpickling, a read in small chunks through a Python file view, an
allocation) and then copies it into the destination. On the 2-core VM that was 0.4-0.5 s of a
0.5-0.7 s resume for a 400 MB checkpoint, where the bytes alone read in ~0.15 s.

:class:`DirectFileSystemReader` reads only each archive's *layout* — its zip directory (torch's
own reader) and its small pickle, unpickled by a restricted unpickler that records dtype,
shape, strides and storage offset instead of building a tensor — then reads the requested
bytes with one ``preadv`` into the destination's memory, in file order. A destination that is
not a contiguous CPU tensor of the stored dtype (a CUDA tensor, a strided view, a tensor
subclass) gets the bytes in a CPU buffer first and one ``copy_``, as PyTorch's path does.
Bytes records, transformed (e.g. compressed) records, archives in another byte order and
non-contiguous slices of a stored tensor go through PyTorch's own path unchanged.

Measured on the 2-core VM (405 MB checkpoint, page cache dropped): read whole in one process
into tensors already allocated, PyTorch's reader took 0.45-0.67 s and this one 0.26-0.38 s
(``benchmarks/checkpoint_io.py`` prints both; the same bytes read sequentially from one file:
0.15-0.20 s); the resume of a 2-rank run, alternating readers, 0.54-0.67 s vs 0.42-0.53 s.
Prefetching each archive's head and tail mattered there: without it the ~15 small header reads
per archive each waited for the disk, and the direct reader was no faster than PyTorch's.

Megatron's ``TorchDistLoadShardedStrategy.load`` builds its reader with the module-level
``_get_filesystem_reader``; :func:`direct_reads` puts a factory for this reader there for
the duration of one load (also under the fully-parallel wrapper, which calls the same
strategy). Nothing else about the load changes: planning, validation and resharding are
Megatron's.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import io
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

_HEADER_BYTES = 4096
"""Bytes at each end of an archive holding its headers (a tensor's pickle and the zip records
before its data; the zip directory after it): a few hundred each."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a stored tensor's elements are: its archive's storage record and the view on it."""

    dtype: torch.dtype
    key: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _layout(storage: tuple[str, torch.dtype, str, str, int], offset: int, size: Sequence[int],
            stride: Sequence[int], *_: object) -> _Layout:
    """Stands in for ``torch._utils._rebuild_tensor_v2`` while reading an archive's pickle:
    records the layout instead of building a tensor. ``storage`` is the persistent id
    ``("storage", <dtype of the torch.XStorage named>, key, location, numel)``."""
    return _Layout(storage[1], storage[2], offset, tuple(size), tuple(stride))


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """Legacy storage class name (as pickled: ``torch FloatStorage``) -> dtype. Read from
    torch's own table: touching the classes themselves warns that TypedStorage is deprecated."""
    return {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
            if not name.startswith("Q")}  # quantized storages carry more than bytes


class _NotATensor(Exception):
    """The archive holds something other than one plain tensor."""


class _LayoutUnpickler(pickle.Unpickler):
    """Reads the pickle of a tensor saved by ``torch.save`` without building it (no storage read).
    Accepts only what a plain tensor's pickle references; anything else is left to torch.load."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _layout
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _storage_dtypes():
            return _storage_dtypes()[name]
        raise _NotATensor(f"{module}.{name}")

    def persistent_load(self, pid: object) -> object:
        return pid


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, step in zip(reversed(size), reversed(stride)):
        if n != 1 and step != expected:
            return False
        expected *= n
    return True


def _stored_view(stream: io.FileIO, offset: int, length: int, req: ReadItem) -> tuple[torch.dtype, int] | None:
    """The dtype and file offset of the requested part of a stored tensor, when that part is
    one contiguous run of the archive's storage record; None otherwise."""
    # torch's file view is a readable binary stream (torch.load reads archives through it);
    # its annotation says only IOBase.
    view = cast(IO[bytes], _create_file_view(stream, offset, length))
    archive = torch._C.PyTorchFileReader(view)
    # has_record and get_record_offset are methods of torch's C++ reader its stub leaves out.
    has_byteorder = archive.has_record("byteorder")  # type: ignore[attr-defined]
    if has_byteorder and archive.get_record("byteorder").decode() != sys.byteorder:
        return None  # PyTorch's path swaps the bytes; this one does not
    try:
        layout = _LayoutUnpickler(io.BytesIO(archive.get_record("data.pkl"))).load()
    except _NotATensor:
        return None
    if not isinstance(layout, _Layout) or len(layout.size) != len(req.lengths):
        return None
    start = layout.offset + sum(s * step for s, step in zip(req.storage_offsets, layout.stride))
    if not _contiguous(tuple(req.lengths), layout.stride):
        return None
    storage_at = offset + archive.get_record_offset(f"data/{layout.key}")  # type: ignore[attr-defined]
    return layout.dtype, storage_at + start * layout.dtype.itemsize


def _read_exact(fd: int, buffer: memoryview, position: int) -> None:
    done = 0
    while done < len(buffer):  # a read may return less than asked (signals, network file systems)
        got = os.preadv(fd, [buffer[done:]], position + done)
        if got == 0:
            raise EOFError(f"checkpoint file ends {len(buffer) - done} bytes early at {position + done}")
        done += got


def _memory_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (any dtype, bf16 included)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class DirectFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` whose tensor reads land in the destination tensors directly."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fallback: list[ReadItem] = []
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.TENSOR and not info.transform_descriptors:
                per_file.setdefault(info.relative_path, []).append(req)
            else:
                fallback.append(req)
        for relative_path, reqs in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            with open(path, "rb", buffering=0) as stream:
                fallback += self._read_file(stream, reqs, planner)
        if fallback:
            super().read_data(LoadPlan(fallback, plan.storage_data), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, stream: io.FileIO, reqs: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Read the requests of one file (sorted by offset); returns those left to PyTorch's
        path."""
        fallback: list[ReadItem] = []
        self._prefetch_headers(stream.fileno(), reqs)
        for req in reqs:
            placed = self._place(stream, req, planner)
            if placed is None:
                fallback.append(req)
                continue
            target, buffer, position = placed
            _read_exact(stream.fileno(), _memory_of(buffer), position)
            if buffer is not target:
                target.copy_(buffer)
            planner.commit_tensor(req, target)
        return fallback

    def _prefetch_headers(self, fd: int, reqs: list[ReadItem]) -> None:
        """Start reading every archive's head and tail (the pickle and local headers; the zip
        directory) now, all at once: parsed one by one from a cold cache, each of their ~15
        small reads per archive waited for the disk (0.25 s of a 2-rank load on the VM)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for req in reqs:
            info = self.storage_data[req.storage_index]
            head = min(info.length, _HEADER_BYTES)
            os.posix_fadvise(fd, info.offset, head, os.POSIX_FADV_WILLNEED)
            os.posix_fadvise(fd, info.offset + info.length - head, head, os.POSIX_FADV_WILLNEED)

    def _place(self, stream: io.FileIO, req: ReadItem,
               planner: LoadPlanner) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(destination, the CPU tensor to read into, file offset) for one request; None to
        leave it to PyTorch's path."""
        info = self.storage_data[req.storage_index]
        placed = _stored_view(stream, info.offset, info.length, req)
        if placed is None:
            return None
        dtype, position = placed
        target = planner.resolve_tensor(req).detach()
        if list(target.size()) != list(req.lengths):  # the check of PyTorch's own path
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {req.lengths}")
        if (type(target) is torch.Tensor and target.device.type == "cpu"
                and target.is_contiguous() and target.dtype == dtype):
            return target, target, position
        # A GPU, strided, other-dtype or subclass (e.g. quantized) destination: read into a
        # CPU buffer, then one copy_ (as PyTorch's path does).
        return target, torch.empty(tuple(req.lengths), dtype=dtype), position


@contextlib.contextmanager
def direct_reads() -> Iterator[None]:
    """Megatron's torch_dist loads inside this block read through :class:`DirectFileSystemReader`
    (metadata caching and multi-storage-client setups keep Megatron's own reader)."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    original = torch_strategy._get_filesystem_reader

    def reader(checkpoint_dir: str | Path, cache_metadata: bool = False,
               async_strategy: str = "mcore") -> FileSystemReader:
        if cache_metadata or torch_strategy.MultiStorageClientFeature.is_enabled():
            return original(checkpoint_dir, cache_metadata=cache_metadata, async_strategy=async_strategy)
        return DirectFileSystemReader(checkpoint_dir)

    torch_strategy._get_filesystem_reader = reader
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original
