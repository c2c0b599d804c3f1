"""ERNIE-Image checkpoints: loading (the single file, plain or under ComfyUI's prefixes, and diffusers folders),
the config from config.json / our metadata / the shapes, and saving in both layouts.

The released single file already uses diffusers' names: diffusers' convert_ernie_image_transformer_checkpoint_
to_diffusers (loaders/single_file_utils.py), the oracle, only drops a `model.diffusion_model.` prefix. Our module
names are those (model.py), so every layout loads by plain key, the prefix (if any) dropped; there is no name map.
diffusers has no single-file detection key for ERNIE-Image; we tell its files by MARKER (`adaLN_sa_ln` is no
other family's name).

Pre-quantized files (ComfyUI's scaled fp8 and comfy_quant, plain fp8, musubi-tuner's and our layouts, GGUF:
precision/stored_layouts.py) load as they are stored, under any of the prefixes; nothing is fused, so each
stored scale stays its Linear's. Which Linears stay in high precision is the family's fp8 rule
(library/models/ernie_image/spec.py `FP8`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import torch

from library.io import (
    CheckpointError, PrefixedReader, check_keys_and_shapes, save_diffusers_folder, save_with_config, state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, marked_prefix, open_transformer, stated_config, without_prefix,
)
from library.models.ernie_image.model import ErnieImage, ErnieImageConfig
from library.models.ernie_image.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras

CLASS_NAME = "ErnieImageTransformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain (and diffusers)
COMFY_PREFIX = PREFIXES[0]
MARKER = "layers.0.adaLN_sa_ln.weight"  # the first block's pre-attention norm: ERNIE-Image's own name
CONFIG_KEY = "ernie_image_config"  # safetensors metadata of single files we write: the config as JSON
# config.json keys diffusers' class does not take and ignores (ERNIE-Image-Turbo's: "use_lora": false)
IGNORED_CONFIG_KEYS = ("lora_rank", "use_lora")
# diffusers' constructor defaults: what a config.json that omits a key means (ours are the released sizes)
DIFFUSERS_DEFAULTS = dict(hidden_size=3072, num_attention_heads=24, num_layers=24, ffn_hidden_size=8192,
                          in_channels=128, out_channels=128, patch_size=1, text_in_dim=2560, rope_theta=256,
                          rope_axes_dim=(32, 48, 48), eps=1e-6)

# ----------------------------------------------------------------------------------------------
# Config


def default_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """The RoPE split of the released head (32, 48, 48 of 128: a quarter for the text index, 3/8 for each
    grid axis), scaled to `head_dim`; files do not store it."""
    if head_dim % 16:
        raise CheckpointError(f"cannot derive ERNIE-Image RoPE axes for head_dim {head_dim}: pass "
                              f"config=ErnieImageConfig(rope_axes_dim=...)")
    return head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> ErnieImageConfig:
    """ErnieImageConfig from tensor shapes (without any prefix): widths from the embedders and the first block,
    the depth from the block count. RoPE axes / theta and eps are the released model's (files do not store them)."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the ERNIE-Image config, key '{key}' is missing")
        return shapes[key]

    hidden, in_channels, patch, _ = shape("x_embedder.proj.weight")
    head_dim = shape("layers.0.self_attention.norm_q.weight")[0]
    return ErnieImageConfig(
        hidden_size=hidden,
        num_attention_heads=hidden // head_dim,
        num_layers=block_count(shapes, "layers."),
        ffn_hidden_size=shape("layers.0.mlp.gate_proj.weight")[0],
        in_channels=in_channels,
        out_channels=shape("final_linear.weight")[0] // (patch * patch),
        patch_size=patch,
        text_in_dim=shape("text_proj.weight")[1] if "text_proj.weight" in shapes else hidden,
        rope_axes_dim=default_rope_axes(head_dim),
    )


