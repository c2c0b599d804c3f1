"""Krea 2 checkpoints: loading the released single files (krea/Krea-2-Raw `raw.safetensors`,
krea/Krea-2-Turbo `turbo.safetensors`: the original krea-ai/krea-2 names, our model's own, optionally
under ComfyUI's `model.diffusion_model.` / `diffusion_model.`) and diffusers folders (each repo's
`transformer/`), the name map between the two, and saving in both layouts.

The oracle of the map is diffusers' convert_krea2_transformer_checkpoint_to_diffusers
(loaders/single_file_utils.py); diffusers detects the single file by `txtfusion.projector.weight`.

  single file / ours                             diffusers
  first.*                                        img_in.*
  tmlp.0.*, tmlp.2.*                             time_embed.linear_1.*, time_embed.linear_2.*
  tproj.1.*                                      time_mod_proj.*
  txtmlp.0.scale, txtmlp.1.*, txtmlp.3.*         txt_in.norm.weight, txt_in.linear_1.*, txt_in.linear_2.*
  txtfusion.*                                    text_fusion.*
  blocks.N.*                                     transformer_blocks.N.*
  last.linear.*, last.norm.scale                 final_layer.linear.*, final_layer.norm.weight
  last.modulation.lin [2, D]                     final_layer.scale_shift_table [2, D]
  in blocks: attn.wq / wk / wv / wo / gate       attn.to_q / to_k / to_v / to_out.0 / to_gate
             attn.qknorm.qnorm.scale / knorm     attn.norm_q.weight / norm_k.weight
             mlp.*, prenorm.scale, postnorm.scale  ff.*, norm1.weight, norm2.weight
             mod.lin [6 D]                        scale_shift_table [6, D] (the same numbers)
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, check_keys_and_shapes, save_diffusers_folder, save_with_config, state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, open_transformer, stated_config,
)
from library.models.krea2.model import Krea2, Krea2Config
from library.precision.stored_layouts import read_stored_layout

CLASS_NAME = "Krea2Transformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain
MARKER = "txtfusion.projector.weight"  # the single file (diffusers' detection key)
DIFFUSERS_MARKER = "text_fusion.projector.weight"
CONFIG_KEY = "krea2_config"  # safetensors metadata of files we write: the config as JSON

# ----------------------------------------------------------------------------------------------
# The name map

_PREFIXES = (  # (ours, diffusers), whole-key prefixes
    ("first.", "img_in."), ("tmlp.0.", "time_embed.linear_1."), ("tmlp.2.", "time_embed.linear_2."),
    ("tproj.1.", "time_mod_proj."), ("txtmlp.0.scale", "txt_in.norm.weight"), ("txtmlp.1.", "txt_in.linear_1."),
    ("txtmlp.3.", "txt_in.linear_2."), ("txtfusion.", "text_fusion."), ("blocks.", "transformer_blocks."),
    ("last.linear.", "final_layer.linear."), ("last.norm.scale", "final_layer.norm.weight"),
    ("last.modulation.lin", "final_layer.scale_shift_table"),
)
_PIECES = (  # (ours, diffusers), pieces inside the blocks' keys
    (".attn.wq.", ".attn.to_q."), (".attn.wk.", ".attn.to_k."), (".attn.wv.", ".attn.to_v."),
    (".attn.wo.", ".attn.to_out.0."), (".attn.gate.", ".attn.to_gate."),
    (".attn.qknorm.qnorm.scale", ".attn.norm_q.weight"), (".attn.qknorm.knorm.scale", ".attn.norm_k.weight"),
    (".mlp.", ".ff."), (".prenorm.scale", ".norm1.weight"), (".postnorm.scale", ".norm2.weight"),
    (".mod.lin", ".scale_shift_table"),
)
BLOCK_TABLE = re.compile(r"blocks\.\d+\.mod\.lin")  # [6 D] here, [6, D] in diffusers


def _swap(key: str, table_from: int) -> str:
    """Rename `key` from naming `table_from` (0 ours, 1 diffusers) to the other one."""
    to = 1 - table_from
    for pair in _PREFIXES:
        if key.startswith(pair[table_from]):
            key = pair[to] + key[len(pair[table_from]) :]
            break
    for pair in _PIECES:
        key = key.replace(pair[table_from], pair[to])
    return key


def diffusers_key(key: str) -> str:
    """Our (single-file) key -> its diffusers name."""
    return _swap(key, 0)


def original_key(key: str) -> str:
    """A diffusers key -> our (single-file) name."""
    return _swap(key, 1)


def to_diffusers_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> Krea2Transformer2DModel's (the blocks' tables as [6, D])."""
    return {diffusers_key(k): (v.reshape(6, -1) if BLOCK_TABLE.fullmatch(k) else v) for k, v in sd.items()}


