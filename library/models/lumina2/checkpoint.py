"""Lumina 2 checkpoints: loading the single file people download (Comfy-Org/Lumina_Image_2.0_Repackaged
split_files/diffusion_models/lumina_2_model_bf16.safetensors, the original names; Neta Lumina / NetaYume Lumina
ship the same), the same names under ComfyUI's `model.diffusion_model.` / `diffusion_model.` (the former also in
Neta Lumina's / NetaYume Lumina's all-in-one ComfyUI checkpoint, beside Gemma 2 under `text_encoders.gemma2_2b.` and
FLUX.1's VAE under `vae.`, whose tensors are never read: sd-scripts' load_lumina_model strips the same prefix) and as
sd-scripts saves a full fine-tune (plain), and a diffusers folder (transformer/ of Lumina2Transformer2DModel); the
config from our metadata, config.json or the shapes; saving the single file and the diffusers folder.

Our module names are the single file's (model.py), so it loads by plain key with its prefix dropped. The file also
holds `norm_final.weight`, an RMSNorm the original NextDiT builds and never calls: diffusers'
convert_lumina2_to_diffusers drops it (DROPPED), and so do we.

The diffusers names (loaders/single_file_utils.py convert_lumina2_to_diffusers, read the other way):

  ours / single file                                diffusers
  t_embedder.mlp.0 / .2                             time_caption_embed.timestep_embedder.linear_1 / linear_2
  cap_embedder.N                                    time_caption_embed.caption_embedder.N
  <block>.attention.qkv  (rows q | k | v, GQA)      <block>.attn.to_q / to_k / to_v  (n_heads, n_kv_heads, n_kv_heads)
  <block>.attention.out / q_norm / k_norm           <block>.attn.to_out.0 / norm_q / norm_k
  <block>.feed_forward.w1 / w2 / w3                 <block>.feed_forward.linear_1 / linear_2 / linear_3
  <block>.attention_norm1  (modulated blocks)       <block>.norm1.norm
  context_refiner.N.attention_norm1                 context_refiner.N.norm1
  <block>.attention_norm2                           <block>.norm2
  <block>.adaLN_modulation.1                        <block>.norm1.linear
  final_layer.adaLN_modulation.1 / final_layer.linear   norm_out.linear_1 / norm_out.linear_2
  x_embedder, ffn_norm1, ffn_norm2                  the same

Pre-quantized single files (ComfyUI's scaled fp8 / comfy_quant, musubi-tuner's and our fp8 layouts, city96's GGUF)
load as stored through precision/stored_layouts.py, as Anima's: our names are the file's, so no tensor is split.
Their fp8 keep rules are the family spec's FP8 (library/models/lumina2/spec.py), read only for such a file.
A diffusers folder is read in full precision only (its fused qkv is built from three tensors).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, RowJoinView, check_keys_and_shapes, metadata_config,
    save_diffusers_folder, save_with_config, state_and_config,
)
from library.models.checkpoint_files import (
    block_count, diffusers_config_json, fill_meta_model, marked_prefix, open_transformer,
)
from library.models.lumina2.model import Lumina2, Lumina2Config
from library.precision.stored_layouts import read_stored_layout, stored_extras

CLASS_NAME = "Lumina2Transformer2DModel"
PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI full / UNet-only, plain (released, sd-scripts)
# A key only Lumina 2 has: its modulation Linear follows a SiLU (index 1); Z-Image's reads the embedding directly (.0)
MARKER = "layers.0.adaLN_modulation.1.weight"
DIFFUSERS_MARKER = "time_caption_embed.caption_embedder.1.weight"
CONFIG_KEY = "lumina2_config"  # safetensors metadata of files we write: the config as JSON
DROPPED = ("norm_final.weight",)  # the original NextDiT's unused RMSNorm (diffusers drops it too)
# Z-Image's learned pad tokens: a file holding them is its successor's, whose blocks have the same names
SUCCESSOR_KEYS = ("x_pad_token", "cap_pad_token")

# ----------------------------------------------------------------------------------------------
# The name map: our key -> its diffusers key(s)

# Whole-name prefixes, then module-name pieces (first match), as convert_lumina2_to_diffusers' tables
_PREFIXES = (("t_embedder.mlp.0.", "time_caption_embed.timestep_embedder.linear_1."),
             ("t_embedder.mlp.2.", "time_caption_embed.timestep_embedder.linear_2."),
             ("cap_embedder.", "time_caption_embed.caption_embedder."),
             ("final_layer.adaLN_modulation.1.", "norm_out.linear_1."), ("final_layer.linear.", "norm_out.linear_2."))
_PIECES = ((".attention.out.", ".attn.to_out.0."), (".attention.q_norm.", ".attn.norm_q."),
           (".attention.k_norm.", ".attn.norm_k."), (".feed_forward.w1.", ".feed_forward.linear_1."),
           (".feed_forward.w2.", ".feed_forward.linear_2."), (".feed_forward.w3.", ".feed_forward.linear_3."),
           (".adaLN_modulation.1.", ".norm1.linear."), (".attention_norm2.", ".norm2."))
QKV = ".attention.qkv.weight"
QKV_PARTS = (".attn.to_q.weight", ".attn.to_k.weight", ".attn.to_v.weight")


def diffusers_keys(key: str) -> tuple[str, ...]:
    """Our key -> its diffusers key, or for a fused qkv the (to_q, to_k, to_v) keys its rows come from."""
    if key.endswith(QKV):
        return tuple(key[: -len(QKV)] + part for part in QKV_PARTS)
    for ours, theirs in _PREFIXES:
        if key.startswith(ours):
            return (theirs + key[len(ours) :],)
    if ".attention_norm1." in key:  # the modulated blocks' RMSNorm lives inside LuminaRMSNormZero
        return (key.replace(".attention_norm1.", ".norm1." if key.startswith("context_refiner.") else ".norm1.norm."),)
    for ours, theirs in _PIECES:
        if ours in key:
            return (key.replace(ours, theirs),)
    return (key,)


def to_diffusers_state_dict(sd: dict[str, torch.Tensor], config: Lumina2Config) -> dict[str, torch.Tensor]:
    """Our state dict -> Lumina2Transformer2DModel's (a fused qkv split into n_heads, n_kv_heads, n_kv_heads heads)."""
    rows = (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.n_kv_heads * config.head_dim)
    out = {}
    for key, value in sd.items():
        names = diffusers_keys(key)
        parts = value.split(rows, dim=0) if len(names) == 3 else (value,)
        out.update({name: part.contiguous() for name, part in zip(names, parts)})
    return out


