"""Black Forest Labs' pre-quantized layouts, "fp8r" and "nvfp4", used as the base as they are stored:
the only form some models' weights are released in. Read exactly as diffusers reads them
(quantizers/bfl/: BFLQuantizer.maybe_update_state_dict, utils.dequantize_fp8r / dequantize_nvfp4,
BFLQuantizationConfig's docstring), and dequantized per layer and per forward to the compute dtype,
as diffusers' BFLFP8RLinear / BFLNVFP4Linear do off their fused-kernel paths.

A Linear X is quantized when the file has `X.weight_scale`:
  fp8r:  `X.weight` float8_e4m3fn [N, K], `X.weight_scale` float32 [N] (one scale per output row).
         W = weight.float() * weight_scale[:, None].
  nvfp4: `X.weight` uint8 [N, K/2] (two E2M1 codes a byte, the even column in the low nibble),
         `X.weight_scale` float8_e4m3fn [N, K/16] (a scale per 16 inputs), `X.weight_scale_2` float32
         [] (the global scale) and `X.input_scale` float32 [] (the calibrated activation scale of
         the FP4 GEMM on Blackwell). W = E2M1[code] * (weight_scale.float() * weight_scale_2),
         the block scale repeated over its 16 columns.
  The float32 W is cast once to the compute dtype. Every other tensor loads as any checkpoint's.
Refused in one line naming the key (as diffusers refuses them): a weight of another dtype than its
scheme's, an nvfp4 layer without `input_scale`. `input_scale` is dropped: we compute in bf16/fp32,
as diffusers does wherever no FP4 kernel runs, which is also what a LoRA trains through.

`BflCheckpoint.layout` names the base in a LoRA's metadata (ss_base_precision): "bfl_fp8r",
"bfl_nvfp4", or "bfl_nvfp4+fp8r" for a file that mixes them (by share of the weights).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn as nn

from library.io import CheckpointError, CheckpointReader
from library.precision.autocast import autocast_off, matmul_input
from library.precision.dequantized_linear import dequantized_linear
from library.precision.fp8 import apply_keeping_dtypes
from library.precision.fp8_checkpoints import diffusion_model_prefix

FP8_MAX, E2M1_MAX, NVFP4_BLOCK = 448.0, 6.0, 16
# E2M1 values by 4-bit code: bit 3 the sign, bits 2-0 the magnitude.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
WEIGHT_DTYPES = {"fp8r": torch.float8_e4m3fn, "nvfp4": torch.uint8}
WEIGHT_DTYPE_NAMES = {"fp8r": "F8_E4M3", "nvfp4": "U8"}


def dequantize(kind: str, weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight of a stored layer, float32 then cast once to `dtype` (diffusers' order)."""
    with autocast_off(weight.device.type):
        if kind == "fp8r":
            w = weight.float() * scale.float()[:, None]
        else:
            codes = torch.stack([weight & 0x0F, weight >> 4], dim=-1).reshape(weight.shape[0], -1)
            values = torch.tensor(E2M1, device=weight.device)[codes.long()]
            w = values * (scale.float() * scale_2.float()).repeat_interleave(NVFP4_BLOCK, dim=1)
        return w.to(dtype)


