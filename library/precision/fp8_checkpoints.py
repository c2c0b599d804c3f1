"""Pre-quantized fp8 transformer checkpoints, used as the base as they are stored (no re-quantization).

Layouts read; the name is also the base precision a LoRA trained on it records (ss_base_precision):
  "fp8"                plain float8_e4m3fn codes: sd-scripts' fp8 files, ComfyUI's plain *-fp8
                       (everything e4m3, norms and biases included), merge_lora --save_precision fp8.
  "fp8_scaled"         e4m3 codes + our bf16 `X.weight_scale` [out, in/64] (merge_lora fp8_scaled).
  "fp8_tensor_scaled"  ComfyUI's scaled fp8 (Comfy-Org's `*_fp8_e4m3fn_scaled.safetensors`): e4m3
                       codes + one float32 scale per Linear.

ComfyUI's scaled fp8, as its loader reads it (comfy/model_detection.py model_config_from_unet,
comfy/ops.py scaled_fp8_ops, comfy/utils.py convert_old_quants, comfy/quant_ops.py; ComfyUI 2025-10
and the comfy_quant format after it):
  - Marker: a tensor `scaled_fp8` at the diffusion model's prefix (`model.diffusion_model.scaled_fp8`
    in a full checkpoint, `scaled_fp8` in a diffusion-model-only file). Its dtype is the weights' fp8
    type (float32 is read as e4m3fn); 2 elements mean "no fp8 matmul", others allow ComfyUI's fp8
    _scaled_mm fast path: inference settings that do not change the weights.
  - Per Linear X: `X.weight` e4m3 codes, `X.scale_weight` float32 0-dim (absent: 1.0, ComfyUI's
    default), optionally `X.scale_input` (the activation scale of that fast path only).
  - Dequantized weight = X.weight.to(dtype) * X.scale_weight.to(dtype), dtype being the compute
    dtype: both operands are cast first, then one multiply rounded in dtype (ops.py: cast_bias_weight
    casts the codes to the input's dtype, then `weight * self.scale_weight.to(dtype=weight.dtype)`;
    comfy-kitchen's eager dequantize_per_tensor_fp8 is the same `x.to(t) * scale.to(t)`). When the
    weight has more elements than the input ComfyUI scales the input instead (same product, other
    rounding); its LoRA patching dequantizes the weight (in float32). We always scale the weight.
  - comfy_quant (newer ComfyUI, which converts the marker layout into it on load): `X.comfy_quant`,
    the uint8 bytes of JSON {"format": "float8_e4m3fn", ...}, or the header entry
    `_quantization_metadata` = {"layers": {X: {...}}}; the scale is `X.weight_scale` (float32 0-dim)
    and the activation scale `X.input_scale`. Format float8_e4m3fn is the same per-tensor layout.
musubi-tuner (src/musubi_tuner/modules/fp8_optimization_utils.py) names its scales `X.scale_weight`
too, without the marker, in the model dtype: shape [] per tensor, [out, 1] per channel or
[out, in/block, 1] per block (block 64 by default), dequantized as weight.to(scale.dtype) * scale.
It quantizes while loading and writes no such file itself, but a saved state dict maps cleanly:
per tensor -> "fp8_tensor_scaled" (the same product when the compute dtype is the scale's, as in
musubi); bf16 scales per 64 input columns (or per row where in % 64 != 0) -> "fp8_scaled", the scale
reshaped to [out, in/64]. Other musubi scales (per channel on 64-divisible rows, other block sizes,
fp16/fp32 block scales that bf16 would round) are refused naming the key.

A plain float8_e5m2 file (every fp8 tensor e5m2, no scale or marker: the "-fp8-e5m2" releases) is no
stored layout: FP8Linear holds e4m3 codes, and e5m2 -> e4m3 is not exact (2^-16 .. 57344 against
2^-9 .. 448), but e5m2 -> bf16 / fp16 / fp32 is (the same sign and exponent range or wider, more
mantissa bits). It is read as a high-precision file, each tensor widened to the compute dtype as
ComfyUI computes with it, with one warning. Asking for an fp8 (or low-bit) base on it is refused before
loading, naming the file (stored_layouts.widened_layout); a LoRA trained on it records "fp8_e5m2".

Refused, one line naming the key: float8_e5m2 beside e4m3 codes, scales or a marker; transformers' fine-grained fp8 (`X.weight_scale_inv`
per 128 x 128 block, the Hugging Face "-FP8" releases), which would otherwise read as plain fp8; comfy_quant formats other than float8_e4m3fn
(nvfp4, int8, mxfp8, ...: number formats and block scales FP8Linear does not hold); ComfyUI scales
that are not one number per tensor; the musubi scales above. Activation scales are dropped: we
compute in bf16/fp32, as ComfyUI does whenever a LoRA is patched in.

A Linear a comfy_quant file stores in high precision (ComfyUI's "fp8mixed" files: no comfy_quant entry, a
bf16 weight) stays a plain Linear holding the file's weight in the compute dtype, as ComfyUI's
mixed_precision_ops computes with it. In the other layouts such a weight is quantized per tensor at load.

Packed weights (fp8_packed.py: [E, K, N] tensors of a mixture's experts, no Linear) load as stored: e4m3 codes
plain, with one scale per tensor (ComfyUI's packed `P_scale` beside its comfy_quant config, or a Linear's
`.scale_weight` / `.weight_scale`), or with our bf16 blocks `P_scale` [E, K/64, N]; each in the mode its scale
says, whatever the Linears' layout. A packed weight the file keeps in high precision stays so (ComfyUI computes
with it as stored). Other scale shapes, or two scales for one weight, are refused naming the key.

An fp8 tensor where our model keeps high precision (the architecture's fp8 keep rules: embedders,
the final layer; and norms, biases) is widened, with one warning: widening is exact, so the base
trained on is the very one ComfyUI computes with (ComfyUI casts those codes to the compute dtype the
same way). An error would make ComfyUI's plain fp8 files, which store everything in e4m3, unusable.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from library.io import CheckpointError, CheckpointReader
from library.precision.fp8 import (
    FP8_CHECKPOINT_DTYPES, PACKED_SCALE_SUFFIX, SCALE_DTYPE, TENSOR_SCALE_DTYPE, FP8LoadConverter, KeepRules,
    dequantize_packed_weight, dequantize_weight, keeps_packed, packed_scale_shape, packed_weight_names, prepare_fp8,
    scale_shape,
)  # fmt: skip

DIFFUSION_MODEL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # ComfyUI full / UNet-only files
COMFY_MARKER = "scaled_fp8"
COMFY_FORMAT = "float8_e4m3fn"  # the only comfy_quant format with our per-tensor layout
# The base_precision (fp8_base / fp8_scaled settings) a training config needs for each stored layout:
# ComfyUI's per-tensor scales are a scaled fp8 base like ours, so fp8_scaled = true; the LoRA
# metadata then records the stored layout itself (DiffusionTask.base_precision).
CONFIG_PRECISION = {"fp8": "fp8", "fp8_scaled": "fp8_scaled", "fp8_tensor_scaled": "fp8_scaled"}
DROPPED_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")  # activation scales, per-layer markers
SCALE_SUFFIXES = (".scale_weight", ".weight_scale", *DROPPED_SUFFIXES)  # what a quantized Linear keeps beside .weight
# A packed weight P's scale in files: P_scale (ours, and ComfyUI's name for a packed weight), or a Linear's names
PACKED_FILE_SCALE_SUFFIXES = (PACKED_SCALE_SUFFIX, ".scale_weight", ".weight_scale")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What a pre-quantized file stores: the layout, the key suffix of its per-tensor scales (None
    for our own layouts) and the diffusion-model prefix its transformer keys carry."""

    layout: str  # "fp8" | "fp8_scaled" | "fp8_tensor_scaled"
    scale_suffix: str | None  # ".scale_weight" (ComfyUI marker layout, musubi) | ".weight_scale" (comfy_quant)
    prefix: str
    packed_scales: frozenset[str] = frozenset()  # the scales of packed fp8 weights (_packed_scales), no prefix

    @property
    def comfy_quant(self) -> bool:
        return self.scale_suffix == ".weight_scale"

    def is_dropped(self, name: str) -> bool:
        """Tensors (named without the prefix) that carry nothing a FP8Linear keeps."""
        if name == COMFY_MARKER or name.endswith(DROPPED_SUFFIXES):
            return True
        return self.scale_suffix is not None and name.endswith(self.scale_suffix)  # loaded with its weight


