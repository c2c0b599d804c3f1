"""GGUF base weights: the block-quantized Linears of the transformer files people run with city96's
ComfyUI-GGUF, kept packed and dequantized per forward, so that a LoRA trains over the very base
they deploy.

Storage: a `GGUFLinear` holds its weight as the file's ggml blocks, a uint8 buffer
[out, in / block * block_bytes] (block_bytes per `block` weights: GGUF_TYPES), exactly as stored;
nothing is widened at load. Each forward (and again in backward, as FP8Linear does) dequantizes it
in torch to float32 and casts once to the compute dtype. The float32 values are bit for bit what
`gguf.quants.dequantize` gives (tests/test_gguf.py, every type): the same operations in the same
order (each product of an fp16 scale and a small integer is exact in float32; the one rounding of a
K-quant's `d * q - m` is the same in numpy and torch). ComfyUI-GGUF itself dequantizes straight in
the compute dtype (scales first rounded to bf16), so its bf16 weights can differ from ours in the
last bf16 bit; float32 matches gguf's reference.

Read: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS block types (city96's
Q2_K and Q3_K_S files, and the IQ4 files ComfyUI-GGUF reads since 6aa9866); F32 / F16 / BF16 tensors load
as any checkpoint's (cast to the load dtype). Any other ggml type (IQ1-3*, TQ*, MXFP4, ...) is refused in one line naming the tensor and its type. Which Linears are GGUFLinear is the file's
choice, not the keep rules of fp8: every Linear whose weight the file stores block-quantized.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from library.io import GGUF_SUFFIX, CheckpointError, CheckpointReader
from library.precision.autocast import autocast_off, matmul_input
from library.precision.dequantized_linear import dequantized_linear
from library.precision.fp8_checkpoints import diffusion_model_prefix

QK_K = 256  # weights per K-quant super-block
PACKED_DTYPE = torch.uint8
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale at byte `start` of each block, as float32 [n, 1] (exact)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] -> [n, 2k]: the k low nibbles, then the k high ones (ggml's order in a block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> [n, 32]: bit j of the uint32 at position j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d f16, 32 x int8: x = q * d
    return b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d f16, 16 bytes of nibbles: x = d * (q - 8)
    return _f16(b, 0) * (_nibbles(b[:, 2:]).to(torch.float32) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d f16, m f16, 16 bytes of nibbles: x = d * q + m
    return _f16(b, 0) * _nibbles(b[:, 4:]).to(torch.float32) + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d f16, 4 bytes of fifth bits, 16 of nibbles: x = d * (q - 16)
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.to(torch.float32) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d f16, m f16, 4 bytes of fifth bits, 16 of nibbles: x = d * q + m
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.to(torch.float32) + _f16(b, 2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> the 8 sub-blocks' 6-bit (scale, min), each uint8 [n, 8]."""
    d, m, low = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [n, 8, 32]: 32-byte chunk c holds sub-block 2c (low nibbles) and 2c+1 (high)."""
    q = qs.reshape(-1, 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin f16, 12 scale bytes, 128 of nibbles: x = d*sc*q - dmin*m
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.to(torch.float32)).reshape(-1, 8, 1)
    dm = (_f16(b, 2) * mn.to(torch.float32)).reshape(-1, 8, 1)
    return (d * _k_low_nibbles(b[:, 16:]).to(torch.float32) - dm).reshape(-1, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # as Q4_K, plus 32 bytes whose bit i is sub-block i's fifth bit
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.to(torch.float32)).reshape(-1, 8, 1)
    dm = (_f16(b, 2) * mn.to(torch.float32)).reshape(-1, 8, 1)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    high = (b[:, 16:48].reshape(-1, 1, 32) >> shifts) & 1
    q = _k_low_nibbles(b[:, 48:]) | (high << 4)
    return (d * q.to(torch.float32) - dm).reshape(-1, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # 128 bytes low nibbles, 64 of 2-bit highs, 16 int8 scales, d f16
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)).reshape(-1, 16, 1)
    low = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)
    q = (low | (high << 4)).to(torch.float32) - 32
    return (d * q.reshape(-1, 16, 16)).reshape(-1, QK_K)


def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """64 bytes -> [n, 16, 16]: 32-byte chunk c holds, at bit pairs 0, 2, 4, 6, sub-blocks 8c .. 8c+7 (two each)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).reshape(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def _q2_k(b: torch.Tensor) -> torch.Tensor:  # 16 bytes of 4-bit (scale, min), 64 of 2-bit q, d, dmin f16: x = d*sc*q - dmin*m
    sc = b[:, :16]
    d = (_f16(b, 80) * (sc & 0x0F).to(torch.float32)).reshape(-1, 16, 1)
    dm = (_f16(b, 82) * (sc >> 4).to(torch.float32)).reshape(-1, 16, 1)
    return (d * _two_bit(b[:, 16:80]).to(torch.float32) - dm).reshape(-1, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:  # 32 bytes of high bits, 64 of 2-bit q, 12 of 6-bit scales, d f16
    sc = b[:, 96:108]  # sub-block i: low nibble of byte i % 8 (>> 4 for i >= 8), 2 high bits from byte 8 + i % 4
    low = (sc[:, :8].reshape(-1, 1, 8) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).reshape(1, 2, 1)) & 0x0F
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 4, 1)
    high = (sc[:, 8:12].reshape(-1, 1, 4) >> shifts) & 3
    scales = (low.reshape(-1, 16) | (high.reshape(-1, 16) << 4)).to(torch.float32) - 32
    d = (_f16(b, 108) * scales).reshape(-1, 16, 1)
    bit = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
    high_bit = ((b[:, :32].reshape(-1, 1, 1, 32) >> bit) & 1).reshape(-1, 16, 16)
    q = _two_bit(b[:, 32:96]).to(torch.float32) - 4 * (1 - high_bit).to(torch.float32)  # a set bit means no -4
    return (d * q).reshape(-1, QK_K)


IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def _levels(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> IQ4's non-uniform levels, float32."""
    return torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=q.device)[q.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:  # d f16, 16 bytes of nibbles: x = d * level[q]
    return _f16(b, 0) * _levels(_nibbles(b[:, 2:]))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:  # d f16, 2 bytes of high scale bits, 4 of low, 128 of nibbles
    low = b[:, 4:8]  # sub-block i's scale: nibble i (low nibble first) + bits 2i, 2i+1 of the uint16 at byte 2
    low = torch.stack([low & 0x0F, low >> 4], dim=2).reshape(-1, 8).to(torch.int32)
    high = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    high = (high[:, None] >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)) & 3
    d = (_f16(b, 0) * ((low | (high << 4)) - 32).to(torch.float32)).reshape(-1, 8, 1)
    qs = b[:, 8:].reshape(-1, 8, 16)  # 16 bytes per sub-block of 32: low nibbles, then high
    return (d * _levels(torch.cat([qs & 0x0F, qs >> 4], dim=2))).reshape(-1, QK_K)


@dataclass(frozen=True)
class BlockType:
    block: int  # weights per block
    block_bytes: int  # bytes per block (its scales included)
    kernel: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, block_bytes] -> float32 [n, block]

    @property
    def bytes_per_parameter(self) -> float:
        return self.block_bytes / self.block


