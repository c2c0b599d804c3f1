"""Checkpoint I/O shared by every model: safetensors reading tensor by tensor, streaming loads
into modules built on the `meta` device, and atomic writes.

Only safetensors and GGUF files are read (no pickle). A checkpoint is a single `.safetensors` file, a
sharded set with a `*.safetensors.index.json`, a folder holding either, or a single `.gguf` file
(the transformers people run with ComfyUI-GGUF). A GGUF file reads through the same CheckpointReader:
keys, shapes in torch order, its ggml type names as dtype names ("F32", "BF16", "Q8_0", "Q4_K", ...)
and, for block-quantized types, the packed blocks as uint8 [*rows, bytes per row]
(library/precision/gguf_weights.py turns them into weights).

Every file written here gets the mode the umask gives an ordinary file (0644 under umask 022), so
other users (a ComfyUI container) can read it; a full disk is one error naming the file; a lock file
keeps two processes from writing the same outputs (held_lock) or lets several share a folder and one
of them tell whether it is alone there (SharedLock).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import mmap
import os
import re
import socket
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import save_file

from library.text_files import read_utf8  # noqa: F401  (re-exported: the loaders import it from here)
from library.atomic_files import (  # noqa: F401  (re-exported: written files live there, torch-free)
    NO_SPACE, DiskFullError, atomic_folder, atomic_path, atomic_target, left_behind, make_parent_folder,
    name_limit, naming_a_full_disk, recover_folder, temporary_name, umask_mode, write_text)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the file and the key."""


class LockedError(OSError):
    """Another live process holds the lock file; the message names it, its pid and host."""


GGUF_SUFFIX = ".gguf"


def safetensors_files(path: str) -> list[str]:
    """The .safetensors files that make up the checkpoint at `path` (file, index or folder), or
    the one .gguf file it is."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    if os.path.isfile(path):
        if path.endswith(".index.json"):
            with open(path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(os.path.dirname(path), s) for s in shards]
        if not path.endswith((".safetensors", GGUF_SUFFIX)):
            raise CheckpointError(f"{path}: expected a .safetensors or .gguf file (other formats are not loaded)")
        return [path]
    indexes = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
    if indexes:
        return safetensors_files(os.path.join(path, indexes[0]))
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: folder holds no .safetensors file")
    return files


def read_json_file(path: str) -> Any:
    """A model folder's JSON file (config.json, tokenizer_config.json): a broken one is one CheckpointError naming it,
    not json's bare "Invalid control character at: line 1 column 6" after the latents were cached."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def component_folder(path: str, name: str) -> str:
    """`path/name` when `path` is a diffusers pipeline folder holding that component
    (transformer, vae, text_encoder, ...), else `path` itself (a component folder or a file)."""
    folder = os.path.join(path, name)
    return folder if os.path.isdir(folder) else path


# safetensors dtype names -> torch dtypes (the format is little-endian, as every machine we run on)
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "BOOL": torch.bool,
}  # fmt: skip