def _packed_scales(reader: CheckpointReader, where: str, prefix: str, fp8: list[str]) -> frozenset[str]:
    """The scales (names without the prefix) of the file's packed fp8 weights: 3-D e4m3 tensors P [E, K, N] (a
    mixture's experts, fp8_packed.py), each with at most one of P_scale (ours and ComfyUI's packed name),
    P.scale_weight, P.weight_scale: one number (a per-tensor scale, ComfyUI's) or, ours, P_scale in bf16 blocks
    [E, K/64, N]. Anything else is refused naming the key."""
    found = set()
    for name in fp8:
        shape = reader.shape(prefix + name)
        if len(shape) != 3 or reader.dtype_name(prefix + name) != "F8_E4M3":
            continue
        scales = [name + s for s in PACKED_FILE_SCALE_SUFFIXES if prefix + name + s in reader]
        if len(scales) > 1:
            raise CheckpointError(f"{where}: '{prefix + name}' has {len(scales)} scales ({', '.join(scales)}); a "
                                  f"packed fp8 weight takes one")
        for scale in scales:
            have = reader.shape(prefix + scale)
            blocks = scale == name + PACKED_SCALE_SUFFIX and have == packed_scale_shape(*shape)
            if not (have in ((), (1,)) or blocks):
                raise CheckpointError(f"{where}: '{prefix + scale}' has shape {have}: a packed fp8 weight {shape} is "
                                      f"read with one scale per tensor, or bf16 block scales "
                                      f"{packed_scale_shape(*shape)} as '{name + PACKED_SCALE_SUFFIX}'")
            found.add(scale)
    return frozenset(found)


