"""FLUX.1 checkpoints: loading (BFL single file, ComfyUI prefixes, diffusers folders), the
BFL <-> diffusers name map, and saving in both layouts.

The model uses BFL names, so a BFL file loads by plain key (minus a ComfyUI prefix). A diffusers
checkpoint splits BFL's fused projections (`qkv` -> to_q/to_k/to_v, single-block `linear1` ->
to_q/to_k/to_v/proj_mlp) and stores the final adaLN rows as (scale, shift) instead of BFL's
(shift, scale). One table, `flux_diffusers_module_map`, describes all of it in rows, and drives
the state-dict converters, the streaming loader and LoRA conversion alike. The oracle is
diffusers' `convert_flux_transformer_checkpoint_to_diffusers` (loaders/single_file_utils.py).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from library.models.flux1.model import Flux, FluxConfig
from library.models.flux1.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras
from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, check_keys_and_shapes, metadata_config, save_diffusers_folder,
    save_with_config, state_and_config,
)
from library.models.checkpoint_files import block_count, fill_meta_model, open_transformer, without_prefix

BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain BFL

# ----------------------------------------------------------------------------------------------
# The name map

RowMap = dict[str, list[tuple[str, int, int]]]


def flux_diffusers_module_map(
    depth: int, depth_single: int, hidden: int, mlp_hidden: int, out_channels: int = 64, guidance: bool = True
) -> RowMap:
    """Every Linear of FLUX.1: BFL module path -> [(diffusers module path, row_start, row_end)].

    Each entry says BFL output rows [row_start, row_end) live in that diffusers module, stored
    consecutively after the rows of earlier entries naming the same module. So the diffusers
    weight (and bias) of a module is the concatenation of its entries' BFL row slices, in order.
    Example: `final_layer.adaLN_modulation.1` -> [("norm_out.linear", h, 2h), ("norm_out.linear", 0, h)].
    Input columns are never split, so a LoRA down matrix is shared by all parts.
    """
    h, m = hidden, mlp_hidden
    whole = lambda name, rows: [(name, 0, rows)]  # noqa: E731
    emb = "time_text_embed."
    table: RowMap = {
        "img_in": whole("x_embedder", h),
        "txt_in": whole("context_embedder", h),
        "time_in.in_layer": whole(emb + "timestep_embedder.linear_1", h),
        "time_in.out_layer": whole(emb + "timestep_embedder.linear_2", h),
        "vector_in.in_layer": whole(emb + "text_embedder.linear_1", h),
        "vector_in.out_layer": whole(emb + "text_embedder.linear_2", h),
    }
    if guidance:
        table["guidance_in.in_layer"] = whole(emb + "guidance_embedder.linear_1", h)
        table["guidance_in.out_layer"] = whole(emb + "guidance_embedder.linear_2", h)
    for i in range(depth):
        b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for stream, q, k, v, out, mod, ff in (
            ("img", "to_q", "to_k", "to_v", "to_out.0", "norm1", "ff"),
            ("txt", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm1_context", "ff_context"),
        ):
            table[f"{b}{stream}_mod.lin"] = whole(f"{d}{mod}.linear", 6 * h)
            table[f"{b}{stream}_attn.qkv"] = [(f"{d}attn.{q}", 0, h), (f"{d}attn.{k}", h, 2 * h), (f"{d}attn.{v}", 2 * h, 3 * h)]
            table[f"{b}{stream}_attn.proj"] = whole(f"{d}attn.{out}", h)
            table[f"{b}{stream}_mlp.0"] = whole(f"{d}{ff}.net.0.proj", m)
            table[f"{b}{stream}_mlp.2"] = whole(f"{d}{ff}.net.2", h)
    for i in range(depth_single):
        b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        qkv = [(d + "attn.to_q", 0, h), (d + "attn.to_k", h, 2 * h), (d + "attn.to_v", 2 * h, 3 * h)]
        table[b + "linear1"] = qkv + [(d + "proj_mlp", 3 * h, 3 * h + m)]
        table[b + "linear2"] = whole(d + "proj_out", h)
        table[b + "modulation.lin"] = whole(d + "norm.linear", 3 * h)
    table["final_layer.linear"] = whole("proj_out", out_channels)
    # diffusers' AdaLayerNormContinuous splits (scale, shift); BFL's final layer (shift, scale).
    table["final_layer.adaLN_modulation.1"] = [("norm_out.linear", h, 2 * h), ("norm_out.linear", 0, h)]
    return table


FLUX_DIFFUSERS_NAMES: RowMap = flux_diffusers_module_map(19, 38, 3072, 12288)  # the released FLUX.1 size


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
        mlp_key = "transformer_blocks.0.ff.net.0.proj.weight" if depth else "single_transformer_blocks.0.proj_mlp.weight"
        mlp = shapes(mlp_key)[0]
        guidance = any(k.startswith("time_text_embed.guidance_embedder.") for k in keys)
    else:
        depth, single = block_count(keys, "double_blocks."), block_count(keys, "single_blocks.")
        hidden, out = shapes("img_in.weight")[0], shapes("final_layer.linear.weight")[0]
        mlp = shapes("double_blocks.0.img_mlp.0.weight")[0] if depth else shapes("single_blocks.0.linear1.weight")[0] - 3 * hidden
        guidance = any(k.startswith("guidance_in.") for k in keys)
    return flux_diffusers_module_map(depth, single, hidden, mlp, out, guidance), _norm_names(depth, single)


def _split_rows(tensor: torch.Tensor, parts) -> dict[str, torch.Tensor]:
    """BFL tensor -> {diffusers module: its rows} (new tensors, never views of the input)."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for module, start, end in parts:
        pieces.setdefault(module, []).append(tensor[start:end])
    return {module: torch.cat(p) for module, p in pieces.items()}


