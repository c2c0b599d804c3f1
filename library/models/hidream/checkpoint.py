"""HiDream-I1 checkpoints: loading the single files people download (ComfyUI's split_files/diffusion_models/
hidream_i1_{full,dev,fast}_{fp16,fp8}.safetensors, city96's GGUF), a diffusers folder (HiDream-ai/HiDream-I1-*'s
transformer/ with config.json, sharded), pre-quantized files as stored; the config from config.json, our metadata or
the shapes; saving both layouts.

Every layout names the modules as ours do (model.py): diffusers' HiDreamImageTransformer2DModel and ComfyUI's
HiDreamImageTransformer2DModel share one set of names, so there is no name map, only a prefix. Single files are bare
(diffusers' from_single_file tells a HiDream file by the bare key `double_stream_blocks.0.block.adaLN_modulation.1.
bias`, single_file_utils CHECKPOINT_KEY_NAMES["hidream"], and its convert_hidream_transformer_to_diffusers only strips
"model.diffusion_model."), or under ComfyUI's "model.diffusion_model." (its own full-checkpoint saves) or
"diffusion_model." (the LoRA-style prefix); all three load. ComfyUI's model_detection tells one by
`caption_projection.0.linear.weight`; MARKER is diffusers' key (a bias: never quantized in an fp8 file).

What the shapes do not say (a single file without our metadata): the head width (128: ComfyUI's model_detection
fixes attention_head_dim 128 and so does every release, so heads = width / 128), the RoPE axes (the released
(64, 32, 32) of the head), the experts picked per token (2), max_resolution ((128, 128)) and llama_layers: the
released rule, block i reads Llama layer min(i, 31) (released_llama_layers), which the forward clips to the last
layer a smaller text encoder gives (HiDream.llama_layer_indices). A config.json or our metadata gives them exactly.
"""

from __future__ import annotations

import json
import re
from typing import Callable

import torch

from library.io import (
    CheckpointError, PrefixedReader, check_keys_and_shapes, save_diffusers_folder, save_with_config, state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, marked_prefix, open_transformer, spec_fp8_rules,
    stated_config, without_prefix,
)
from library.models.hidream.model import HIDREAM_I1, PATCH, HiDream, HiDreamConfig, released_llama_layers
from library.precision.fp8 import KeepRules
from library.precision.fp8_checkpoints import Fp8Checkpoint
from library.precision.stored_layouts import read_stored_layout, stored_extras

CLASS_NAME = "HiDreamImageTransformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full checkpoint / LoRA-style, bare (released)
MARKER = "double_stream_blocks.0.block.adaLN_modulation.1.bias"  # diffusers' single-file detection key
CONFIG_KEY = "hidream_config"  # safetensors metadata of files we write: the config as JSON
PATCH_KEY = "x_embedder.proj.weight"
EXPERTS = re.compile(r"(?:double|single)_stream_blocks\.0\.block\.ff_i\.experts\.(\d+)\.")
# diffusers' constructor arguments that are no part of the model: force_inference_output picks its MoE code path
# (ours has one); save writes the released value.
IGNORED_CONFIG_KEYS = ("force_inference_output",)

