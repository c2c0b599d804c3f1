"""Z-Image checkpoints: loading (diffusers folders, the single-file layout of ComfyUI and the original
Z-Image code), the name map between the two, and saving in both layouts.

The model uses diffusers' names, so a diffusers folder (the released Tongyi-MAI repos' transformer/)
loads by plain key. The single-file layout differs in names only, and in one fused tensor: the
oracle is diffusers' convert_z_image_transformer_checkpoint_to_diffusers (loaders/single_file_utils.py).

  single file (optionally under `model.diffusion_model.` / `diffusion_model.`)   diffusers / ours
  x_embedder.*                                                                    all_x_embedder.2-1.*
  final_layer.*                                                                   all_final_layer.2-1.*
  <block>.attention.qkv.weight  (rows q | k | v)                                  <block>.attention.to_q / to_k / to_v.weight
  <block>.attention.out.weight                                                    <block>.attention.to_out.0.weight
  <block>.attention.q_norm.weight, k_norm.weight                                  <block>.attention.norm_q.weight, norm_k.weight
  norm_final.weight (some files; the final LayerNorm has no weight)               dropped
  everything else (t_embedder, cap_embedder, pad tokens, norms, feed_forward)     the same

Pre-quantized files (ComfyUI's scaled fp8 and comfy_quant, musubi-tuner's and our fp8 layouts, city96's
ComfyUI-GGUF files, whose convert.py keeps these single-file names) load as stored, through
precision/stored_layouts.py like every family's; the fused qkv's stored tensors are split as
_SingleFileView says, so the split is exact whatever the layout.
"""

from __future__ import annotations

import json
import math
import re
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, RowSplitView, check_keys_and_shapes, save_diffusers_folder, save_with_config,
    state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, open_transformer, stated_config,
)
from library.models.zimage.model import ZImage, ZImageConfig
from library.models.zimage.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras

CLASS_NAME = "ZImageTransformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain
# The key diffusers' single-file detection looks for (its Lumina 2 neighbour has `adaLN_modulation.1`).
MARKER = "layers.0.adaLN_modulation.0.weight"
SINGLE_FILE_MARKER = "x_embedder.weight"
DIFFUSERS_MARKER = "all_x_embedder.2-1.weight"
CONFIG_KEY = "zimage_config"  # safetensors metadata of files we write: the config as JSON
DROPPED = ("norm_final.weight",)

# ----------------------------------------------------------------------------------------------
# The name map

# (single-file, diffusers) module-name pieces, applied as whole-name prefixes (the embedders) or as
# module-name endings, whatever tensor of the module follows (weight, bias, and a pre-quantized file's
# scale_weight / weight_scale / comfy_quant ...).
_PREFIXES = (("x_embedder.", "all_x_embedder.2-1."), ("final_layer.", "all_final_layer.2-1."))
_MODULES = (
    (".attention.out", ".attention.to_out.0"),
    (".attention.q_norm", ".attention.norm_q"),
    (".attention.k_norm", ".attention.norm_k"),
)
QKV_MODULE, QKV_PART_MODULES = ".attention.qkv", (".attention.to_q", ".attention.to_k", ".attention.to_v")
QKV, QKV_PARTS = QKV_MODULE + ".weight", tuple(m + ".weight" for m in QKV_PART_MODULES)
# Tensors of a fused qkv that describe the whole layer, not its rows: each part gets the same one
# (ComfyUI's per-layer format JSON and activation scales; a one-number weight scale, by its size).
_PER_LAYER = ("comfy_quant", "scale_input", "input_scale")


def diffusers_key(key: str) -> str:
    """A single-file key (prefix already stripped) -> its diffusers name; the fused qkv keeps its own."""
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old) :]
    module, dot, leaf = key.rpartition(".")
    for old, new in _MODULES:
        if module.endswith(old):
            return module[: -len(old)] + new + dot + leaf
    return key