class _DiffusersView:
    """A CheckpointReader view of a diffusers transformer under our names (the blocks' [6, D]
    tables read as [6 D])."""

    def __init__(self, reader: CheckpointReader):
        self.reader, self.path, self.metadata = reader, reader.path, reader.metadata
        self.sources = {original_key(k): k for k in reader.keys()}

    def keys(self) -> list[str]:
        return list(self.sources)

    def __contains__(self, key: str) -> bool:
        return key in self.sources

    def shape(self, key: str) -> tuple[int, ...]:
        shape = self.reader.shape(self.sources[key])
        return (shape[0] * shape[1],) if BLOCK_TABLE.fullmatch(key) and len(shape) == 2 else shape

    def file_of(self, key: str) -> str:
        return self.reader.file_of(self.sources[key])

    def dtype_name(self, key: str) -> str:
        return self.reader.dtype_name(self.sources[key])

    def get(self, key: str) -> torch.Tensor:
        tensor = self.reader.get(self.sources[key])
        return tensor.reshape(-1) if BLOCK_TABLE.fullmatch(key) else tensor


class _PrefixView(_DiffusersView):
    """A single file's keys without its ComfyUI prefix (other keys, e.g. a VAE's, are not read)."""

    def __init__(self, reader: CheckpointReader, prefix: str):
        self.reader, self.path, self.metadata = reader, reader.path, reader.metadata
        self.sources = {k[len(prefix) :]: k for k in reader.keys() if k.startswith(prefix)}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(self.sources[key])

    def get(self, key: str) -> torch.Tensor:
        return self.reader.get(self.sources[key])


# ----------------------------------------------------------------------------------------------
# Config