# ----------------------------------------------------------------------------------------------
# Config


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> HiDreamConfig:
    """HiDreamConfig from tensor shapes (without any prefix): the width and latent channels from x_embedder, heads of
    128, the block counts, the routed experts of the first block, the T5 / Llama / pooled widths from their
    projections; the rest as released (module docstring)."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the HiDream config, key '{key}' is missing")
        return shapes[key]

    width, features = shape(PATCH_KEY)
    head = HIDREAM_I1.attention_head_dim
    if width % head:
        raise CheckpointError(f"{source}: '{PATCH_KEY}' gives width {width}, no multiple of the released head width "
                              f"{head}: such a file needs its config (our metadata or a diffusers config.json)")
    double, single = block_count(shapes, "double_stream_blocks."), block_count(shapes, "single_stream_blocks.")
    experts = len({m.group(1) for k in shapes if (m := EXPERTS.match(k))})
    caption = block_count(shapes, "caption_projection.")
    try:
        return HiDreamConfig(
            num_layers=double, num_single_layers=single, attention_head_dim=head, num_attention_heads=width // head,
            in_channels=features // (PATCH * PATCH),
            out_channels=shape("final_layer.linear.weight")[0] // (PATCH * PATCH),
            t5_dim=shape(f"caption_projection.{caption - 1}.linear.weight")[1],
            llama_dim=shape("caption_projection.0.linear.weight")[1],
            text_emb_dim=shape("p_embedder.pooled_embedder.linear_1.weight")[1], num_routed_experts=experts,
            num_activated_experts=min(HIDREAM_I1.num_activated_experts, experts),
            llama_layers=released_llama_layers(double + single))
    except ValueError as e:
        raise CheckpointError(f"{source}: the shapes give no HiDream config: {e}") from None


# diffusers' constructor defaults where the released config.json states every key; a key it omits means these
DIFFUSERS_DEFAULTS = dict(patch_size=None, in_channels=64, out_channels=None, num_layers=16, num_single_layers=32,
                          attention_head_dim=128, num_attention_heads=20, caption_channels=None, text_emb_dim=2048,
                          num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(32, 32),
                          max_resolution=(128, 128), llama_layers=None)


def config_from_diffusers(cfg: dict, source: str = "config.json") -> HiDreamConfig:
    """HiDreamConfig from a HiDreamImageTransformer2DModel config.json; unknown keys are refused, a key it omits is
    diffusers' default (which for patch_size, caption_channels and llama_layers builds no working model: refused)."""
    unknown = sorted(k for k in cfg if k not in DIFFUSERS_DEFAULTS and not k.startswith("_")
                     and k not in IGNORED_CONFIG_KEYS)
    if unknown:
        raise CheckpointError(f"{source}: unknown {CLASS_NAME} config keys {unknown}")
    c = {**DIFFUSERS_DEFAULTS, **cfg}
    if c["patch_size"] != PATCH:
        raise CheckpointError(f"{source}: patch_size {c['patch_size']}: only HiDream's 2 is supported")
    if not c["caption_channels"] or len(c["caption_channels"]) != 2 or c["llama_layers"] is None:
        raise CheckpointError(f"{source}: caption_channels {c['caption_channels']} / llama_layers "
                              f"{c['llama_layers']}: expected [t5 width, llama width] and one Llama layer per block")
    try:
        return HiDreamConfig(
            num_layers=c["num_layers"], num_single_layers=c["num_single_layers"],
            attention_head_dim=c["attention_head_dim"], num_attention_heads=c["num_attention_heads"],
            in_channels=c["in_channels"], out_channels=c["out_channels"] or c["in_channels"],
            axes_dims_rope=tuple(c["axes_dims_rope"]), t5_dim=c["caption_channels"][0],
            llama_dim=c["caption_channels"][1], text_emb_dim=c["text_emb_dim"],
            num_routed_experts=c["num_routed_experts"], num_activated_experts=c["num_activated_experts"],
            llama_layers=tuple(c["llama_layers"]), max_resolution=tuple(c["max_resolution"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def diffusers_config(config: HiDreamConfig) -> dict:
    """The HiDreamImageTransformer2DModel config.json of `config` (force_inference_output as released: false)."""
    if config.rope_theta != HIDREAM_I1.rope_theta:
        raise ValueError(f"diffusers' {CLASS_NAME} fixes RoPE theta at 10000: {config}")
    return {"_class_name": CLASS_NAME, "patch_size": PATCH, "in_channels": config.in_channels,
            "out_channels": config.out_channels, "num_layers": config.num_layers,
            "num_single_layers": config.num_single_layers, "attention_head_dim": config.attention_head_dim,
            "num_attention_heads": config.num_attention_heads, "caption_channels": [config.t5_dim, config.llama_dim],
            "text_emb_dim": config.text_emb_dim, "num_routed_experts": config.num_routed_experts,
            "num_activated_experts": config.num_activated_experts, "axes_dims_rope": list(config.axes_dims_rope),
            "max_resolution": list(config.max_resolution), "llama_layers": list(config.llama_layers),
            "force_inference_output": False}


def config_from_json(text: str) -> HiDreamConfig:
    """The config save_hidream_single_file writes in the metadata (JSON lists back to tuples)."""
    fields = json.loads(text)
    return HiDreamConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


# ----------------------------------------------------------------------------------------------
# Loading


def load_hidream(
    path: str,
    dtype: torch.dtype = torch.float32,
    prepare: Callable[[HiDream], Callable | None] | None = None,
    read_weights: bool = True,
    config: HiDreamConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    fp8_rules: KeepRules | None = None,
) -> HiDream:
    """Load the HiDream-I1 transformer from a single file (bare as released, or under "model.diffusion_model." /
    "diffusion_model."; a file's other prefixes, e.g. a bundled VAE, are not read) or a diffusers folder (the
    pipeline folder with transformer/, or that folder; sharded or not).

    dtype casts floating weights on read and becomes compute_dtype. prepare / convert: the meta-model and per-tensor
    hooks (fp8 while loading). read_weights=False: the meta model as it would load, from the headers alone (the
    memory planner). config overrides config.json, the `hidream_config` metadata and the shapes. Every key and shape
    is checked before any weight is read; another family's file is one CheckpointError naming the missing key. A
    pre-quantized file is used as it is stored, whatever `prepare` asks; fp8_rules: the Linears its fp8 layers keep
    in high precision (default: the family spec's FP8)."""
    # a foreign diffusers class is refused even with config=, before the prefix check
    path, reader = open_transformer(path, "load_hidream", dtype)
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    prefix = marked_prefix(path, reader.keys(), PREFIXES, MARKER, "a HiDream-I1 transformer")
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    view, extra = PrefixedReader(reader, prefix), stored_extras(stored)
    if config is None:
        config = stated_config(path, reader, diffusers_json, config_from_diffusers, CONFIG_KEY, config_from_json,
                               lambda: config_from_shapes({k: view.shape(k) for k in view.keys() if not extra(k)},
                                                          path))
    with torch.device("meta"):
        model = HiDream(config)
    check_keys_and_shapes(view, model.state_dict(), config, extra)
    if fp8_rules is None and isinstance(stored, Fp8Checkpoint):  # fp8 layouts follow keep rules; GGUF's the file
        fp8_rules = spec_fp8_rules(path, stored, "library.models.hidream", "HiDream")
    return fill_meta_model(model, reader, without_prefix(prefix), path, dtype, stored=stored, keep_rules=fp8_rules,
                           prepare=prepare, convert=convert, read_weights=read_weights, loader="load_hidream")


# ----------------------------------------------------------------------------------------------
# Saving


def save_hidream_single_file(weights, path: str, config: HiDreamConfig | None = None, prefix: str = "",
                             metadata: dict[str, str] | None = None, write_config: bool = True):
    """Write the single-file layout (atomic): bare as the released files (or under `prefix`, e.g. ComfyUI's
    "model.diffusion_model."), the config (given or the model's) in the metadata as `hidream_config` JSON unless
    write_config is False (a released file has none: the loader reads the sizes from the shapes)."""
    sd, config = state_and_config(weights, config)
    tensors = {prefix + k: v.contiguous() for k, v in sd.items()}
    save_with_config(tensors, path, CONFIG_KEY, config if write_config else None, metadata)


def save_hidream_diffusers(weights, config: HiDreamConfig | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors (the same names)."""
    sd, config = state_and_config(weights, config)
    if config is None:
        raise ValueError("save_hidream_diffusers needs a HiDreamConfig (or the model) to write config.json")
    save_diffusers_folder({k: v.contiguous() for k, v in sd.items()}, diffusers_config(config), folder)

