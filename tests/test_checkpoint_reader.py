"""The direct checkpoint reader (hpc_mca/checkpoint/reader.py): loads through it equal loads
through PyTorch's own reader and the saved values, for every kind of record and destination.

The checkpoint is a real torch_dist one, written and read by Megatron's dist_checkpointing in a
worker process (tests/checkpoint_reader_worker.py: the CPU compat layer it needs is
process-global). Multi-rank loads (resharding over TP/PP/DP/EP, the optimizer formats) go
through the same reader in test_checkpoint.py and test_optimizer_format.py.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpc_mca.checkpoint.reader import _stored_view

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_reader_worker import saved_tensors  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("reader")
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "checkpoint_reader_worker.py"),
                           str(workdir)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(workdir / "loaded.pt", weights_only=False)


@pytest.mark.parametrize("reader", ["direct", "torch"])
def test_whole_tensors_and_objects_load_as_saved(loaded: dict, reader: str) -> None:
    got = loaded["whole"][reader]
    for key, t in saved_tensors().items():
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    assert got["extra"]["step"] == 7 and torch.equal(got["extra"]["rng"], torch.arange(3))


@pytest.mark.parametrize("reader", ["direct", "torch"])
@pytest.mark.parametrize("axis", [0, 1])
def test_slices_of_a_stored_tensor_land_in_their_destinations(loaded: dict, reader: str,
                                                              axis: int) -> None:
    """A rank that holds part of a tensor reads part of a stored record: a row block (one
    contiguous run of the record) or a column block (strided: PyTorch's path reads it)."""
    for index in range(2):
        expected = saved_tensors()["fp32"].chunk(2, dim=axis)[index]
        assert torch.equal(loaded[f"part_axis{axis}_{index}"][reader]["fp32"], expected)


@pytest.mark.parametrize("reader", ["direct", "torch"])
def test_strided_and_other_dtype_destinations(loaded: dict, reader: str) -> None:
    """A destination that is a transposed view, or of another dtype, receives the values
    (read into a buffer, then copied)."""
    got = loaded["other_destinations"][reader]
    assert torch.equal(got["fp32"], saved_tensors()["fp32"])
    assert got["bf16"].dtype == torch.float32
    assert torch.equal(got["bf16"], saved_tensors()["bf16"].float())


def test_the_layout_points_at_the_tensors_bytes(tmp_path: Path) -> None:
    """The parsed layout of a torch.save archive names the file offset of exactly the requested
    elements, and refuses (None) a request that is not one contiguous run."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    buffer = io.BytesIO()
    buffer.write(b"x" * 100)  # the record starts inside a larger file
    torch.save(tensor, buffer)
    path = tmp_path / "records.bin"
    path.write_bytes(buffer.getvalue())

    def request(offsets: tuple[int, int], lengths: tuple[int, int]) -> ReadItem:
        return ReadItem(LoadItemType.TENSOR, MetadataIndex("t"), torch.Size([0, 0]),
                        MetadataIndex("t"), torch.Size(offsets), torch.Size(lengths))

    with open(path, "rb", buffering=0) as stream:
        length = len(buffer.getvalue()) - 100
        for offsets, lengths in [((0, 0), (4, 6)), ((2, 0), (2, 6)), ((3, 0), (1, 6))]:
            dtype, position = _stored_view(stream, 100, length, request(offsets, lengths))
            expected = tensor[offsets[0]:offsets[0] + lengths[0]]
            data = path.read_bytes()[position:position + expected.numel() * 4]
            assert dtype == torch.float32
            assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).view(lengths), expected)
        assert _stored_view(stream, 100, length, request((0, 2), (4, 3))) is None
    transposed = tmp_path / "transposed.bin"
    torch.save(tensor.t(), transposed)  # a (6, 4) view with strides (1, 6)
    with open(transposed, "rb", buffering=0) as stream:
        assert _stored_view(stream, 0, transposed.stat().st_size, request((0, 0), (6, 4))) is None