def single_file_key(key: str) -> str:
    """A diffusers key -> its single-file name (to_q / to_k / to_v are fused by the callers)."""
    for old, new in _PREFIXES:
        if key.startswith(new):
            return old + key[len(new) :]
    module, dot, leaf = key.rpartition(".")
    for old, new in _MODULES:
        if module.endswith(new):
            return module[: -len(new)] + old + dot + leaf
    return key


def to_single_file_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our (diffusers-named) state dict -> the single-file layout (fused qkv, original names)."""
    sd, out = dict(sd), {}
    for key in [k for k in sd if k.endswith(QKV_PARTS[0])]:
        block = key[: -len(QKV_PARTS[0])]
        out[block + QKV] = torch.cat([sd.pop(block + part) for part in QKV_PARTS], dim=0)
    out.update({single_file_key(k): v for k, v in sd.items()})
    return out


def from_single_file_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The single-file layout (no prefix) -> our names: diffusers' converter, tensor for tensor."""
    out = {}
    for key, value in sd.items():
        if key in DROPPED:
            continue
        if key.endswith(QKV):
            block = key[: -len(QKV)]
            out.update({block + part: t for part, t in zip(QKV_PARTS, value.chunk(3, dim=0))})
        else:
            out[diffusers_key(key)] = value
    return out


class _SingleFileView(RowSplitView):
    """A CheckpointReader view of a single-file checkpoint under our names, prefix stripped: every
    tensor of a fused `attention.qkv` appears as to_q / to_k / to_v (library/io.py RowSplitView: rows
    in three equal parts, a pre-quantized file's weights exact). What describes the whole layer
    (ComfyUI's one float32 scale per tensor, its comfy_quant JSON, activation scales) goes to every
    part unchanged: q, k and v then dequantize to the rows the fused weight dequantizes to, bit for bit."""

    parts, part_names = 3, "q / k / v"

    def __init__(self, reader: CheckpointReader, prefix: str):
        super().__init__(reader)
        for key in reader.keys():
            name = key[len(prefix) :] if key.startswith(prefix) else None
            if name is None or name in DROPPED:
                continue
            module, _, leaf = name.rpartition(".")
            if module.endswith(QKV_MODULE):
                block = module[: -len(QKV_MODULE)]
                for i, part in enumerate(QKV_PART_MODULES):
                    self.sources[f"{block}{part}.{leaf}"] = (key, None if self._per_layer(key, leaf) else i)
            else:
                self.sources[diffusers_key(name)] = (key, None)

    def _per_layer(self, key: str, leaf: str) -> bool:
        return leaf in _PER_LAYER or (leaf not in ("weight", "bias") and math.prod(self.reader.shape(key)) == 1)


# ----------------------------------------------------------------------------------------------
# Config


