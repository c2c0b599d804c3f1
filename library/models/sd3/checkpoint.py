"""SD3 / SD3.5 MMDiT checkpoints: loading SAI's single file (sd3.5_large.safetensors, sd3.5_medium.safetensors,
sd3_medium.safetensors: our names under "model.diffusion_model."; ComfyUI's UNet-only files under "diffusion_model."
or bare), the all-in-one files that bundle the text encoders and the VAE beside it (sd3_medium_incl_clips*.safetensors:
text_encoders.* and first_stage_model.* are not read), and a diffusers folder (transformer/ of SD3Transformer2DModel);
the config from our metadata, config.json or the shapes; saving the single file and the diffusers folder.

The diffusers names (diffusers' loaders/single_file_utils.py convert_sd3_transformer_checkpoint_to_diffusers, read
the other way; `_DIFFUSERS` below) split every fused qkv: x_block.attn.qkv into attn.to_q / to_k / to_v,
context_block.attn.qkv into attn.add_q_proj / add_k_proj / add_v_proj, x_block.attn2.qkv into attn2.to_q / to_k /
to_v; and two adaLNs store their halves swapped (diffusers' AdaLayerNormContinuous reads scale, shift; SAI's
shift, scale): final_layer.adaLN_modulation.1 (norm_out.linear) and the last block's pre-only
context_block.adaLN_modulation.1 (norm1_context.linear), as for every BFL-style final layer. The other blocks'
modulation rows are in SAI's order in both (AdaLayerNormZero and SD35AdaLayerNormZeroX chunk shift, scale, gate
x 2 (x 3) as SAI does).

`pos_embed` (the file's [1, N^2, width] position table; diffusers' persistent pos_embed.pos_embed buffer) is not a
weight of ours: the model computes it (model.pos_embed_table) from the grid sd-scripts names as SD3.5's. The loader
reads N from its shape and compares the file's values with the computed table: within a 16-bit rounding the exact
float32 table is used; a file holding another grid (the released files could not be read here) keeps its own table,
as diffusers, ComfyUI and sd-scripts run it (model.stored_pos_embed, in the file's dtype on the CPU, never cast with
the model), with one warning naming the grids.

Pre-quantized single files (ComfyUI's scaled fp8 / comfy_quant, our fp8 layouts, city96's GGUF) load as stored through
precision/stored_layouts.py. A diffusers folder is read in full precision only (its fused tensors are built from parts).
"""

from __future__ import annotations

import logging
import math
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
from library.models.sd3.model import HEAD_DIM, PATCH, SD3, SD3Config, pos_embed_table, table_positions
from library.precision.stored_layouts import read_stored_layout, stored_extras

logger = logging.getLogger(__name__)

CLASS_NAME = "SD3Transformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # SAI's release / ComfyUI's UNet-only, plain
MARKER = "joint_blocks.0.context_block.attn.qkv.weight"  # ComfyUI's model_detection key for an MMDiT
PATCH_KEY = "x_embedder.proj.weight"
POS_KEY = "pos_embed"  # the file's position table (not a weight of ours)
DIFFUSERS_POS_KEY = "pos_embed.pos_embed"
DIFFUSERS_MARKER = "transformer_blocks.0.attn.add_q_proj.weight"  # with pos_embed.proj (other joint models: x_embedder)
DIFFUSERS_PATCH = "pos_embed.proj.weight"
CONFIG_KEY = "sd3_config"  # safetensors metadata of files we write: the config as JSON
FINAL_MODULATION = "final_layer.adaLN_modulation.1"  # rows (shift, scale); diffusers' norm_out.linear (scale, shift)
POS_TOLERANCE = 1 / 128  # the file's table vs ours: bf16 rounds values in [-1, 1] by at most 2^-9

# ----------------------------------------------------------------------------------------------
# The diffusers names: (our module regex, its diffusers module(s)); a tuple splits our rows in that order