def diffusion_model_prefix(keys: list[str]) -> str:
    """`model.diffusion_model.` / `diffusion_model.` when the file holds the transformer under it
    (ComfyUI; a full checkpoint also bundles text encoders and the VAE under other prefixes), else ''."""
    return next((p for p in DIFFUSION_MODEL_PREFIXES if any(k.startswith(p) for k in keys)), "")


def _comfy_quant_formats(reader: CheckpointReader, names: list[str], prefix: str) -> dict[str, str]:
    """Layer -> comfy_quant format, from `X.comfy_quant` tensors and the `_quantization_metadata` header."""
    formats = {}
    for name in (n for n in names if n.endswith(".comfy_quant")):
        conf = json.loads(bytes(reader.get(prefix + name).to(torch.uint8).tolist()))
        formats[name[: -len(".comfy_quant")]] = conf.get("format")
    if "_quantization_metadata" in reader.metadata:
        layers = json.loads(reader.metadata["_quantization_metadata"]).get("layers", {})
        formats.update({k: (v.get("format") if isinstance(v, dict) else v) for k, v in layers.items()})
    return formats


def _check_per_tensor_scales(reader: CheckpointReader, where: str, keys: list[str]) -> None:
    for key in keys:
        if len(reader.shape(key)) > 1 or (reader.shape(key) and reader.shape(key)[0] != 1):
            raise CheckpointError(f"{where}: '{key}' has shape {reader.shape(key)}; ComfyUI's scaled fp8 stores one "
                                  f"float32 scale per tensor (shape ())")


def _musubi_layout(reader: CheckpointReader, where: str, prefix: str, scales: list[str]) -> str:
    """"fp8_tensor_scaled" or "fp8_scaled" for musubi-tuner's `X.scale_weight`s (no ComfyUI marker)."""
    per_tensor = [n for n in scales if reader.shape(prefix + n) in ((), (1,))]
    if len(per_tensor) == len(scales):
        return "fp8_tensor_scaled"
    for name in scales:
        key, shape, weight = prefix + name, reader.shape(prefix + name), prefix + name[: -len("scale_weight")] + "weight"
        if weight not in reader or len(reader.shape(weight)) != 2:
            raise CheckpointError(f"{where}: '{key}' scales no 2-D '{weight}'")
        out, in_features = reader.shape(weight)
        rows, blocks = scale_shape(out, in_features)
        fits = shape == (rows, blocks, 1) or (blocks == 1 and shape == (rows, 1))  # one block: in is 64 or not 64-divisible
        if name in per_tensor or reader.dtype_name(key) != "BF16" or not fits:
            raise CheckpointError(f"{where}: '{key}' ({reader.dtype_name(key)} {shape}, weight [{out}, {in_features}]) "
                                  f"is a musubi-tuner fp8 scale that maps onto neither one scale per tensor (all of "
                                  f"them) nor bf16 scales per 64 input columns {(rows, blocks, 1)}; give the bf16 checkpoint")
    return "fp8_scaled"