def default_axes_dims(head_dim: int) -> tuple[int, int, int]:
    """Z-Image's RoPE split of a head: a quarter for the sequence axis, 3/8 each for rows and columns
    ((32, 48, 48) for head_dim 128). Files do not store it."""
    if head_dim % 8:
        raise CheckpointError(f"cannot derive Z-Image's RoPE axes for head_dim {head_dim}: "
                              f"pass config=ZImageConfig(axes_dims=...)")
    return (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> ZImageConfig:
    """ZImageConfig from tensor shapes under our names. Depths from block counts, widths from the
    embedders, heads from the QK-norm width (128 when the model has no QK norm); theta, t_scale,
    eps and the RoPE split are Z-Image's (files do not store them)."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the Z-Image config, key '{key}' is missing")
        return shapes[key]

    embedder = next((k for k in shapes if re.fullmatch(r"all_x_embedder\.\d+-1\.weight", k)), DIFFUSERS_MARKER)
    patch = int(embedder.split(".")[1].split("-")[0])
    dim, patch_dim = shape(embedder)
    norm_q = "layers.0.attention.norm_q.weight"
    head_dim = shape(norm_q)[0] if norm_q in shapes else 128
    siglip = shapes.get("siglip_embedder.1.weight")
    return ZImageConfig(
        in_channels=patch_dim // (patch * patch),
        patch_size=patch,
        dim=dim,
        n_layers=block_count(shapes, "layers."),
        n_refiner_layers=block_count(shapes, "noise_refiner."),
        n_heads=dim // head_dim,
        qk_norm=norm_q in shapes,
        cap_feat_dim=shape("cap_embedder.1.weight")[1],
        siglip_feat_dim=siglip[1] if siglip else None,
        axes_dims=default_axes_dims(head_dim),
    )


def config_from_diffusers(cfg: dict, source: str = "config.json") -> ZImageConfig:
    """ZImageConfig from a ZImageTransformer2DModel config.json (diffusers' defaults fill gaps)."""
    patches, frames = list(cfg.get("all_patch_size", [2])), list(cfg.get("all_f_patch_size", [1]))
    if len(patches) != 1 or frames != [1]:
        raise CheckpointError(f"{source}: all_patch_size {patches} / all_f_patch_size {frames}: one image patch size "
                              f"with frame patch 1 is supported")
    return ZImageConfig(
        in_channels=cfg.get("in_channels", 16),
        patch_size=patches[0],
        dim=cfg.get("dim", 3840),
        n_layers=cfg.get("n_layers", 30),
        n_refiner_layers=cfg.get("n_refiner_layers", 2),
        n_heads=cfg.get("n_heads", 30),  # n_kv_heads is stored but unused: diffusers builds full heads
        norm_eps=float(cfg.get("norm_eps", 1e-5)),
        qk_norm=bool(cfg.get("qk_norm", True)),
        cap_feat_dim=cfg.get("cap_feat_dim", 2560),
        siglip_feat_dim=cfg.get("siglip_feat_dim"),
        rope_theta=float(cfg.get("rope_theta", 256.0)),
        t_scale=float(cfg.get("t_scale", 1000.0)),
        axes_dims=tuple(cfg.get("axes_dims", (32, 48, 48))),
        axes_lens=tuple(cfg.get("axes_lens", (1024, 512, 512))),  # diffusers' default; the releases say 1536
    )


def diffusers_config(config: ZImageConfig) -> dict:
    """The ZImageTransformer2DModel config.json for `config`."""
    return {
        "_class_name": CLASS_NAME,
        "all_patch_size": [config.patch_size],
        "all_f_patch_size": [1],
        "in_channels": config.in_channels,
        "dim": config.dim,
        "n_layers": config.n_layers,
        "n_refiner_layers": config.n_refiner_layers,
        "n_heads": config.n_heads,
        "n_kv_heads": config.n_heads,
        "norm_eps": config.norm_eps,
        "qk_norm": config.qk_norm,
        "cap_feat_dim": config.cap_feat_dim,
        "siglip_feat_dim": config.siglip_feat_dim,
        "rope_theta": config.rope_theta,
        "t_scale": config.t_scale,
        "axes_dims": list(config.axes_dims),
        "axes_lens": list(config.axes_lens),
    }


def zimage_config_from_json(text: str) -> ZImageConfig:
    fields = json.loads(text)
    return ZImageConfig(**{**fields, "axes_dims": tuple(fields["axes_dims"]), "axes_lens": tuple(fields["axes_lens"])})


# ----------------------------------------------------------------------------------------------
# Loading


def _single_file_prefix(keys: list[str]) -> str | None:
    for prefix in PREFIXES:
        if prefix + MARKER in keys and prefix + SINGLE_FILE_MARKER in keys:
            return prefix
    return None


def _source(path: str, reader: CheckpointReader, config: ZImageConfig | None, diffusers_json: dict | None):
    """(config, a reader under our names, its stored layout or None) for either layout (diffusers_json: the
    folder's config.json, as open_transformer read it); the wrong file is one CheckpointError."""
    keys = reader.keys()
    prefix = None if DIFFUSERS_MARKER in keys else _single_file_prefix(keys)
    if prefix is not None:
        source = _SingleFileView(reader, prefix)
    elif DIFFUSERS_MARKER in keys and MARKER in keys:
        source = reader
    else:
        raise CheckpointError(f"{path}: not a Z-Image transformer (no key '{MARKER}' with '{DIFFUSERS_MARKER}' "
                              f"(diffusers) or '{SINGLE_FILE_MARKER}' (single file), under any of the prefixes "
                              f"{[p for p in PREFIXES if p]} or none)")
    # A pre-quantized file (fp8, GGUF) is used as it is. Checked on the file's own keys first (an error
    # names the key as the file has it), then read under our names (the fused qkv's scales split).
    stored = read_stored_layout(reader, path)
    if stored is not None and source is not reader:
        stored = read_stored_layout(source, path)
    extra = stored_extras(stored)

    def from_shapes() -> ZImageConfig:  # a stored layout's scales and markers are no tensors of the model
        return config_from_shapes({k: source.shape(k) for k in source.keys() if not extra(k)}, path)

    if config is None:
        config = stated_config(path, reader, diffusers_json, config_from_diffusers, CONFIG_KEY, zimage_config_from_json,
                               from_shapes)
    with torch.device("meta"):
        expected = ZImage(config).state_dict()
    check_keys_and_shapes(source, expected, config, extra)  # every key named with its file, before any read
    return config, source, stored


def load_zimage(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: ZImageConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[ZImage], Callable | None] | None = None,
    read_weights: bool = True,
    model_class: type[ZImage] = ZImage,
) -> ZImage:
    """Load a Z-Image transformer from a diffusers folder (the pipeline folder with `transformer/`,
    or the transformer folder itself; sharded or not) or a single file in the ComfyUI / original
    layout (optionally under `model.diffusion_model.` / `diffusion_model.`).

    dtype casts floating weights on read and becomes compute_dtype. config overrides what config.json,
    the `zimage_config` metadata or the key shapes say. convert / prepare are the per-tensor and
    meta-model hooks, as for the other families (fp8 quantized while loading: `prepare=fp8_prepare(mode,
    arch)`); a pre-quantized file (fp8, GGUF) is used as it is stored, whatever `prepare` asks.
    read_weights=False gives the meta model as it would load, from the headers alone (the memory
    planner). The model is built on `meta` and filled one tensor at a time. model_class: the ZImage
    class to build (omni.py's ZImageOmni for an Omni checkpoint's omni forward).
    """
    path, reader = open_transformer(path, "load_zimage", dtype)
    # a foreign diffusers class is refused even with config=, before the marker check
    diffusers_json = diffusers_config_json(path, CLASS_NAME)
    config, source, stored = _source(path, reader, config, diffusers_json)
    with torch.device("meta"):
        model = model_class(config)
    return fill_meta_model(model, source, lambda key: key, path, dtype, stored=stored, keep_rules=FP8, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_zimage")


# ----------------------------------------------------------------------------------------------
# Saving


def save_zimage_diffusers(model_or_sd, config: ZImageConfig | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_zimage_diffusers needs a ZImageConfig (or a ZImage model) to write config.json")
    save_diffusers_folder(sd, diffusers_config(config), folder)


def save_zimage_single_file(model_or_sd, path: str, config: ZImageConfig | None = None, prefix: str = "",
                            metadata: dict[str, str] | None = None):
    """Write the single-file layout (atomic; `prefix` e.g. ComfyUI's `model.diffusion_model.`), the
    config (when known) in the metadata as `zimage_config` JSON so that non-standard sizes reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    sd = {prefix + k: v for k, v in to_single_file_state_dict(sd).items()}
    save_with_config(sd, path, CONFIG_KEY, config, metadata)