_B, _D = r"joint_blocks\.(\d+)\.", r"transformer_blocks.\1."
_DIFFUSERS = tuple((re.compile(ours), theirs) for ours, theirs in (
    (r"x_embedder\.proj", "pos_embed.proj"), (r"context_embedder", "context_embedder"),
    (r"t_embedder\.mlp\.0", "time_text_embed.timestep_embedder.linear_1"),
    (r"t_embedder\.mlp\.2", "time_text_embed.timestep_embedder.linear_2"),
    (r"y_embedder\.mlp\.0", "time_text_embed.text_embedder.linear_1"),
    (r"y_embedder\.mlp\.2", "time_text_embed.text_embedder.linear_2"),
    (_B + r"x_block\.attn\.qkv", (_D + "attn.to_q", _D + "attn.to_k", _D + "attn.to_v")),
    (_B + r"context_block\.attn\.qkv", (_D + "attn.add_q_proj", _D + "attn.add_k_proj", _D + "attn.add_v_proj")),
    (_B + r"x_block\.attn\.ln_q", _D + "attn.norm_q"), (_B + r"x_block\.attn\.ln_k", _D + "attn.norm_k"),
    (_B + r"context_block\.attn\.ln_q", _D + "attn.norm_added_q"),
    (_B + r"context_block\.attn\.ln_k", _D + "attn.norm_added_k"),
    (_B + r"x_block\.attn\.proj", _D + "attn.to_out.0"), (_B + r"context_block\.attn\.proj", _D + "attn.to_add_out"),
    (_B + r"x_block\.attn2\.qkv", (_D + "attn2.to_q", _D + "attn2.to_k", _D + "attn2.to_v")),
    (_B + r"x_block\.attn2\.ln_q", _D + "attn2.norm_q"), (_B + r"x_block\.attn2\.ln_k", _D + "attn2.norm_k"),
    (_B + r"x_block\.attn2\.proj", _D + "attn2.to_out.0"),
    (_B + r"x_block\.adaLN_modulation\.1", _D + "norm1.linear"),
    (_B + r"context_block\.adaLN_modulation\.1", _D + "norm1_context.linear"),
    (_B + r"x_block\.mlp\.fc1", _D + "ff.net.0.proj"), (_B + r"x_block\.mlp\.fc2", _D + "ff.net.2"),
    (_B + r"context_block\.mlp\.fc1", _D + "ff_context.net.0.proj"),
    (_B + r"context_block\.mlp\.fc2", _D + "ff_context.net.2"),
    (r"final_layer\.linear", "proj_out"), (re.escape(FINAL_MODULATION), "norm_out.linear"),
))


def diffusers_modules(module: str) -> tuple[str, ...]:
    """Our module path -> its diffusers module, or the modules a fused one's rows come from (in row order)."""
    return renamed_modules(_DIFFUSERS, module)


def diffusers_keys(key: str) -> tuple[str, ...]:
    return renamed_keys(_DIFFUSERS, key)


def swapped_modules(depth: int) -> tuple[str, str]:
    """The adaLNs whose halves diffusers stores swapped: the final layer's and the last block's pre-only text one."""
    return FINAL_MODULATION, f"joint_blocks.{depth - 1}.context_block.adaLN_modulation.1"


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """(shift, scale) rows <-> (scale, shift)."""
    first, second = t.chunk(2, dim=0)
    return torch.cat((second, first))


def _swapped(key: str, depth: int) -> bool:
    return key.rpartition(".")[0] in swapped_modules(depth)


def to_diffusers_state_dict(sd: dict[str, torch.Tensor], config: SD3Config) -> dict[str, torch.Tensor]:
    """Our state dict -> SD3Transformer2DModel's (qkv split, two adaLNs' halves swapped, the position table added)."""
    out = {}
    for key, value in sd.items():
        if key == POS_KEY:
            continue
        names = diffusers_keys(key)
        if _swapped(key, config.depth):
            value = swap_halves(value)
        parts = value.chunk(len(names)) if len(names) > 1 else (value,)
        out.update({name: part.contiguous() for name, part in zip(names, parts)})
    dtype = next(iter(sd.values())).dtype
    out[DIFFUSERS_POS_KEY] = pos_embed_table(config)[None].to(dtype)
    return out