# ggml's block layouts (ggml-common.h; gguf.constants.GGML_QUANT_SIZES holds the same sizes)
GGUF_TYPES = {
    "Q8_0": BlockType(32, 34, _q8_0), "Q4_0": BlockType(32, 18, _q4_0), "Q4_1": BlockType(32, 20, _q4_1),
    "Q5_0": BlockType(32, 22, _q5_0), "Q5_1": BlockType(32, 24, _q5_1),
    "Q4_K": BlockType(QK_K, 144, _q4_k), "Q5_K": BlockType(QK_K, 176, _q5_k), "Q6_K": BlockType(QK_K, 210, _q6_k),
    "Q3_K": BlockType(QK_K, 110, _q3_k), "Q2_K": BlockType(QK_K, 84, _q2_k),
    "IQ4_NL": BlockType(32, 18, _iq4_nl), "IQ4_XS": BlockType(QK_K, 136, _iq4_xs),
}  # fmt: skip


def _block_type(qtype: str, what: str) -> BlockType:
    if qtype not in GGUF_TYPES:
        raise CheckpointError(f"{what} is GGUF type {qtype}; only {', '.join(GGUF_TYPES)} (and F32/F16/BF16) are read")
    return GGUF_TYPES[qtype]


def packed_shape(out_features: int, in_features: int, qtype: str) -> tuple[int, int]:
    """The uint8 shape of an [out, in] weight stored as `qtype` blocks (blocks run along `in`)."""
    kind = _block_type(qtype, f"a [{out_features}, {in_features}] weight")
    if in_features % kind.block:
        raise ValueError(f"{qtype} stores rows in blocks of {kind.block}; {in_features} inputs do not divide")
    return out_features, in_features // kind.block * kind.block_bytes


