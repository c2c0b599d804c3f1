"""FLUX.2 checkpoints: loading (BFL single file, ComfyUI prefixes, diffusers folders), the
BFL <-> diffusers name map, and saving in both layouts.

The model uses BFL names, so a BFL file loads by plain key (minus a ComfyUI prefix). diffusers'
Flux2Transformer2DModel differs in three ways only: it splits the double blocks' fused `qkv` into
to_q/to_k/to_v (add_*_proj for text), stores the final adaLN rows as (scale, shift) instead of
BFL's (shift, scale), and renames (the single blocks' fused `linear1` / `linear2` stay fused as
`attn.to_qkv_mlp_proj` / `attn.to_out`). The oracle is diffusers'
`convert_flux2_transformer_checkpoint_to_diffusers` (loaders/single_file_utils.py). One row table,
`flux2_diffusers_module_map`, in the format of FLUX.1's, drives the converters and the streaming
loader (and later LoRA conversion), with FLUX.1's row helpers.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, check_keys_and_shapes, metadata_config, save_diffusers_folder,
    save_with_config, state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, open_transformer, without_prefix,
)
from library.models.flux1.checkpoint import (
    RowMap,
    _DiffusersAsBFL,
    _join_rows,
    _source_keys,
    _split_rows,
)
from library.models.flux2.model import Flux2, Flux2Config
from library.models.flux2.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras

BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain BFL
CLASS_NAME = "Flux2Transformer2DModel"
# Keys only FLUX.2 has (diffusers' single-file detection uses the first): tell it from FLUX.1.
FLUX2_MARKERS = ("single_stream_modulation.lin.weight", "single_stream_modulation.linear.weight")

# ----------------------------------------------------------------------------------------------
# The name map


def flux2_diffusers_module_map(
    depth: int, depth_single: int, hidden: int, mlp_hidden: int, out_channels: int = 128, guidance: bool = True
) -> RowMap:
    """Every Linear of FLUX.2: BFL module path -> [(diffusers module path, row_start, row_end)]
    (the format of flux1.checkpoint.flux_diffusers_module_map: a diffusers weight is the
    concatenation of its entries' BFL row slices, in order; input columns are never split)."""
    h, m = hidden, mlp_hidden
    whole = lambda name, rows: [(name, 0, rows)]  # noqa: E731
    emb = "time_guidance_embed."
    table: RowMap = {
        "img_in": whole("x_embedder", h),
        "txt_in": whole("context_embedder", h),
        "time_in.in_layer": whole(emb + "timestep_embedder.linear_1", h),
        "time_in.out_layer": whole(emb + "timestep_embedder.linear_2", h),
    }
    if guidance:
        table["guidance_in.in_layer"] = whole(emb + "guidance_embedder.linear_1", h)
        table["guidance_in.out_layer"] = whole(emb + "guidance_embedder.linear_2", h)
    for name, rows in (("double_stream_modulation_img", 6 * h), ("double_stream_modulation_txt", 6 * h),
                       ("single_stream_modulation", 3 * h)):  # fmt: skip
        table[name + ".lin"] = whole(name + ".linear", rows)
    for i in range(depth):
        b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for stream, q, k, v, out, ff in (
            ("img", "to_q", "to_k", "to_v", "to_out.0", "ff"),
            ("txt", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context"),
        ):
            table[f"{b}{stream}_attn.qkv"] = [(f"{d}attn.{q}", 0, h), (f"{d}attn.{k}", h, 2 * h), (f"{d}attn.{v}", 2 * h, 3 * h)]
            table[f"{b}{stream}_attn.proj"] = whole(f"{d}attn.{out}", h)
            table[f"{b}{stream}_mlp.0"] = whole(f"{d}{ff}.linear_in", 2 * m)
            table[f"{b}{stream}_mlp.2"] = whole(f"{d}{ff}.linear_out", h)
    for i in range(depth_single):
        b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}.attn."
        table[b + "linear1"] = whole(d + "to_qkv_mlp_proj", 3 * h + 2 * m)
        table[b + "linear2"] = whole(d + "to_out", h)
    table["final_layer.linear"] = whole("proj_out", out_channels)
    # diffusers' AdaLayerNormContinuous splits (scale, shift); BFL's final layer (shift, scale).
    table["final_layer.adaLN_modulation.1"] = [("norm_out.linear", h, 2 * h), ("norm_out.linear", 0, h)]
    return table


def _norm_names(depth: int, depth_single: int) -> dict[str, str]:
    """QK-norm weights (not Linears): BFL key -> diffusers key, one to one."""
    names = {}
    for i in range(depth):
        b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}.attn."
        for stream, q, k in (("img", "norm_q", "norm_k"), ("txt", "norm_added_q", "norm_added_k")):
            names[f"{b}{stream}_attn.norm.query_norm.scale"] = f"{d}{q}.weight"
            names[f"{b}{stream}_attn.norm.key_norm.scale"] = f"{d}{k}.weight"
    for i in range(depth_single):
        b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}.attn."
        names[b + "norm.query_norm.scale"] = d + "norm_q.weight"
        names[b + "norm.key_norm.scale"] = d + "norm_k.weight"
    return names