class _SingleFileView(RowSplitView):
    """A single file under our names: its prefix dropped; keys under other prefixes (an all-in-one file's
    text_encoders.* and first_stage_model.*) and the position table are not read. No tensor is split."""

    parts, part_names = 1, "whole"

    def __init__(self, reader: CheckpointReader, prefix: str):
        super().__init__(reader)
        for key in reader.keys():
            if key.startswith(prefix) and key[len(prefix):] != POS_KEY:
                self.sources[key[len(prefix):]] = (key, None)


class _DiffusersView(RowJoinView):
    """A diffusers transformer folder under our names: a qkv is its parts concatenated by rows, two adaLNs' halves
    swapped back; the position table buffer is not read."""

    def __init__(self, reader: CheckpointReader, our_keys, depth: int):
        super().__init__(reader, our_keys, diffusers_keys)
        self.sources.pop(DIFFUSERS_POS_KEY, None)
        self.depth = depth

    def transform(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        return swap_halves(tensor) if _swapped(key, self.depth) else tensor


def _attn2_blocks(keys, prefix: str = "joint_blocks.", part: str = "x_block.attn2.") -> tuple[int, ...]:
    """The MMDiT-X blocks among `keys`: those with a second self-attention (ours: x_block.attn2, diffusers' attn2)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\." + re.escape(part))
    return tuple(sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))}))


# ----------------------------------------------------------------------------------------------
# Config


def config_from_shapes(shapes: dict[str, tuple[int, ...]], pos_rows: int | None,
                       source: str = "checkpoint") -> SD3Config:
    """SD3Config from tensor shapes under our names: the width and latent channels from x_embedder, the depth from the
    joint blocks (sd-scripts reads width / 64; the count holds for tiny files too), heads of 64, the MLP ratio, the
    text and pooled widths, qk norm from ln_q, MMDiT-X blocks from their attn2, the table side from pos_rows (the
    file's pos_embed rows, N^2; None: SD3.5-Large's 192)."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the SD3 config, key '{key}' is missing")
        return shapes[key]

    width, in_channels = shape(PATCH_KEY)[:2]
    depth = block_count(shapes, "joint_blocks.")
    side = math.isqrt(pos_rows) if pos_rows else SD3Config.pos_embed_max_size
    if pos_rows and side * side != pos_rows:
        raise CheckpointError(f"{source}: '{POS_KEY}' has {pos_rows} rows, no square grid")
    dual = _attn2_blocks(shapes)
    try:
        return SD3Config(
            depth=depth, hidden_size=width, in_channels=in_channels,
            out_channels=shape("final_layer.linear.weight")[0] // (PATCH * PATCH),
            mlp_ratio=shape("joint_blocks.0.x_block.mlp.fc1.weight")[0] / width,
            context_dim=shape("context_embedder.weight")[1], pooled_dim=shape("y_embedder.mlp.0.weight")[1],
            pos_embed_max_size=side, qk_norm="joint_blocks.0.x_block.attn.ln_q.weight" in shapes,
            dual_attention_layers=dual)
    except ValueError as e:
        raise CheckpointError(f"{source}: the shapes give no SD3 config: {e}") from None


def config_from_diffusers(cfg: dict, source: str = "config.json") -> SD3Config:
    """SD3Config from an SD3Transformer2DModel config.json (diffusers' defaults fill gaps)."""
    if cfg.get("patch_size", 2) != PATCH or cfg.get("attention_head_dim", HEAD_DIM) != HEAD_DIM:
        raise CheckpointError(f"{source}: patch_size {cfg.get('patch_size')} / attention_head_dim "
                              f"{cfg.get('attention_head_dim')}: only SD3's 2 and 64 are supported")
    if cfg.get("qk_norm") not in (None, "rms_norm"):
        raise CheckpointError(f"{source}: qk_norm {cfg['qk_norm']!r}: only SD3.5's 'rms_norm' (or none) is supported")
    width = cfg.get("num_attention_heads", 18) * HEAD_DIM
    if cfg.get("caption_projection_dim", width) != width:
        raise CheckpointError(f"{source}: caption_projection_dim {cfg['caption_projection_dim']} is not the width "
                              f"{width}")
    return SD3Config(
        depth=cfg.get("num_layers", 18), hidden_size=width, in_channels=cfg.get("in_channels", 16),
        out_channels=cfg.get("out_channels") or cfg.get("in_channels", 16),
        context_dim=cfg.get("joint_attention_dim", 4096), pooled_dim=cfg.get("pooled_projection_dim", 2048),
        pos_embed_max_size=cfg.get("pos_embed_max_size", 96), qk_norm=cfg.get("qk_norm") == "rms_norm",
        dual_attention_layers=tuple(cfg.get("dual_attention_layers") or ()))