def _quantization_extras(reader: CheckpointReader, names: list[str]) -> bool:
    """Whether the transformer's tensors carry fp8 scales or markers (of any layout above; transformers'
    `.weight_scale_inv` never gets here: _transformer_fp8 refuses it first)."""
    return (COMFY_MARKER in names or "_quantization_metadata" in reader.metadata
            or any(n.endswith(SCALE_SUFFIXES) for n in names))


def _transformer_fp8(reader: CheckpointReader, where: str) -> tuple[str, list[str], list[str]]:
    """(the transformer's key prefix, its tensor names without it, those stored fp8). Transformers'
    fine-grained fp8 is refused here, before any layout is told from the names."""
    prefix = diffusion_model_prefix(reader.keys())
    names = [k[len(prefix) :] for k in reader.keys() if k.startswith(prefix)]
    fp8 = [n for n in names if reader.dtype_name(prefix + n) in FP8_CHECKPOINT_DTYPES and n != COMFY_MARKER]
    inverse = next((n for n in names if n.endswith(".weight_scale_inv")), None) if fp8 else None
    if inverse:
        raise CheckpointError(f"{where}: '{prefix + inverse}' is a block-wise fp8 scale (transformers' fine-grained "
                              f"fp8, [out/128, in/128] blocks), a layout not read; give the bf16 checkpoint")
    return prefix, names, fp8


def _plain_e5m2(reader: CheckpointReader, names: list[str], fp8: list[str], e5m2: list[str]) -> bool:
    """Whether the file is a plain e5m2 one: every fp8 tensor e5m2, no scale or marker."""
    return bool(e5m2) and len(e5m2) == len(fp8) and not _quantization_extras(reader, names)


def plain_e5m2_key(reader: CheckpointReader, path: str | None = None) -> str | None:
    """The first 2-D (a Linear's) float8_e5m2 tensor of a plain e5m2 transformer file (read_fp8_checkpoint
    reads it as a high-precision file, widened), else None."""
    prefix, names, fp8 = _transformer_fp8(reader, path or reader.path)
    e5m2 = [n for n in fp8 if reader.dtype_name(prefix + n) == "F8_E5M2"]
    if not _plain_e5m2(reader, names, fp8, e5m2):
        return None
    return prefix + next((n for n in e5m2 if len(reader.shape(prefix + n)) == 2), e5m2[0])