def _join_rows(tensors: dict[str, torch.Tensor], parts) -> torch.Tensor:
    """{diffusers module: tensor} -> the BFL tensor, rows put back in BFL order."""
    offsets = dict.fromkeys(tensors, 0)
    placed = []
    for module, start, end in parts:
        offset = offsets[module]
        placed.append((start, tensors[module][offset : offset + end - start]))
        offsets[module] = offset + end - start
    return torch.cat([t for _, t in sorted(placed, key=lambda p: p[0])])


def _source_keys(parts, suffix: str) -> list[str]:
    return [f"{module}.{suffix}" for module in dict.fromkeys(module for module, _, _ in parts)]


def flux_to_diffusers_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL-named FLUX state dict -> diffusers FluxTransformer2DModel names (new tensors)."""
    sd = dict(sd)
    rows, norms = row_tables(sd.keys(), lambda k: tuple(_need(sd, k).shape), diffusers=False)
    out = {}
    for module, parts in rows.items():
        for suffix in ("weight", "bias"):
            key = f"{module}.{suffix}"
            if suffix == "bias" and key not in sd:
                continue  # qkv_bias=False checkpoints
            for target, tensor in _split_rows(_need(sd, key), parts).items():
                out[f"{target}.{suffix}"] = tensor
            del sd[key]
    for bfl_key, diffusers_key in norms.items():
        out[diffusers_key] = sd.pop(_check(sd, bfl_key))
    _no_leftovers(sd)
    return out


def diffusers_to_flux_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers FluxTransformer2DModel state dict -> BFL names (fused qkv / linear1, BFL row order)."""
    sd = dict(sd)
    rows, norms = row_tables(sd.keys(), lambda k: tuple(_need(sd, k).shape), diffusers=True)
    out = {}
    for module, parts in rows.items():
        for suffix in ("weight", "bias"):
            sources = _source_keys(parts, suffix)
            if suffix == "bias" and not any(k in sd for k in sources):
                continue
            tensors = {k.rsplit(".", 1)[0]: sd.pop(_check(sd, k)) for k in sources}
            out[f"{module}.{suffix}"] = _join_rows(tensors, parts)
    for bfl_key, diffusers_key in norms.items():
        out[bfl_key] = sd.pop(_check(sd, diffusers_key))
    _no_leftovers(sd)
    return out