def diffusers_config(config: SD3Config) -> dict:
    """The SD3Transformer2DModel config.json of `config` (sample_size 128: the released 1024 px)."""
    return {"_class_name": CLASS_NAME, "sample_size": 128, "patch_size": PATCH, "in_channels": config.in_channels,
            "out_channels": config.out_channels, "num_layers": config.depth, "attention_head_dim": HEAD_DIM,
            "num_attention_heads": config.num_heads, "joint_attention_dim": config.context_dim,
            "caption_projection_dim": config.hidden_size, "pooled_projection_dim": config.pooled_dim,
            "pos_embed_max_size": config.pos_embed_max_size,
            "dual_attention_layers": list(config.dual_attention_layers),
            "qk_norm": "rms_norm" if config.qk_norm else None}


def config_from_json(text: str) -> SD3Config:
    """The config save_sd3_single_file writes in the metadata."""
    import json

    fields = json.loads(text)
    return SD3Config(**{**fields, "dual_attention_layers": tuple(fields["dual_attention_layers"])})


# ----------------------------------------------------------------------------------------------
# The position table's check


def _file_column_positions(table: torch.Tensor, width: int) -> tuple[float, float]:
    """(first, last) column position the file's table encodes along its top row, read from the lowest frequency pair
    (angle = position x 10000^(-(k-1)/k), k = width / 4: below pi for any released grid, so atan2 is unambiguous)."""
    k = width // 4
    top_row = table[: math.isqrt(table.shape[0])].double()  # tokens (0, c): the column half comes first
    angle = torch.atan2(top_row[:, k - 1], top_row[:, 2 * k - 1])
    omega = 1.0 / 10000 ** ((k - 1) / k)
    return float(angle[0] / omega), float(angle[-1] / omega)


def pos_embed_difference(table: torch.Tensor, config: SD3Config) -> float:
    """The max abs difference of the file's table [1, N^2, width] (any float dtype) to ours. Compared in row bands (a
    384^2 table is 0.45 GB in bf16)."""
    n, width = config.pos_embed_max_size, config.hidden_size
    table = table.reshape(n, n, width)
    worst = 0.0
    for top in range(0, n, 32):
        ours = pos_embed_table(config, top=top, rows=32).view(-1, n, width)
        worst = max(worst, float((table[top: top + 32].float() - ours).abs().max()))
    return worst


def file_pos_embed(table: torch.Tensor, config: SD3Config, where: str, key: str) -> torch.Tensor | None:
    """None where the file's table is ours within POS_TOLERANCE (the computed float32 table runs); else the file's
    table [N^2, width] as stored, with one warning naming the grids (module docstring)."""
    worst = pos_embed_difference(table, config)
    if worst <= POS_TOLERANCE:
        return None
    first, last = _file_column_positions(table.reshape(-1, config.hidden_size), config.hidden_size)
    positions = table_positions(config)
    logger.warning(f"{where}: key '{key}' is not the position table this trainer computes (max abs diff {worst:.3g}: "
                   f"its columns run from position {first:.4g} to {last:.4g}, ours from {float(positions[0]):.4g} to "
                   f"{float(positions[-1]):.4g}); the file's own table is used, as its dtype holds it")
    return table.reshape(-1, config.hidden_size).detach().clone()


# ----------------------------------------------------------------------------------------------
# Loading


def _fp8_rules():
    from library.models.sd3.spec import FP8  # read only for a pre-quantized file

    return FP8