def row_tables(keys, shapes: Callable[[str], tuple], diffusers: bool) -> tuple[RowMap, dict[str, str]]:
    """Name tables sized for a state dict in either layout (sizes read from its shapes)."""
    if diffusers:
        depth, single = block_count(keys, "transformer_blocks."), block_count(keys, "single_transformer_blocks.")
        hidden, out = shapes("x_embedder.weight")[0], shapes("proj_out.weight")[0]
        mlp = shapes("single_transformer_blocks.0.attn.to_out.weight")[1] - hidden if single else \
            shapes("transformer_blocks.0.ff.linear_out.weight")[1]
        guidance = any(k.startswith("time_guidance_embed.guidance_embedder.") for k in keys)
    else:
        depth, single = block_count(keys, "double_blocks."), block_count(keys, "single_blocks.")
        hidden, out = shapes("img_in.weight")[0], shapes("final_layer.linear.weight")[0]
        mlp = shapes("single_blocks.0.linear2.weight")[1] - hidden if single else shapes("double_blocks.0.img_mlp.2.weight")[1]
        guidance = any(k.startswith("guidance_in.") for k in keys)
    return flux2_diffusers_module_map(depth, single, hidden, mlp, out, guidance), _norm_names(depth, single)


def _check(sd, key: str) -> str:
    if key not in sd:
        raise CheckpointError(f"FLUX.2 state dict: missing key '{key}'")
    return key


def _no_leftovers(sd):
    if sd:
        raise CheckpointError(f"FLUX.2 state dict: unexpected keys {sorted(sd)[:5]} ({len(sd)} in all)")


def flux2_to_diffusers_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL-named FLUX.2 state dict -> diffusers Flux2Transformer2DModel names (new tensors)."""
    sd = dict(sd)
    rows, norms = row_tables(sd.keys(), lambda k: tuple(sd[_check(sd, k)].shape), diffusers=False)
    out = {}
    for module, parts in rows.items():
        for target, tensor in _split_rows(sd.pop(_check(sd, module + ".weight")), parts).items():
            out[target + ".weight"] = tensor
    for bfl_key, diffusers_key in norms.items():
        out[diffusers_key] = sd.pop(_check(sd, bfl_key))
    _no_leftovers(sd)
    return out


def diffusers_to_flux2_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers Flux2Transformer2DModel state dict -> BFL names (fused qkv, BFL final-layer row order)."""
    sd = dict(sd)
    rows, norms = row_tables(sd.keys(), lambda k: tuple(sd[_check(sd, k)].shape), diffusers=True)
    out = {}
    for module, parts in rows.items():
        tensors = {k.rsplit(".", 1)[0]: sd.pop(_check(sd, k)) for k in _source_keys(parts, "weight")}
        out[module + ".weight"] = _join_rows(tensors, parts)
    for bfl_key, diffusers_key in norms.items():
        out[bfl_key] = sd.pop(_check(sd, diffusers_key))
    _no_leftovers(sd)
    return out


# ----------------------------------------------------------------------------------------------
# Config