def _read_header(path: str) -> tuple[dict, dict[str, str], int]:
    """(tensor entries, metadata, offset of the data) of a safetensors file, from its JSON header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise CheckpointError(f"{path}: not a safetensors file (header length {length}, file size {size})")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    metadata = header.pop("__metadata__", None) or {}
    for key, entry in header.items():
        begin, end = entry.get("data_offsets", (0, -1))
        if entry.get("dtype") not in ST_DTYPES or not 0 <= begin <= end <= size - 8 - length:
            raise CheckpointError(f"{path}: tensor '{key}' has dtype {entry.get('dtype')!r} / data {begin}..{end} "
                                  f"outside the file (truncated or not safetensors)")
    return header, metadata, 8 + length


def _gguf_value(field):
    """A GGUF metadata value as the string a safetensors header would hold (lists as JSON)."""
    value = field.contents()
    return value if isinstance(value, str) else json.dumps(value)


def _read_gguf_header(path: str) -> tuple[dict, dict[str, str], int]:
    """(tensor entries, metadata, 0) of a GGUF file, in _read_header's form: shapes in torch order
    (ggml stores them innermost first), data offsets from the start of the file, and for
    block-quantized types the packed shape [*rows, row bytes] under "packed". ComfyUI-GGUF's
    `comfy.gguf.orig_shape.<name>` (a tensor reshaped to fit ggml's 4 dimensions) gives the shape."""
    from gguf import GGML_QUANT_SIZES, GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:  # the package's parse errors: bad magic, truncation
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated, or not GGUF: {e})") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: a big-endian GGUF file; only little-endian files are read")
    size = os.path.getsize(path)
    metadata = {name: _gguf_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    entries = {}
    for t in reader.tensors:
        stored = [int(n) for n in reversed(t.shape.tolist())]
        name, kind = t.tensor_type.name, t.tensor_type
        block, block_bytes = GGML_QUANT_SIZES[kind]
        entry = {"dtype": name, "shape": stored, "data_offsets": [t.data_offset, t.data_offset + t.n_bytes]}
        if name not in ST_DTYPES:
            entry["packed"] = [*stored[:-1], stored[-1] // block * block_bytes] if stored else [block_bytes]
        orig = metadata.get(f"comfy.gguf.orig_shape.{t.name}")
        if orig is not None:
            entry["shape"] = [int(n) for n in json.loads(orig)]
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(f"{path}: tensor '{t.name}' ({name} {stored}) ends past the end of the file (truncated)")
        entries[t.name] = entry
    return entries, metadata, 0


class CheckpointReader:
    """Read-only view of one checkpoint's tensors across its shards, one tensor at a time.

    Tensors are read with pread into fresh memory, not mapped: a loaded model then owns aligned
    memory of its own (no tensor pins a mapping of a 24 GB file), and the process's RSS counts
    what it holds, not every page of the checkpoint it has looked at (those stay in the page cache)."""

    def __init__(self, path: str):
        self.path = path
        self.files = safetensors_files(path)
        self._headers, self._where = [], {}
        self._maps: dict[int, mmap.mmap] = {}  # file index -> its private mapping (get(mapped=True))
        for i, f in enumerate(self.files):
            entries, metadata, data_start = _read_gguf_header(f) if f.endswith(GGUF_SUFFIX) else _read_header(f)
            self._headers.append((entries, data_start))
            if i == 0:
                self.metadata: dict[str, str] = dict(metadata)
            for k in sorted(entries):  # safe_open's order: sorted by name
                if k in self._where:  # a folder of two checkpoints (two releases, bf16 beside fp8) is no set of shards
                    raise CheckpointError(f"{path}: '{k}' is in both {os.path.basename(self.files[self._where[k]])} "
                                          f"and {os.path.basename(f)}: a folder's .safetensors files are read as one "
                                          f"checkpoint's shards; keep one checkpoint in the folder, or give the file")
                self._where[k] = i

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def file_of(self, key: str) -> str:
        return os.path.basename(self.files[self._where[key]])

    def _entry(self, key: str) -> dict:
        return self._headers[self._where[key]][0][key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._entry(key)["shape"])

    def numel(self, keys=None) -> int:
        """Elements of `keys` (default: every tensor), from the headers alone."""
        return sum(math.prod(self.shape(k)) for k in (self.keys() if keys is None else keys))

    def dtype_name(self, key: str) -> str:
        """safetensors dtype string of a tensor ("BF16", "F8_E4M3", ...), or a GGUF file's ggml type
        name ("F32", "Q8_0", "Q4_K", ...), without reading it."""
        return self._entry(key)["dtype"]

    def is_block_quantized(self, key: str) -> bool:
        """A GGUF tensor stored in ggml blocks (Q8_0, Q4_K, ...): get() gives its packed bytes."""
        return "packed" in self._entry(key)

    def get(self, key: str, mapped: bool = False) -> torch.Tensor:
        """The tensor in fresh memory; mapped: on the file's pages where its offset allows (a private, copy-on-write
        mapping: pages the kernel may drop and read again, not memory of the process's own), for a file read once
        and whole that may be as large as a model (a LoRA of whole deltas, merge_lora's and generate.py's)."""
        i = self._where[key]
        entries, data_start = self._headers[i]
        entry = entries[key]
        begin, end = entry["data_offsets"]
        if "packed" in entry:  # ggml blocks: uint8 [*rows, bytes per row], as stored
            out = torch.empty(entry["packed"], dtype=torch.uint8)
        else:
            out = torch.empty(entry["shape"], dtype=ST_DTYPES[entry["dtype"]])
        if out.numel() * out.element_size() != end - begin:
            raise CheckpointError(f"{self.files[i]}: tensor '{key}' holds {end - begin} bytes, not "
                                  f"{out.numel() * out.element_size()} for {entry['dtype']} {entry['shape']}")
        if mapped and out.numel() and (data_start + begin) % out.element_size() == 0 and "packed" not in entry:
            if os.path.getsize(self.files[i]) < data_start + end:
                raise CheckpointError(f"{self.files[i]}: truncated inside tensor '{key}'")
            if i not in self._maps:
                with open(self.files[i], "rb") as f:
                    self._maps[i] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            return torch.frombuffer(self._maps[i], dtype=out.dtype, count=out.numel(),
                                    offset=data_start + begin).view(out.shape)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if end > begin else memoryview(b"")
        with open(self.files[i], "rb", buffering=0) as f:
            done = 0
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:]], data_start + begin + done)
                if n <= 0:
                    raise CheckpointError(f"{self.files[i]}: truncated inside tensor '{key}'")
                done += n
        return out

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k in self._where:
            yield k, self.get(k)

    def rename(self, names: dict[str, str]) -> None:
        """From now on read each key of `names` (old -> new, no new one an existing key) under its new name;
        keys() stays sorted by name."""
        for old, new in names.items():
            i = self._where.pop(old)
            entries = self._headers[i][0]
            entries[new] = entries.pop(old)
            self._where[new] = i
        self._where = dict(sorted(self._where.items()))

    def leave_out(self, keys) -> None:
        """From now on read as if the file did not hold `keys`."""
        for key in keys:
            del self._where[key]


