"""Ideogram 4 checkpoints: the diffusers folder (`transformer/`, also `unconditional_transformer/`)
and single files (optionally under ComfyUI's `model.diffusion_model.` / `diffusion_model.` or the
original `conditional_transformer.` prefix), read tensor by tensor; the released files are
pre-quantized (BFL fp8r / nvfp4, library/precision/bfl_weights.py) and load as stored.

Names: our model has diffusers' names, so a diffusers folder loads by plain key. The original
layout fuses q, k and v: `attention.qkv` [3D, D] and names the output `attention.o` (diffusers'
_convert_non_diffusers_ideogram4_lora_to_diffusers, the only map diffusers 0.42.1 has for Ideogram 4:
it has no single-file converter for the transformer); the view below splits qkv into thirds along
the rows, scales included (fp8r's per-row scales and nvfp4's block scales split with their rows,
nvfp4's global scales are shared), as BFLQuantizedParameter.chunk does. Every other original name
is taken to be diffusers' (the LoRA converter maps feed_forward.* and adaln_modulation one to one);
a file with other names is refused naming its first unknown key.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, RowSplitView, check_keys_and_shapes, load_streaming, prepared_convert,
    save_diffusers_folder,
)
from library.models.checkpoint_files import diffusers_config_json, open_transformer
from library.models.ideogram4.model import Ideogram4, Ideogram4Config
from library.precision.bfl_weights import bfl_converter, read_bfl_checkpoint
from library.precision.stored_layouts import read_stored_layout

CLASS_NAME = "Ideogram4Transformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "conditional_transformer.", "")
MARKER = "llm_cond_proj.weight"  # in every layout
FUSED = re.compile(r"(layers\.\d+\.attention)\.qkv\.(weight|weight_scale|weight_scale_2|input_scale)")
SPLIT = ("to_q", "to_k", "to_v")


class _View(RowSplitView):
    """A CheckpointReader view of one layout under our names: the prefix stripped, `attention.o`
    read as `attention.to_out.0`, `attention.qkv.*` as its three row blocks (a one-number scale,
    shape (), whole to each)."""

    parts, part_names = 3, "q / k / v"

    def __init__(self, reader: CheckpointReader, prefix: str):
        super().__init__(reader)
        for key in reader.keys():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            if m := FUSED.fullmatch(name):
                whole = len(reader.shape(key)) == 0
                for i, proj in enumerate(SPLIT):
                    self.sources[f"{m.group(1)}.{proj}.{m.group(2)}"] = (key, None if whole else i)
                continue
            self.sources[re.sub(r"\.attention\.o\.", ".attention.to_out.0.", name)] = (key, None)


# ----------------------------------------------------------------------------------------------
# Config


def config_from_diffusers(cfg: dict) -> Ideogram4Config:
    fields = {f.name for f in dataclasses.fields(Ideogram4Config)}
    return Ideogram4Config(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in fields})


def diffusers_config(config: Ideogram4Config) -> dict:
    return {"_class_name": CLASS_NAME, **{k: (list(v) if isinstance(v, tuple) else v)
                                          for k, v in dataclasses.asdict(config).items()}}


def config_from_shapes(view: _View, source: str) -> Ideogram4Config:
    """The config a file's headers give (head_dim 256 and the released M-RoPE sections assumed when
    the width allows, as no tensor carries them)."""
    try:
        hidden, in_channels = view.shape("input_proj.weight")
        layers = 1 + max(int(m.group(1)) for k in view.keys() if (m := re.match(r"layers\.(\d+)\.", k)))
        head_dim = view.shape("layers.0.attention.norm_q.weight")[0]
        ffn = view.shape("layers.0.feed_forward.w1.weight")[0]
        adaln = view.shape("adaln_proj.weight")[0]
        llm = view.shape("llm_cond_norm.weight")[0]
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{source}: not an Ideogram 4 transformer ({e})") from None
    return Ideogram4Config(in_channels=in_channels, num_layers=layers, attention_head_dim=head_dim,
                           num_attention_heads=hidden // head_dim, intermediate_size=ffn, adaln_dim=adaln,
                           llm_features_dim=llm)


# ----------------------------------------------------------------------------------------------
# Loading


def load_ideogram4(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: Ideogram4Config | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Ideogram4], Callable | None] | None = None,
    read_weights: bool = True,
    component: str = "transformer",
) -> Ideogram4:
    """Load an Ideogram 4 transformer from a diffusers folder (the pipeline folder: `component` is
    `transformer` or `unconditional_transformer`; or the component folder itself) or a single file.

    A BFL-quantized file (fp8r / nvfp4, the released form) keeps its quantized Linears as stored
    (BFLLinear, dequantized per forward to the compute dtype); `model.stored_layout` names it (the
    LoRA's ss_base_precision). dtype casts every other floating weight and becomes compute_dtype. A
    float file is quantized while loading by `prepare` (a base precision: `fp8_prepare(mode, arch)`).
    read_weights=False gives the meta model as it would load, from the headers alone."""
    path, reader = open_transformer(path, "load_ideogram4", dtype, component=component, fp8_via=None)
    prefix = next((p for p in PREFIXES if any(k.startswith(p) for k in reader.keys())
                   and (p + MARKER in reader or p + "llm_cond_proj.weight_scale" in reader)), None)
    if prefix is None:
        raise CheckpointError(f"{path}: not an Ideogram 4 transformer (no key '{MARKER}', plain or under "
                              f"{' / '.join(p for p in PREFIXES if p)})")
    view = _View(reader, prefix)
    stored = read_bfl_checkpoint(view, path)
    if stored is None and (other := read_stored_layout(reader, path)) is not None:
        raise CheckpointError(f"{path}: a {other.layout} Ideogram 4 file is not read; Ideogram 4 is released "
                              f"as BFL fp8r / nvfp4, which are")
    if config is None and (cfg := diffusers_config_json(path, CLASS_NAME)) is not None:
        config = config_from_diffusers(cfg)
    config = config or config_from_shapes(view, path)
    with torch.device("meta"):
        model = Ideogram4(config)
    if stored is not None:
        if prepare is not None or convert is not None:
            raise ValueError(f"load_ideogram4: {path} is pre-quantized ({stored.layout}); it loads as stored")
        convert = bfl_converter(model, stored, dtype)
        check_keys_and_shapes(view, model.state_dict(), config, extra=stored.is_dropped)  # BFLLinear's own keys
    else:  # checked before prepare: a float file holds the float model's keys, quantized while loading
        check_keys_and_shapes(view, model.state_dict(), config)
        convert = prepared_convert(model, prepare, convert, "load_ideogram4")
    if read_weights:
        load_streaming(model, view, lambda key: key, dtype=dtype, convert=convert)
    else:
        model.to(dtype)
    model.compute_dtype = dtype
    model.stored_layout = stored.layout if stored else None
    return model


def save_ideogram4_diffusers(state_dict: dict[str, torch.Tensor], config: Ideogram4Config, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors (a
    quantized state dict as bfl_weights' quantize_* give it is written as it is)."""
    save_diffusers_folder(state_dict, diffusers_config(config), folder)