def quantize_fp8r(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, K] -> the fp8r tensors (diffusers' quantize_fp8r): tiny test files in the released layout."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return {"weight": (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "weight_scale": scale}


def quantize_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, K] -> the nvfp4 tensors (diffusers' quantize_nvfp4, the ModelOpt layout; input_scale 1)."""
    w = weight.float()
    n, k = w.shape
    scale_2 = w.abs().amax() / (FP8_MAX * E2M1_MAX)
    blocks = w.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    scale = (blocks.abs().amax(dim=-1) / E2M1_MAX / scale_2).to(torch.float8_e4m3fn)
    s = (scale.float() * scale_2)[..., None]
    scaled = torch.where(s > 0, blocks / s, torch.zeros_like(blocks))
    m = scaled.abs().clamp(max=E2M1_MAX)  # round to nearest on the E2M1 grid (spacing 0.5 / 1 / 2)
    m = torch.where(m < 2, torch.round(m * 2) / 2, torch.where(m < 4, torch.round(m), torch.round(m / 2) * 2))
    codes = torch.where(m < 2, m * 2, torch.where(m < 4, m + 2, m / 2 + 4)).to(torch.uint8)
    codes = (codes | ((scaled < 0).to(torch.uint8) << 3)).reshape(n, k)
    return {"weight": codes[:, 0::2] | (codes[:, 1::2] << 4), "weight_scale": scale, "weight_scale_2": scale_2,
            "input_scale": torch.ones((), dtype=torch.float32)}


# ----------------------------------------------------------------------------------------------
# The layer


class BFLLinear(nn.Module):
    """A frozen Linear whose weight is stored as a BFL file stores it (`kind` "fp8r" or "nvfp4").

    Buffers (never trained; `model.to(dtype)` leaves fp8 / uint8 alone): `weight`, `weight_scale`,
    and for nvfp4 `weight_scale_2`. forward dequantizes to the input's (or autocast's) dtype."""

    backward_saves_weights_only = True  # its autograd Function keeps the stored tensors, never x

    def __init__(self, in_features: int, out_features: int, bias: bool = True, kind: str = "fp8r", device=None):
        super().__init__()
        if kind not in WEIGHT_DTYPES or (kind == "nvfp4" and in_features % NVFP4_BLOCK):
            raise ValueError(f"BFLLinear: kind {kind!r} for {in_features} inputs")
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.compute_dtype: torch.dtype | None = None
        if kind == "fp8r":
            self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_scale", torch.zeros(out_features, dtype=torch.float32, device=device))
            self.weight_scale_2 = None
        else:
            self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.zeros(out_features, in_features // NVFP4_BLOCK,
                                                             dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer("weight_scale_2", torch.zeros((), dtype=torch.float32, device=device))
        b = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)
        self.bias = b if bias else None

    @classmethod
    def from_meta_linear(cls, linear: nn.Linear, kind: str) -> "BFLLinear":
        return cls(linear.in_features, linear.out_features, linear.bias is not None, kind, device="meta")

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.kind, self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, dtype = matmul_input(x, self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        x = x.to(dtype)
        with autocast_off(x.device.type):  # the matmul runs in exactly `dtype`
            stored = (self.weight, self.weight_scale, self.weight_scale_2)
            return dequantized_linear(x, bias, dequantize, self.kind, *stored, dtype)

    def _apply(self, fn, recurse=True):  # model.to(bf16) keeps the stored dtypes; device moves apply
        return apply_keeping_dtypes(self, fn, ("weight", "weight_scale", "weight_scale_2"),
                                    lambda: super(BFLLinear, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, kind={self.kind}"


# ----------------------------------------------------------------------------------------------
# Files


@dataclass(frozen=True)
class BflCheckpoint:
    """What a BFL-quantized transformer file stores: the layout name, the diffusion-model prefix of
    its keys, and the scheme of every quantized Linear (file key without prefix and `.weight`)."""

    layout: str
    prefix: str
    kinds: dict[str, str]

    def is_dropped(self, name: str) -> bool:
        return name.endswith(".input_scale")


def is_bfl(reader: CheckpointReader) -> bool:
    """A `.weight_scale_2` (nvfp4), or a float32 1-D `.weight_scale` with one entry per row of its
    weight (fp8r's per-row scale: our fp8_scaled stores bf16 [out, in/64], ComfyUI's per-tensor fp8
    float32 [] or [1])."""
    for key in reader.keys():
        if key.endswith(".weight_scale_2"):
            return True
        shape, weight = reader.shape(key), key[: -len("_scale")]
        if (key.endswith(".weight_scale") and reader.dtype_name(key) == "F32" and len(shape) == 1 and shape[0] > 1
                and weight in reader and reader.shape(weight)[:1] == shape):
            return True
    return False


def read_bfl_checkpoint(reader: CheckpointReader, path: str | None = None) -> BflCheckpoint | None:
    """The BFL layout of a transformer file, None if it is none; a malformed layer is one
    CheckpointError naming its key (BFLQuantizer.maybe_update_state_dict's checks)."""
    if not is_bfl(reader):
        return None
    where, prefix = path or reader.path, diffusion_model_prefix(reader.keys())
    keys = set(reader.keys())
    kinds, share = {}, Counter()
    for key in sorted(k for k in keys if k.startswith(prefix) and k.endswith(".weight_scale")):
        layer = key[: -len(".weight_scale")]
        kind = "nvfp4" if layer + ".weight_scale_2" in keys else "fp8r"
        weight = layer + ".weight"
        if weight not in keys or reader.dtype_name(weight) != WEIGHT_DTYPE_NAMES[kind]:
            found = reader.dtype_name(weight) if weight in keys else "missing"
            raise CheckpointError(f"{where}: '{weight}' is {found}, but the {kind} layout expects "
                                  f"{WEIGHT_DTYPES[kind]}")
        if kind == "nvfp4" and layer + ".input_scale" not in keys:
            raise CheckpointError(f"{where}: '{layer}' has weight_scale_2 but no input_scale, which nvfp4 requires")
        kinds[layer[len(prefix) :]] = kind
        share[kind] += reader.numel([weight])
    return BflCheckpoint("bfl_" + "+".join(k for k, _ in share.most_common()), prefix, kinds)


def prepare_bfl(model: nn.Module, info: BflCheckpoint, rename=lambda name: name) -> nn.Module:
    """Swap every exact nn.Linear of the meta `model` that the file stores quantized for a BFLLinear
    (in place). rename: file layer name (no prefix) -> model module name."""
    kinds = {rename(name): kind for name, kind in info.kinds.items()}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and name in kinds:
                setattr(parent, child_name, BFLLinear.from_meta_linear(child, kinds[name]))
    return model


class BflLoadConverter:
    """load_streaming convert hook (model keys): a BFLLinear's tensors arrive as stored (input_scale
    dropped); a quantized weight the model holds elsewhere (no exact nn.Linear) is dequantized to
    `dtype` with its scales, which are then dropped; other floating tensors are cast to `dtype`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, BFLLinear)}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # scales of a dequantized-on-load layer

    def keep_dtype(self, key: str) -> bool:
        return True  # every tensor arrives as stored; __call__ decides

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        layer, _, leaf = key.rpartition(".")
        if leaf == "input_scale":
            return {}
        if layer in self.layers and leaf in ("weight", "weight_scale", "weight_scale_2"):
            return {key: tensor}
        if leaf in ("weight", "weight_scale", "weight_scale_2") and (tensor.dtype in (torch.float8_e4m3fn, torch.uint8)
                                                                     or leaf != "weight"):
            got = self.pending.setdefault(layer, {})
            got[leaf] = tensor
            scale_2 = got.get("weight_scale_2")
            kind = "nvfp4" if got.get("weight", tensor).dtype == torch.uint8 else "fp8r"
            if "weight" in got and "weight_scale" in got and (kind == "fp8r" or scale_2 is not None):
                del self.pending[layer]
                return {f"{layer}.weight": dequantize(kind, got["weight"], got["weight_scale"], scale_2, self.dtype)}
            return {}
        return {key: tensor.to(self.dtype) if tensor.is_floating_point() else tensor}


def bfl_converter(model: nn.Module, info: BflCheckpoint, dtype: torch.dtype, rename=lambda name: name) -> BflLoadConverter:
    """The `prepare` hook's work for a BFL file: BFLLinears in the meta model, and the convert hook."""
    return BflLoadConverter(prepare_bfl(model, info, rename), dtype)
