"""Transformer files stored quantized are trained on as they are stored: fp8 files
(fp8_checkpoints.py: ours, ComfyUI's scaled fp8, musubi-tuner's), GGUF files (gguf_weights.py:
ComfyUI-GGUF's) and BFL's fp8r / nvfp4 files (bfl_weights.py: diffusers' BFL quantizer layouts). The family loaders ask here, one call for every stored format, so a new format
needs no loader change:

    stored = read_stored_layout(reader, path)   # None: a bf16 / fp16 / fp32 file
    if stored:
        prepare = lambda model: stored_converter(model, stored, rules, dtype, reader, path)

`stored.layout` names the base in a LoRA's metadata (ss_base_precision: "fp8_tensor_scaled",
"gguf_q8_0", "gguf_q4_k+q6_k", "bfl_nvfp4", ...), so that inference can match training.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from library.errors import ConfigError
from library.io import CheckpointError, CheckpointReader, component_folder
from library.precision.bnb_weights import refuse_serialized
from library.precision.bfl_weights import BflCheckpoint, bfl_converter, read_bfl_checkpoint
from library.precision.fp8 import KeepRules
from library.precision.fp8_checkpoints import (CONFIG_PRECISION, Fp8Checkpoint, plain_e5m2_key, prequantized_converter,
                                               read_fp8_checkpoint)
from library.precision.gguf_weights import GgufCheckpoint, gguf_converter, is_gguf, read_gguf_checkpoint

StoredLayout = Fp8Checkpoint | GgufCheckpoint | BflCheckpoint

# A plain float8_e5m2 file loads widened to the compute dtype: no stored layout, but widening is exact, so
# the base trained on is that file's (the name a LoRA's metadata gives it).
WIDENED_E5M2 = "fp8_e5m2"


def read_stored_layout(reader: CheckpointReader, path: str | None = None) -> StoredLayout | None:
    """How the transformer file stores its weights when it is pre-quantized (None: in high precision).
    Layouts we cannot use raise CheckpointError naming the tensor that shows them."""
    if is_gguf(reader):
        return read_gguf_checkpoint(reader, path)
    refuse_serialized(reader.keys(), path or reader.path)
    return read_bfl_checkpoint(reader, path) or read_fp8_checkpoint(reader, path)


def stored_layout(reader: CheckpointReader, path: str | None = None) -> str | None:
    """The layout name ("fp8_scaled", "gguf_q8_0", ...) of a pre-quantized transformer file, else None."""
    info = read_stored_layout(reader, path)
    return info.layout if info else None


def stored_converter(model: nn.Module, info: StoredLayout, rules: KeepRules, dtype: torch.dtype,
                     reader: CheckpointReader, source: str):
    """The `prepare` hook's work on the meta `model` for a stored layout: swap in the layers that hold
    the file's weights as stored (FP8Linear, GGUFLinear) and return the per-tensor convert hook. fp8
    layers follow the architecture's keep `rules`; GGUF ones the file (each Linear it stores in blocks)."""
    if isinstance(info, GgufCheckpoint):
        return gguf_converter(model, info, dtype)
    if isinstance(info, BflCheckpoint):  # like GGUF: the file says which Linears it stores quantized
        return bfl_converter(model, info, dtype)
    return prequantized_converter(model, info, rules, dtype, reader, source)


def stored_extras(info: StoredLayout | None):
    """key -> True for the tensors of a stored file (keys without its prefix) that are no tensor of the
    high-precision model: fp8 scales (the packed weights' too), ComfyUI's marker and activation scales. A loader's
    key check skips them; GGUF files store only the model's own tensors."""
    if isinstance(info, BflCheckpoint):
        return info.is_dropped
    if not isinstance(info, Fp8Checkpoint):
        return lambda key: False
    return lambda key: info.is_dropped(key) or key.endswith(".weight_scale") or key in info.packed_scales


def config_precision(layout: str) -> str:
    """The base precision a training config must ask for (config.base_precision) to train on a file
    of `layout`: fp8 files the matching fp8 setting; GGUF files none ("bf16": fp8_base = false), since
    the file's blocks are the base and are never quantized again (BFL's fp8r / nvfp4 likewise)."""
    return CONFIG_PRECISION.get(layout, "bf16")


def config_settings(layout: str, by_base_precision: bool = False, wanted: str = "") -> str:
    """The config keys that give config_precision(layout), as a user writes them: base_precision where the
    config set that key (by_base_precision), else the older fp8_base / fp8_scaled. `wanted`: the config's
    base precision now; "fp8" came from fp8_scaled = false, a key refused without fp8_base
    (config_keys.IDLE_UNLESS), so the advice drops it too."""
    needed = config_precision(layout)
    if by_base_precision:
        return f'base_precision = "{needed}"'
    if needed == "bf16":
        return "fp8_base = false without fp8_scaled = false" if wanted == "fp8" else "fp8_base = false"
    return f"fp8_base = true and fp8_scaled = {str(needed == 'fp8_scaled').lower()}"


def check_config_precision(path: str, layout: str | None, wanted: str, by_base_precision: bool = False) -> None:
    """ConfigError unless the config's base precision (`wanted`, config.base_precision) is the one a
    file of `layout` needs: a pre-quantized base is used as it is stored, so the config must say so.
    by_base_precision: the config set the base_precision key (the advice names it), not fp8_base / fp8_scaled."""
    if layout and config_precision(layout) != wanted:
        raise ConfigError(f"{path}: the checkpoint stores a pre-quantized {layout} base (used as it is), but the "
                          f"config asks for {wanted}; set {config_settings(layout, by_base_precision, wanted)} (what {layout} "
                          f"files need), or give the bf16 checkpoint")


def widened_layout(path: str, wanted: str) -> str | None:
    """WIDENED_E5M2 for a plain float8_e5m2 transformer file at `path` (no other, a pre-quantized one
    included: ask read_stored_layout first), else None. ConfigError naming the file and its first e5m2
    tensor where the config asks for another base than bf16 (`wanted`, config.base_precision): e5m2
    codes do not convert exactly to e4m3 or to a low-bit layout."""
    reader = CheckpointReader(path)
    key = None if is_gguf(reader) else plain_e5m2_key(reader, path)
    if key and wanted != "bf16":
        raise ConfigError(f"{path}: '{key}' is float8_e5m2 (a plain e5m2 file, widened exactly to the compute dtype), "
                          f"but the config asks for a {wanted} base; set base_precision = \"bf16\" (fp8_base = false), "
                          f"or give a bf16 checkpoint")
    return WIDENED_E5M2 if key else None


def refuse_stored_base(model_path: str, what: str, consequence: str) -> None:
    """CheckpointError (from the header) when the transformer at `model_path` (file or diffusers folder)
    is pre-quantized: it loads as stored whatever base precision is asked for, so a tool that compares
    precisions made from it would compare that base with itself (`consequence`)."""
    path = component_folder(model_path, "transformer")
    layout = stored_layout(CheckpointReader(path), path)
    if layout:
        raise CheckpointError(f"{what} {model_path}: the transformer is stored pre-quantized ({layout}) and loads as "
                              f"stored whatever precision is asked for, so {consequence}; give the bf16 checkpoint")