def default_axes(head_dim: int) -> tuple[int, int, int]:
    """The original model's RoPE split of a head (krea-ai/krea-2's SingleStreamDiT): 6 (head_dim // 16)
    each for rows and columns, the rest for the first axis ((32, 48, 48) for 128). Files do not store it."""
    side = 6 * (head_dim // 16)
    return (head_dim - 2 * side, side, side)


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> Krea2Config:
    """Krea2Config from tensor shapes under our names: widths from the projections, heads from the
    q/k-norm widths, depths from block counts; theta, eps and the RoPE split are Krea 2's."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the Krea 2 config, key '{key}' is missing")
        return shapes[key]

    hidden, in_channels = shape("first.weight")
    head_dim = shape("blocks.0.attn.qknorm.qnorm.scale")[0]
    text_dim = shape("txtmlp.1.weight")[1]
    text_head = shape("txtfusion.layerwise_blocks.0.attn.qknorm.qnorm.scale")[0]
    return Krea2Config(
        in_channels=in_channels,
        num_layers=block_count(shapes, "blocks."),
        attention_head_dim=head_dim,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=shape("blocks.0.attn.wk.weight")[0] // head_dim,
        intermediate_size=shape("blocks.0.mlp.gate.weight")[0],
        timestep_embed_dim=shape("tmlp.0.weight")[1],
        text_hidden_dim=text_dim,
        num_text_layers=shape(MARKER)[1],
        text_num_attention_heads=text_dim // text_head,
        text_num_key_value_heads=shape("txtfusion.layerwise_blocks.0.attn.wk.weight")[0] // text_head,
        text_intermediate_size=shape("txtfusion.layerwise_blocks.0.mlp.gate.weight")[0],
        num_layerwise_text_blocks=block_count(shapes, "txtfusion.layerwise_blocks."),
        num_refiner_text_blocks=block_count(shapes, "txtfusion.refiner_blocks."),
        axes_dims_rope=default_axes(head_dim),
    )


def config_from_diffusers(cfg: dict, source: str = "config.json") -> Krea2Config:
    """Krea2Config from a Krea2Transformer2DModel config.json (diffusers' defaults fill gaps)."""
    fields = {f.name for f in dataclasses.fields(Krea2Config)}
    try:
        return Krea2Config(**{k: v for k, v in cfg.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def diffusers_config(config: Krea2Config) -> dict:
    """The Krea2Transformer2DModel config.json for `config`."""
    return {"_class_name": CLASS_NAME, **{**dataclasses.asdict(config), "axes_dims_rope": list(config.axes_dims_rope)}}


def krea2_config_from_json(text: str) -> Krea2Config:
    return Krea2Config(**json.loads(text))


# ----------------------------------------------------------------------------------------------
# Loading


def _source(path: str, reader: CheckpointReader, config: Krea2Config | None):
    """(config, a reader under our names) for either layout; the wrong file is one CheckpointError."""
    keys = reader.keys()
    prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
    if prefix is not None:
        source = _PrefixView(reader, prefix)
    elif DIFFUSERS_MARKER in keys:
        source = _DiffusersView(reader)
    else:
        raise CheckpointError(f"{path}: not a Krea 2 transformer (no key '{MARKER}' (single file, plain or under "
                              f"{' / '.join(p for p in PREFIXES if p)}) or '{DIFFUSERS_MARKER}' (diffusers))")
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    if config is None:
        config = stated_config(path, reader, diffusers_json, config_from_diffusers, CONFIG_KEY, krea2_config_from_json,
                               lambda: config_from_shapes({k: source.shape(k) for k in source.keys()}, path))
    with torch.device("meta"):
        expected = Krea2(config).state_dict()
    check_keys_and_shapes(source, expected, config)  # every key named with its file, before any read
    return config, source


def load_krea2(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: Krea2Config | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Krea2], Callable | None] | None = None,
    read_weights: bool = True,
) -> Krea2:
    """Load a Krea 2 transformer (Raw or Turbo) from a released single file (original names,
    optionally under ComfyUI's prefixes) or a diffusers folder (the pipeline folder with
    `transformer/`, or the transformer folder itself; sharded or not).

    dtype casts floating weights on read and becomes compute_dtype. config overrides what
    config.json, the `krea2_config` metadata or the key shapes say. convert / prepare are the
    per-tensor and meta-model hooks (fp8 quantized while loading: `prepare=fp8_prepare(mode, arch)`).
    read_weights=False gives the meta model as it would load, from the headers alone (the planner).
    """
    path, reader = open_transformer(path, "load_krea2", dtype)
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    # Refused before the key check, which would name a stored scale an unexpected key (spec.py: FP8Rules.stored)
    if stored is not None:
        keys = reader.keys()
        if not any(p + MARKER in keys for p in PREFIXES) and DIFFUSERS_MARKER not in keys:  # another model's
            raise CheckpointError(f"{path}: not a Krea 2 transformer (no key '{MARKER}' or '{DIFFUSERS_MARKER}')")
        raise CheckpointError(f"{path}: a pre-quantized ({stored.layout}) Krea 2 file is not read yet; use the bf16 "
                              f"file (base_precision / fp8_base quantize it while loading)")
    config, source = _source(path, reader, config)
    with torch.device("meta"):
        model = Krea2(config)
    return fill_meta_model(model, source, lambda key: key, path, dtype, stored=None, keep_rules=None, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_krea2")


# ----------------------------------------------------------------------------------------------
# Saving


def save_krea2_diffusers(model_or_sd, config: Krea2Config | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_krea2_diffusers needs a Krea2Config (or a Krea2 model) to write config.json")
    save_diffusers_folder(to_diffusers_state_dict(sd), diffusers_config(config), folder)


def save_krea2_single_file(model_or_sd, path: str, config: Krea2Config | None = None, prefix: str = "",
                           metadata: dict[str, str] | None = None):
    """Write the released single-file layout (atomic; `prefix` e.g. ComfyUI's `model.diffusion_model.`),
    the config (when known) in the metadata as `krea2_config` JSON so that non-standard sizes reload exactly."""
    sd, config = state_and_config(model_or_sd, config)
    save_with_config({prefix + k: v for k, v in sd.items()}, path, CONFIG_KEY, config, metadata)