def _skeleton(keys, prefix: str) -> SD3Config:
    """A tiny config with the file's blocks and optional modules (only the names of its model matter)."""
    names = [k[len(prefix):] for k in keys if k.startswith(prefix)]
    depth = block_count(names, "joint_blocks.")
    dual = _attn2_blocks(names)
    return SD3Config(depth=max(depth, 1), hidden_size=HEAD_DIM, context_dim=1, pooled_dim=1, in_channels=1,
                     out_channels=1, pos_embed_max_size=1, qk_norm="joint_blocks.0.x_block.attn.ln_q.weight" in names,
                     dual_attention_layers=tuple(sorted(i for i in dual if i < depth - 1)))


def _single_file_source(path: str, reader: CheckpointReader, config: SD3Config | None):
    """(config, the file under our names, its stored layout, the file's pos_embed key or None)."""
    prefix = marked_prefix(path, reader.keys(), PREFIXES, MARKER, "an SD3 / SD3.5 MMDiT transformer")
    source = _SingleFileView(reader, prefix)
    stored = read_stored_layout(reader, path) and read_stored_layout(source, path)
    extra = stored_extras(stored)
    pos_key = prefix + POS_KEY if prefix + POS_KEY in reader else None
    pos_rows = reader.shape(pos_key)[-2] if pos_key else None
    if config is None:
        config = stated_config(path, reader, None, config_from_diffusers, CONFIG_KEY, config_from_json,
                               lambda: config_from_shapes({k: source.shape(k) for k in source.keys() if not extra(k)},
                                                          pos_rows, path))
    return config, source, stored, pos_key


def _diffusers_source(path: str, reader: CheckpointReader, config: SD3Config | None, diffusers_json):
    """(config, the folder under our names, no stored layout, the pos_embed key or None) of a diffusers folder."""
    pos_key = DIFFUSERS_POS_KEY if DIFFUSERS_POS_KEY in reader else None
    if config is None and diffusers_json is not None:
        config = config_from_diffusers(diffusers_json, os.path.join(path, "config.json"))
    keys = reader.keys()
    skeleton = config or SD3Config(
        depth=max(block_count(keys, "transformer_blocks."), 1), hidden_size=HEAD_DIM, context_dim=1, pooled_dim=1,
        in_channels=1, out_channels=1, pos_embed_max_size=1, qk_norm="transformer_blocks.0.attn.norm_q.weight" in keys,
        dual_attention_layers=_attn2_blocks(keys, "transformer_blocks.", "attn2."))
    with torch.device("meta"):
        our_keys = SD3(skeleton).state_dict().keys()
    view = _DiffusersView(reader, our_keys, skeleton.depth)
    if config is None:
        config = config_from_shapes({k: view.shape(k) for k in view.keys()},
                                    reader.shape(pos_key)[-2] if pos_key else None, path)
    return config, view, None, pos_key