def config_from_diffusers(cfg: dict, source: str = "config.json") -> ErnieImageConfig:
    """ErnieImageConfig from an ErnieImageTransformer2DModel config.json; a key it omits is diffusers' default
    (DIFFUSERS_DEFAULTS), as diffusers would build it. Unknown keys are refused, Turbo's ignored ones aside."""
    if not cfg.get("qk_layernorm", True):
        raise CheckpointError(f"{source}: qk_layernorm false is not supported (diffusers' class cannot build it)")
    names = {f.name for f in dataclasses.fields(ErnieImageConfig)}
    unknown = sorted(k for k in cfg if k not in names and not k.startswith("_")
                     and k not in ("qk_layernorm", *IGNORED_CONFIG_KEYS))
    if unknown:
        raise CheckpointError(f"{source}: unknown ErnieImageTransformer2DModel config keys {unknown}")
    kwargs = {**DIFFUSERS_DEFAULTS, **{k: v for k, v in cfg.items() if k in names}}
    kwargs["rope_axes_dim"], kwargs["rope_theta"] = tuple(kwargs["rope_axes_dim"]), float(kwargs["rope_theta"])
    try:
        return ErnieImageConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def diffusers_config(config: ErnieImageConfig) -> dict:
    """The ErnieImageTransformer2DModel config.json for `config`."""
    if config.rope_theta != int(config.rope_theta):
        raise ValueError(f"diffusers' ErnieImageTransformer2DModel takes rope_theta as an int: {config}")
    fields = dataclasses.asdict(config)
    fields.update(rope_theta=int(config.rope_theta), rope_axes_dim=list(config.rope_axes_dim))
    return {"_class_name": CLASS_NAME, **fields, "qk_layernorm": True}


def config_from_json(text: str) -> ErnieImageConfig:
    """The config save_ernie_image_single_file writes in the metadata."""
    fields = json.loads(text)
    fields["rope_axes_dim"] = tuple(fields["rope_axes_dim"])
    return ErnieImageConfig(**fields)


# ----------------------------------------------------------------------------------------------
# Loading


def load_ernie_image(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: ErnieImageConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[ErnieImage], Callable | None] | None = None,
    read_weights: bool = True,
) -> ErnieImage:
    """Load an ERNIE-Image transformer from the single file (plain, or under ComfyUI's `model.diffusion_model.` /
    `diffusion_model.`; a file's other prefixes, e.g. a bundled VAE, are not read) or a diffusers folder (the
    pipeline folder with `transformer/`, or the transformer folder; sharded or not).

    dtype casts floating weights on read and becomes compute_dtype. config overrides config.json, the
    `ernie_image_config` metadata and the key shapes. convert / prepare: the per-tensor and meta-model hooks (fp8
    while loading). read_weights=False: the meta model as it would load, from the headers alone (the memory
    planner). Every key and shape is checked before any weight is read. A pre-quantized file is used as it is
    stored, whatever `prepare` asks (its fp8 layers keep the spec's FP8 Linears in high precision)."""
    path, reader = open_transformer(path, "load_ernie_image", dtype)
    prefix = marked_prefix(path, reader.keys(), PREFIXES, MARKER, "an ERNIE-Image transformer")
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    view = PrefixedReader(reader, prefix)
    if config is None:
        config = stated_config(path, reader, diffusers_json, config_from_diffusers, CONFIG_KEY, config_from_json,
                               lambda: config_from_shapes({k: view.shape(k) for k in view.keys()}, path))
    with torch.device("meta"):
        model = ErnieImage(config)
    check_keys_and_shapes(view, model.state_dict(), config, stored_extras(stored))
    return fill_meta_model(model, reader, without_prefix(prefix), path, dtype, stored=stored, keep_rules=FP8,
                           prepare=prepare, convert=convert, read_weights=read_weights, loader="load_ernie_image")


# ----------------------------------------------------------------------------------------------
# Saving


def save_ernie_image_single_file(model_or_sd, path: str, config: ErnieImageConfig | None = None, prefix: str = "",
                                 metadata: dict[str, str] | None = None):
    """Write the single file (atomic) under `prefix` ("" as released, COMFY_PREFIX as ComfyUI's full files), the
    config (when known) in the metadata as `ernie_image_config` JSON so that non-standard sizes reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config({prefix + k: v for k, v in sd.items()}, path, CONFIG_KEY, config, metadata)


def save_ernie_image_diffusers(model_or_sd, config: ErnieImageConfig | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_ernie_image_diffusers needs an ErnieImageConfig (or the model) to write config.json")
    save_diffusers_folder(sd, diffusers_config(config), folder)
