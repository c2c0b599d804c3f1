"""Qwen-Image-2.1 checkpoints: the diffusers folder (Qwen/Qwen-Image-2.1's `transformer/`, sharded) and
the single file distributed for ComfyUI, loaded tensor by tensor; saving in both layouts.

Our module names are diffusers' (model.py). The single file differs in two ways, read from diffusers'
convert_qwen_image21_transformer_checkpoint_to_diffusers (loaders/single_file_utils.py), its oracle:
- keys may carry ComfyUI's `model.diffusion_model.` prefix (we also accept `diffusion_model.`);
- each block's SwiGLU gate and up projections are one fused `img_mlp.gate_up.weight` [2 hidden, D],
  gate rows first: gate_layer = rows [0, hidden), proj = rows [hidden, 2 hidden).
diffusers detects the file by `txt_in.text_norm.weight` (CHECKPOINT_KEY_NAMES["qwen-image-2.1"]).
Pre-quantized files (ComfyUI's scaled fp8 and comfy_quant, musubi-tuner's and our fp8 layouts, city96's
GGUF) load as stored through precision/stored_layouts.py, the fused gate_up's stored tensors split by rows.
"""

from __future__ import annotations

import dataclasses
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
    diffusers_config_json, fill_meta_model, marked_prefix, open_transformer, stated_config,
)
from library.models.qwen_image21.model import QwenImage21, QwenImage21Config
from library.models.qwen_image21.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras

CLASS_NAME = "QwenImage21Transformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain
MARKER = "txt_in.text_norm.weight"  # diffusers' detection key, the same in both layouts
CONFIG_KEY = "qwen_image21_config"  # safetensors metadata of single files we write: the config as JSON
FUSED = re.compile(r"(transformer_blocks\.\d+\.img_mlp\.)gate_up\.weight")
FUSED_MODULE = re.compile(r"(transformer_blocks\.\d+\.img_mlp\.)gate_up")
_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")


# Tensors of the fused gate_up that describe the whole layer, not its rows: each half gets the same one
# (ComfyUI's per-layer format JSON and activation scales; a one-number weight scale, by its size).
_PER_LAYER = ("comfy_quant", "scale_input", "input_scale")


class _View(RowSplitView):
    """A CheckpointReader view under our names: the prefix dropped (a ComfyUI file's other keys, e.g. a
    VAE's, are not read), every tensor of a fused `img_mlp.gate_up` read as gate_layer (first half of the
    rows) and proj (second half).

    How a fused tensor splits, so that a pre-quantized file stays the very weights it stores (as Z-Image's
    fused qkv): rows (weights in any dtype, GGUF blocks: each row's blocks run along the input; per-row and
    per-64-column fp8 scales) in two equal halves; what describes the whole layer (ComfyUI's one float32
    scale per tensor, its comfy_quant JSON, activation scales) to both halves unchanged."""

    parts, part_names = 2, "gate / up"

    def __init__(self, reader: CheckpointReader, prefix: str):
        super().__init__(reader)
        for key in reader.keys():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            module, _, leaf = name.rpartition(".")
            if m := FUSED_MODULE.fullmatch(module):
                whole = self._per_layer(key, leaf)
                self.sources[f"{m.group(1)}gate_layer.{leaf}"] = (key, None if whole else 0)
                self.sources[f"{m.group(1)}proj.{leaf}"] = (key, None if whole else 1)
            else:
                self.sources[name] = (key, None)

    def _per_layer(self, key: str, leaf: str) -> bool:
        return leaf in _PER_LAYER or (leaf not in ("weight", "bias") and math.prod(self.reader.shape(key)) == 1)


# ----------------------------------------------------------------------------------------------
# Config


def config_from_shapes(source: _View, path: str) -> QwenImage21Config:
    """The config from tensor shapes (a single file has no config.json); RoPE axes, theta and eps are
    the released model's (files do not store them)."""

    def shape(key):
        if key not in source:
            raise CheckpointError(f"{path}: cannot infer the Qwen-Image-2.1 config, key '{key}' is missing")
        return source.shape(key)

    dim, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    if head_dim != sum(QwenImage21Config.axes_dims_rope):
        raise CheckpointError(f"{path}: head dim {head_dim} has no known RoPE axes; pass a QwenImage21Config")
    return QwenImage21Config(
        in_channels=in_channels,
        out_channels=shape("proj_out.weight")[0],
        num_layers=len({int(m.group(1)) for k in source.keys() if (m := _BLOCK.match(k))}),
        attention_head_dim=head_dim,
        num_attention_heads=dim // head_dim,
        context_in_dim=shape("txt_in.in_layer.weight")[1],
        mlp_ratio=shape("transformer_blocks.0.img_mlp.proj.weight")[0] // dim,
    )