def default_axes_dim(head_dim: int) -> tuple[int, ...]:
    """RoPE axes as FLUX.2 splits its head: four equal (t, h, w, l) parts ((32, 32, 32, 32) for
    head_dim 128). BFL files do not store it."""
    if head_dim % 8:
        raise CheckpointError(f"cannot derive FLUX.2 RoPE axes for head_dim {head_dim}: pass config=Flux2Config(axes_dim=...)")
    return (head_dim // 4,) * 4


def config_from_bfl_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> Flux2Config:
    """Flux2Config from BFL key shapes: depths from block counts, widths from img_in / txt_in / norms.
    theta (2000) and the RoPE split are FLUX.2's: BFL files do not store them."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the FLUX.2 config, key '{key}' is missing")
        return shapes[key]

    hidden, in_channels = shape("img_in.weight")
    depth, depth_single = block_count(shapes, "double_blocks."), block_count(shapes, "single_blocks.")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale" if depth else "single_blocks.0.norm.query_norm.scale")[0]
    mlp = shape("double_blocks.0.img_mlp.2.weight")[1] if depth else shape("single_blocks.0.linear2.weight")[1] - hidden
    if shape("final_layer.linear.weight")[0] != in_channels:
        raise CheckpointError(f"{source}: final_layer.linear has {shape('final_layer.linear.weight')[0]} outputs, "
                              f"expected in_channels {in_channels}")
    return Flux2Config(
        in_channels=in_channels,
        context_in_dim=shape("txt_in.weight")[1],
        hidden_size=hidden,
        mlp_ratio=mlp / hidden,
        num_heads=hidden // head_dim,
        depth=depth,
        depth_single=depth_single,
        axes_dim=default_axes_dim(head_dim),
        guidance_embed="guidance_in.in_layer.weight" in shapes,
        time_dim=shape("time_in.in_layer.weight")[1],
    )


def config_from_diffusers(cfg: dict, source: str = "config.json") -> Flux2Config:
    """Flux2Config from a diffusers Flux2Transformer2DModel config.json (diffusers' defaults fill gaps)."""
    in_channels = cfg.get("in_channels", 128)
    if cfg.get("patch_size", 1) != 1 or cfg.get("out_channels") not in (None, in_channels):
        raise CheckpointError(f"{source}: patch_size must be 1 and out_channels equal in_channels for FLUX.2")
    if cfg.get("eps", 1e-6) != 1e-6:
        raise CheckpointError(f"{source}: eps {cfg['eps']} is not supported (FLUX.2 uses 1e-6)")
    heads, head_dim = cfg.get("num_attention_heads", 48), cfg.get("attention_head_dim", 128)
    return Flux2Config(
        in_channels=in_channels,
        context_in_dim=cfg.get("joint_attention_dim", 15360),
        hidden_size=heads * head_dim,
        mlp_ratio=float(cfg.get("mlp_ratio", 3.0)),
        num_heads=heads,
        depth=cfg.get("num_layers", 8),
        depth_single=cfg.get("num_single_layers", 48),
        axes_dim=tuple(cfg.get("axes_dims_rope", (32, 32, 32, 32))),
        theta=float(cfg.get("rope_theta", 2000)),
        guidance_embed=bool(cfg.get("guidance_embeds", True)),
        time_dim=cfg.get("timestep_guidance_channels", 256),
    )


def diffusers_config(config: Flux2Config) -> dict:
    """The Flux2Transformer2DModel config.json for `config`."""
    if config.theta != int(config.theta):
        raise ValueError(f"diffusers Flux2Transformer2DModel stores rope_theta as an int: {config}")
    return {
        "_class_name": CLASS_NAME,
        "patch_size": 1,
        "in_channels": config.in_channels,
        "out_channels": None,
        "num_layers": config.depth,
        "num_single_layers": config.depth_single,
        "attention_head_dim": config.head_dim,
        "num_attention_heads": config.num_heads,
        "joint_attention_dim": config.context_in_dim,
        "timestep_guidance_channels": config.time_dim,
        "mlp_ratio": config.mlp_ratio,
        "axes_dims_rope": list(config.axes_dim),
        "rope_theta": int(config.theta),
        "eps": 1e-6,
        "guidance_embeds": config.guidance_embed,
    }


def flux2_config_from_json(text: str) -> Flux2Config:
    fields = json.loads(text)
    fields["axes_dim"] = tuple(fields["axes_dim"])
    return Flux2Config(**fields)


# ----------------------------------------------------------------------------------------------
# Loading


def _check_diffusers_shapes(reader: CheckpointReader, config: Flux2Config):
    """Every diffusers key present, expected, and of the expected shape (named in the error)."""
    with torch.device("meta"):
        expected = flux2_to_diffusers_state_dict(Flux2(config).state_dict())
    check_keys_and_shapes(reader, expected, config)


def _bfl_prefix(keys: list[str]) -> str | None:
    for prefix in BFL_PREFIXES:  # diffusers keeps the modulation module names but calls the Linear `linear`
        if prefix + FLUX2_MARKERS[0] in keys:
            return prefix
    return None


def _diffusers_source(path: str, reader: CheckpointReader, config: Flux2Config | None, diffusers_json: dict | None):
    """(config, BFL-keyed view) of a diffusers Flux2Transformer2DModel folder (diffusers_json: its config.json);
    shapes checked up front."""
    if config is None and diffusers_json is not None:
        config = config_from_diffusers(diffusers_json, source=os.path.join(path, "config.json"))
    if config is None:
        meta = {k: torch.empty(reader.shape(k), device="meta") for k in reader.keys()}
        config = config_from_bfl_shapes({k: tuple(v.shape) for k, v in diffusers_to_flux2_state_dict(meta).items()}, path)
    _check_diffusers_shapes(reader, config)
    return config, _DiffusersAsBFL(reader, *row_tables(reader.keys(), reader.shape, diffusers=True))


def load_flux2(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: Flux2Config | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Flux2], Callable | None] | None = None,
    read_weights: bool = True,
) -> Flux2:
    """Load a FLUX.2 transformer from a BFL single file (optionally with a ComfyUI
    `model.diffusion_model.` / `diffusion_model.` prefix) or a diffusers folder (the pipeline
    folder with `transformer/`, or the transformer folder itself; sharded or not).

    Arguments as load_flux (library/models/flux1/checkpoint.py): dtype casts floating weights on read
    and becomes compute_dtype; config overrides what config.json / the `flux2_config` metadata / the
    key shapes say; convert / prepare are the per-tensor and meta-model hooks (fp8:
    `prepare=fp8_prepare("fp8_scaled", "flux2")`); read_weights=False gives the meta model as it
    would load (the memory planner). The model is built on `meta` and filled one tensor at a time.
    """
    # a pre-quantized file (fp8, GGUF) is used as it is
    path, reader = open_transformer(path, "load_flux2", dtype)
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    keys = reader.keys()
    prefix = _bfl_prefix(keys)
    if prefix is not None:
        if config is None and "flux2_config" in reader.metadata:
            config = metadata_config(reader, "flux2_config", flux2_config_from_json)
        if config is None:
            config = config_from_bfl_shapes({k[len(prefix) :]: reader.shape(k) for k in keys if k.startswith(prefix)}, path)
        source, rename = reader, without_prefix(prefix)
    elif FLUX2_MARKERS[1] in keys:
        if stored:
            raise CheckpointError(f"{path}: a pre-quantized ({stored.layout}) FLUX.2 checkpoint must use BFL key names "
                                  f"(diffusers folders split the fused qkv rows, which stored scales do not survive)")
        config, source = _diffusers_source(path, reader, config, diffusers_json)
        rename = lambda key: key  # noqa: E731
    else:
        raise CheckpointError(f"{path}: not a FLUX.2 transformer (no key '{FLUX2_MARKERS[0]}' (BFL) or "
                              f"'{FLUX2_MARKERS[1]}' (diffusers))")

    with torch.device("meta"):
        model = Flux2(config)
    if prefix is not None:  # every key and shape from the header, before caching (the load named them after it)
        check_keys_and_shapes(PrefixedReader(reader, prefix), model.state_dict(), config, stored_extras(stored))
    # a stored layout comes only with BFL names (refused above in diffusers'), so `source` is the reader then
    return fill_meta_model(model, source, rename, path, dtype, stored=stored, keep_rules=FP8, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_flux2")


# ----------------------------------------------------------------------------------------------
# Saving


def save_flux2_bfl(model_or_sd, path: str, config: Flux2Config | None = None, metadata: dict[str, str] | None = None):
    """Write a BFL single-file checkpoint (atomic), the config (when known) in the metadata as
    `flux2_config` JSON so that non-standard sizes reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config(sd, path, "flux2_config", config, metadata)


def save_flux2_diffusers(model_or_sd, config: Flux2Config | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_flux2_diffusers needs a Flux2Config (or a Flux2 model) to write config.json")
    save_diffusers_folder(flux2_to_diffusers_state_dict(sd), diffusers_config(config), folder)
