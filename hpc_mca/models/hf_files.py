"""Where the tensors of a Hugging Face safetensors checkpoint live: :class:`HFCheckpoint` (the
index, or the single file's header) and :func:`read_header`. No tensor data is read; the
config reader counts a checkpoint's MTP modules from this listing, and
:mod:`hpc_mca.models.checkpoint` checks and reads the tensors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_mca.models.errors import ModelLoadError

__all__ = ["INDEX_FILE", "MAX_HEADER_BYTES", "SINGLE_FILE", "HFCheckpoint", "TensorInfo", "read_header"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> dtype and shape, from the header of one safetensors file (no data read)."""
    try:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 0 < size <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {size} is out of range")
            header = json.loads(handle.read(size))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({err})") from None
    header.pop("__metadata__", None)
    return {
        name: TensorInfo(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
        for name, entry in header.items()
    }


@dataclass(frozen=True)
class HFCheckpoint:
    """Where each tensor of an HF checkpoint lives."""

    directory: Path
    weight_map: Mapping[str, str]
    """Tensor name -> file name inside ``directory``."""
    index_path: Path | None = None
    """The index file of a sharded checkpoint; None for a single ``model.safetensors``."""

    @classmethod
    def open(cls, directory: Path) -> HFCheckpoint:
        """Find the checkpoint in ``directory`` (index first, then a single file)."""
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ModelLoadError(f"{index}: unreadable index ({err!r})") from None
            return cls(directory, dict(weight_map), index)
        single = directory / SINGLE_FILE
        if single.is_file():
            return cls(directory, dict.fromkeys(read_header(single), SINGLE_FILE))
        raise ModelLoadError(
            f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints "
            "are supported)"
        )

    @property
    def listing(self) -> Path:
        """The file that says which tensors exist: the index, or the single file."""
        return self.index_path or self.directory / SINGLE_FILE

    def path_of(self, tensor: str) -> Path:
        return self.directory / self.weight_map[tensor]
