"""Nucleus-Image checkpoints: loading (a single file, plain or under ComfyUI's prefixes, and diffusers folders), the
config from config.json / our metadata / the shapes, and saving in both layouts.

The released weights are a diffusers folder (transformer/ with config.json and sharded safetensors); ComfyUI's
single files keep diffusers' names (its NucleusImage model reads the packed experts as they are). Our module names
are those (model.py), so every layout loads by plain key, the prefix (if any) dropped: there is no name map. diffusers
has no single-file support for it; we tell its files by MARKER (`encoder_proj`, the per-block text projection, is no
other family's name, and every block has one, dense or MoE).

Pre-quantized files (ComfyUI's scaled fp8 and comfy_quant, plain fp8, musubi-tuner's and our layouts, GGUF:
precision/stored_layouts.py) load as they are stored, under any of the prefixes; nothing is fused, so each stored
scale stays its Linear's. Which Linears stay in high precision is the family's fp8 rule (library/models/nucleus_image/
spec.py `FP8`, read when such a file is loaded, or given as `fp8_rules`). The packed experts ([E, in, out] tensors, no
Linear: precision/fp8_packed.py) load as stored too: in bf16 / fp16 / fp32, or as e4m3 codes, plain or with one
scale per tensor (ComfyUI's `_scale`, `.scale_weight` or `.weight_scale`) or with our bf16 block scales
(`<name>_scale` [E, in/64, out], what an fp8_scaled model saves). A base precision fp8 / fp8_scaled asked of a
high-precision file quantizes them while loading, as the Linears. Experts in GGUF blocks, or split per expert (some
ComfyUI conversions), are refused naming the tensor.

What the shapes do not say (a single file without our metadata): the patch size (2), the RoPE split (16/56/56 of 128,
scaled to the head), use_sigmoid (False), route_scale (2.5) and the per-block capacity factors: the released pattern
on the blocks the keys show as MoE (the first two 4.0, the others 2.0; the dense ones 0), which is the released list
at the released depth. A config.json or our metadata gives them exactly.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, check_keys_and_shapes, save_diffusers_folder, save_with_config,
    state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, marked_prefix, open_transformer, spec_fp8_rules, stated_config,
    without_prefix,
)
from library.models.nucleus_image.model import NUCLEUS_IMAGE, DENSE_MOE_STRATEGIES, NucleusImage, NucleusImageConfig
from library.precision.fp8 import KeepRules
from library.precision.fp8_checkpoints import Fp8Checkpoint
from library.precision.stored_layouts import read_stored_layout, stored_extras

CLASS_NAME = "NucleusMoEImageTransformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain (and diffusers)
COMFY_PREFIX = PREFIXES[0]
MARKER = "transformer_blocks.0.encoder_proj.weight"  # the first block's text projection: Nucleus-Image's own name
CONFIG_KEY = "nucleus_image_config"  # safetensors metadata of single files we write: the config as JSON
# config.json keys diffusers' class takes that are no part of the model: how it runs the experts (the released
# config says true; ours always run as one batched matmul). save writes the released value.
IGNORED_CONFIG_KEYS = ("use_grouped_mm",)
# diffusers' constructor defaults: what a config.json that omits a key means (ours are the released sizes). None:
# out_channels = in_channels, num_key_value_heads = num_attention_heads; one capacity factor for every block.
DIFFUSERS_DEFAULTS = dict(patch_size=2, in_channels=64, out_channels=None, num_layers=24, attention_head_dim=128,
                          num_attention_heads=16, num_key_value_heads=None, joint_attention_dim=3584,
                          axes_dims_rope=(16, 56, 56), mlp_ratio=4.0, moe_enabled=True,
                          dense_moe_strategy="leave_first_three_and_last_block_dense", num_experts=128,
                          moe_intermediate_dim=1344, capacity_factors=8.0, use_sigmoid=False, route_scale=2.5)
EXPERT_TENSORS = (".img_mlp.experts.gate_up_proj", ".img_mlp.experts.down_proj")
EXPERT_DTYPES = ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2")  # safetensors' names (ggml's: the first three)
SPLIT_EXPERTS = re.compile(r"\.img_mlp\.experts\.(gate_up|down)_projs\.\d+\.")  # ComfyUI's per-expert Linears

# ----------------------------------------------------------------------------------------------
# Config


def default_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """The released RoPE split (16, 56, 56 of 128: an eighth for the frame, 7/16 for each grid axis) scaled to
    `head_dim`; files do not store it."""
    if head_dim % 32:
        raise CheckpointError(f"cannot derive Nucleus-Image RoPE axes for head_dim {head_dim}: pass "
                              f"config=NucleusImageConfig(axes_dims_rope=...)")
    return head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16


def released_capacity_factors(moe_blocks: tuple[int, ...], num_layers: int) -> tuple[float, ...]:
    """The released pattern on these MoE blocks: the first two 4.0, the others 2.0, dense blocks 0 (diffusers
    reads no factor for them). At the released depth and strategy it is the released list."""
    return tuple(0.0 if i not in moe_blocks else 4.0 if moe_blocks.index(i) < 2 else 2.0 for i in range(num_layers))


def _strategy(moe_blocks: tuple[int, ...], num_layers: int, source: str) -> tuple[str, bool]:
    """(dense_moe_strategy, moe_enabled) that build MoE MLPs on exactly `moe_blocks`, the released one first."""
    released = NUCLEUS_IMAGE.dense_moe_strategy
    names = (released, *(n for n in DENSE_MOE_STRATEGIES if n != released))
    for name in names:
        if tuple(i for i in range(num_layers) if DENSE_MOE_STRATEGIES[name](i, num_layers)) == moe_blocks:
            return name, True
    raise CheckpointError(f"{source}: MoE MLPs on blocks {list(moe_blocks)} of {num_layers} match no "
                          f"dense_moe_strategy of diffusers' ({', '.join(DENSE_MOE_STRATEGIES)})")


def _mlp_ratio(dense_inner: int, inner_dim: int, source: str) -> float:
    """The mlp_ratio whose SwiGLU width (int(dim * ratio * 2/3) // 128 * 128) is `dense_inner`: the released 4.0
    where it fits, else the exact ratio."""
    for ratio in (NUCLEUS_IMAGE.mlp_ratio, dense_inner * 1.5 / inner_dim):
        if int(inner_dim * ratio * 2 / 3) // 128 * 128 == dense_inner:
            return ratio
    raise CheckpointError(f"{source}: a dense MLP of width {dense_inner} at dim {inner_dim} is no mlp_ratio's "
                          f"(diffusers rounds it down to a multiple of 128)")


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> NucleusImageConfig:
    """NucleusImageConfig from tensor shapes (without any prefix): widths from the embedders and the first block,
    the depth from the block count, MoE blocks from the router keys present. What files do not store is the
    released model's (the module docstring lists it)."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the Nucleus-Image config, key '{key}' is missing")
        return shapes[key]

    inner, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    num_layers = block_count(shapes, "transformer_blocks.")
    moe = tuple(i for i in range(num_layers) if f"transformer_blocks.{i}.img_mlp.gate.weight" in shapes)
    dense = [i for i in range(num_layers) if i not in moe]
    strategy, enabled = _strategy(moe, num_layers, source)
    patch = NUCLEUS_IMAGE.patch_size
    out_rows = shape("proj_out.weight")[0]
    if out_rows % (patch * patch):
        raise CheckpointError(f"{source}: proj_out has {out_rows} rows, no whole number of channels per "
                              f"{patch}x{patch} patch")
    experts, moe_inner = (shape(f"transformer_blocks.{moe[0]}.img_mlp.experts.down_proj")[:2] if moe
                          else (NUCLEUS_IMAGE.num_experts, NUCLEUS_IMAGE.moe_intermediate_dim))
    ratio = (_mlp_ratio(shape(f"transformer_blocks.{dense[0]}.img_mlp.net.0.proj.weight")[0] // 2, inner, source)
             if dense else NUCLEUS_IMAGE.mlp_ratio)
    try:
        return NucleusImageConfig(
            patch_size=patch, in_channels=in_channels, out_channels=out_rows // (patch * patch), num_layers=num_layers,
            attention_head_dim=head_dim, num_attention_heads=inner // head_dim,
            num_key_value_heads=shape("transformer_blocks.0.attn.to_k.weight")[0] // head_dim,
            joint_attention_dim=shape("txt_norm.weight")[0], axes_dims_rope=default_rope_axes(head_dim),
            mlp_ratio=ratio, moe_enabled=enabled, dense_moe_strategy=strategy, num_experts=experts,
            moe_intermediate_dim=moe_inner, capacity_factors=released_capacity_factors(moe, num_layers))
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None


def config_from_diffusers(cfg: dict, source: str = "config.json") -> NucleusImageConfig:
    """NucleusImageConfig from a NucleusMoEImageTransformer2DModel config.json; a key it omits is diffusers' default
    (DIFFUSERS_DEFAULTS), as diffusers would build it. Unknown keys are refused, use_grouped_mm ignored."""
    names = {f.name for f in dataclasses.fields(NucleusImageConfig)} - {"rope_theta"}  # theta: fixed in diffusers
    unknown = sorted(k for k in cfg if k not in names and not k.startswith("_") and k not in IGNORED_CONFIG_KEYS)
    if unknown:
        raise CheckpointError(f"{source}: unknown {CLASS_NAME} config keys {unknown}")
    kwargs = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in cfg.items() if k in names}}
    if kwargs["out_channels"] is None:
        kwargs["out_channels"] = kwargs["in_channels"]
    if kwargs["num_key_value_heads"] is None:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if not isinstance(kwargs["capacity_factors"], (list, tuple)):
        kwargs["capacity_factors"] = [kwargs["capacity_factors"]] * kwargs["num_layers"]
    try:
        return NucleusImageConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def diffusers_config(config: NucleusImageConfig) -> dict:
    """The NucleusMoEImageTransformer2DModel config.json for `config` (use_grouped_mm as released)."""
    if config.rope_theta != NUCLEUS_IMAGE.rope_theta:
        raise ValueError(f"diffusers' {CLASS_NAME} fixes RoPE theta at 10000: {config}")
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "rope_theta"}
    fields.update(axes_dims_rope=list(config.axes_dims_rope), capacity_factors=list(config.capacity_factors))
    return {"_class_name": CLASS_NAME, **fields, "use_grouped_mm": True}


