"""Writing GGUF transformer files in ComfyUI-GGUF's layout (tools/merge_lora.py --save_precision gguf_*),
one tensor at a time, with the `gguf` package's own quantization.

The layout is what city96's two steps produce (ComfyUI-GGUF's auto_convert branch), tensor for tensor
(tests/test_merge_gguf.py runs convert.py's own rules against ours where the mirror is at hand):
`general.architecture` the family's ComfyUI-GGUF name (its spec's `gguf.arch`), the checkpoint's key
names without the ComfyUI `model.diffusion_model.` prefix, and per tensor:
  1. ComfyUI-GGUF tools/convert.py handle_tensors gives the float type: from an F32 / BF16 source,
     F32 for 1-D tensors, tensors of at most 1024 elements (QUANTIZATION_THRESHOLD) and the arch's
     keys_hiprec, else BF16 from bf16 and F16 from f32; from any other source (F16, fp8) F16.
  2. Its llama.cpp patch (tools/lcpp.patch, llama_model_quantize_internal) then quantizes a tensor
     whose name ends in `weight` (not `_norm.weight`), of exactly 2 ggml dimensions (trailing size-1
     dimensions do not count), that none of the arch's unquantized substrings names, to the type asked
     for; img_tensor_get_type's ffn rule stores the MLP output projections as Q4_1 / Q5_1 where Q4_0 /
     Q5_0 is asked for. A row that does not divide into the type's blocks keeps its step-1 type (the
     patch falls back for K-quants; llama.cpp would stop on the others).
The family's facts (its spec's GgufLayout: arch, unquantized, hiprec) are read through GgufRules.
Block types: the ones `gguf.quants.quantize` (gguf 0.19) implements: Q8_0, Q5_1, Q5_0, Q4_1, Q4_0.
The K-quants (Q6_K, Q5_K, Q4_K) it can only dequantize, so they are not written here. Values are
quantized from float32 (the merged weight as merge_lora computes it).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch
import torch.nn as nn

from library.precision.gguf_weights import GGUF_TYPES, GGUFLinear

WRITE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")  # what gguf.quants.quantize writes
SMALL = 1024  # elements: at most this many stay F32 (ComfyUI-GGUF convert.py's QUANTIZATION_THRESHOLD)
# tools/lcpp.patch img_tensor_get_type "Rules for ffn" (auto_convert branch, :198-231): the MLP output
# projections one step up at Q4_0 / Q5_0
FFN_DOWN = ("ffn_down", ".ffn.2.weight", ".ff.net.2.weight", ".mlp.layer2.weight", ".adaln_modulation_mlp.2.weight",
            ".feed_forward.w2.weight", ".img_mlp.net.2.weight", ".txt_mlp.net.2.weight")
FFN_DOWN_TYPE = {"Q4_0": "Q4_1", "Q5_0": "Q5_1"}
# fp16 rounds a value below 65520 (its largest, 65504, + half its last step) to at most 65504; from 65520 on to inf
FP16_MAX, FP16_OVERFLOW = 65504.0, 65520.0
# The |value| from which each written type writes inf (gguf reads NaN back): F16's own, else its fp16 block
# scale's, d = absmax / 127 (Q8_0), / 16 (Q5_0), / 8 (Q4_0), or its fp16 block minimum's (Q5_1, Q4_1).
OVERFLOWS_AT = {"F16": FP16_OVERFLOW, "Q8_0": FP16_OVERFLOW * 127, "Q5_0": FP16_OVERFLOW * 16,
                "Q4_0": FP16_OVERFLOW * 8, "Q5_1": FP16_OVERFLOW, "Q4_1": FP16_OVERFLOW}
FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q5_1": "MOSTLY_Q5_1", "Q5_0": "MOSTLY_Q5_0", "Q4_1": "MOSTLY_Q4_1", "Q4_0": "MOSTLY_Q4_0"}


@dataclass(frozen=True)
class GgufEntry:
    name: str  # the tensor's name in the file
    shape: tuple[int, ...]  # torch order ([out, in])
    ggml_type: str  # "Q8_0", "F32", "F16", "BF16", ...

    @property
    def nbytes(self) -> int:
        numel = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        if self.ggml_type in GGUF_TYPES:
            kind = GGUF_TYPES[self.ggml_type]
            return numel // kind.block * kind.block_bytes
        return numel * (4 if self.ggml_type == "F32" else 2)


class GgufRules(Protocol):
    """What the writer needs of a family (library/models/spec.py GgufLayout)."""

    arch: str  # general.architecture
    unquantized: tuple[str, ...]  # substrings of tensor names the patch leaves unquantized
    hiprec: tuple[str, ...]  # convert.py keys_hiprec: substrings of names kept F32


def _ggml_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims of a torch shape: its dimensions, less the leading size-1 ones (ggml's trailing ne)."""
    dims = len(shape)
    while dims > 1 and shape[len(shape) - dims] == 1:
        dims -= 1
    return max(dims, 1)


