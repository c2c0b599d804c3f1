"""Writing GGUF transformer files in ComfyUI-GGUF's layout (tools/merge_lora.py --save_precision gguf_*),
one tensor at a time, with the `gguf` package's own quantization.

The layout is what city96's tools produce (ComfyUI-GGUF tools/convert.py, then its llama.cpp
quantize patch): `general.architecture` the family's ComfyUI-GGUF name (its spec's gguf_arch),
the checkpoint's key names without the ComfyUI `model.diffusion_model.` prefix, and per tensor:
  - 1-D tensors and tensors of at most 1024 elements: F32 (convert.py's rule);
  - Linear weights the architecture quantizes (the Linears its fp8 keep rules do not keep, which
    match the patch's list of unquantized tensors where its spec's gguf_arch comment says so) whose
    rows divide into the type's blocks: the block type asked for;
  - the other tensors: BF16 from a bf16 source, F16 otherwise (convert.py's output types, which the
    quantize step leaves alone; llama.cpp falls back to F16 where a row does not divide into blocks).
Block types: the ones `gguf.quants.quantize` (gguf 0.19) implements: Q8_0, Q5_1, Q5_0, Q4_1, Q4_0.
The K-quants (Q6_K, Q5_K, Q4_K) it can only dequantize, so they are not written here. Values are
quantized from float32 (the merged weight as merge_lora computes it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from library.precision.fp8 import KeepRules, is_high_precision
from library.precision.gguf_weights import GGUF_TYPES

WRITE_TYPES = ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0")  # what gguf.quants.quantize writes
SMALL = 1024  # elements: at most this many stay F32 (ComfyUI-GGUF convert.py's QUANTIZATION_THRESHOLD)
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


def output_type(module_weight: str | None, shape: tuple[int, ...], source_dtype: str, qtype: str, rules: KeepRules) -> str:
    """The ggml type a tensor gets in ComfyUI-GGUF's layout. module_weight: the model module path of a
    Linear weight ("double_blocks.0.img_attn.qkv"), None for every other tensor; source_dtype: the
    safetensors dtype name of the tensor in the base ("BF16", "F32", ...)."""
    if qtype not in WRITE_TYPES:
        raise ValueError(f"GGUF type {qtype}: only {', '.join(WRITE_TYPES)} can be written (gguf quantizes only these)")
    numel = int(np.prod(shape)) if shape else 1
    if len(shape) <= 1 or numel <= SMALL:
        return "F32"
    if module_weight is not None and not is_high_precision(module_weight, rules) and shape[-1] % GGUF_TYPES[qtype].block == 0:
        return qtype
    return "BF16" if source_dtype == "BF16" else "F16"


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