def config_from_diffusers(cfg: dict, source: str = "config.json") -> QwenImage21Config:
    """From a QwenImage21Transformer2DModel config.json (diffusers' defaults fill gaps)."""
    names = {f.name for f in dataclasses.fields(QwenImage21Config)}
    kwargs = {k: v for k, v in cfg.items() if k in names}
    if kwargs.get("out_channels") is None:
        kwargs["out_channels"] = kwargs.get("in_channels", QwenImage21Config.in_channels)
    try:
        return QwenImage21Config(**kwargs)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def diffusers_config(config: QwenImage21Config) -> dict:
    """The QwenImage21Transformer2DModel config.json for `config` (theta is not a diffusers argument)."""
    d = {k: v for k, v in dataclasses.asdict(config).items() if k != "rope_theta"}
    return {"_class_name": CLASS_NAME, **d, "axes_dims_rope": list(config.axes_dims_rope)}


def _source(path: str, reader: CheckpointReader, config: QwenImage21Config | None):
    """(config, a view under our names) for either layout; the wrong file is one CheckpointError naming the key."""
    source = _View(reader, marked_prefix(path, reader.keys(), PREFIXES, MARKER, "a Qwen-Image-2.1 transformer"))
    # A pre-quantized file (fp8, GGUF) is used as it is. Checked on the file's own keys first (an error
    # names the key as the file has it), then read under our names (the fused gate_up's scales split).
    stored = read_stored_layout(reader, path) and read_stored_layout(source, path)
    extra = stored_extras(stored)
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    if config is None:
        config = stated_config(path, reader, diffusers_json, config_from_diffusers, CONFIG_KEY,
                               lambda text: QwenImage21Config(**json.loads(text)),
                               lambda: config_from_shapes(source, path))
    with torch.device("meta"):
        expected = QwenImage21(config).state_dict()
    check_keys_and_shapes(source, expected, config, extra)  # every key named with its file, before any read
    return config, source, stored


def load_qwen_image21(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: QwenImage21Config | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[QwenImage21], Callable | None] | None = None,
    read_weights: bool = True,
) -> QwenImage21:
    """Load a Qwen-Image-2.1 transformer from a diffusers folder (the pipeline folder with
    `transformer/`, or the transformer folder; sharded or not) or a ComfyUI single file (prefixed or
    not, gate_up fused or not).

    dtype casts floating weights on read and becomes compute_dtype. config overrides config.json, the
    `qwen_image21_config` metadata and the key shapes. convert / prepare: the per-tensor and meta-model
    hooks (fp8 while loading: `prepare=fp8_prepare(mode, arch)`). read_weights=False: the meta model as
    it would load, from the headers alone (the memory planner). A pre-quantized file (ComfyUI's scaled fp8,
    comfy_quant, musubi-tuner's and our fp8 layouts, GGUF) is used as it is stored, whatever `prepare` asks."""
    path, reader = open_transformer(path, "load_qwen_image21", dtype)
    config, source, stored = _source(path, reader, config)
    with torch.device("meta"):
        model = QwenImage21(config)
    return fill_meta_model(model, source, lambda key: key, path, dtype, stored=stored, keep_rules=FP8, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_qwen_image21")


# ----------------------------------------------------------------------------------------------
# Saving


def save_qwen_image21_diffusers(model_or_sd, config: QwenImage21Config | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_qwen_image21_diffusers needs a QwenImage21Config (or the model) to write config.json")
    save_diffusers_folder(sd, diffusers_config(config), folder)


def to_comfy_state_dict(sd: dict[str, torch.Tensor], prefix: str = "model.diffusion_model.") -> dict:
    """Our state dict -> the ComfyUI single file's tensors (prefix, gate_up fused gate rows first)."""
    out = {}
    for key, value in sd.items():
        if key.endswith("img_mlp.gate_layer.weight"):
            stem = key[: -len("gate_layer.weight")]
            out[prefix + stem + "gate_up.weight"] = torch.cat((value, sd[stem + "proj.weight"]))
        elif not key.endswith("img_mlp.proj.weight"):
            out[prefix + key] = value
    return out


def save_qwen_image21_single_file(model_or_sd, path: str, config: QwenImage21Config | None = None,
                                  prefix: str = "model.diffusion_model.", metadata: dict[str, str] | None = None):
    """Write the ComfyUI single-file layout (atomic), the config (when known) in the metadata."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config(to_comfy_state_dict(sd, prefix), path, CONFIG_KEY, config, metadata)
