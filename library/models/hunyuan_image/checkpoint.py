"""HunyuanImage-2.1 checkpoints: loading Tencent's single file (dit/hunyuanimage2.1.safetensors and the distilled
dit/hunyuanimage2.1-distilled.safetensors: the original names, which are ours), the same under ComfyUI's
`model.diffusion_model.` / `diffusion_model.` prefixes, ComfyUI's renamed single file (Comfy-Org's
HunyuanImage_2.1_ComfyUI split_files/diffusion_models/: BFL-style block names) and a diffusers folder (transformer/ of
HunyuanImageTransformer2DModel, hunyuanvideo-community/HunyuanImage-2.1-Diffusers); the config from our metadata,
config.json or the shapes; saving the single file (either naming) and the diffusers folder.

ComfyUI's names are Tencent's through the replacements of its HunyuanVideo.process_unet_state_dict
(comfy/supported_models.py), which it applies to every file it loads (so both namings run there):

  ours / Tencent                                   ComfyUI
  <stream>_mod.linear, modulation.linear           <stream>_mod.lin, modulation.lin
  <stream>_attn_qkv / _attn_proj                   <stream>_attn.qkv / _attn.proj  (refiner: self_attn.qkv / .proj)
  <stream>_attn_q_norm.weight / _k_norm.weight     <stream>_attn.norm.query_norm.scale / .key_norm.scale
  single q_norm.weight / k_norm.weight             norm.query_norm.scale / norm.key_norm.scale
  <...>mlp.fc1 / mlp.fc2                           <...>mlp.0 / mlp.2
  time_in / guidance_in / time_r_in .mlp.0 / .2    .in_layer / .out_layer  (txt_in.t_embedder too)
  txt_in.c_embedder.linear_1 / linear_2            txt_in.c_embedder.in_layer / out_layer

The diffusers names (scripts/convert_hunyuan_image_to_diffusers.py, read the other way; `_DIFFUSERS` below) split
every fused projection: a double block's img_attn_qkv into attn.to_q / to_k / to_v, txt_attn_qkv into
attn.add_q_proj / add_k_proj / add_v_proj, a single block's linear1 into attn.to_q / to_k / to_v and proj_mlp, the
refiner's self_attn_qkv into attn.to_q / to_k / to_v; and the final adaLN's halves are swapped (diffusers'
AdaLayerNormContinuous reads scale, shift; Tencent's FinalLayer shift, scale).

Pre-quantized single files (ComfyUI's scaled fp8 / comfy_quant, musubi-tuner's and our fp8 layouts, city96's GGUF)
load as stored through precision/stored_layouts.py under our names (a ComfyUI-named file renamed, no tensor split).
A diffusers folder is read in full precision only (its fused tensors are built from parts).
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, RowJoinView, RowSplitView, check_keys_and_shapes, save_diffusers_folder,
    save_with_config, state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, marked_prefix, open_transformer, renamed_keys,
    renamed_modules, stated_config,
)
from library.models.hunyuan_image.model import HunyuanImage, HunyuanImageConfig
from library.precision.stored_layouts import read_stored_layout, stored_extras

CLASS_NAME = "HunyuanImageTransformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain (Tencent's release)
# Keys only a HunyuanImage / HunyuanVideo transformer has (its text token refiner), in Tencent's and ComfyUI's names;
# img_in.proj's 4-D weight (a 2-D patch) then tells the image model from the video ones (5-D, Conv3d)
MARKER = "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight"
COMFY_MARKER = "txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight"
PATCH_KEY = "img_in.proj.weight"
DIFFUSERS_MARKER = "time_guidance_embed.timestep_embedder.linear_1.weight"  # HunyuanVideo's is time_text_embed
CONFIG_KEY = "hunyuan_image_config"  # safetensors metadata of files we write: the config as JSON
FINAL_MODULATION = "final_layer.adaLN_modulation.1"  # rows (shift, scale); diffusers' norm_out.linear (scale, shift)

# ----------------------------------------------------------------------------------------------
# ComfyUI's names (its process_unet_state_dict, Tencent -> ComfyUI, in its order)

_COMFY_REPLACEMENTS = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."), ("_attn_qkv.", "_attn.qkv."), ("mlp.fc1.", "mlp.0."), ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.weight", "_attn.norm.query_norm.scale"), ("_attn_k_norm.weight", "_attn.norm.key_norm.scale"),
    (".q_norm.weight", ".norm.query_norm.scale"), (".k_norm.weight", ".norm.key_norm.scale"),
    ("_attn_proj.", "_attn.proj."), (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."), ("_in.mlp.0.", "_in.in_layer."),
)


def comfy_key(key: str) -> str:
    """Our (Tencent's) key -> ComfyUI's."""
    for ours, theirs in _COMFY_REPLACEMENTS:
        key = key.replace(ours, theirs)
    return key


# ----------------------------------------------------------------------------------------------
# The diffusers names: (our module regex, its diffusers module(s)); a tuple splits our rows in that order

_REFINER, _DOUBLE, _SINGLE = r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.", r"double_blocks\.(\d+)\.", \
    r"single_blocks\.(\d+)\."
_R, _D, _S = r"context_embedder.token_refiner.refiner_blocks.\1.", r"transformer_blocks.\1.", \
    r"single_transformer_blocks.\1."
_DIFFUSERS = tuple((re.compile(ours), theirs) for ours, theirs in (
    (r"img_in\.proj", "x_embedder.proj"), (r"txt_in\.input_embedder", "context_embedder.proj_in"),
    (r"txt_in\.t_embedder\.mlp\.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
    (r"txt_in\.t_embedder\.mlp\.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
    (r"txt_in\.c_embedder\.(linear_[12])", r"context_embedder.time_text_embed.text_embedder.\1"),
    (_REFINER + r"(norm[12])", _R + r"\2"),
    (_REFINER + "self_attn_qkv", (_R + "attn.to_q", _R + "attn.to_k", _R + "attn.to_v")),
    (_REFINER + "self_attn_proj", _R + "attn.to_out.0"), (_REFINER + r"mlp\.fc1", _R + "ff.net.0.proj"),
    (_REFINER + r"mlp\.fc2", _R + "ff.net.2"), (_REFINER + r"adaLN_modulation\.1", _R + "norm_out.linear"),
    (r"byt5_in\.layernorm", "context_embedder_2.norm"), (r"byt5_in\.fc([123])", r"context_embedder_2.linear_\1"),
    (r"time_in\.mlp\.0", "time_guidance_embed.timestep_embedder.linear_1"),
    (r"time_in\.mlp\.2", "time_guidance_embed.timestep_embedder.linear_2"),
    (r"time_r_in\.mlp\.0", "time_guidance_embed.timestep_embedder_r.linear_1"),
    (r"time_r_in\.mlp\.2", "time_guidance_embed.timestep_embedder_r.linear_2"),
    (r"guidance_in\.mlp\.0", "time_guidance_embed.guidance_embedder.linear_1"),
    (r"guidance_in\.mlp\.2", "time_guidance_embed.guidance_embedder.linear_2"),
    (_DOUBLE + r"img_mod\.linear", _D + "norm1.linear"), (_DOUBLE + r"txt_mod\.linear", _D + "norm1_context.linear"),
    (_DOUBLE + "img_attn_qkv", (_D + "attn.to_q", _D + "attn.to_k", _D + "attn.to_v")),
    (_DOUBLE + "txt_attn_qkv", (_D + "attn.add_q_proj", _D + "attn.add_k_proj", _D + "attn.add_v_proj")),
    (_DOUBLE + "img_attn_q_norm", _D + "attn.norm_q"), (_DOUBLE + "img_attn_k_norm", _D + "attn.norm_k"),
    (_DOUBLE + "txt_attn_q_norm", _D + "attn.norm_added_q"), (_DOUBLE + "txt_attn_k_norm", _D + "attn.norm_added_k"),
    (_DOUBLE + "img_attn_proj", _D + "attn.to_out.0"), (_DOUBLE + "txt_attn_proj", _D + "attn.to_add_out"),
    (_DOUBLE + r"img_mlp\.fc1", _D + "ff.net.0.proj"), (_DOUBLE + r"img_mlp\.fc2", _D + "ff.net.2"),
    (_DOUBLE + r"txt_mlp\.fc1", _D + "ff_context.net.0.proj"), (_DOUBLE + r"txt_mlp\.fc2", _D + "ff_context.net.2"),
    (_SINGLE + r"modulation\.linear", _S + "norm.linear"),
    (_SINGLE + "linear1", (_S + "attn.to_q", _S + "attn.to_k", _S + "attn.to_v", _S + "proj_mlp")),
    (_SINGLE + "q_norm", _S + "attn.norm_q"), (_SINGLE + "k_norm", _S + "attn.norm_k"),
    (_SINGLE + "linear2", _S + "proj_out"),
    (r"final_layer\.linear", "proj_out"), (re.escape(FINAL_MODULATION), "norm_out.linear"),
))


def diffusers_modules(module: str) -> tuple[str, ...]:
    """Our module path -> its diffusers module, or the modules a fused one's rows come from (in row order)."""
    return renamed_modules(_DIFFUSERS, module)


def diffusers_keys(key: str) -> tuple[str, ...]:
    return renamed_keys(_DIFFUSERS, key)


def split_rows(key: str, rows: int, config: HunyuanImageConfig) -> tuple[int, ...]:
    """How a fused tensor's `rows` divide among its diffusers parts: q, k, v (and a single block's MLP input)."""
    parts = len(diffusers_keys(key))
    if parts == 4:
        return (config.hidden_size,) * 3 + (rows - 3 * config.hidden_size,)
    return (rows // parts,) * parts


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(shift, scale) rows <-> (scale, shift): the final adaLN between Tencent's order and diffusers'."""
    first, second = t.chunk(2, dim=0)
    return torch.cat((second, first))


def to_diffusers_state_dict(sd: dict[str, torch.Tensor], config: HunyuanImageConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> HunyuanImageTransformer2DModel's (fused tensors split, the final adaLN's halves swapped)."""
    out = {}
    for key, value in sd.items():
        names = diffusers_keys(key)
        if key.startswith(FINAL_MODULATION + "."):
            value = swap_halves(value)
        parts = value.split(split_rows(key, value.shape[0], config)) if len(names) > 1 else (value,)
        out.update({name: part.contiguous() for name, part in zip(names, parts)})
    return out


class _SingleFileView(RowSplitView):
    """A single file under our names: its prefix dropped (keys under other prefixes, a bundled VAE's, not read);
    ComfyUI's names renamed to Tencent's (a pre-quantized tensor beside a weight, e.g. `scale_weight`, follows its
    module); a key we have no name for keeps its own (the key check names it). No tensor is split."""

    parts, part_names = 1, "whole"

    def __init__(self, reader: CheckpointReader, prefix: str, ours_of: dict[str, str]):
        super().__init__(reader)
        for key in reader.keys():
            if key.startswith(prefix):
                name = key[len(prefix):]
                self.sources[ours_of.get(name) or _renamed_module(name, ours_of)] = (key, None)


def _renamed_module(name: str, ours_of: dict[str, str]) -> str:
    """A tensor beside a renamed module's weight (an fp8 scale) under our module's name; others as they are."""
    module, _, leaf = name.rpartition(".")
    ours = ours_of.get(module + ".weight")
    return f"{ours[: -len('.weight')]}.{leaf}" if ours else name


class _DiffusersView(RowJoinView):
    """A diffusers transformer folder under our names: a fused tensor is its parts concatenated by rows, the final
    adaLN's halves swapped back."""

    def __init__(self, reader: CheckpointReader, our_keys):
        super().__init__(reader, our_keys, diffusers_keys)

    def transform(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return swap_halves(tensor) if key.startswith(FINAL_MODULATION + ".") else tensor


# ----------------------------------------------------------------------------------------------
# Config


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> HunyuanImageConfig:
    """HunyuanImageConfig from tensor shapes under our names: widths from the embedders, the head from the QK-norm
    width, depths from the block counts, the MLP ratio from its rows, glyph and distilled modules from their keys.
    The RoPE split (half the head each for rows and columns), theta and the eps are HunyuanImage's."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the HunyuanImage config, key '{key}' is missing")
        return shapes[key]

    width, in_channels = shape(PATCH_KEY)[:2]
    depth, single = block_count(shapes, "double_blocks."), block_count(shapes, "single_blocks.")
    head_dim = shape("double_blocks.0.img_attn_q_norm.weight" if depth else "single_blocks.0.q_norm.weight")[0]
    mlp = (shape("double_blocks.0.img_mlp.fc1.weight")[0] if depth
           else shape("single_blocks.0.linear1.weight")[0] - 3 * width)
    glyph = shapes.get("byt5_in.fc1.weight")
    try:
        return HunyuanImageConfig(
            in_channels=in_channels, out_channels=shape("final_layer.linear.weight")[0], hidden_size=width,
            num_heads=width // head_dim, depth=depth, depth_single=single, mlp_ratio=mlp / width,
            text_dim=shape("txt_in.input_embedder.weight")[1], glyph_dim=glyph[1] if glyph else None,
            glyph_hidden=glyph[0] if glyph else HunyuanImageConfig.glyph_hidden,
            refiner_depth=block_count(shapes, "txt_in.individual_token_refiner.blocks."),
            axes_dim=(head_dim // 2, head_dim - head_dim // 2), guidance_embeds="guidance_in.mlp.0.weight" in shapes,
            use_meanflow="time_r_in.mlp.0.weight" in shapes)
    except ValueError as e:
        raise CheckpointError(f"{source}: the shapes give no HunyuanImage config: {e}") from None


def config_from_diffusers(cfg: dict, source: str = "config.json",
                          glyph_hidden: int | None = None) -> HunyuanImageConfig:
    """HunyuanImageConfig from a HunyuanImageTransformer2DModel config.json (diffusers' defaults fill gaps)."""
    if tuple(cfg.get("patch_size", (1, 1))) != (1, 1) or cfg.get("qk_norm", "rms_norm") != "rms_norm":
        raise CheckpointError(f"{source}: patch_size {cfg.get('patch_size')} / qk_norm {cfg.get('qk_norm')}: only "
                              f"HunyuanImage-2.1's (1, 1) and rms_norm are supported (the refiner's 3-D patch is not)")
    heads = cfg.get("num_attention_heads", 28)
    return HunyuanImageConfig(
        in_channels=cfg.get("in_channels", 64), out_channels=cfg.get("out_channels") or cfg.get("in_channels", 64),
        hidden_size=heads * cfg.get("attention_head_dim", 128), num_heads=heads, depth=cfg.get("num_layers", 20),
        depth_single=cfg.get("num_single_layers", 40), mlp_ratio=float(cfg.get("mlp_ratio", 4.0)),
        text_dim=cfg.get("text_embed_dim", 3584), glyph_dim=cfg.get("text_embed_2_dim"),
        glyph_hidden=glyph_hidden or HunyuanImageConfig.glyph_hidden, refiner_depth=cfg.get("num_refiner_layers", 2),
        axes_dim=tuple(cfg.get("rope_axes_dim", (64, 64))), theta=float(cfg.get("rope_theta", 256.0)),
        guidance_embeds=bool(cfg.get("guidance_embeds", False)), use_meanflow=bool(cfg.get("use_meanflow", False)))


def diffusers_config(config: HunyuanImageConfig) -> dict:
    """The HunyuanImageTransformer2DModel config.json of `config` (its byT5 hidden width is diffusers' fixed 2048)."""
    return {"_class_name": CLASS_NAME, "in_channels": config.in_channels, "out_channels": config.out_channels,
            "num_attention_heads": config.num_heads, "attention_head_dim": config.head_dim,
            "num_layers": config.depth, "num_single_layers": config.depth_single,
            "num_refiner_layers": config.refiner_depth, "mlp_ratio": config.mlp_ratio, "patch_size": [1, 1],
            "qk_norm": "rms_norm", "guidance_embeds": config.guidance_embeds, "text_embed_dim": config.text_dim,
            "text_embed_2_dim": config.glyph_dim, "rope_theta": config.theta, "rope_axes_dim": list(config.axes_dim),
            "use_meanflow": config.use_meanflow}


def config_from_json(text: str) -> HunyuanImageConfig:
    """The config save_hunyuan_image_single_file writes in the metadata."""
    fields = json.loads(text)
    return HunyuanImageConfig(**{**fields, "axes_dim": tuple(fields["axes_dim"])})


# ----------------------------------------------------------------------------------------------
# Loading


def _fp8_rules():
    from library.models.hunyuan_image.spec import FP8  # read only for a pre-quantized file

    return FP8


def _names_of(keys: list[str], path: str) -> tuple[str, bool]:
    """(the prefix, ComfyUI's names?) of a single file; a file of another model is one CheckpointError."""
    for prefix in PREFIXES:
        for marker, comfy in ((MARKER, False), (COMFY_MARKER, True)):
            if prefix + marker in keys:
                return prefix, comfy
    marked_prefix(path, keys, PREFIXES, MARKER, "a HunyuanImage-2.1 transformer")  # raises, naming the marker
    raise AssertionError("unreachable")


def _single_file_source(path: str, reader: CheckpointReader, config: HunyuanImageConfig | None):
    """(config, the file under our names, its stored layout or None) of a Tencent / ComfyUI single file."""
    prefix, comfy = _names_of(reader.keys(), path)
    patch = reader.shape(prefix + PATCH_KEY) if prefix + PATCH_KEY in reader else None
    if patch is not None and len(patch) != 4:
        raise CheckpointError(f"{path}: not a HunyuanImage-2.1 transformer: '{prefix + PATCH_KEY}' has shape {patch}, "
                              f"a 3-D patch (a HunyuanVideo or HunyuanImage refiner transformer)")
    skeleton = _skeleton(reader.keys(), prefix, comfy)
    with torch.device("meta"):
        our_keys = HunyuanImage(skeleton).state_dict().keys()
    ours_of = {comfy_key(k): k for k in our_keys} if comfy else {}
    source = _SingleFileView(reader, prefix, ours_of)
    # A pre-quantized file is used as it is: checked on the file's own keys first, then read under our names.
    stored = read_stored_layout(reader, path) and read_stored_layout(source, path)
    extra = stored_extras(stored)
    if config is None:
        config = stated_config(path, reader, None, config_from_diffusers, CONFIG_KEY, config_from_json,
                               lambda: config_from_shapes({k: source.shape(k) for k in source.keys() if not extra(k)},
                                                          path))
    return config, source, stored


def _skeleton(keys: list[str], prefix: str, comfy: bool) -> HunyuanImageConfig:
    """A tiny config with the file's block counts and optional modules (only the names of its model matter)."""
    names = [k[len(prefix):] for k in keys if k.startswith(prefix)]
    ours = {k.replace("_in.in_layer.", "_in.mlp.0.") for k in names} if comfy else set(names)
    return HunyuanImageConfig(hidden_size=4, num_heads=1, text_dim=1, glyph_dim=1 if "byt5_in.fc1.weight" in ours
                              else None, glyph_hidden=1, axes_dim=(2, 2), in_channels=1, out_channels=1,
                              depth=block_count(names, "double_blocks."),
                              depth_single=block_count(names, "single_blocks."),
                              refiner_depth=block_count(names, "txt_in.individual_token_refiner.blocks."),
                              guidance_embeds="guidance_in.mlp.0.weight" in ours,
                              use_meanflow="time_r_in.mlp.0.weight" in ours)


def _diffusers_source(path: str, reader: CheckpointReader, config: HunyuanImageConfig | None, diffusers_json):
    """(config, the folder under our names, no stored layout) of a diffusers transformer folder."""
    glyph = reader.shape("context_embedder_2.linear_1.weight")[0] if "context_embedder_2.linear_1.weight" in reader \
        else None
    if config is None and diffusers_json is not None:
        config = config_from_diffusers(diffusers_json, os.path.join(path, "config.json"), glyph)
    skeleton = config or _diffusers_skeleton(reader.keys())
    with torch.device("meta"):
        our_keys = HunyuanImage(skeleton).state_dict().keys()
    view = _DiffusersView(reader, our_keys)
    return config or config_from_shapes({k: view.shape(k) for k in view.keys()}, path), view, None


def _diffusers_skeleton(keys: list[str]) -> HunyuanImageConfig:
    return HunyuanImageConfig(hidden_size=4, num_heads=1, text_dim=1, glyph_hidden=1, axes_dim=(2, 2), in_channels=1,
                              glyph_dim=1 if "context_embedder_2.linear_1.weight" in keys else None, out_channels=1,
                              depth=block_count(keys, "transformer_blocks."),
                              depth_single=block_count(keys, "single_transformer_blocks."),
                              refiner_depth=block_count(keys, "context_embedder.token_refiner.refiner_blocks."),
                              guidance_embeds="time_guidance_embed.guidance_embedder.linear_1.weight" in keys,
                              use_meanflow="time_guidance_embed.timestep_embedder_r.linear_1.weight" in keys)


def load_hunyuan_image(
    path: str,
    dtype: torch.dtype = torch.float32,
    prepare: Callable[[HunyuanImage], Callable | None] | None = None,
    read_weights: bool = True,
    config: HunyuanImageConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> HunyuanImage:
    """Load a HunyuanImage-2.1 transformer from Tencent's single file (plain or under ComfyUI's prefixes; a file's
    other prefixes are not read), ComfyUI's renamed single file, or a diffusers folder (the pipeline folder with
    transformer/, or that folder; sharded or not).

    dtype casts floating weights on read and becomes compute_dtype. prepare / convert: the meta-model and per-tensor
    hooks (fp8 while loading). read_weights=False: the meta model as it would load, from the headers alone (the
    memory planner). config overrides config.json, the `hunyuan_image_config` metadata and the shapes. Every key and
    shape is checked before any weight is read; a wrong file is one CheckpointError naming it."""
    # a foreign diffusers class is refused even with config=
    path, reader = open_transformer(path, "load_hunyuan_image", dtype)
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    if DIFFUSERS_MARKER in reader:
        config, source, stored = _diffusers_source(path, reader, config, diffusers_json)
    else:
        config, source, stored = _single_file_source(path, reader, config)
    with torch.device("meta"):
        model = HunyuanImage(config)
    check_keys_and_shapes(source, model.state_dict(), config, stored_extras(stored))
    return fill_meta_model(model, source, lambda key: key, path, dtype, stored=stored,
                           keep_rules=_fp8_rules() if stored else None, prepare=prepare, convert=convert,
                           read_weights=read_weights, loader="load_hunyuan_image")


# ----------------------------------------------------------------------------------------------
# Saving and the module maps


def save_hunyuan_image_single_file(model_or_sd, path: str, config: HunyuanImageConfig | None = None, prefix: str = "",
                                   comfy_names: bool = False, metadata: dict[str, str] | None = None):
    """Write the single-file layout (atomic): Tencent's names, or ComfyUI's (comfy_names), under `prefix` (e.g.
    `model.diffusion_model.`); the config (when known) in the metadata as `hunyuan_image_config` JSON."""
    sd, config = state_and_config(model_or_sd, config)
    name = comfy_key if comfy_names else (lambda key: key)
    save_with_config({prefix + name(k): v.contiguous() for k, v in sd.items()}, path, CONFIG_KEY, config, metadata)


def save_hunyuan_image_diffusers(model_or_sd, config: HunyuanImageConfig | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_hunyuan_image_diffusers needs a HunyuanImageConfig (or the model) to write config.json")
    save_diffusers_folder(to_diffusers_state_dict(sd, config), diffusers_config(config), folder)


def module_map(keys, shape, naming: str) -> dict[str, list[tuple[str, int, int]]]:
    """{our Linear: [(its module in `naming`, row0, row1)]} for a checkpoint's keys (`shape(key)`: its shape), the
    format of the other families' module_map_of_keys: naming "diffusers" (fused q / k / v (/ mlp) rows split) or
    "comfy" (renamed, whole). The final adaLN, whose halves diffusers swaps, is no row range of one module: left out
    (no LoRA of ours targets it)."""
    if naming not in ("diffusers", "comfy"):
        raise ValueError(f"module_map naming must be 'diffusers' or 'comfy', got {naming!r}")
    keys = list(keys)
    config = _diffusers_skeleton(keys) if naming == "diffusers" else _skeleton(keys, "", True)
    with torch.device("meta"):
        model = HunyuanImage(config)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == FINAL_MODULATION:
            continue
        if naming == "comfy":
            theirs = comfy_key(name + ".weight")
            if theirs in keys:
                out[name] = [(theirs[: -len(".weight")], 0, shape(theirs)[0])]
            continue
        parts = diffusers_modules(name)
        if all(p + ".weight" in keys for p in parts):
            starts = [0]
            for p in parts:
                starts.append(starts[-1] + shape(p + ".weight")[0])
            out[name] = [(p, starts[i], starts[i + 1]) for i, p in enumerate(parts)]
    return out