def config_from_json(text: str) -> NucleusImageConfig:
    """The config save_nucleus_image_single_file writes in the metadata."""
    return NucleusImageConfig(**json.loads(text))


# ----------------------------------------------------------------------------------------------
# Loading


def refuse_quantized_experts(reader: CheckpointReader, path: str) -> None:
    """The packed experts load as stored in bf16 / fp16 / fp32 / fp8 (precision/fp8_checkpoints.py): one line
    naming the first expert tensor stored otherwise (GGUF blocks), or split per expert."""
    for key in reader.keys():
        if SPLIT_EXPERTS.search(key):
            raise CheckpointError(f"{path}: '{key}': experts split per expert (ComfyUI's layout of some quantized "
                                  f"files) are not read; give a file with the packed experts.gate_up_proj / down_proj")
        if key.endswith(EXPERT_TENSORS) and (reader.dtype_name(key) not in EXPERT_DTYPES
                                             or reader.is_block_quantized(key)):
            raise CheckpointError(f"{path}: '{key}' is stored as {reader.dtype_name(key)}: Nucleus-Image's packed "
                                  f"experts load in bf16 / fp16 / fp32 / fp8 only; give a file that keeps them so")


def load_nucleus_image(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: NucleusImageConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[NucleusImage], Callable | None] | None = None,
    read_weights: bool = True,
    fp8_rules: KeepRules | None = None,
) -> NucleusImage:
    """Load a Nucleus-Image transformer from a diffusers folder (the pipeline folder with `transformer/`, or the
    transformer folder; sharded or not) or a single file (plain, or under ComfyUI's `model.diffusion_model.` /
    `diffusion_model.`; a file's other prefixes, e.g. a bundled VAE, are not read).

    dtype casts floating weights on read and becomes compute_dtype. config overrides config.json, the
    `nucleus_image_config` metadata and the key shapes. convert / prepare: the per-tensor and meta-model hooks (fp8
    while loading: the family's fp8_prepare quantizes the Linears and the packed experts). read_weights=False: the
    meta model as it would load, from the headers alone (the memory planner). Every key and shape is checked before
    any weight is read. A pre-quantized file is used as it is stored (its experts too), whatever `prepare` asks;
    fp8_rules: the Linears its fp8 layers keep in high precision (default: the family spec's FP8)."""
    path, reader = open_transformer(path, "load_nucleus_image", dtype)
    prefix = marked_prefix(path, reader.keys(), PREFIXES, MARKER, "a Nucleus-Image transformer")
    refuse_quantized_experts(reader, path)
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    view = PrefixedReader(reader, prefix)
    if config is None:
        config = stated_config(path, reader, diffusers_json, config_from_diffusers, CONFIG_KEY, config_from_json,
                               lambda: config_from_shapes({k: view.shape(k) for k in view.keys()}, path))
    with torch.device("meta"):
        model = NucleusImage(config)
    check_keys_and_shapes(view, model.state_dict(), config, stored_extras(stored))
    if fp8_rules is None and isinstance(stored, Fp8Checkpoint):  # fp8 layouts follow keep rules; GGUF's the file
        fp8_rules = spec_fp8_rules(path, stored, "library.models.nucleus_image", "Nucleus-Image")
    return fill_meta_model(model, reader, without_prefix(prefix), path, dtype, stored=stored, keep_rules=fp8_rules,
                           prepare=prepare, convert=convert, read_weights=read_weights, loader="load_nucleus_image")


# ----------------------------------------------------------------------------------------------
# Saving


def save_nucleus_image_single_file(model_or_sd, path: str, config: NucleusImageConfig | None = None,
                                   prefix: str = "", metadata: dict[str, str] | None = None):
    """Write a single file (atomic) under `prefix` ("" plain, COMFY_PREFIX as ComfyUI's full files), the config (when
    known) in the metadata as `nucleus_image_config` JSON so that non-standard sizes and capacities reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config({prefix + k: v for k, v in sd.items()}, path, CONFIG_KEY, config, metadata)


def save_nucleus_image_diffusers(model_or_sd, config: NucleusImageConfig | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_nucleus_image_diffusers needs a NucleusImageConfig (or the model) to write config.json")
    save_diffusers_folder(sd, diffusers_config(config), folder)
