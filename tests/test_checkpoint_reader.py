"""library/io.CheckpointReader reads tensors into memory of their own (pread), not as views of a
mapped file: aligned data (views were only 8-byte aligned, or worse, and CPU kernels round
differently on them) and no mapping kept alive by a loaded model. Bad files are one line."""

import os

import pytest
import torch
from safetensors.torch import save_file

from library.io import CheckpointError, CheckpointReader


def test_tensors_are_aligned_owned_copies_equal_to_the_file(tmp_path):
    path = str(tmp_path / "a.safetensors")
    # 3 bf16 values (6 bytes) first: every tensor after it starts off any 8-byte boundary in the file
    tensors = {"a": torch.randn(3).bfloat16(), "b": torch.randn(5, 7), "c": torch.randn(4).to(torch.float8_e4m3fn),
               "d": torch.arange(6), "e": torch.zeros(0, 3)}
    save_file(tensors, path)
    reader = CheckpointReader(path)
    assert reader.keys() == sorted(tensors)
    for name, expected in tensors.items():
        got = reader.get(name)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)) if got.numel() else True
        assert got.numel() == 0 or got.data_ptr() % 64 == 0, name
        got.add_(1) if got.is_floating_point() and got.dtype.itemsize > 1 else None  # writable, not a read-only map


def test_truncated_and_foreign_files_are_one_line_naming_the_file(tmp_path):
    path = str(tmp_path / "a.safetensors")
    save_file({"w": torch.randn(64, 64)}, path)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(CheckpointError, match=r"a\.safetensors: tensor 'w' .* outside the file"):
        CheckpointReader(path)
    other = str(tmp_path / "b.safetensors")
    with open(other, "wb") as f:
        f.write(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=r"b\.safetensors: not a safetensors file"):
        CheckpointReader(other)
    assert os.path.exists(other)
