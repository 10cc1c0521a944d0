"""Hugging Face safetensors checkpoints: locate, pre-check from headers, read slices.

A checkpoint is ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
:func:`inspect_checkpoint` reads only the JSON headers of the shard files (a few KB each, no
tensor data) and compares them with what the config implies, so that every rank fails with the
same one-line :class:`ModelLoadError` (naming file and tensor) before any of them allocates the
model or enters a collective. :class:`SliceReader` then opens, lazily, only the shards that hold
pieces a rank needs and reads just those rows/columns (``safe_open(...).get_slice``), so a rank's
memory stays near what it owns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.hf_config import HFModelSpec
from hpc_mca.models.hf_files import (
    INDEX_FILE,
    MAX_HEADER_BYTES,
    SINGLE_FILE,
    HFCheckpoint,
    TensorInfo,
    read_header,
)
from hpc_mca.models.mapping import Piece, hf_tensor_shapes

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFCheckpoint",
    "SliceReader",
    "inspect_checkpoint",
    "read_header",
    "weights_fingerprint",
]

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")

def inspect_checkpoint(spec: HFModelSpec, directory: Path | None = None) -> HFCheckpoint:
    """Check that the checkpoint holds every tensor ``spec`` implies, with matching shapes.

    Reads headers only, except for a tied model that saved an ``lm_head.weight`` (both vocab
    matrices are compared: :func:`_check_tied_head`). Raises ModelLoadError naming the file and
    the tensor for a missing shard file, a missing tensor, a shape mismatch, a non-float dtype
    or a tied head that differs from the embedding. Other extra tensors are ignored.
    """
    directory = directory or spec.directory
    if directory is None:
        raise ModelLoadError(f"{spec.source}: no model directory to read weights from")
    ckpt = HFCheckpoint.open(Path(directory))
    expected = hf_tensor_shapes(spec)
    _check_files_exist(ckpt, expected)
    headers: dict[str, dict[str, TensorInfo]] = {}
    for name, shape in expected.items():
        if name not in ckpt.weight_map:
            raise ModelLoadError(
                f"{ckpt.listing}: tensor {name} is missing ({spec.source} with model_type "
                f"{spec.model_type!r} needs it)"
            )
        file = ckpt.weight_map[name]
        if file not in headers:
            headers[file] = read_header(ckpt.directory / file)
        _check_tensor(ckpt, spec, name, shape, headers[file])
    _check_tied_head(ckpt, spec)
    return ckpt


_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _check_tied_head(ckpt: HFCheckpoint, spec: HFModelSpec) -> None:
    """A config that ties the output layer to the embedding, over a checkpoint whose
    ``lm_head.weight`` is another matrix: transformers loads it untied (and warns); tied here it
    would be another model. Refused; an equal copy (what a tied model's save may write) loads."""
    if not spec.tie_word_embeddings or _HEAD not in ckpt.weight_map or _EMBED not in ckpt.weight_map:
        return
    import torch
    from safetensors import safe_open

    with safe_open(str(ckpt.path_of(_HEAD)), framework="pt") as head_file, \
            safe_open(str(ckpt.path_of(_EMBED)), framework="pt") as embed_file:
        head, embed = head_file.get_tensor(ckpt.key(_HEAD)), embed_file.get_tensor(ckpt.key(_EMBED))
    if head.shape != embed.shape or not torch.equal(head, embed):
        raise ModelLoadError(
            f"{ckpt.path_of(_HEAD)}: {_HEAD} differs from {_EMBED} while {spec.source} ties them "
            "(tie_word_embeddings=true; transformers would load them untied); valid: "
            "tie_word_embeddings false in config.json, or no lm_head.weight (or an equal one)")


def _check_files_exist(ckpt: HFCheckpoint, expected: Mapping[str, Any]) -> None:
    holders: dict[str, str] = {}  # file -> a tensor it should hold, preferring needed ones
    for needed_only in (True, False):
        for name, file in ckpt.weight_map.items():
            if name in expected or not needed_only:
                holders.setdefault(file, name)
    for file, tensor in holders.items():
        if not (ckpt.directory / file).is_file():
            raise ModelLoadError(
                f"{ckpt.directory / file}: shard file is missing (listed in {ckpt.listing} "
                f"for tensor {tensor})"
            )


def _check_tensor(
    ckpt: HFCheckpoint,
    spec: HFModelSpec,
    name: str,
    shape: tuple[int, ...],
    header: Mapping[str, TensorInfo],
) -> None:
    path = ckpt.path_of(name)
    info = header.get(ckpt.key(name))
    if info is None:
        raise ModelLoadError(f"{path}: tensor {name} is missing (listed in {ckpt.listing})")
    if info.shape != shape:
        raise ModelLoadError(
            f"{path}: tensor {name} has shape {list(info.shape)} but {spec.source} implies "
            f"{list(shape)}"
        )
    if info.dtype not in _FLOAT_DTYPES:
        raise ModelLoadError(
            f"{path}: tensor {name} has dtype {info.dtype} (supported: {', '.join(_FLOAT_DTYPES)})"
        )


class SliceReader(contextlib.AbstractContextManager["SliceReader"]):
    """Reads pieces of HF tensors, opening each shard file on first use only."""

    def __init__(self, ckpt: HFCheckpoint) -> None:
        self._ckpt = ckpt
        self._files: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    @property
    def opened(self) -> list[str]:
        """File names opened so far (the tests check that a rank opened only what it needs)."""
        return sorted(self._files)

    def read(self, piece: Piece) -> Any:
        """The piece as a CPU tensor in the checkpoint's dtype."""
        from safetensors import safe_open

        file = self._ckpt.weight_map[piece.hf_name]
        if file not in self._files:
            path = self._ckpt.directory / file
            self._files[file] = self._stack.enter_context(safe_open(str(path), framework="pt"))
        handle = self._files[file]
        if piece.dim is None:
            return handle.get_tensor(self._ckpt.key(piece.hf_name))
        view = handle.get_slice(self._ckpt.key(piece.hf_name))
        if piece.dim == 0:
            return view[piece.hf_start : piece.hf_stop]
        return view[:, piece.hf_start : piece.hf_stop]

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()


_SAMPLES = 16
_SAMPLE_BYTES = 64 << 10


def weights_fingerprint(directory: str | Path) -> str:
    """A SHA-256 that tells one model's weights from another's without reading them all:
    config.json, and for every ``*.safetensors`` file its name, size, header (every tensor's
    name, dtype, shape and offsets) and 16 samples of 64 KiB spread evenly over its data. Two
    checkpoints of the same shape (say a fine-tune of the base) differ in the sampled bytes;
    reading costs about 1 MiB per file whatever the model's size. A directory with no weights
    (a config for a seeded random init) is fingerprinted by its config.json alone."""
    import hashlib

    root = Path(directory)
    digest = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            digest.update(handle.read(min(header_size, MAX_HEADER_BYTES)))
            start = 8 + header_size
            span = max(size - start - _SAMPLE_BYTES, 0)
            for i in range(_SAMPLES):
                handle.seek(start + span * i // max(_SAMPLES - 1, 1))
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()