def _check(sd, key: str) -> str:
    if key not in sd:
        raise CheckpointError(f"FLUX state dict: missing key '{key}'")
    return key


def _need(sd, key: str) -> torch.Tensor:
    return sd[_check(sd, key)]


def _no_leftovers(sd):
    if sd:
        raise CheckpointError(f"FLUX state dict: unexpected keys {sorted(sd)[:5]} ({len(sd)} in all)")


# ----------------------------------------------------------------------------------------------
# Config


def default_axes_dim(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes as FLUX.1 splits its head: 1/8 for the index axis, the rest halved between rows
    and columns ((16, 56, 56) for head_dim 128). BFL files do not store it."""
    first = head_dim // 8
    rest = (head_dim - first) // 2
    if first % 2 or rest % 2 or first + 2 * rest != head_dim:
        raise CheckpointError(f"cannot derive RoPE axes for head_dim {head_dim}: pass config=FluxConfig(axes_dim=...)")
    return (first, rest, rest)


def config_from_bfl_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> FluxConfig:
    """FluxConfig from BFL key shapes: depths from block counts, widths from img_in / norms."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the FLUX config, key '{key}' is missing")
        return shapes[key]

    hidden, in_channels = shape("img_in.weight")
    depth, depth_single = block_count(shapes, "double_blocks."), block_count(shapes, "single_blocks.")
    block = "double_blocks.0.img_attn." if depth else "single_blocks.0."
    head_dim = shape(block + "norm.query_norm.scale")[0]
    mlp = shape("double_blocks.0.img_mlp.0.weight")[0] if depth else shape("single_blocks.0.linear1.weight")[0] - 3 * hidden
    return FluxConfig(
        in_channels=in_channels,
        vec_in_dim=shape("vector_in.in_layer.weight")[1],
        context_in_dim=shape("txt_in.weight")[1],
        hidden_size=hidden,
        mlp_ratio=mlp / hidden,
        num_heads=hidden // head_dim,
        depth=depth,
        depth_single=depth_single,
        axes_dim=default_axes_dim(head_dim),
        qkv_bias=(block + "qkv.bias" in shapes) if depth else True,
        guidance_embed="guidance_in.in_layer.weight" in shapes,
    )


def config_from_diffusers(cfg: dict, source: str = "config.json") -> FluxConfig:
    """FluxConfig from a diffusers FluxTransformer2DModel config.json (diffusers' defaults fill gaps)."""
    if cfg.get("patch_size", 1) != 1 or cfg.get("out_channels") not in (None, cfg.get("in_channels", 64)):
        raise CheckpointError(f"{source}: patch_size must be 1 and out_channels equal in_channels for FLUX.1")
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    return FluxConfig(
        in_channels=cfg.get("in_channels", 64),
        vec_in_dim=cfg.get("pooled_projection_dim", 768),
        context_in_dim=cfg.get("joint_attention_dim", 4096),
        hidden_size=heads * head_dim,
        num_heads=heads,
        depth=cfg.get("num_layers", 19),
        depth_single=cfg.get("num_single_layers", 38),
        axes_dim=tuple(cfg.get("axes_dims_rope", (16, 56, 56))),
        guidance_embed=bool(cfg.get("guidance_embeds", False)),
    )


def diffusers_config(config: FluxConfig) -> dict:
    """The FluxTransformer2DModel config.json for `config` (what diffusers can express)."""
    if config.mlp_ratio != 4.0 or not config.qkv_bias or config.theta != 10000:
        raise ValueError(f"diffusers FluxTransformer2DModel needs mlp_ratio 4, qkv_bias and theta 10000: {config}")
    return {
        "_class_name": "FluxTransformer2DModel",
        "patch_size": 1,
        "in_channels": config.in_channels,
        "out_channels": None,
        "num_layers": config.depth,
        "num_single_layers": config.depth_single,
        "attention_head_dim": config.head_dim,
        "num_attention_heads": config.num_heads,
        "joint_attention_dim": config.context_in_dim,
        "pooled_projection_dim": config.vec_in_dim,
        "guidance_embeds": config.guidance_embed,
        "axes_dims_rope": list(config.axes_dim),
    }


