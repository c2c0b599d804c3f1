"""FLUX.3 checkpoints: loading (BFL single file, ComfyUI prefixes, diffusers folders), the
BFL <-> diffusers name map, and saving in both layouts.

The model uses BFL names, so a BFL file loads by plain key (minus a ComfyUI prefix). diffusers'
Flux3Transformer2DModel renames every tensor one to one (`content_mode_blocks.` -> `mode_blocks.`,
`q_proj` -> `attn.to_q`, `.lin` -> `.linear`, ...; nothing is fused or split) and stores the final adaLN
rows as (scale, shift) instead of BFL's (shift, scale). The oracle is diffusers'
`convert_flux3_transformer_checkpoint_to_diffusers` (loaders/single_file_utils.py), which also drops the
training-only `repa_projectors.*` heads BFL's files may carry: so do we. One key table,
`flux3_diffusers_names`, drives the state-dict converters and the diffusers-folder loader.

Pre-quantized files (ComfyUI's scaled fp8 and the other layouts precision/stored_layouts.py reads) load as they
are stored, as FLUX.2's do, in BFL names (ComfyUI's prefixes included) and in diffusers' (nothing is fused, so a
stored scale stays its Linear's).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, RowSplitView, check_keys_and_shapes, metadata_config,
    save_diffusers_folder, save_with_config, state_and_config,
)
from library.models.checkpoint_files import block_count, diffusers_config_json, fill_meta_model, open_transformer
from library.models.flux3.model import MODES, STREAMS, Flux3Config, Flux3Transformer
from library.models.flux3.spec import FP8
from library.precision.fp8_checkpoints import COMFY_MARKER
from library.precision.stored_layouts import StoredLayout, read_stored_layout, stored_extras

BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain BFL
CLASS_NAME = "Flux3Transformer2DModel"
# Keys only FLUX.3 has (BFL's, diffusers' single-file detection; diffusers' folder): tell it from the others.
FLUX3_MARKERS = ("early_stream_modulations.image.lin.weight", "early_stream_modulations.image.linear.weight")
FINAL_ADALN_LAYER = "final_layer.image.adaLN_modulation.1"
FINAL_ADALN = FINAL_ADALN_LAYER + ".weight"  # rows (shift, scale) ...
DIFFUSERS_FINAL_ADALN = "norm_out.linear.weight"  # ... diffusers' (scale, shift)
TRAINING_ONLY = "repa_projectors."  # BFL's REPA heads: not part of the model, skipped on load

# ----------------------------------------------------------------------------------------------
# The name map

# Inside every block (per-mode and single alike): BFL name -> diffusers name.
_BLOCK_NAMES = {
    "q_proj.weight": "attn.to_q.weight",
    "k_proj.weight": "attn.to_k.weight",
    "v_proj.weight": "attn.to_v.weight",
    "attn_out.weight": "attn.to_out.0.weight",
    "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight",
    "mlp_in.weight": "ff.linear_in.weight",
    "mlp_out.weight": "ff.linear_out.weight",
}


def flux3_diffusers_names(depth: int, depth_single: int, flow_map: bool) -> dict[str, str]:
    """Every tensor of FLUX.3: BFL key -> diffusers Flux3Transformer2DModel key (one to one; the final
    adaLN's rows also swap halves: swap_halves)."""
    names = {f"emb_in.{mode}.weight": f"x_embedders.{mode}.weight" for mode in MODES}
    names["txt_in.weight"] = "context_embedder.weight"
    embedders = {"time_in": "timestep_embedder"} | ({"ref_time_in": "target_timestep_embedder"} if flow_map else {})
    for bfl, diffusers in embedders.items():
        names[f"{bfl}.in_layer.weight"] = f"{diffusers}.linear_1.weight"
        names[f"{bfl}.out_layer.weight"] = f"{diffusers}.linear_2.weight"
    for kind in ("early_stream_modulations", "single_stream_modulations"):
        names.update({f"{kind}.{s}.lin.weight": f"{kind}.{s}.linear.weight" for s in STREAMS})
    blocks = {f"content_mode_blocks.{mode}.{i}.": f"mode_blocks.{mode}.{i}." for mode in MODES for i in range(depth)}
    blocks |= {f"txt_mode_blocks.{i}.": f"txt_mode_blocks.{i}." for i in range(depth)}
    blocks |= {f"single_blocks.{i}.": f"single_transformer_blocks.{i}." for i in range(depth_single)}
    for bfl, diffusers in blocks.items():
        names.update({bfl + ours: diffusers + theirs for ours, theirs in _BLOCK_NAMES.items()})
    names["final_layer.image.linear.weight"] = "proj_out.weight"
    names[FINAL_ADALN] = DIFFUSERS_FINAL_ADALN
    return names


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """(shift, scale) rows <-> (scale, shift) rows: its own inverse (a new tensor)."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat((second, first))


def names_for(keys, diffusers: bool) -> dict[str, str]:
    """The BFL -> diffusers key table sized for a state dict in either layout (block counts from its keys)."""
    if diffusers:
        single, flow_map = "single_transformer_blocks.", any(k.startswith("target_timestep_embedder.") for k in keys)
    else:
        single, flow_map = "single_blocks.", any(k.startswith("ref_time_in.") for k in keys)
    return flux3_diffusers_names(block_count(keys, "txt_mode_blocks."), block_count(keys, single), flow_map)


def _renamed(sd: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """sd under names[key], the final adaLN's halves swapped; every key of sd and of names must be there."""
    missing = [k for k in names if k not in sd]
    if missing:
        raise CheckpointError(f"FLUX.3 state dict: missing keys {missing[:5]} ({len(missing)} in all)")
    unexpected = sorted(k for k in sd if k not in names)
    if unexpected:
        raise CheckpointError(f"FLUX.3 state dict: unexpected keys {unexpected[:5]} ({len(unexpected)} in all)")
    return {names[k]: swap_halves(v) if k in (FINAL_ADALN, DIFFUSERS_FINAL_ADALN) else v for k, v in sd.items()}


def flux3_to_diffusers_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL-named FLUX.3 state dict -> diffusers Flux3Transformer2DModel names (REPA heads dropped)."""
    sd = {k: v for k, v in sd.items() if not k.startswith(TRAINING_ONLY)}
    return _renamed(sd, names_for(sd.keys(), diffusers=False))


def diffusers_to_flux3_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers Flux3Transformer2DModel state dict -> BFL names (BFL's final-layer row order)."""
    return _renamed(dict(sd), {d: b for b, d in names_for(sd.keys(), diffusers=True).items()})


# ----------------------------------------------------------------------------------------------
# Config


def default_axes_dim(head_dim: int) -> tuple[int, ...]:
    """RoPE axes as FLUX.3 splits its head: four equal (t, h, w, l) parts ((32, 32, 32, 32) for
    head_dim 128). BFL files do not store it."""
    if head_dim % 8:
        raise CheckpointError(f"cannot derive FLUX.3 RoPE axes for head_dim {head_dim}: pass "
                              f"config=Flux3Config(axes_dim=...)")
    return (head_dim // 4,) * 4


def config_from_bfl_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> Flux3Config:
    """Flux3Config from BFL key shapes: depths from block counts, widths from the embedders and norms,
    flow_map from `ref_time_in`. theta (10000) and the RoPE split are FLUX.3's: BFL files do not store them."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the FLUX.3 config, key '{key}' is missing")
        return shapes[key]

    hidden, in_channels = shape("emb_in.image.weight")
    depth, depth_single = block_count(shapes, "txt_mode_blocks."), block_count(shapes, "single_blocks.")
    for mode in MODES:
        if block_count(shapes, f"content_mode_blocks.{mode}.") != depth:
            raise CheckpointError(f"{source}: {block_count(shapes, f'content_mode_blocks.{mode}.')} "
                                  f"content_mode_blocks.{mode} blocks but {depth} txt_mode_blocks; FLUX.3 has as many "
                                  f"of each mode")
    block = "single_blocks.0." if depth_single else "txt_mode_blocks.0."
    head_dim, mlp = shape(block + "norm.query_norm.scale")[0], shape(block + "mlp_out.weight")[1]
    if shape("final_layer.image.linear.weight")[0] != in_channels:
        raise CheckpointError(f"{source}: final_layer.image.linear has {shape('final_layer.image.linear.weight')[0]} "
                              f"outputs, expected in_channels {in_channels}")
    return Flux3Config(
        in_channels=in_channels,
        cond_in_channels=shape("emb_in.image_cond.weight")[1],
        context_in_dim=shape("txt_in.weight")[1],
        hidden_size=hidden,
        mlp_ratio=mlp / hidden,
        num_heads=hidden // head_dim,
        depth=depth,
        depth_single=depth_single,
        axes_dim=default_axes_dim(head_dim),
        time_dim=shape("time_in.in_layer.weight")[1],
        flow_map="ref_time_in.in_layer.weight" in shapes,
    )


def config_from_diffusers(cfg: dict, source: str = "config.json") -> Flux3Config:
    """Flux3Config from a diffusers Flux3Transformer2DModel config.json (diffusers' defaults fill gaps)."""
    if cfg.get("eps", 1e-6) != 1e-6:
        raise CheckpointError(f"{source}: eps {cfg['eps']} is not supported (FLUX.3 uses 1e-6)")
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    return Flux3Config(
        in_channels=cfg.get("in_channels", 128),
        cond_in_channels=cfg.get("cond_in_channels", 128),
        context_in_dim=cfg.get("joint_attention_dim", 20480),
        hidden_size=heads * head_dim,
        mlp_ratio=float(cfg.get("mlp_ratio", 3.0)),
        num_heads=heads,
        depth=cfg.get("num_layers", 5),
        depth_single=cfg.get("num_single_layers", 28),
        axes_dim=tuple(cfg.get("axes_dims_rope", (32, 32, 32, 32))),
        theta=float(cfg.get("rope_theta", 10000)),
        time_dim=cfg.get("timestep_channels", 256),
        flow_map=bool(cfg.get("flow_map", False)),
    )


def diffusers_config(config: Flux3Config) -> dict:
    """The Flux3Transformer2DModel config.json for `config`."""
    if config.theta != int(config.theta):
        raise ValueError(f"diffusers Flux3Transformer2DModel stores rope_theta as an int: {config}")
    return {
        "_class_name": CLASS_NAME,
        "in_channels": config.in_channels,
        "cond_in_channels": config.cond_in_channels,
        "num_layers": config.depth,
        "num_single_layers": config.depth_single,
        "attention_head_dim": config.head_dim,
        "num_attention_heads": config.num_heads,
        "joint_attention_dim": config.context_in_dim,
        "timestep_channels": config.time_dim,
        "mlp_ratio": config.mlp_ratio,
        "axes_dims_rope": list(config.axes_dim),
        "rope_theta": int(config.theta),
        "eps": 1e-6,
        "flow_map": config.flow_map,
    }


def flux3_config_from_json(text: str) -> Flux3Config:
    fields = json.loads(text)
    fields["axes_dim"] = tuple(fields["axes_dim"])
    return Flux3Config(**fields)


# ----------------------------------------------------------------------------------------------
# Loading


class _DiffusersAsBFL(RowSplitView):
    """A CheckpointReader view of a diffusers Flux3Transformer2DModel checkpoint under BFL keys (library/io.py
    RowSplitView; nothing is split: diffusers renames FLUX.3's Linears one to one). A pre-quantized file's scales
    and markers (`X.scale_weight`, `X.weight_scale`, `X.comfy_quant`, ...) appear under their Linear's BFL name,
    so the stored layouts read them as a BFL file's. The final adaLN's halves are swapped back as they are read,
    with every tensor of that layer that runs along its rows (per-row / per-block scales; a per-tensor scale
    stays as it is)."""

    parts, part_names = 1, "rows"

    def __init__(self, reader: CheckpointReader, names: dict[str, str]):
        super().__init__(reader)
        to_bfl = {diffusers: bfl for bfl, diffusers in names.items()}
        layers = {d[: -len(".weight")]: b[: -len(".weight")] for d, b in to_bfl.items()
                  if d.endswith(".weight") and b.endswith(".weight")}  # Linears (not the QK norms' scales)
        for key in reader.keys():
            layer, _, leaf = key.rpartition(".")
            if key in to_bfl:
                self.sources[to_bfl[key]] = (key, None)
            elif layer in layers:  # a stored layout's tensors beside a Linear's weight
                self.sources[f"{layers[layer]}.{leaf}"] = (key, None)
            elif key == COMFY_MARKER:
                self.sources[key] = (key, None)

    def get(self, key: str) -> torch.Tensor:
        tensor = super().get(key)
        rows = self.shape(FINAL_ADALN)[0] if FINAL_ADALN in self else None
        if key.startswith(FINAL_ADALN_LAYER + ".") and tensor.dim() and tensor.shape[0] == rows:
            return swap_halves(tensor)
        return tensor


def _diffusers_source(path: str, reader: CheckpointReader, config: Flux3Config | None, stored: StoredLayout | None,
                      diffusers_json: dict | None):
    """(config, BFL-keyed view, its stored layout) of a diffusers Flux3Transformer2DModel folder (diffusers_json: its
    config.json); keys and shapes checked up front (a stored layout's scales and markers aside)."""
    if config is None and diffusers_json is not None:
        config = config_from_diffusers(diffusers_json, source=os.path.join(path, "config.json"))
    if config is None:  # a bare weights file: the sizes from its shapes, under BFL names
        to_bfl = {d: b for b, d in names_for(reader.keys(), diffusers=True).items()}
        config = config_from_bfl_shapes({to_bfl[k]: reader.shape(k) for k in reader.keys() if k in to_bfl}, path)
    with torch.device("meta"):
        expected = flux3_to_diffusers_state_dict(Flux3Transformer(config).state_dict())
    check_keys_and_shapes(reader, expected, config, stored_extras(stored))
    view = _DiffusersAsBFL(reader, flux3_diffusers_names(config.depth, config.depth_single, config.flow_map))
    # a pre-quantized folder: read again under BFL names, so that each Linear's scales are found by its model key
    return config, view, read_stored_layout(view, path) if stored else None


def _bfl_prefix(keys: list[str]) -> str | None:
    for prefix in BFL_PREFIXES:  # diffusers keeps the modulation module names but calls the Linear `linear`
        if prefix + FLUX3_MARKERS[0] in keys:
            return prefix
    return None


def _bfl_source(path: str, reader: CheckpointReader, prefix: str, config: Flux3Config | None):
    """(config, rename) of a BFL single file under `prefix`: the config from its metadata or its shapes."""
    if config is None and "flux3_config" in reader.metadata:
        config = metadata_config(reader, "flux3_config", flux3_config_from_json)
    if config is None:
        config = config_from_bfl_shapes({k[len(prefix) :]: reader.shape(k) for k in reader.keys()
                                         if k.startswith(prefix)}, path)

    def rename(key: str) -> str | None:  # other prefixes (a bundled VAE or text encoder) and REPA heads: skipped
        name = key[len(prefix) :] if key.startswith(prefix) else None
        return None if name is None or name.startswith(TRAINING_ONLY) else name

    return config, rename


def load_flux3(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: Flux3Config | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Flux3Transformer], Callable | None] | None = None,
    read_weights: bool = True,
) -> Flux3Transformer:
    """Load a FLUX.3 transformer from a BFL single file (optionally with a ComfyUI
    `model.diffusion_model.` / `diffusion_model.` prefix; `repa_projectors.*` skipped) or a diffusers
    folder (the pipeline folder with `transformer/`, or the transformer folder itself; sharded or not).

    Arguments as load_flux2 (library/models/flux2/checkpoint.py): dtype casts floating weights on read and
    becomes compute_dtype; config overrides what config.json / the `flux3_config` metadata / the key shapes
    say; convert / prepare are the per-tensor and meta-model hooks (fp8); read_weights=False gives the meta
    model as it would load (the memory planner). The model is built on `meta` and filled one tensor at a time.
    A pre-quantized file (precision/stored_layouts.py: ComfyUI's scaled fp8, plain fp8, ours, musubi-tuner's,
    GGUF) is used as it is stored, whatever `prepare` asks, in either naming: diffusers renames FLUX.3's Linears
    one to one, so each keeps its scales (the final adaLN's row-wise ones swap with its halves).
    """
    # a pre-quantized file (fp8, GGUF, BFL's) is used as it is
    path, reader = open_transformer(path, "load_flux3", dtype)
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    keys = reader.keys()
    prefix = _bfl_prefix(keys)
    if prefix is not None:
        config, rename = _bfl_source(path, reader, prefix, config)
        source = reader
    elif FLUX3_MARKERS[1] in keys:
        config, source, stored = _diffusers_source(path, reader, config, stored, diffusers_json)
        rename = lambda key: key  # noqa: E731
    else:
        raise CheckpointError(f"{path}: not a FLUX.3 transformer (no key '{FLUX3_MARKERS[0]}' (BFL) or "
                              f"'{FLUX3_MARKERS[1]}' (diffusers))")

    with torch.device("meta"):
        model = Flux3Transformer(config)
    if prefix is not None:  # every key and shape from the header, before any weight is read
        extra = stored_extras(stored)
        check_keys_and_shapes(PrefixedReader(reader, prefix), model.state_dict(), config,
                              lambda key: key.startswith(TRAINING_ONLY) or extra(key))
    return fill_meta_model(model, source, rename, path, dtype, stored=stored, keep_rules=FP8, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_flux3")


# ----------------------------------------------------------------------------------------------
# Saving


def save_flux3_bfl(model_or_sd, path: str, config: Flux3Config | None = None, metadata: dict[str, str] | None = None):
    """Write a BFL single-file checkpoint (atomic), the config (when known) in the metadata as
    `flux3_config` JSON so that non-standard sizes reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config(sd, path, "flux3_config", config, metadata)


def save_flux3_diffusers(model_or_sd, config: Flux3Config | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_flux3_diffusers needs a Flux3Config (or a Flux3Transformer) to write config.json")
    save_diffusers_folder(flux3_to_diffusers_state_dict(sd), diffusers_config(config), folder)