def dequantize(packed: torch.Tensor, qtype: str, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight of `shape` in `dtype` from its GGUF bytes: uint8 blocks of a block type, or the
    raw bytes (or the tensor) of an F32/F16/BF16 one. Computed in float32 (what gguf.quants.dequantize
    gives, bit for bit), then cast once to `dtype`."""
    if qtype in FLOAT_TYPES:
        values = packed if packed.dtype == FLOAT_TYPES[qtype] else packed.contiguous().view(FLOAT_TYPES[qtype])
        return values.reshape(shape).to(torch.float32).to(dtype)
    kind = _block_type(qtype, "a tensor")
    if packed.dtype != PACKED_DTYPE:
        raise TypeError(f"dequantize: {qtype} blocks are uint8 bytes, got {packed.dtype}")
    return kind.kernel(packed.reshape(-1, kind.block_bytes)).reshape(shape).to(dtype)


# ----------------------------------------------------------------------------------------------
# The layer


class GGUFLinear(nn.Module):
    """A frozen Linear whose weight is a GGUF file's blocks of one block type (`qtype`).

    State dict: `weight` uint8 [out, in / block * block_bytes] (the blocks as stored), `bias` (high
    precision, frozen, absent if bias=False). The weight is a buffer: it never trains, and
    `model.to(dtype)` leaves integer tensors alone (device moves and block swap still move it).
    forward dequantizes to the input's dtype (or the autocast dtype) and runs F.linear: gradients
    reach the input (a LoRA sits on top), never the base. compute_dtype: None follows the input."""

    backward_saves_weights_only = True  # its autograd Function keeps the stored tensors, never x

    def __init__(self, in_features: int, out_features: int, bias: bool = True, qtype: str = "Q8_0",
                 device=None, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.compute_dtype: torch.dtype | None = None
        shape = packed_shape(out_features, in_features, qtype)
        self.register_buffer("weight", torch.zeros(shape, dtype=PACKED_DTYPE, device=device))
        b = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        self.bias = b if bias else None

    @classmethod
    def from_meta_linear(cls, linear: nn.Linear, qtype: str) -> "GGUFLinear":
        """A meta-device mirror of `linear` for load_streaming to fill with the file's blocks."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, qtype, device="meta")
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.qtype, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, dtype = matmul_input(x, self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        shape = (self.out_features, self.in_features)
        x = x.to(dtype)
        with autocast_off(x.device.type):  # the matmul runs in exactly `dtype`
            return dequantized_linear(x, bias, dequantize, self.weight, self.qtype, shape, dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if key in state_dict and state_dict[key].dtype != PACKED_DTYPE:
            raise CheckpointError(f"'{key}': GGUFLinear ({self.qtype}) expects the file's uint8 blocks, got "
                                  f"{state_dict[key].dtype}; load GGUF files through the family's loader")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, qtype={self.qtype}"


# ----------------------------------------------------------------------------------------------
# Files


def is_gguf(reader: CheckpointReader) -> bool:
    return all(f.endswith(GGUF_SUFFIX) for f in reader.files)


@dataclass(frozen=True)
class GgufCheckpoint:
    """What a GGUF transformer file stores: its layout name, the diffusion-model prefix of its keys,
    and the block type and (torch-order) shape of every block-quantized tensor, by model key."""

    layout: str  # "gguf_q8_0", or the types by share of the weights: "gguf_q4_k+q6_k"; "gguf_f16" unquantized
    prefix: str
    types: dict[str, str]
    shapes: dict[str, tuple[int, ...]]


def read_gguf_checkpoint(reader: CheckpointReader, path: str | None = None) -> GgufCheckpoint | None:
    """The GGUF layout of a transformer file (None for safetensors files). A tensor of a type we
    cannot dequantize is one CheckpointError naming it and its type."""
    if not is_gguf(reader):
        return None
    where = path or reader.path
    prefix = diffusion_model_prefix(reader.keys())
    keys = [k for k in reader.keys() if k.startswith(prefix)]
    types, shapes, share = {}, {}, Counter()
    for key in keys:
        kind = reader.dtype_name(key)
        share[kind] += reader.numel([key])
        if reader.is_block_quantized(key):
            _block_type(kind, f"{where}: tensor '{key}'")
            types[key[len(prefix) :]], shapes[key[len(prefix) :]] = kind, reader.shape(key)
    ranked = [k for k, _ in share.most_common() if k in GGUF_TYPES] or [k for k, _ in share.most_common(1)]
    return GgufCheckpoint("gguf_" + "+".join(ranked).lower(), prefix, types, shapes)


def prepare_gguf(model: nn.Module, info: GgufCheckpoint) -> nn.Module:
    """Swap every nn.Linear of the meta `model` whose weight the file stores block-quantized for a
    GGUFLinear of that type (in place). A stored shape other than the model's is named here: later
    the packed shapes would hide which weight it was."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            qtype = info.types.get(name + ".weight")
            # Exact nn.Linear only: subclasses (e.g. nn.MultiheadAttention's out_proj) may read .weight directly.
            if type(child) is not nn.Linear or qtype is None:
                continue
            stored, want = info.shapes[name + ".weight"], (child.out_features, child.in_features)
            if tuple(stored) != want:
                raise CheckpointError(f"key '{info.prefix}{name}.weight' has shape {tuple(stored)}, the model expects {want}")
            setattr(parent, child_name, GGUFLinear.from_meta_linear(child, qtype))
    return model


class GgufLoadConverter:
    """load_streaming convert hook (model keys) for a GGUF file used as it is: a GGUFLinear's weight
    takes the file's blocks unchanged; a block-quantized tensor the model holds elsewhere (not an
    exact nn.Linear) is dequantized to `dtype` (float32 first, exact, then one cast); the rest are
    load_streaming's usual floating tensors, already in `dtype`."""

    def __init__(self, model: nn.Module, info: GgufCheckpoint, dtype: torch.dtype):
        self.info, self.dtype = info, dtype
        self.packed = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, GGUFLinear)}

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if key in self.packed or key not in self.info.types:
            return {key: tensor}
        return {key: dequantize(tensor, self.info.types[key], self.info.shapes[key], self.dtype)}


def gguf_converter(model: nn.Module, info: GgufCheckpoint, dtype: torch.dtype) -> GgufLoadConverter:
    """The `prepare` hook's work for a GGUF file: GGUFLinears in the meta model, and the convert hook."""
    return GgufLoadConverter(prepare_gguf(model, info), info, dtype)