# ----------------------------------------------------------------------------------------------
# Loading


class _DiffusersAsBFL:
    """A CheckpointReader view of a diffusers checkpoint under BFL keys: `get` reads the parts of
    one module (e.g. to_q, to_k, to_v) and joins them, so peak memory stays one module."""

    def __init__(self, reader: CheckpointReader, rows: RowMap, norms: dict[str, str]):
        self.reader, self.path = reader, reader.path
        self.sources: dict[str, tuple[list[str], list | None]] = {}
        for module, parts in rows.items():
            for suffix in ("weight", "bias"):
                keys = _source_keys(parts, suffix)
                if any(k in reader for k in keys):
                    self.sources[f"{module}.{suffix}"] = (keys, parts)
        for bfl_key, diffusers_key in norms.items():
            if diffusers_key in reader:
                self.sources[bfl_key] = ([diffusers_key], None)

    def keys(self) -> list[str]:
        return list(self.sources)

    def file_of(self, key: str) -> str:
        return self.reader.file_of(self.sources[key][0][0])

    def get(self, key: str) -> torch.Tensor:
        keys, parts = self.sources[key]
        if parts is None:
            return self.reader.get(keys[0])
        return _join_rows({k.rsplit(".", 1)[0]: self.reader.get(k) for k in keys}, parts)


def _check_diffusers_shapes(reader: CheckpointReader, config: FluxConfig):
    """Every diffusers key present, expected, and of the expected shape (named in the error)."""
    with torch.device("meta"):
        expected = flux_to_diffusers_state_dict(Flux(config).state_dict())
    check_keys_and_shapes(reader, expected, config)


def _bfl_prefix(keys: list[str]) -> str | None:
    for prefix in BFL_PREFIXES:
        if any(k.startswith(prefix + "double_blocks.") or k.startswith(prefix + "img_in.") for k in keys):
            return prefix
    return None


def _refuse_other_family(path: str, keys: list[str]):
    """Qwen-Image shares `img_in.` / `transformer_blocks.` with FLUX names, FLUX.2 and Chroma `double_blocks.`;
    say which model it is."""
    config_json = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config_json):
        with open(config_json) as f:
            name = json.load(f).get("_class_name", "FluxTransformer2DModel")
        if name != "FluxTransformer2DModel":
            raise CheckpointError(f"{config_json}: _class_name is {name!r}, expected 'FluxTransformer2DModel' (FLUX.1)")
    qwen = next((k for k in keys if k.split(".")[-2:-1] == ["txt_norm"]), None)
    if qwen is not None:
        raise CheckpointError(f"{path}: key '{qwen}' belongs to a Qwen-Image transformer, not FLUX.1")
    flux2 = next((k for k in keys if "single_stream_modulation." in k or "double_stream_modulation_img." in k), None)
    if flux2 is not None:
        raise CheckpointError(f"{path}: key '{flux2}' belongs to a FLUX.2 transformer, not FLUX.1")
    chroma = next((k for k in keys if k.endswith("distilled_guidance_layer.in_proj.weight")), None)  # its approximator
    if chroma is not None:
        raise CheckpointError(f"{path}: key '{chroma}' belongs to a Chroma transformer, not FLUX.1; set "
                              f"model_type = \"chroma\"")


