"""Checkpoint I/O shared by every model: safetensors reading tensor by tensor, streaming loads
into modules built on the `meta` device, and atomic writes.

Only safetensors files are read (no pickle). A checkpoint is a single `.safetensors` file, a
sharded set with a `*.safetensors.index.json`, or a folder holding either.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Callable, Iterator

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the file and the key."""


def safetensors_files(path: str) -> list[str]:
    """The .safetensors files that make up the checkpoint at `path` (file, index or folder)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    if os.path.isfile(path):
        if path.endswith(".index.json"):
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(os.path.dirname(path), s) for s in shards]
        if not path.endswith(".safetensors"):
            raise CheckpointError(f"{path}: expected a .safetensors file (other formats are not loaded)")
        return [path]
    indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
    if indexes:
        return safetensors_files(os.path.join(path, indexes[0]))
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: folder holds no .safetensors file")
    return files


def component_folder(path: str, name: str) -> str:
    """`path/name` when `path` is a diffusers pipeline folder holding that component
    (transformer, vae, text_encoder, ...), else `path` itself (a component folder or a file)."""
    folder = os.path.join(path, name)
    return folder if os.path.isdir(folder) else path


class CheckpointReader:
    """Read-only view of one checkpoint's tensors across its shards, one tensor at a time."""

    def __init__(self, path: str):
        self.path = path
        self.files = safetensors_files(path)
        self._handles = [safe_open(f, framework="pt", device="cpu") for f in self.files]
        self._where: dict[str, int] = {}
        for i, h in enumerate(self._handles):
            for k in h.keys():
                self._where[k] = i
        self.metadata: dict[str, str] = dict(self._handles[0].metadata() or {})

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def file_of(self, key: str) -> str:
        return os.path.basename(self.files[self._where[key]])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[key]].get_slice(key).get_shape())

    def dtype_name(self, key: str) -> str:
        """safetensors dtype string of a tensor ("BF16", "F8_E4M3", ...) without reading it."""
        return self._handles[self._where[key]].get_slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k in self._where:
            yield k, self.get(k)


def strip_prefix(keys: list[str], prefixes: tuple[str, ...]) -> str:
    """The first of `prefixes` that every key starts with ('' if none)."""
    for p in prefixes:
        if keys and all(k.startswith(p) for k in keys):
            return p
    return ""


def _few(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" ... ({len(keys)} in all)" if len(keys) > 5 else "")


def load_streaming(
    model: nn.Module,
    reader: CheckpointReader,
    rename: Callable[[str], str | None],
    dtype: torch.dtype | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    keep_dtype: Callable[[str], bool] = lambda name: False,
) -> None:
    """Load `reader` into `model` (typically built on `meta`) one tensor at a time.

    rename: checkpoint key -> model key, or None to skip the tensor.
    dtype: floating tensors are cast to it straight after reading (None keeps the file dtype),
        except where keep_dtype(model_key) or convert.keep_dtype(model_key) (if convert has one) is True.
    convert: optional per-tensor hook (model_key, tensor) -> {model_key: tensor}, used to split
        fused tensors or to quantize while loading. Peak memory is one model plus one tensor.
    Missing/unexpected keys and shape mismatches raise CheckpointError naming file and key.
    """
    # A convert hook may name tensors it wants in the file's dtype (e.g. fp8 quantizes from the source).
    convert_keeps = getattr(convert, "keep_dtype", lambda name: False)
    expected = dict(model.state_dict(keep_vars=True))
    loaded: dict[str, torch.Tensor] = {}
    unexpected = []
    for ckpt_key in reader.keys():
        name = rename(ckpt_key)
        if name is None:
            continue
        tensor = reader.get(ckpt_key)
        if dtype is not None and tensor.is_floating_point() and not (keep_dtype(name) or convert_keeps(name)):
            tensor = tensor.to(dtype)
        parts = convert(name, tensor) if convert else {name: tensor}
        for key, value in parts.items():
            if key not in expected:
                unexpected.append(ckpt_key)
                continue
            if tuple(value.shape) != tuple(expected[key].shape):
                raise CheckpointError(
                    f"{reader.path}: {reader.file_of(ckpt_key)}: key '{ckpt_key}' has shape {tuple(value.shape)}, "
                    f"the model expects {tuple(expected[key].shape)} for '{key}'"
                )
            loaded[key] = value
    missing = [k for k in expected if k not in loaded]
    if unexpected:
        raise CheckpointError(f"{reader.path}: unexpected keys for this model: {_few(unexpected)}")
    if missing:
        raise CheckpointError(f"{reader.path}: missing keys: {_few(missing)}")
    model.load_state_dict(loaded, strict=True, assign=True)


def make_parent_folder(path: str) -> str:
    """Create the folder `path` goes in (and its parents); returns it. A file where a folder must
    be is named in the error (os.makedirs would only say 'File exists')."""
    folder = os.path.dirname(os.path.abspath(path))
    blocker = folder
    while not os.path.exists(blocker):
        blocker = os.path.dirname(blocker)
    if not os.path.isdir(blocker):
        raise NotADirectoryError(f"{path}: cannot be written, '{blocker}' is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    return folder


@contextlib.contextmanager
def atomic_path(path: str):
    """Yield a temporary path beside `path`; on success it is renamed over `path` (atomic on
    POSIX), on failure removed. A crash leaves either the old file or the new one, never half."""
    folder = make_parent_folder(path)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the result should look like any written file
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def atomic_folder(path: str):
    """Yield a temporary folder beside `path` to fill; on success it takes the place of `path` (an
    older folder there is moved aside first and removed after), on failure it is removed. A crash
    leaves the old folder, the new one, or the old one under a hidden `.old` name, never a mix."""
    folder = make_parent_folder(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path}: a file is there; expected a folder (or nothing)")
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700
    old = None
    try:
        yield tmp
        if os.path.isdir(path):
            old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".old", dir=folder)
            os.replace(path, os.path.join(old, "folder"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        if old and os.path.isdir(path):  # the old folder goes only once the new one is in place
            shutil.rmtree(old)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None):
    """Atomic safetensors write; tensors are made contiguous CPU tensors first."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=metadata)


def write_text(path: str, text: str):
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
