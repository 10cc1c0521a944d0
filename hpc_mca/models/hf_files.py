"""Where the tensors of a Hugging Face safetensors checkpoint live: :class:`HFCheckpoint` (the
index, or the single file's header) and :func:`read_header`. No tensor data is read; the
config reader counts a checkpoint's MTP modules from this listing, and
:mod:`hpc_mca.models.checkpoint` checks and reads the tensors.

A vision-language checkpoint may nest its language model (``model.language_model.*``) and
tower (``model.visual.*``), as transformers 5 saves Qwen3-VL and as hub checkpoints of Qwen3-VL
are; :class:`HFCheckpoint` lists those tensors under the flat names (``model.*``, ``visual.*``)
the rest of the package uses, and :meth:`HFCheckpoint.key` gives the file's own name back."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpc_mca.models.errors import ModelLoadError

__all__ = ["INDEX_FILE", "MAX_HEADER_BYTES", "SINGLE_FILE", "HFCheckpoint", "TensorInfo", "file_key",
           "flat_name", "read_header"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own limit

_NESTED = (("model.language_model.", "model."), ("model.visual.", "visual."))
"""(a nested checkpoint's prefix, the flat name's) of a vision-language model's tensors."""


def flat_name(key: str) -> str:
    """The flat name of a tensor a checkpoint calls ``key``."""
    for nested, flat in _NESTED:
        if key.startswith(nested):
            return flat + key.removeprefix(nested)
    return key


def file_key(name: str, nested: bool) -> str:
    """What a checkpoint in the nested layout (``nested``) calls the tensor named ``name``."""
    if nested:
        for nested_prefix, flat in _NESTED:
            if name.startswith(flat):
                return nested_prefix + name.removeprefix(flat)
    return name


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
    """Tensor name (flat) -> file name inside ``directory``."""
    index_path: Path | None = None
    """The index file of a sharded checkpoint; None for a single ``model.safetensors``."""
    keys: Mapping[str, str] = field(default_factory=dict)
    """Flat name -> the file's own name, where they differ (a nested VL checkpoint)."""

    @classmethod
    def open(cls, directory: Path) -> HFCheckpoint:
        """Find the checkpoint in ``directory`` (index first, then a single file)."""
        index = directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ModelLoadError(f"{index}: unreadable index ({err!r})") from None
            return cls._flat(directory, dict(weight_map), index)
        single = directory / SINGLE_FILE
        if single.is_file():
            return cls._flat(directory, dict.fromkeys(read_header(single), SINGLE_FILE), None)
        raise ModelLoadError(
            f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints "
            "are supported)"
        )

    @classmethod
    def _flat(cls, directory: Path, weight_map: dict[str, str], index: Path | None
              ) -> HFCheckpoint:
        keys = {flat_name(key): key for key in weight_map if flat_name(key) != key}
        flat = {flat_name(key): file for key, file in weight_map.items()}
        return cls(directory, flat, index, keys)

    def key(self, tensor: str) -> str:
        """The file's own name of the tensor named ``tensor`` here."""
        return self.keys.get(tensor, tensor)

    @property
    def listing(self) -> Path:
        """The file that says which tensors exist: the index, or the single file."""
        return self.index_path or self.directory / SINGLE_FILE

    def path_of(self, tensor: str) -> Path:
        return self.directory / self.weight_map[tensor]
