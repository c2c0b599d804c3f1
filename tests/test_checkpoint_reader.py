"""library/io.CheckpointReader reads tensors into memory of their own (pread), not as views of a
mapped file: aligned data (views were only 8-byte aligned, or worse, and CPU kernels round
differently on them) and no mapping kept alive by a loaded model; on the file's pages only where asked
(a LoRA's whole deltas, added once). Bad files are one line."""

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


def on_pages_of(path: str, t: torch.Tensor) -> bool:
    """Whether t's memory lies in a mapping of the file `path` (/proc/self/maps)."""
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, *_, name = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in span.split("-"))
            if name.strip() == os.path.realpath(path) and low <= ptr < high:
                return True
    return False


def test_mapped_tensors_lie_on_the_files_pages_where_aligned_and_are_the_same_values(tmp_path):
    """get(mapped=True), for the whole deltas a merge adds once (a file as large as the model): a tensor on the file's
    pages, copy-on-write (writable, the file unchanged); one at an offset its dtype cannot view, an empty one, read
    into memory of its own; a file cut short is one line."""
    path = str(tmp_path / "a.safetensors")
    tensors = {"a": torch.randn(3).bfloat16(), "b": torch.randn(5, 7), "c": torch.randn(64, 64), "e": torch.zeros(0, 3)}
    save_file(tensors, path)
    reader = CheckpointReader(path)
    got = {name: reader.get(name, mapped=True) for name in tensors}
    for name, expected in tensors.items():
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name
    entries, start = reader._headers[0]
    for name in ("b", "c"):
        aligned = (start + entries[name]["data_offsets"][0]) % 4 == 0
        assert on_pages_of(path, got[name]) == aligned, name
    assert any(on_pages_of(path, t) for t in got.values()) and not on_pages_of(path, got["e"])
    before = open(path, "rb").read()
    got["c"].add_(1)
    assert open(path, "rb").read() == before and torch.equal(CheckpointReader(path).get("c"), tensors["c"])
    with open(path, "r+b") as f:
        f.truncate(len(before) - 64)
    with pytest.raises(CheckpointError, match=r"a\.safetensors: truncated inside tensor 'c'"):
        reader_again(reader).get("c", mapped=True)


def reader_again(reader: CheckpointReader) -> CheckpointReader:
    """The reader's headers, read before the file was cut, without its mappings."""
    again = CheckpointReader.__new__(CheckpointReader)
    again.__dict__.update(reader.__dict__, _maps={})
    return again


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


def test_a_folder_of_two_checkpoints_is_refused_naming_a_shared_key_and_both_files(tmp_path, tiny_set):
    """A folder's .safetensors files (no index) are read as one checkpoint's shards: a folder holding two
    checkpoints (dev beside schnell, bf16 beside fp8) loaded as one, each shared key from the last file,
    without a word. Now one line naming a shared key and both files; shards with distinct keys still load."""
    import shutil

    from library.models.flux1.checkpoint import load_flux

    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({"a": torch.ones(2)}, str(shards / "part-1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(shards / "part-2.safetensors"))
    assert CheckpointReader(str(shards)).keys() == ["a", "b"]
    folder = tmp_path / "flux"
    folder.mkdir()
    shutil.copy(tiny_set["flux_bfl"], folder / "flux1-dev.safetensors")
    shutil.copy(tiny_set["flux_bfl"], folder / "flux1-schnell.safetensors")
    with pytest.raises(CheckpointError) as caught:
        load_flux(str(folder))
    line = str(caught.value)
    assert line.startswith(f"{folder}: '") and "' is in both flux1-dev.safetensors and flux1-schnell.safetensors: " \
        "a folder's .safetensors files are read as one checkpoint's shards; keep one checkpoint in the folder, " \
        "or give the file" in line and "\n" not in line, line


def test_batchnorm_step_counter_may_be_absent_but_nothing_else(tmp_path):
    """AutoencoderKLFlux2 has a BatchNorm; files may leave out its num_batches_tracked counter
    (unused outside training). Its running statistics and every other key stay required."""
    from library.io import load_streaming

    def build():
        with torch.device("meta"):
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))

    source = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    source[1].running_var.fill_(2.0)
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}
    save_file(state, tmp_path / "bn.safetensors")
    model = build()
    load_streaming(model, CheckpointReader(str(tmp_path / "bn.safetensors")), rename=lambda k: k)
    assert torch.equal(model[1].running_var, source[1].running_var) and int(model[1].num_batches_tracked) == 0
    save_file({k: v for k, v in state.items() if k != "1.running_mean"}, tmp_path / "no_mean.safetensors")
    with pytest.raises(CheckpointError, match="missing keys: 1.running_mean"):
        load_streaming(build(), CheckpointReader(str(tmp_path / "no_mean.safetensors")), rename=lambda k: k)


def test_prepared_convert_takes_prepares_hook_or_the_convert_given_never_both():
    """The loaders' one rule (library/io.py prepared_convert): prepare's hook is the convert hook;
    prepare returning the model (prepare_fp8) is no hook; a hook given both ways is refused."""
    from library.io import prepared_convert

    model, hook, convert = torch.nn.Linear(2, 2), (lambda key, t: {key: t}), (lambda key, t: {key: t})
    assert prepared_convert(model, lambda m: hook, None, "load_x") is hook
    assert prepared_convert(model, lambda m: m, convert, "load_x") is convert
    assert prepared_convert(model, None, convert, "load_x") is convert
    with pytest.raises(ValueError, match="load_x: give the convert hook either as convert= or as prepare's result"):
        prepared_convert(model, lambda m: hook, convert, "load_x")