def read_fp8_checkpoint(reader: CheckpointReader, path: str | None = None) -> Fp8Checkpoint | None:
    """The fp8 layout of a transformer checkpoint, or None when its transformer is bf16/fp16/fp32.
    Only the transformer's keys count (those under its ComfyUI prefix, when it has one). Layouts
    we cannot use as they are raise CheckpointError naming the key that shows them."""
    where = path or reader.path
    prefix, names, fp8 = _transformer_fp8(reader, where)
    if not fp8:
        return None
    packed = _packed_scales(reader, where, prefix, fp8)
    names = [n for n in names if n not in packed]  # the Linears' scales and markers tell the layout
    e5m2 = [n for n in fp8 if reader.dtype_name(prefix + n) == "F8_E5M2"]
    if _plain_e5m2(reader, names, fp8, e5m2):
        warnings.warn(f"{where}: {len(e5m2)} float8_e5m2 tensors (first '{prefix + e5m2[0]}') are widened exactly to "
                      f"the compute dtype (as ComfyUI computes them); the base is coarser than a bf16 one", stacklevel=2)
        return None
    if e5m2:
        raise CheckpointError(f"{where}: '{prefix + e5m2[0]}' is float8_e5m2 beside float8_e4m3fn codes, fp8 scales or "
                              f"a marker; scaled fp8 bases must be float8_e4m3fn (a plain e5m2 file is widened)")
    if COMFY_MARKER in names:
        if reader.dtype_name(prefix + COMFY_MARKER) not in ("F8_E4M3", "F32"):
            raise CheckpointError(f"{where}: '{prefix + COMFY_MARKER}' is {reader.dtype_name(prefix + COMFY_MARKER)}: "
                                  f"ComfyUI's marker names the weights' fp8 type, and only float8_e4m3fn is read")
        _check_per_tensor_scales(reader, where, [prefix + n for n in names if n.endswith(".scale_weight")])
        return Fp8Checkpoint("fp8_tensor_scaled", ".scale_weight", prefix, packed)
    formats = _comfy_quant_formats(reader, names, prefix)
    if formats:
        other = next(((k, f) for k, f in formats.items() if f != COMFY_FORMAT), None)
        if other:
            raise CheckpointError(f"{where}: layer '{other[0]}' is comfy_quant format {other[1]!r}; only "
                                  f"{COMFY_FORMAT!r} (one float32 scale per tensor) is read")
        _check_per_tensor_scales(reader, where, [prefix + n for n in names if n.endswith(".weight_scale")])
        return Fp8Checkpoint("fp8_tensor_scaled", ".weight_scale", prefix, packed)
    musubi = [n for n in names if n.endswith(".scale_weight")]
    if musubi:
        return Fp8Checkpoint(_musubi_layout(reader, where, prefix, musubi), ".scale_weight", prefix, packed)
    scales = [n for n in names if n.endswith(".weight_scale")]
    flat = next((n for n in scales if len(reader.shape(prefix + n)) != 2), None)
    if flat:
        raise CheckpointError(f"{where}: '{prefix + flat}' has shape {reader.shape(prefix + flat)}, not the [out, in/64] "
                              f"block scales of fp8_scaled, and no comfy_quant marker says it is a per-tensor scale")
    for name in scales:
        key, weight = prefix + name, prefix + name[: -len("_scale")]
        want = scale_shape(*reader.shape(weight)) if weight in reader and len(reader.shape(weight)) == 2 else None
        if reader.shape(key) != want:
            raise CheckpointError(f"{where}: '{key}' has shape {reader.shape(key)}, not the fp8_scaled block scales "
                                  f"{want} (one per 64 input columns) of a 2-D '{weight}'")
    return Fp8Checkpoint("fp8_scaled" if scales else "fp8", None, prefix, packed)


def fp8_checkpoint_layout(reader: CheckpointReader, path: str | None = None) -> str | None:
    """"fp8" / "fp8_scaled" / "fp8_tensor_scaled" for a pre-quantized transformer file, else None."""
    info = read_fp8_checkpoint(reader, path)
    return info.layout if info else None