def convert_type(name: str, shape: tuple[int, ...], source_dtype: str, rules: GgufRules) -> str:
    """Step 1: the float type ComfyUI-GGUF's convert.py writes for a tensor of safetensors dtype `source_dtype`."""
    if source_dtype not in ("F32", "BF16"):
        return "F16"
    numel = int(np.prod(shape)) if shape else 1
    if len(shape) == 1 or numel <= SMALL or any(k in name for k in rules.hiprec):
        return "F32"
    return "BF16" if source_dtype == "BF16" else "F16"


def quantized_type(name: str, shape: tuple[int, ...], qtype: str, rules: GgufRules) -> str | None:
    """Step 2: the block type the quantize patch gives tensor `name` of `shape` at file type `qtype`
    (the ffn rule's step up included), or None where it leaves the tensor as step 1 wrote it."""
    if (not name.endswith("weight") or "_norm.weight" in name or _ggml_dims(shape) != 2
            or any(k in name for k in rules.unquantized)):
        return None
    if any(k in name for k in FFN_DOWN):
        qtype = FFN_DOWN_TYPE.get(qtype, qtype)
    return qtype if shape[-1] % GGUF_TYPES[qtype].block == 0 else None


def output_type(name: str, shape: tuple[int, ...], source_dtype: str, qtype: str, rules: GgufRules) -> str:
    """The ggml type of tensor `name` (its name in the file) in ComfyUI-GGUF's layout at file type
    `qtype` (module docstring: convert.py, then the quantize patch)."""
    if qtype not in WRITE_TYPES:
        raise ValueError(f"GGUF type {qtype}: only {', '.join(WRITE_TYPES)} can be written (gguf quantizes only these)")
    return quantized_type(name, shape, qtype, rules) or convert_type(name, shape, source_dtype, rules)


def prepare_gguf_like(model: nn.Module, qtype: str, rules: GgufRules) -> nn.Module:
    """A meta `model` as a GGUF file of `qtype` in this layout would load (the memory planner without a
    file): each Linear the quantize patch quantizes becomes a GGUFLinear of its type, the rest stay high
    precision. Module names are matched as file names: the unquantized substrings name both namings."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            kind = quantized_type(name + ".weight", (child.out_features, child.in_features), qtype, rules) \
                if type(child) is nn.Linear else None
            if kind is not None:
                setattr(parent, child_name, GGUFLinear.from_meta_linear(child, kind))
    return model


def encode(tensor: torch.Tensor, ggml_type: str) -> np.ndarray:
    """A float tensor as the bytes of `ggml_type`: gguf's own quantize on its float32 values (F32 /
    F16 / BF16 included: BF16 by gguf's rounding, exact for a bf16 source)."""
    import gguf

    values = tensor.detach().to(torch.float32).contiguous().numpy()
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[ggml_type])


def write_gguf_streaming(path: str, arch: str, qtype: str, entries: list[GgufEntry],
                         tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Write a GGUF file whose tensor list is known before its tensors: header, key-values (the
    architecture, quantization version, file type, `metadata` as strings), tensor infos, then each
    tensor encoded and written as `tensors` yields it (exactly `entries`, in order), one at a time."""
    try:
        _write_gguf(path, arch, qtype, entries, tensors, metadata)
    except OSError as e:  # numpy's tofile says a short write without its errno ("69632 requested and 8160 written"):
        if e.errno is None and "requested and" in str(e):  # a full disk (or quota), as the caller then names it
            raise OSError(errno.ENOSPC, f"short write ({e})") from None
        raise


def _write_gguf(path: str, arch: str, qtype: str, entries: list[GgufEntry],
                tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[qtype]])
    for key, value in metadata.items():
        writer.add_string(key, value)
    for e in entries:
        writer.add_tensor_info(e.name, e.shape, np.dtype(np.float32), e.nbytes, raw_dtype=gguf.GGMLQuantizationType[e.ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for e in entries:
        name, tensor = next(tensors)
        if name != e.name or tuple(tensor.shape) != e.shape:
            raise RuntimeError(f"GGUF streaming writer: got {name} {tuple(tensor.shape)}, planned {e}")
        data = encode(tensor, e.ggml_type)
        writer.write_tensor_data(data)
        del tensor, data
    if next(tensors, None) is not None:
        raise RuntimeError("GGUF streaming writer: more tensors than planned")
    writer.close()


def save_precision_type(save_precision: str) -> str | None:
    """"gguf_q8_0" -> "Q8_0"; None for a save_precision that is not GGUF."""
    match = re.fullmatch(r"gguf_(\w+)", save_precision or "")
    return match.group(1).upper() if match else None