# ----------------------------------------------------------------------------------------------
# Config


def default_axes_dims(head_dim: int) -> tuple[int, int, int]:
    """The RoPE split of a head files do not store: rows and columns a third each (rounded down to even), the
    sequence axis the rest: (32, 32, 32) for the released head_dim 96, (12, 10, 10) for 32."""
    third = head_dim // 3 // 2 * 2
    return (head_dim - 2 * third, third, third)


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> Lumina2Config:
    """Lumina2Config from tensor shapes under our names: widths from the embedders, depths from the block counts,
    head_dim from the QK-norm width, kv heads from the qkv rows ((n_heads + 2 n_kv_heads) head_dim), the feed-forward
    width as stored. The patch (2), theta, eps and the RoPE split (default_axes_dims) are Lumina 2's."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the Lumina 2 config, key '{key}' is missing")
        return shapes[key]

    patch = Lumina2Config.patch_size
    dim, patch_dim = shape("x_embedder.weight")
    q_norm = "layers.0.attention.q_norm.weight"
    if q_norm not in shapes:
        raise CheckpointError(f"{source}: no '{q_norm}': without QK norms the head width is not in the file; "
                              f"pass config=Lumina2Config(...)")
    head_dim = shape(q_norm)[0]
    qkv_rows, hidden = shape("layers.0" + QKV)[0], shape("layers.0.feed_forward.w1.weight")[0]
    multiple = Lumina2Config.multiple_of  # released: 4 dim rounded up to 256; another width is stated exactly
    ffn = {} if hidden == -(-4 * dim // multiple) * multiple else dict(multiple_of=hidden,
                                                                       ffn_dim_multiplier=hidden / (4 * dim))
    try:
        return Lumina2Config(
            in_channels=patch_dim // (patch * patch), dim=dim, n_layers=block_count(shapes, "layers."),
            n_refiner_layers=block_count(shapes, "noise_refiner."), n_heads=dim // head_dim,
            n_kv_heads=(qkv_rows - dim) // (2 * head_dim), cap_feat_dim=shape("cap_embedder.0.weight")[0],
            axes_dims=default_axes_dims(head_dim), **ffn)
    except ValueError as e:
        raise CheckpointError(f"{source}: the shapes give no Lumina 2 config: {e}") from None


def config_from_diffusers(cfg: dict, source: str = "config.json") -> Lumina2Config:
    """Lumina2Config from a Lumina2Transformer2DModel config.json (diffusers' defaults fill gaps)."""
    out_channels = cfg.get("out_channels")
    if out_channels not in (None, cfg.get("in_channels", 16)):
        raise CheckpointError(f"{source}: out_channels {out_channels} != in_channels: not supported")
    return Lumina2Config(
        in_channels=cfg.get("in_channels", 16), patch_size=cfg.get("patch_size", 2), dim=cfg.get("hidden_size", 2304),
        n_layers=cfg.get("num_layers", 26), n_refiner_layers=cfg.get("num_refiner_layers", 2),
        n_heads=cfg.get("num_attention_heads", 24),
        n_kv_heads=cfg.get("num_kv_heads") or cfg.get("num_attention_heads", 24),  # None: full heads (diffusers)
        multiple_of=cfg.get("multiple_of", 256), ffn_dim_multiplier=cfg.get("ffn_dim_multiplier"),
        norm_eps=float(cfg.get("norm_eps", 1e-5)), cap_feat_dim=cfg.get("cap_feat_dim", 1024),
        axes_dims=tuple(cfg.get("axes_dim_rope", (32, 32, 32))), axes_lens=tuple(cfg.get("axes_lens", (300, 512, 512))))


def diffusers_config(config: Lumina2Config) -> dict:
    """The Lumina2Transformer2DModel config.json of `config` (its QK norms are diffusers' fixed eps 1e-5)."""
    return {"_class_name": CLASS_NAME, "sample_size": 128, "patch_size": config.patch_size,
            "in_channels": config.in_channels, "out_channels": None, "hidden_size": config.dim,
            "num_layers": config.n_layers, "num_refiner_layers": config.n_refiner_layers,
            "num_attention_heads": config.n_heads, "num_kv_heads": config.n_kv_heads, "multiple_of": config.multiple_of,
            "ffn_dim_multiplier": config.ffn_dim_multiplier, "norm_eps": config.norm_eps, "scaling_factor": 1.0,
            "axes_dim_rope": list(config.axes_dims), "axes_lens": list(config.axes_lens),
            "cap_feat_dim": config.cap_feat_dim}


def config_from_json(text: str) -> Lumina2Config:
    """The config save_lumina2_single_file writes in the metadata."""
    fields = json.loads(text)
    return Lumina2Config(**{**fields, "axes_dims": tuple(fields["axes_dims"]), "axes_lens": tuple(fields["axes_lens"])})


# ----------------------------------------------------------------------------------------------
# Loading


def _refuse_successor(path: str, keys: list[str]) -> None:
    found = next((k for k in keys for p in PREFIXES for s in SUCCESSOR_KEYS if k == p + s), None)
    if found is not None:
        raise CheckpointError(f"{path}: not a Lumina 2 transformer: it holds '{found}', a Z-Image transformer's pad "
                              f"token (same block names, another model: load it as model_type zimage)")


def _fp8_rules():
    from library.models.lumina2.spec import FP8  # read only for a pre-quantized file

    return FP8


def load_lumina2(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: Lumina2Config | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Lumina2], Callable | None] | None = None,
    read_weights: bool = True,
) -> Lumina2:
    """Load a Lumina 2 transformer from the released single file (original names, plain as sd-scripts saves it or
    under ComfyUI's prefixes; a file's other prefixes, the all-in-one file's Gemma and VAE, are not read; the key check
    sees only the transformer's) or a diffusers folder
    (the pipeline folder with transformer/, or that folder; sharded or not).

    dtype casts floating weights on read and becomes compute_dtype. config overrides what config.json, the
    `lumina2_config` metadata or the shapes say. convert / prepare: the per-tensor and meta-model hooks (fp8 while
    loading). read_weights=False: the meta model as it would load, from the headers alone (the memory planner).
    Every key and shape is checked before any weight is read; a wrong file is one CheckpointError naming it."""
    path, reader = open_transformer(path, "load_lumina2", dtype)
    _refuse_successor(path, reader.keys())
    diffusers_json = diffusers_config_json(path, CLASS_NAME)  # a foreign class is refused even with config=
    if DIFFUSERS_MARKER in reader.keys():
        config, view, rename, stored = _diffusers_source(path, reader, config, diffusers_json)
        source = view
    else:
        config, view, rename, stored = _single_file_source(path, reader, config)
        source = reader
    with torch.device("meta"):
        model = Lumina2(config)
    scales = stored_extras(stored)
    check_keys_and_shapes(view, model.state_dict(), config, extra=lambda key: key in DROPPED or scales(key))
    keep_rules = _fp8_rules() if stored else None
    return fill_meta_model(model, source, rename, path, dtype, stored=stored, keep_rules=keep_rules, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_lumina2")


def _diffusers_source(path: str, reader: CheckpointReader, config: Lumina2Config | None, diffusers_json: dict | None):
    """(config, the folder under our names, rename, no stored layout) of a diffusers transformer folder."""
    if config is None and diffusers_json is not None:
        config = config_from_diffusers(diffusers_json, os.path.join(path, "config.json"))
    with torch.device("meta"):
        our_keys = Lumina2(config or _skeleton(reader)).state_dict().keys()
    view = RowJoinView(reader, our_keys, diffusers_keys)  # a fused qkv: its to_q / to_k / to_v rows
    config = config or config_from_shapes({k: view.shape(k) for k in view.keys()}, path)
    return config, view, (lambda key: key), None


def _single_file_source(path: str, reader: CheckpointReader, config: Lumina2Config | None):
    """(config, the file's keys under our names, rename, its stored layout or None) of a single file: the prefix
    dropped; keys under other prefixes (a bundled VAE) and DROPPED not read."""
    prefix = marked_prefix(path, reader.keys(), PREFIXES, MARKER, "a Lumina 2 transformer")
    stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    view, extra = PrefixedReader(reader, prefix), stored_extras(stored)
    if config is None and CONFIG_KEY in reader.metadata:
        config = metadata_config(reader, CONFIG_KEY, config_from_json)
    config = config or config_from_shapes(
        {k: view.shape(k) for k in view.keys() if k not in DROPPED and not extra(k)}, path)

    def rename(key: str) -> str | None:
        name = key[len(prefix) :] if key.startswith(prefix) else None
        return None if name in DROPPED else name

    return config, view, rename, stored


def _skeleton(reader: CheckpointReader) -> Lumina2Config:
    """A config with the folder's block counts (for the name map of a diffusers folder without config.json)."""
    return Lumina2Config(dim=8, n_heads=1, n_kv_heads=1, axes_dims=(4, 2, 2), cap_feat_dim=1, in_channels=1,
                         n_layers=block_count(reader.keys(), "layers."),
                         n_refiner_layers=block_count(reader.keys(), "noise_refiner."))


# ----------------------------------------------------------------------------------------------
# Saving


def save_lumina2_single_file(model_or_sd, path: str, config: Lumina2Config | None = None, prefix: str = "",
                             metadata: dict[str, str] | None = None, extra: dict[str, torch.Tensor] | None = None):
    """Write the single-file layout (atomic; `prefix` e.g. ComfyUI's `model.diffusion_model.`), the config (when
    known) in the metadata as `lumina2_config` JSON so that non-standard sizes reload exactly. extra: tensors stored
    beside the weights under the same prefix (the released file's unused norm_final.weight, for tests)."""
    sd, config = state_and_config(model_or_sd, config)
    tensors = {prefix + k: v.contiguous() for k, v in {**sd, **(extra or {})}.items()}
    save_with_config(tensors, path, CONFIG_KEY, config, metadata)


def save_lumina2_diffusers(model_or_sd, config: Lumina2Config | None, folder: str):
    """Write a diffusers transformer folder: config.json + diffusion_pytorch_model.safetensors."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_lumina2_diffusers needs a Lumina2Config (or a Lumina2 model) to write config.json")
    save_diffusers_folder(to_diffusers_state_dict(sd, config), diffusers_config(config), folder)