class PrequantizedConverter:
    """load_streaming convert hook (model keys, the prefix already stripped) for an fp8 checkpoint
    used as it is: every FP8Linear gets the file's e4m3 codes and scales unchanged (a per-tensor
    scale goes in with its weight: absent means 1.0, as in ComfyUI); a Linear weight the file keeps
    in high precision is quantized here in the file's layout (comfy_quant: it is no FP8Linear but
    cast to `dtype`, see prequantized_converter); fp8 tensors where the model keeps high precision
    are widened exactly (with their scale), one warning for all; every other floating tensor is cast
    to `dtype`; markers and activation scales are dropped."""

    def __init__(self, model: nn.Module, info: Fp8Checkpoint, dtype: torch.dtype, reader: CheckpointReader, source: str):
        # no mode check: a packed weight's mode is what its stored scale says (_packed_as_stored), not the layout's
        self.inner, self.info, self.dtype, self.reader = FP8LoadConverter(model), info, dtype, reader
        self.packed = set(packed_weight_names(model))  # every packed weight, stored in fp8 by the model or not
        fp8_names = [k[len(info.prefix) :] for k in reader.keys()
                     if k.startswith(info.prefix) and reader.dtype_name(k) in FP8_CHECKPOINT_DTYPES]  # fmt: skip
        self.widened = [n for n in fp8_names if n not in self.inner.quantized and n not in self.inner.packed
                        and not info.is_dropped(n)]  # fmt: skip
        self.source, self._warned = source, False  # warned at the first widening: not when only planning memory

    def keep_dtype(self, key: str) -> bool:
        return True  # every tensor arrives as stored; __call__ decides

    def _warn_widening(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"{self.source}: {len(self.widened)} fp8 tensors where the model keeps high precision (first "
                          f"'{self.info.prefix + self.widened[0]}') are widened to {self.dtype} exactly (as ComfyUI "
                          f"computes them); the base there is coarser than a bf16 one", stacklevel=3)

    def _scale(self, layer: str, suffix: str) -> torch.Tensor | None:
        key = self.info.prefix + layer + suffix
        return self.reader.get(key) if key in self.reader else None

    def _scale_of(self, layer: str) -> torch.Tensor | None:
        """The layer's scale as FP8Linear holds it: per tensor fp32 0-dim (exact from any float), blocks
        bf16 [out, in/64] (ours as stored; musubi's [out, in/64, 1] reshaped)."""
        scale = self._scale(layer, self.info.scale_suffix or ".weight_scale")
        if scale is None:
            return None
        if self.info.layout == "fp8_tensor_scaled":
            return scale.to(TENSOR_SCALE_DTYPE).reshape(())
        return self._block_scale(layer + ".weight_scale", scale.reshape(scale.shape[0], -1))

    def _block_scale(self, key: str, scale: torch.Tensor) -> torch.Tensor:
        """Block scales in SCALE_DTYPE, the dtype FP8Linear holds: a wider stored scale must be a bf16
        value already (a widened bf16 scale is), else rounding it would change the base without a word."""
        held = scale.to(SCALE_DTYPE)
        if scale.dtype != SCALE_DTYPE and not torch.equal(held.to(scale.dtype), scale):
            raise CheckpointError(f"{self.source}: '{self.info.prefix + key}' holds {scale.dtype} block scales that "
                                  f"bfloat16 would round (fp8_scaled keeps bf16 scales [out, in/64]); give the bf16 "
                                  f"checkpoint or one written by merge_lora --save_precision fp8_scaled")
        return held

    def _packed(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """A packed weight as stored: e4m3 codes with their scale where the model stores it in fp8 (_packed_as_stored
        made it so for each it does not keep), widened with its scale where it keeps it; one stored in high
        precision cast to `dtype`. Its scale is read with it (its own key gives nothing)."""
        if key in self.info.packed_scales:
            return {}
        if tensor.dtype != torch.float8_e4m3fn:
            return {key: tensor.to(self.dtype)}
        scale = self._packed_scale(key)
        if key in self.inner.packed:
            return {key: tensor} if scale is None else {key: tensor, key + PACKED_SCALE_SUFFIX: scale}
        self._warn_widening()
        return {key: dequantize_packed_weight(tensor, scale, self.dtype)}

    def _packed_scale(self, key: str) -> torch.Tensor | None:
        """A packed weight's scale as PackedWeights holds it: one number fp32 0-dim, blocks bf16 [E, K/64, N]."""
        name = next((key + s for s in PACKED_FILE_SCALE_SUFFIXES if key + s in self.info.packed_scales), None)
        if name is None:
            return None
        scale = self.reader.get(self.info.prefix + name)
        return scale.to(TENSOR_SCALE_DTYPE).reshape(()) if scale.numel() == 1 else self._block_scale(name, scale)

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if key in self.packed or key in self.info.packed_scales:
            return self._packed(key, tensor)
        if self.info.is_dropped(key):
            return {}
        is_fp8 = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        if key in self.inner.quantized:
            if not is_fp8:
                return self.inner(key, tensor)
            if self.info.scale_suffix is None:  # ours: the block scales arrive as their own keys
                return {key: tensor}
            scale = self._scale_of(layer)
            if scale is None and self.info.layout == "fp8_tensor_scaled":
                scale = torch.ones((), dtype=TENSOR_SCALE_DTYPE)  # ComfyUI's default; musubi blocks: a missing key
            return {key: tensor} if scale is None else {key: tensor, f"{layer}.weight_scale": scale}
        if is_fp8:  # widened: the values ComfyUI computes with, exactly
            self._warn_widening()
            scale = self._scale_of(layer) if layer else None
            return {key: dequantize_weight(tensor, scale, self.dtype) if scale is not None else tensor.to(self.dtype)}
        if key.endswith(".weight_scale"):  # ours: the block scales of an FP8Linear, or of a widened layer
            return {key: self._block_scale(key, tensor)} if key[: -len("_scale")] in self.inner.quantized else {}
        return {key: tensor.to(self.dtype) if tensor.is_floating_point() else tensor}


@dataclass(frozen=True)
class _StoredKeepRules:
    """KeepRules: the architecture's, plus the exact names of the Linears the file stores in high precision."""

    keep: tuple[str, ...]
    modulation: tuple[str, ...]


def _high_precision_linears(model: nn.Module, info: Fp8Checkpoint, reader: CheckpointReader) -> list[str]:
    """The Linears of a comfy_quant file whose weight is not fp8 in the file (from its header): ComfyUI
    computes with them as stored (mixed_precision_ops: a layer without comfy_quant config is a plain
    Linear in the compute dtype), so they are never quantized. Other layouts: none."""
    if not info.comfy_quant:
        return []
    weights = {name: info.prefix + name + ".weight" for name, m in model.named_modules() if type(m) is nn.Linear}
    return [name for name, key in weights.items()
            if key in reader and reader.dtype_name(key) not in FP8_CHECKPOINT_DTYPES]  # fmt: skip


def _packed_as_stored(model: nn.Module, info: Fp8Checkpoint, rules: KeepRules, reader: CheckpointReader) -> None:
    """The packed weights of the meta `model` that the file stores in e4m3 (and `rules` do not keep) are stored in
    fp8 in the mode their scale says: none "fp8", one number "fp8_tensor_scaled", blocks "fp8_scaled". The others
    stay in high precision as stored, as ComfyUI computes with them (its packed experts without a quantization
    config are plain tensors in the compute dtype)."""
    for name, (module, weight) in packed_weight_names(model).items():
        key = info.prefix + name
        if key not in reader or reader.dtype_name(key) != "F8_E4M3" or keeps_packed(name, rules):
            continue
        scale = next((info.prefix + name + s for s in PACKED_FILE_SCALE_SUFFIXES if name + s in info.packed_scales),
                     None)
        mode = "fp8" if scale is None else "fp8_tensor_scaled" if reader.shape(scale) in ((), (1,)) else "fp8_scaled"
        module.quantize_packed(weight, mode)


def prequantized_converter(model: nn.Module, info: Fp8Checkpoint, rules: KeepRules, dtype: torch.dtype,
                           reader: CheckpointReader, source: str) -> PrequantizedConverter:
    """Swap the Linears of the meta `model` that the architecture's `rules` do not keep (and a comfy_quant
    file stores in fp8) for FP8Linear of the file's layout, store its packed weights as the file does
    (_packed_as_stored); the convert hook."""
    as_stored = _high_precision_linears(model, info, reader)
    if as_stored:
        rules = _StoredKeepRules((*rules.keep, *map(re.escape, as_stored)), tuple(rules.modulation))
    model = prepare_fp8(model, info.layout, rules, packed=False)
    _packed_as_stored(model, info, rules, reader)
    return PrequantizedConverter(model, info, dtype, reader, source)


def scaled_fp8_converter(model: nn.Module, reader: CheckpointReader, source: str, rules: KeepRules | None,
                         dtype: torch.dtype, rename=lambda key: key) -> PrequantizedConverter | None:
    """The convert hook of a text encoder (T5-XXL, the LLMs) whose file is ComfyUI's scaled fp8
    (t5xxl_fp8_e4m3fn_scaled, qwen_2.5_vl_7b_fp8_scaled: layout "fp8_tensor_scaled"), else None. Never
    quantized again: with fp8 keep `rules` (an fp8 encoder asked for) each Linear keeps its codes and
    scale, as a transformer's does; with None every fp8 tensor is widened to `dtype` with its scale
    (codes * scale_weight, ComfyUI's values). The scales are looked up under the model's key names, so
    a file whose scaled Linears the loader's `rename` renames is refused (it would read scale 1.0)."""
    if not _quantization_extras(reader, reader.keys()):  # plain fp8 / e5m2 files load as before: cast to dtype
        return None
    info = read_fp8_checkpoint(reader, source)
    if info is None or info.layout != "fp8_tensor_scaled":
        return None
    renamed = next((k for k in reader.keys() if k.endswith(info.scale_suffix) and rename(k) not in (k, None)), None)
    if renamed:
        raise CheckpointError(f"{source}: '{renamed}' would load as '{rename(renamed)}': scaled fp8 is read in the "
                              f"model's own key names only (ComfyUI's files use them); give the bf16 checkpoint")
    if rules is None:
        return PrequantizedConverter(model, info, dtype, reader, source)
    return prequantized_converter(model, info, rules, dtype, reader, source)