def load_sd3(
    path: str,
    dtype: torch.dtype = torch.float32,
    prepare: Callable[[SD3], Callable | None] | None = None,
    read_weights: bool = True,
    config: SD3Config | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> SD3:
    """Load an SD3 / SD3.5 MMDiT from SAI's single file (under "model.diffusion_model.", ComfyUI's "diffusion_model."
    or bare; an all-in-one file's text encoders and VAE are not read) or a diffusers folder (the pipeline folder with
    transformer/, or that folder; sharded or not).

    dtype casts floating weights on read and becomes compute_dtype. prepare / convert: the meta-model and per-tensor
    hooks (fp8 while loading). read_weights=False: the meta model as it would load, from the headers alone (the
    memory planner; the position table's values are then not checked). config overrides config.json, the
    `sd3_config` metadata and the shapes. Every key and shape is checked before any weight is read; a wrong file is
    one CheckpointError naming it."""
    # a foreign diffusers class is refused even with config=
    path, reader = open_transformer(path, "load_sd3", dtype)
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    if DIFFUSERS_MARKER in reader and DIFFUSERS_PATCH in reader:
        config, source, stored, pos_key = _diffusers_source(path, reader, config, diffusers_json)
    else:
        config, source, stored, pos_key = _single_file_source(path, reader, config)
    with torch.device("meta"):
        model = SD3(config)
    check_keys_and_shapes(source, model.state_dict(), config, stored_extras(stored))
    stored_table = None
    if pos_key is not None:
        side = config.pos_embed_max_size
        want = (1, side * side, config.hidden_size)
        if tuple(reader.shape(pos_key)) != want:
            raise CheckpointError(f"{path}: key '{pos_key}' has shape {tuple(reader.shape(pos_key))}, expected {want}")
        stored_table = file_pos_embed(reader.get(pos_key), config, path, pos_key) if read_weights else None
    model = fill_meta_model(model, source, lambda key: key, path, dtype, stored=stored,
                           keep_rules=_fp8_rules() if stored else None, prepare=prepare, convert=convert,
                           read_weights=read_weights, loader="load_sd3")
    model.stored_pos_embed = stored_table
    return model


# ----------------------------------------------------------------------------------------------
# Saving and the module map


def save_sd3_single_file(weights, path: str, config: SD3Config | None = None, prefix: str = "model.diffusion_model.",
                         metadata: dict[str, str] | None = None, write_config: bool = True):
    """Write SAI's single-file layout (atomic): our names under `prefix` with the position table `pos_embed` (in the
    weights' dtype, as released). The config: given, the model's, or read from the shapes (the table side then
    from a `pos_embed` in `weights`; without one a ValueError); stored in the metadata as `sd3_config` JSON unless
    write_config is False (a released file has none: the loader reads the sizes from the shapes)."""
    sd, config = state_and_config(weights, config)
    table = sd.pop(POS_KEY, None)
    if config is None and table is None:
        raise ValueError(f"save_sd3_single_file({path}): a state dict without 'pos_embed' needs its SD3Config (the "
                         f"position table's side is in no weight's shape)")
    if config is None:
        config = config_from_shapes({k: tuple(v.shape) for k, v in sd.items()}, table.shape[-2], path)
    dtype = sd[PATCH_KEY].dtype
    tensors = {prefix + k: v.contiguous() for k, v in sd.items()}
    tensors[prefix + POS_KEY] = pos_embed_table(config)[None].to(dtype)
    save_with_config(tensors, path, CONFIG_KEY, config if write_config else None, metadata)


def save_sd3_diffusers(weights, config: SD3Config | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(weights, config)
    if config is None:
        raise ValueError("save_sd3_diffusers needs an SD3Config (or the model) to write config.json")
    save_diffusers_folder(to_diffusers_state_dict(sd, config), diffusers_config(config), folder)


def module_map(keys, shape, naming: str = "diffusers") -> dict[str, list[tuple[str, int, int]]]:
    """{our Linear: [(its diffusers module, row0, row1)]} for a diffusers checkpoint's keys (`shape(key)`: its shape),
    the format of the other families' module maps (qkv rows split into q / k / v). The two adaLNs whose halves
    diffusers swaps are no row range of one module: left out (LoRA keys of them would need the swap)."""
    if naming != "diffusers":
        raise ValueError(f"module_map naming must be 'diffusers', got {naming!r}")
    keys = list(keys)
    depth = max(block_count(keys, "transformer_blocks."), 1)
    dual = _attn2_blocks(keys, "transformer_blocks.", "attn2.")
    config = SD3Config(depth=depth, hidden_size=HEAD_DIM, context_dim=1, pooled_dim=1, in_channels=1, out_channels=1,
                       pos_embed_max_size=1, qk_norm=True,
                       dual_attention_layers=tuple(i for i in dual if i < depth - 1))
    with torch.device("meta"):
        model = SD3(config)
    skip = swapped_modules(depth)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name in skip:
            continue
        parts = diffusers_modules(name)
        if all(p + ".weight" in keys for p in parts):
            starts = [0]
            for p in parts:
                starts.append(starts[-1] + shape(p + ".weight")[0])
            out[name] = [(p, starts[i], starts[i + 1]) for i, p in enumerate(parts)]
    return out