class RowSplitView:
    """A CheckpointReader seen under a family's own names, where a fused Linear of the file (an attention
    qkv, an MLP gate_up) is read as `parts` equal row blocks. A
    subclass fills `sources`: our key -> (file key, None for the whole tensor, or i for its i-th row
    block); a tensor that describes the whole fused layer (a per-tensor scale) maps whole to every part.
    Splitting rows keeps a pre-quantized file's weights exact: GGUF blocks and fp8 row / 64-column scales
    run along the input. A fused tensor is read once for all its parts (the last one is kept)."""

    parts: int
    part_names: str  # what the parts are ("q / k / v"), for the error naming a bad shape

    def __init__(self, reader: CheckpointReader):
        self.reader, self.path, self.files, self.metadata = reader, reader.path, reader.files, reader.metadata
        self.sources: dict[str, tuple[str, int | None]] = {}
        self._fused: tuple[str, torch.Tensor] | None = None

    def keys(self) -> list[str]:
        return list(self.sources)

    def __contains__(self, key: str) -> bool:
        return key in self.sources

    def shape(self, key: str) -> tuple[int, ...]:
        source, part = self.sources[key]
        shape = self.reader.shape(source)
        if part is None:
            return shape
        if not shape or shape[0] % self.parts:
            raise CheckpointError(f"{self.path}: {self.file_of(key)}: key '{source}' has shape {shape}, not "
                                  f"{self.parts} equal {self.part_names} row blocks")
        return (shape[0] // self.parts, *shape[1:])

    def numel(self, keys=None) -> int:
        return sum(math.prod(self.shape(k)) for k in (self.keys() if keys is None else keys))

    def dtype_name(self, key: str) -> str:
        return self.reader.dtype_name(self.sources[key][0])

    def is_block_quantized(self, key: str) -> bool:
        return self.reader.is_block_quantized(self.sources[key][0])

    def file_of(self, key: str) -> str:
        return self.reader.file_of(self.sources[key][0])

    def get(self, key: str) -> torch.Tensor:
        source, part = self.sources[key]
        if part is None:
            return self.reader.get(source)
        rows = self.shape(key)[0]  # checks the split first
        if self._fused is None or self._fused[0] != source:
            self._fused = (source, self.reader.get(source))
        return self._fused[1][part * rows : (part + 1) * rows].clone()  # its own memory: the fused tensor is let go


class RowJoinView:
    """A CheckpointReader (a diffusers folder) seen under a family's own names, where one of our fused tensors is the
    file's parts concatenated by rows (to_q / to_k / to_v read as our qkv): parts_of(our key) -> the file's keys, in
    row order. A file key none of ours takes keeps its own name (the key check names it); `transform(our key,
    tensor)` is a subclass's last step (a layer whose halves the file stores swapped)."""

    def __init__(self, reader: CheckpointReader, our_keys, parts_of: Callable[[str], tuple[str, ...]]):
        self.reader, self.path, self.files, self.metadata = reader, reader.path, reader.files, reader.metadata
        names_of = {key: parts_of(key) for key in our_keys}
        self.sources = {key: names for key, names in names_of.items() if all(n in reader for n in names)}
        taken = {name for names in self.sources.values() for name in names}
        self.sources.update({name: (name,) for name in reader.keys() if name not in taken})

    def keys(self) -> list[str]:
        return list(self.sources)

    def __contains__(self, key: str) -> bool:
        return key in self.sources

    def shape(self, key: str) -> tuple[int, ...]:
        shapes = [self.reader.shape(name) for name in self.sources[key]]
        return (sum(s[0] for s in shapes), *shapes[0][1:]) if len(shapes) > 1 else shapes[0]

    def dtype_name(self, key: str) -> str:
        return self.reader.dtype_name(self.sources[key][0])

    def file_of(self, key: str) -> str:
        return f"{self.reader.file_of(self.sources[key][0])} ('{self.sources[key][0]}')"

    def transform(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def get(self, key: str) -> torch.Tensor:
        names = self.sources[key]
        tensor = torch.cat([self.reader.get(n) for n in names]) if len(names) > 1 else self.reader.get(names[0])
        return self.transform(key, tensor)


def _few(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" ... ({len(keys)} in all)" if len(keys) > 5 else "")


def prepared_convert(model: nn.Module, prepare, convert, loader: str):
    """The convert hook a checkpoint loader streams with: `prepare(model)`'s result where that is a
    hook (fp8_load_converter, a stored layout's converter: they need the prepared model), else
    `convert`. prepare_fp8 returns the model itself, which is no hook. `loader` names the function in
    the error for a hook given both ways."""
    hook = prepare(model) if prepare is not None else None
    if hook is None or isinstance(hook, nn.Module):
        return convert
    if convert is not None:
        raise ValueError(f"{loader}: give the convert hook either as convert= or as prepare's result, not both")
    return hook


def _fits(reader, found: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """found is the model's shape `want`, or (a GGUF file) `want` less its leading size-1 dimensions:
    llama.cpp's quantize writes every tensor with ggml_n_dims, which drops trailing ggml dims of size 1
    (a [1, dim] pad token arrives as [dim] in the files people run); the values are the same."""
    if found == want:
        return True
    squeezed = want
    while len(squeezed) > 1 and squeezed[0] == 1:
        squeezed = squeezed[1:]
    return found == squeezed and all(f.endswith(GGUF_SUFFIX) for f in reader.files)


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
            if not _fits(reader, tuple(value.shape), tuple(expected[key].shape)):
                raise CheckpointError(
                    f"{reader.path}: {reader.file_of(ckpt_key)}: key '{ckpt_key}' has shape {tuple(value.shape)}, "
                    f"the model expects {tuple(expected[key].shape)} for '{key}'"
                )
            if expected[key].is_floating_point() and not (value.is_floating_point() or value.is_complex()):
                raise CheckpointError(f"{reader.path}: {reader.file_of(ckpt_key)}: key '{ckpt_key}' holds "
                                      f"{value.dtype} integers, the model expects floating-point weights for '{key}'")
            loaded[key] = value if value.shape == expected[key].shape else value.reshape(expected[key].shape)
    for key in [k for k in expected if k not in loaded and k.endswith("num_batches_tracked")]:
        # BatchNorm's step counter (only used to average in training): released VAE files may omit it.
        loaded[key] = torch.zeros((), dtype=torch.long)
    missing = [k for k in expected if k not in loaded]
    if unexpected:
        raise CheckpointError(f"{reader.path}: unexpected keys for this model: {_few(unexpected)}")
    if missing:
        raise CheckpointError(f"{reader.path}: missing keys: {_few(missing)}")
    model.load_state_dict(loaded, strict=True, assign=True)


def append_csv_row(path: str, row: list, header: list[str] | None = None) -> None:
    """Append `row` to the CSV log `path`; a `header` starts the file anew. A full disk is one
    DiskFullError naming the log (an append cannot be atomic: the rows before it are kept)."""
    mode = "a" if header is None else "w"
    with naming_a_full_disk(path, "the rows logged before are kept"), open(path, mode, newline="") as f:
        writer = csv.writer(f)
        if header is not None:
            writer.writerow(header)
        writer.writerow(row)


def _lock_holder(fd: int) -> str:
    """'pid N on host H (since T)' from a lock file's content; 'a process' where it names none (its
    holder has not written it yet, or someone else wrote it)."""
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        holder = json.loads(os.read(fd, 4096))
        who = f"pid {int(holder['pid'])} on host {holder.get('host', '?')}"
        if "started" in holder:
            who += f" (since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))})"
        return who
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):  # empty, half-written, not ours
        return "a process"


def _flock_file(path: str, advice: str) -> int | None:
    """A descriptor of the lock file `path`, flock-ed by us; None where the file system (or the
    OS) has no flock."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise LockedError(f"{path}: held by {holder}: {advice}") from None
        except OSError:  # ENOLCK / EOPNOTSUPP: some network and FUSE file systems
            os.close(fd)
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)  # its holder removed it between our open and flock: lock the new file


@contextlib.contextmanager
def held_lock(path: str, advice: str):
    """Hold the lock file `path` for the block, or raise LockedError naming its holder (pid, host)
    and `advice`. The lock is the kernel's (flock), so a process that dies drops it: a file left
    by a killed run is taken over with one warning line. The file is removed at the end."""
    make_parent_folder(path)
    fd = _flock_file(path, advice)
    if fd is None:
        print(f"warning: {path}: this file system cannot lock files; a second run using {os.path.dirname(path)} "
              f"at the same time would not be stopped", file=sys.stderr)
        yield
        return
    try:
        if os.fstat(fd).st_size:
            print(f"warning: {path}: taking over the lock of {_lock_holder(fd)}, which ended without releasing it",
                  file=sys.stderr)
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": int(time.time())}
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):  # removed before unlocking: a process that opened
            os.remove(path)  # this file finds it gone and makes a new one
        os.close(fd)


class SharedLock:
    """The lock file `path`, held shared (flock LOCK_SH) from here to close(), beside any number of
    other holders; alone() makes it exclusive for a block where no other process holds it. A new
    holder waits while one is alone (a cleanup's few seconds). The kernel drops a killed holder's
    lock, and the file is never removed: a process that opened it after the removal would lock a
    new file and think itself alone beside the holders of the old one. A file this user cannot
    open (another user's, 0600) is not held, with one warning line: the holder goes on without
    it and is never alone (it cannot know who else uses the folder), and the holders of the file
    cannot know of it (one alone there may remove the caches it reads). On a file system without
    flock no holder is seen, so none is ever alone either."""

    def __init__(self, path: str):
        self.path, self.fd, self.held = path, _open_lock_file(path), False
        if self.fd is None:
            return
        try:
            self.held = _flock(self.fd, "LOCK_SH")  # False: no flock here (not POSIX, some network file systems)
        except BaseException:  # interrupted while a holder is alone: the descriptor is not left open
            self.close()
            raise
        if not self.held:
            print(f"warning: {path}: this file system cannot lock files; another run using "
                  f"{os.path.dirname(path)} at the same time would not be seen, so unused caches there are left "
                  f"as they are", file=sys.stderr)

    @contextlib.contextmanager
    def alone(self) -> Iterator[bool]:
        """True, with the lock exclusive for the block (and shared again after), where no other
        process holds it; False where one does, where the file could not be opened (or is closed),
        or where the file system cannot lock (another run would be unseen: never alone)."""
        if self.fd is None or not self.held:  # unopened: others may use it unseen; no flock: none is seen
            yield False
            return
        with _one_at_a_time(os.path.dirname(self.path)):
            alone = _flock(self.fd, "LOCK_EX", wait=False)
            if not alone:  # a failed conversion lets go of the shared lock (Linux): take it back before
                _flock(self.fd, "LOCK_SH")  # another holder may try (_one_at_a_time)
        try:
            yield alone
        finally:
            if alone:
                _flock(self.fd, "LOCK_SH")  # a conversion down never waits

    def close(self):
        """Lets go of the lock; a second call does nothing (the number may be another file's by then)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def _open_lock_file(path: str) -> int | None:
    """A descriptor of the lock file `path` (made where missing); read-only where it is another
    user's (0644: flock needs only that) or on a read-only mount. None, with one warning line naming
    the file, why, and what goes unseen, where it cannot be opened at all."""
    try:
        make_parent_folder(path)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:  # EACCES: another user's file or folder; EROFS: a read-only mount
        first = e
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:  # the first error says why where the file is missing (a folder we cannot write)
        why = first if isinstance(e, FileNotFoundError) else e
        print(f"warning: cannot open {path}: {why.strerror or why}; going on without it: a run holding it would not "
              f"see this one and could remove the caches it reads, and unused caches in {os.path.dirname(path)} are "
              f"left as they are", file=sys.stderr)
        return None


def _flock(fd: int, operation: str, wait: bool = True) -> bool:
    """flock(fd, operation): False where another process holds it (wait=False) or the file system
    cannot lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return False
    try:
        fcntl.flock(fd, getattr(fcntl, operation) | (0 if wait else fcntl.LOCK_NB))
        return True
    except OSError:  # BlockingIOError: held; ENOLCK / EOPNOTSUPP: some network and FUSE file systems
        return False


@contextlib.contextmanager
def _one_at_a_time(folder: str):
    """The folder's own flock for the block: the holders of a SharedLock in it try alone() one at a
    time. Where a folder cannot be locked, they try unguarded (two tries in the same microseconds
    could then both fail, or one be let in by the other's failed try)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a folder we may write but not list, Windows
        yield
        return
    try:
        _flock(fd, "LOCK_EX")
        yield
    finally:
        os.close(fd)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None):
    """Atomic safetensors write; tensors are made contiguous CPU tensors first."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except SafetensorError as e:  # its writer's I/O errors are no OSError: a full disk would be a traceback
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), str(e)) from None


# -- transformer files in their two release layouts ----------------------------------------------


class PrefixedReader:
    """A checkpoint's tensors under one prefix, named without it: the transformer's keys of a (ComfyUI-prefixed) single
    file for check_keys_and_shapes, or one component of a ComfyUI full checkpoint for its loader (a text encoder under
    `text_encoders.<name>.transformer.`, the VAE under `vae.`: an "all in one" file). The keys under
    other prefixes (the other components) are not seen; the metadata is the file's."""

    def __init__(self, reader: CheckpointReader, prefix: str):
        self.reader, self.prefix, self.path, self.files = reader, prefix, reader.path, reader.files
        self.metadata = reader.metadata

    def keys(self) -> list[str]:
        return [k[len(self.prefix) :] for k in self.reader.keys() if k.startswith(self.prefix)]

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.reader

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(self.prefix + key)

    def file_of(self, key: str) -> str:
        return self.reader.file_of(self.prefix + key)

    def dtype_name(self, key: str) -> str:
        return self.reader.dtype_name(self.prefix + key)

    def numel(self, keys=None) -> int:
        return sum(math.prod(self.shape(k)) for k in (self.keys() if keys is None else keys))

    def is_block_quantized(self, key: str) -> bool:
        return self.reader.is_block_quantized(self.prefix + key)

    def get(self, key: str, mapped: bool = False) -> torch.Tensor:
        return self.reader.get(self.prefix + key, mapped)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for k in self.keys():
            yield k, self.get(k)


# safetensors' (and ggml's) names of integer tensors: no weight of a model is stored so; merge tools that wrote one
# left a file the load cannot train on ("Only Tensors of floating point ... can require gradients").
INTEGER_DTYPE_NAMES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})


def check_keys_and_shapes(reader: CheckpointReader, expected: dict[str, torch.Tensor], what,
                          extra: Callable[[str], bool] = lambda key: False) -> None:
    """Every tensor of `reader` expected, of the expected shape, and none missing (each named in the
    error; `what` says what was expected, e.g. the config). `extra(key)`: tensors a stored layout
    carries beside the model's own (fp8 scales, markers), not checked here. A key is named with its file in
    a folder, with the file alone given one ("x.safetensors: x.safetensors: key ..." said it twice)."""
    def where(key: str) -> str:
        return reader.path if os.path.isfile(reader.path) else f"{reader.path}: {reader.file_of(key)}"

    for key in reader.keys():
        if extra(key):
            continue
        if key not in expected:
            raise CheckpointError(f"{where(key)}: unexpected key '{key}' for {what}")
        found, want = reader.shape(key), tuple(expected[key].shape)
        if not _fits(reader, found, want):
            raise CheckpointError(f"{where(key)}: key '{key}' has shape {found}, expected {want}")
        if expected[key].is_floating_point() and reader.dtype_name(key) in INTEGER_DTYPE_NAMES:
            raise CheckpointError(f"{where(key)}: key '{key}' holds {reader.dtype_name(key)} integers, expected "
                                  f"floating-point weights")
    missing = [k for k in expected if k not in reader]
    if missing:
        raise CheckpointError(f"{reader.path}: missing keys: {', '.join(missing[:5])} ({len(missing)} in all)")


def check_model_file(path: str, key: str, what: str, markers: dict[str | tuple[str, ...], tuple | None]) -> None:
    """The checkpoint at `path` (named by config key `key`) is `what` as far as its header tells: for
    each marker some key ends in it (after any prefix, so ComfyUI, HF and diffusers layouts alike; a
    tuple of endings: any one of them, the same tensor as layouts name it), of the marker's shape (None:
    any shape; None on an axis: any size). No tensor is read; a missing path or marker is one
    CheckpointError naming the path and what was expected."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder ({key}: expected {what})")
    reader = CheckpointReader(path)
    keys = reader.keys()
    for ending, shape in markers.items():
        endings = ending if isinstance(ending, tuple) else (ending,)
        found = next((k for k in keys for e in endings if k == e or k.endswith("." + e)), None)
        if found is None:
            named = " or ".join(f"'{e}'" for e in endings)
            raise CheckpointError(f"{path}: {key} is not {what}: no key ends in {named} (its keys: {_few(keys)})")
        have = reader.shape(found)
        if shape is not None and (len(have) != len(shape) or any(w not in (None, n) for w, n in zip(shape, have))):
            want = "(" + ", ".join("*" if n is None else str(n) for n in shape) + ")"
            raise CheckpointError(f"{path}: {key} is not {what}: '{found}' has shape {have}, expected {want}")


DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def state_and_config(model_or_sd, config):
    """(state dict, config) of a model (its own config unless one is given) or of a state dict."""
    if isinstance(model_or_sd, torch.nn.Module):
        return model_or_sd.state_dict(), config or model_or_sd.config
    return dict(model_or_sd), config


def metadata_config(reader: CheckpointReader, config_key: str, make: Callable[[str], Any]) -> Any:
    """The config save_with_config wrote under `config_key`, made by `make` (its JSON text -> the config dataclass):
    a broken one (not JSON, a field missing or unknown) is one CheckpointError naming the file and the key, not
    json's bare "Expecting property name ..." or a dataclass's TypeError."""
    try:
        return make(reader.metadata[config_key])
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(f"{reader.path}: metadata '{config_key}' is not the model's config as this trainer "
                              f"writes it ({type(e).__name__}: {e}); remove the key to read the sizes from the "
                              f"tensors' shapes, or save the checkpoint again") from None


def save_with_config(tensors: dict[str, torch.Tensor], path: str, config_key: str, config,
                     metadata: dict[str, str] | None = None):
    """A single safetensors file (atomic) whose metadata carries the config dataclass as JSON under
    `config_key` (when known), so that non-standard sizes reload exactly."""
    metadata = dict(metadata or {})
    if config is not None:
        metadata[config_key] = json.dumps(dataclasses.asdict(config))
    save_safetensors(tensors, path, metadata=metadata or None)


def save_diffusers_folder(tensors: dict[str, torch.Tensor], config_json: dict, folder: str):
    """A diffusers component folder: config.json + diffusion_pytorch_model.safetensors, each atomic."""
    os.makedirs(folder, exist_ok=True)
    save_safetensors(tensors, os.path.join(folder, DIFFUSERS_WEIGHTS), metadata={"format": "pt"})
    write_text(os.path.join(folder, "config.json"), json.dumps(config_json, indent=2) + "\n")