def load_flux(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: FluxConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Flux], Callable | None] | None = None,
    read_weights: bool = True,
) -> Flux:
    """Load a FLUX.1 transformer from a BFL single file (optionally with a ComfyUI
    `model.diffusion_model.` / `diffusion_model.` prefix) or a diffusers folder (the pipeline
    folder with `transformer/`, or the transformer folder itself; sharded or not).

    dtype: floating weights are cast to it on read; also the model's compute_dtype.
    config: overrides what is read from config.json / the safetensors metadata / key shapes.
    convert: per-tensor hook (BFL key, tensor) -> {key: tensor} for load_streaming (e.g. fp8).
    prepare: called on the meta-device model before loading (e.g. to swap Linears for FP8Linear);
        a callable it returns becomes the convert hook, for hooks that need the prepared model:
        `prepare=fp8_prepare("fp8_scaled", "flux")` (library/models/family.py).
    The model is built on `meta` and filled one tensor (diffusers: one module) at a time.
    """
    # a pre-quantized file (fp8, GGUF) is used as it is
    path, reader = open_transformer(path, "load_flux", dtype, fp8_via="convert=")
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    keys = reader.keys()
    _refuse_other_family(path, keys)
    prefix = _bfl_prefix(keys)
    diffusers_named = any(k.startswith(("transformer_blocks.", "single_transformer_blocks.")) for k in keys)
    if stored and prefix is None and diffusers_named:
        raise CheckpointError(f"{path}: a pre-quantized ({stored.layout}) FLUX checkpoint must use BFL key names "
                              f"(diffusers folders fuse and split rows, which stored scales do not survive); merge "
                              f"into the BFL file instead")

    if prefix is not None:
        if config is None and "flux_config" in reader.metadata:
            config = metadata_config(reader, "flux_config", flux_config_from_json)
        if config is None:
            shapes = {k[len(prefix) :]: reader.shape(k) for k in keys if k.startswith(prefix)}
            config = config_from_bfl_shapes(shapes, source=path)
        source, rename = reader, without_prefix(prefix)
    elif diffusers_named:  # (x_embedder. alone is Z-Image's too)
        config_json = os.path.join(path, "config.json") if os.path.isdir(path) else None
        if config is None and config_json and os.path.exists(config_json):
            with open(config_json) as f:
                config = config_from_diffusers(json.load(f), source=config_json)
        if config is None:
            meta = {k: torch.empty(reader.shape(k), device="meta") for k in keys}
            config = config_from_bfl_shapes({k: tuple(v.shape) for k, v in diffusers_to_flux_state_dict(meta).items()}, path)
        _check_diffusers_shapes(reader, config)
        source = _DiffusersAsBFL(reader, *row_tables(keys, reader.shape, diffusers=True))
        rename = lambda key: key  # noqa: E731
    else:
        raise CheckpointError(f"{path}: not a FLUX.1 transformer (no double_blocks./img_in. or transformer_blocks. keys)")

    with torch.device("meta"):
        model = Flux(config)
    if prefix is not None:  # every key and shape from the header, before caching (the load named them after it)
        check_keys_and_shapes(PrefixedReader(reader, prefix), model.state_dict(), config, stored_extras(stored))
    # a stored layout comes only with BFL names (refused above in diffusers'), so `source` is the reader then
    return fill_meta_model(model, source, rename, path, dtype, stored=stored, keep_rules=FP8, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_flux")


# ----------------------------------------------------------------------------------------------
# Saving


def flux_config_from_json(text: str) -> FluxConfig:
    fields = json.loads(text)
    fields["axes_dim"] = tuple(fields["axes_dim"])
    return FluxConfig(**fields)


def save_flux_bfl(model_or_sd, path: str, config: FluxConfig | None = None, metadata: dict[str, str] | None = None):
    """Write a BFL single-file checkpoint (atomic), the config (when known) in the metadata as
    `flux_config` JSON so that non-standard sizes reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config(sd, path, "flux_config", config, metadata)


def save_flux_diffusers(model_or_sd, config: FluxConfig | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_flux_diffusers needs a FluxConfig (or a Flux model) to write config.json")
    save_diffusers_folder(flux_to_diffusers_state_dict(sd), diffusers_config(config), folder)
