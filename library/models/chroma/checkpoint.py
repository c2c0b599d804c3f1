"""Chroma checkpoints: the BFL-style single file (chroma-unlocked-v*.safetensors, Chroma1-HD.safetensors,
optionally under a ComfyUI prefix) and diffusers folders (transformer/ config.json + shards), both
read tensor by tensor into a model built on `meta`; the diffusers name map; writers of both layouts.

Chroma's blocks are FLUX.1's minus the modulation Linears, so its name map is FLUX.1's
(library/models/flux1/checkpoint.py: fused qkv / linear1 split into to_q/to_k/to_v/proj_mlp) with
the pruned rows dropped and the approximator's added: `distilled_guidance_layer.layers.N.in_layer`
/ `out_layer` -> `linear_1` / `linear_2`, `norms.N.scale` -> `norms.N.weight`. The oracle is
diffusers' `convert_chroma_transformer_checkpoint_to_diffusers` (loaders/single_file_utils.py).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from library.io import (
    CheckpointError, PrefixedReader, check_keys_and_shapes, metadata_config, save_diffusers_folder, save_with_config,
    state_and_config,
)
from library.models.checkpoint_files import block_count, fill_meta_model, open_transformer, without_prefix
from library.models.chroma.model import Chroma, ChromaConfig
from library.models.flux1.checkpoint import (  # FLUX.1's name map and row-joining view, unchanged
    BFL_PREFIXES,
    RowMap,
    _DiffusersAsBFL,
    _join_rows,
    _norm_names,
    _source_keys,
    _split_rows,
    default_axes_dim,
    flux_diffusers_module_map,
)
from library.models.chroma.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras

DIFFUSERS_CLASS = "ChromaTransformer2DModel"
APPROXIMATOR = "distilled_guidance_layer."
MARKER = APPROXIMATOR + "in_proj.weight"  # the key that tells a Chroma file from a FLUX.1 one

# FLUX.1 rows that Chroma pruned (its modulation Linears and the embedders the approximator replaced).
_PRUNED = ("_mod.lin", "modulation.lin", "time_in.", "vector_in.", "final_layer.adaLN_modulation")

# ----------------------------------------------------------------------------------------------
# The name map


def chroma_diffusers_module_map(config: ChromaConfig) -> RowMap:
    """Every Linear of Chroma: BFL module path -> [(diffusers module path, row_start, row_end)]
    (the format of flux1's `flux_diffusers_module_map`, which it starts from)."""
    flux = flux_diffusers_module_map(
        config.depth, config.depth_single, config.hidden_size, config.mlp_hidden, config.in_channels, guidance=False
    )
    table = {name: parts for name, parts in flux.items() if not any(p in name for p in _PRUNED)}
    a, g = config.approximator_hidden, APPROXIMATOR
    table[g + "in_proj"] = [(g + "in_proj", 0, a)]
    for i in range(config.approximator_layers):
        table[f"{g}layers.{i}.in_layer"] = [(f"{g}layers.{i}.linear_1", 0, a)]
        table[f"{g}layers.{i}.out_layer"] = [(f"{g}layers.{i}.linear_2", 0, a)]
    table[g + "out_proj"] = [(g + "out_proj", 0, config.hidden_size)]
    return table


def chroma_norm_names(config: ChromaConfig) -> dict[str, str]:
    """Norm weights (not Linears): BFL key -> diffusers key, one to one."""
    names = _norm_names(config.depth, config.depth_single)
    for i in range(config.approximator_layers):
        names[f"{APPROXIMATOR}norms.{i}.scale"] = f"{APPROXIMATOR}norms.{i}.weight"
    return names


CHROMA_DIFFUSERS_NAMES: RowMap = chroma_diffusers_module_map(ChromaConfig())  # the released size


def chroma_to_diffusers_state_dict(sd: dict[str, torch.Tensor], config: ChromaConfig) -> dict[str, torch.Tensor]:
    """BFL-named Chroma state dict -> diffusers ChromaTransformer2DModel names (new tensors)."""
    sd, out = dict(sd), {}
    for module, parts in chroma_diffusers_module_map(config).items():
        for suffix in ("weight", "bias"):
            for target, tensor in _split_rows(sd.pop(_need(sd, f"{module}.{suffix}")), parts).items():
                out[f"{target}.{suffix}"] = tensor
    for bfl_key, diffusers_key in chroma_norm_names(config).items():
        out[diffusers_key] = sd.pop(_need(sd, bfl_key))
    if sd:
        raise CheckpointError(f"Chroma state dict: unexpected keys {sorted(sd)[:5]} ({len(sd)} in all)")
    return out


def diffusers_to_chroma_state_dict(sd: dict[str, torch.Tensor], config: ChromaConfig) -> dict[str, torch.Tensor]:
    """diffusers ChromaTransformer2DModel state dict -> BFL names (fused qkv / linear1)."""
    sd, out = dict(sd), {}
    for module, parts in chroma_diffusers_module_map(config).items():
        for suffix in ("weight", "bias"):
            tensors = {k.rsplit(".", 1)[0]: sd.pop(_need(sd, k)) for k in _source_keys(parts, suffix)}
            out[f"{module}.{suffix}"] = _join_rows(tensors, parts)
    for bfl_key, diffusers_key in chroma_norm_names(config).items():
        out[bfl_key] = sd.pop(_need(sd, diffusers_key))
    if sd:
        raise CheckpointError(f"Chroma state dict: unexpected keys {sorted(sd)[:5]} ({len(sd)} in all)")
    return out


def _need(sd, key: str) -> str:
    if key not in sd:
        raise CheckpointError(f"Chroma state dict: missing key '{key}'")
    return key


# ----------------------------------------------------------------------------------------------
# Config


def config_from_bfl_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> ChromaConfig:
    """ChromaConfig from BFL key shapes: depths from block counts, widths from img_in / norms / approximator."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the Chroma config, key '{key}' is missing")
        return shapes[key]

    hidden, in_channels = shape("img_in.weight")
    depth, depth_single = block_count(shapes, "double_blocks."), block_count(shapes, "single_blocks.")
    block = "double_blocks.0.img_attn." if depth else "single_blocks.0."
    head_dim = shape(block + "norm.query_norm.scale")[0]
    mlp = shape("double_blocks.0.img_mlp.0.weight")[0] if depth else shape("single_blocks.0.linear1.weight")[0] - 3 * hidden
    approximator_hidden, approximator_in = shape(MARKER)
    return ChromaConfig(
        in_channels=in_channels,
        context_in_dim=shape("txt_in.weight")[1],
        hidden_size=hidden,
        mlp_ratio=mlp / hidden,
        num_heads=hidden // head_dim,
        depth=depth,
        depth_single=depth_single,
        axes_dim=default_axes_dim(head_dim),
        approximator_in_dim=approximator_in,
        approximator_hidden=approximator_hidden,
        approximator_layers=block_count(shapes, APPROXIMATOR + "layers."),
    )


def config_from_diffusers_shapes(keys: list[str], shape: Callable[[str], tuple], source: str = "checkpoint") -> ChromaConfig:
    """ChromaConfig from a diffusers-named state dict's shapes alone (tools/merge_lora.py reads a folder
    by its header): every width the name map needs; heads as the released head_dim 128 where it divides."""
    def need(key):
        if key not in keys:
            raise CheckpointError(f"{source}: cannot infer the Chroma config, key '{key}' is missing")
        return shape(key)

    hidden, in_channels = need("x_embedder.weight")
    depth, single = block_count(keys, "transformer_blocks."), block_count(keys, "single_transformer_blocks.")
    mlp = need("transformer_blocks.0.ff.net.0.proj.weight")[0] if depth else need("single_transformer_blocks.0.proj_mlp.weight")[0]
    head_dim = 128 if hidden % 128 == 0 else hidden
    approximator_hidden, approximator_in = need(MARKER)
    return ChromaConfig(
        in_channels=in_channels, context_in_dim=need("context_embedder.weight")[1], hidden_size=hidden,
        mlp_ratio=mlp / hidden, num_heads=hidden // head_dim, depth=depth, depth_single=single, axes_dim=(head_dim,),
        approximator_in_dim=approximator_in, approximator_hidden=approximator_hidden,
        approximator_layers=block_count(keys, APPROXIMATOR + "layers."),
    )  # fmt: skip


def config_from_diffusers(cfg: dict, source: str = "config.json") -> ChromaConfig:
    """ChromaConfig from a diffusers ChromaTransformer2DModel config.json (diffusers' defaults fill gaps)."""
    if cfg.get("patch_size", 1) != 1 or cfg.get("out_channels") not in (None, cfg.get("in_channels", 64)):
        raise CheckpointError(f"{source}: patch_size must be 1 and out_channels equal in_channels for Chroma")
    heads, head_dim = cfg.get("num_attention_heads", 24), cfg.get("attention_head_dim", 128)
    return ChromaConfig(
        in_channels=cfg.get("in_channels", 64),
        context_in_dim=cfg.get("joint_attention_dim", 4096),
        hidden_size=heads * head_dim,
        num_heads=heads,
        depth=cfg.get("num_layers", 19),
        depth_single=cfg.get("num_single_layers", 38),
        axes_dim=tuple(cfg.get("axes_dims_rope", (16, 56, 56))),
        approximator_in_dim=cfg.get("approximator_num_channels", 64),
        approximator_hidden=cfg.get("approximator_hidden_dim", 5120),
        approximator_layers=cfg.get("approximator_layers", 5),
    )


def diffusers_config(config: ChromaConfig) -> dict:
    """The ChromaTransformer2DModel config.json for `config` (what diffusers can express)."""
    if config.mlp_ratio != 4.0 or config.theta != 10000:
        raise ValueError(f"diffusers ChromaTransformer2DModel needs mlp_ratio 4 and theta 10000: {config}")
    return {
        "_class_name": DIFFUSERS_CLASS,
        "patch_size": 1,
        "in_channels": config.in_channels,
        "out_channels": None,
        "num_layers": config.depth,
        "num_single_layers": config.depth_single,
        "attention_head_dim": config.head_dim,
        "num_attention_heads": config.num_heads,
        "joint_attention_dim": config.context_in_dim,
        "axes_dims_rope": list(config.axes_dim),
        "approximator_num_channels": config.approximator_in_dim,
        "approximator_hidden_dim": config.approximator_hidden,
        "approximator_layers": config.approximator_layers,
    }


def chroma_config_from_json(text: str) -> ChromaConfig:
    fields = json.loads(text)
    fields["axes_dim"] = tuple(fields["axes_dim"])
    return ChromaConfig(**fields)


# ----------------------------------------------------------------------------------------------
# Loading


def _bfl_prefix(keys: list[str]) -> str | None:
    for prefix in BFL_PREFIXES:
        if any(k.startswith(prefix + "double_blocks.") or k.startswith(prefix + "img_in.") for k in keys):
            return prefix
    return None


def _refuse_other_models(path: str, keys: list[str], prefix: str | None) -> None:
    """One error naming the file and the key that shows it is no Chroma transformer: a FLUX.1 file
    has per-block modulation Linears and no approximator; a diffusers folder names its class."""
    config_json = os.path.join(path, "config.json")
    if os.path.isdir(path) and os.path.isfile(config_json):
        with open(config_json) as f:
            name = json.load(f).get("_class_name", DIFFUSERS_CLASS)
        if name != DIFFUSERS_CLASS:
            raise CheckpointError(f"{config_json}: _class_name is {name!r}, expected {DIFFUSERS_CLASS!r} (Chroma)")
    if prefix is None:  # diffusers names: FLUX.1's adaLN Linears and time/text embedders
        prefix, pruned = "", ("norm1.linear.", "norm1_context.linear.", "norm.linear.", "time_text_embed.")
    else:
        pruned = _PRUNED
    found = next((k for k in keys if k.startswith(prefix) and any(p in k for p in pruned)), None)
    if found is not None:
        raise CheckpointError(f"{path}: key '{found}' is a FLUX.1-style modulation/embedder weight that Chroma "
                              f"pruned: not a Chroma transformer (Chroma has '{MARKER}', its approximator)")
    if prefix + MARKER not in keys:
        raise CheckpointError(f"{path}: not a Chroma transformer: key '{prefix + MARKER}' (its approximator) is missing")


def load_chroma(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: ChromaConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Chroma], Callable | None] | None = None,
    read_weights: bool = True,
) -> Chroma:
    """Load a Chroma transformer from its BFL-style single file (optionally with a ComfyUI
    `model.diffusion_model.` / `diffusion_model.` prefix) or a diffusers folder (the pipeline
    folder with `transformer/`, or the transformer folder itself; sharded or not).

    dtype: floating weights are cast to it on read; also the model's compute_dtype.
    config: overrides what is read from config.json / the safetensors metadata / key shapes.
    convert: per-tensor hook (BFL key, tensor) -> {key: tensor} for load_streaming (e.g. fp8).
    prepare: called on the meta-device model before loading (e.g. to swap Linears for FP8Linear);
        a callable it returns becomes the convert hook, as in flux1's load_flux.
    read_weights: False builds the model on `meta` from the header alone (the memory planner).
    A pre-quantized single file (ComfyUI's scaled fp8 / comfy_quant, musubi-tuner's or our fp8, a
    ComfyUI-GGUF file) is used as it is stored (precision/stored_layouts.py), whatever `prepare` asks.
    The model is built on `meta` and filled one tensor (diffusers: one module) at a time.
    """
    path, reader = open_transformer(path, "load_chroma", dtype, fp8_via="convert=")
    keys = reader.keys()
    prefix = _bfl_prefix(keys)
    _refuse_other_models(path, keys, prefix)
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    if stored and prefix is None and any(k.startswith("single_transformer_blocks.") for k in keys):  # diffusers names
        raise CheckpointError(f"{path}: a pre-quantized ({stored.layout}) Chroma checkpoint must use BFL key names "
                              f"(diffusers folders split the fused qkv / linear1 rows, which stored scales do not "
                              f"survive); use the single file")

    if prefix is not None:
        if config is None and "chroma_config" in reader.metadata:
            config = metadata_config(reader, "chroma_config", chroma_config_from_json)
        if config is None:
            config = config_from_bfl_shapes({k[len(prefix) :]: reader.shape(k) for k in keys if k.startswith(prefix)}, path)
        with torch.device("meta"):
            expected = Chroma(config).state_dict()
        check_keys_and_shapes(PrefixedReader(reader, prefix), expected, config, stored_extras(stored))
        source, rename = reader, without_prefix(prefix)
    else:
        config_json = os.path.join(path, "config.json") if os.path.isdir(path) else None
        if config is None and config_json and os.path.exists(config_json):
            with open(config_json) as f:
                config = config_from_diffusers(json.load(f), source=config_json)
        if config is None:
            raise CheckpointError(f"{path}: a diffusers Chroma checkpoint needs its config.json (or pass config=)")
        with torch.device("meta"):
            check_keys_and_shapes(reader, chroma_to_diffusers_state_dict(Chroma(config).state_dict(), config), config)
        source = _DiffusersAsBFL(reader, chroma_diffusers_module_map(config), chroma_norm_names(config))
        rename = lambda key: key  # noqa: E731

    with torch.device("meta"):
        model = Chroma(config)
    # a stored layout's scales are read under BFL names (a diffusers folder's are refused above, or fail its key
    # check): `source` is the reader then
    return fill_meta_model(model, source, rename, path, dtype, stored=stored, keep_rules=FP8, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_chroma")


# ----------------------------------------------------------------------------------------------
# Saving


def save_chroma_bfl(model_or_sd, path: str, config: ChromaConfig | None = None, metadata: dict[str, str] | None = None):
    """Write a BFL-style single file (atomic), the config (when known) in the metadata as
    `chroma_config` JSON so that non-standard sizes reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config(sd, path, "chroma_config", config, metadata)


def save_chroma_diffusers(model_or_sd, config: ChromaConfig | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_chroma_diffusers needs a ChromaConfig (or a Chroma model) to write config.json")
    save_diffusers_folder(chroma_to_diffusers_state_dict(sd, config), diffusers_config(config), folder)
