"""Anima checkpoints: loading the single file people download (ComfyUI's split_files/diffusion_models/
anima-*.safetensors: the DiT and the LLM adapter under "net.", original names), the same names plain or under
ComfyUI's `model.diffusion_model.` / `diffusion_model.`, and a diffusers pipeline folder (transformer/:
CosmosTransformer3DModel, text_conditioner/: AnimaTextConditioner); the config from our metadata, the
folder's config.json files or the shapes; saving the single file and the diffusers folders.

Our module names are the single file's (model.py), so a single file loads by plain key with its prefix dropped.
The file may also carry what NVIDIA's training code (and sd-scripts' save_anima_model) store beside the weights:
the RoPE module's persistent buffers `pos_embedder.{seq,dim_spatial_range,dim_temporal_range}` and training
counters; diffusers' convert_cosmos_transformer_checkpoint_to_diffusers drops them (IGNORED), and so do we.

diffusers' names: the transformer's follow its Cosmos-2.0 table (loaders/single_file_utils.py; the LoRA table
_convert_non_diffusers_anima_lora_to_diffusers is the same without the QK norms), the text conditioner's are
the adapter's own (`llm_adapter.` -> `text_conditioner.`).

Pre-quantized single files (fp8, GGUF: precision/stored_layouts.py) are not read yet: one CheckpointError says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable

import torch

from library.io import (
    CheckpointError, CheckpointReader, PrefixedReader, check_keys_and_shapes, metadata_config, save_diffusers_folder,
    save_with_config, state_and_config,
)
from library.models.anima.model import Anima, AnimaConfig
from library.models.checkpoint_files import (
    block_count, check_compute_dtype, diffusers_config_json, fill_meta_model, marked_prefix,
)
from library.models.anima.spec import FP8
from library.precision.stored_layouts import read_stored_layout, stored_extras

# The released single file's "net.", ComfyUI's full / UNet-only state dicts, plain (and our diffusers view)
PREFIXES = ("net.", "model.diffusion_model.", "diffusion_model.", "")
RELEASED_PREFIX = PREFIXES[0]
MARKER = "llm_adapter.embed.weight"  # the adapter's T5 embedding: Anima's own (a Cosmos-Predict2 DiT has none)
CONFIG_KEY = "anima_config"  # safetensors metadata of single files we write: the config as JSON
# Not weights: the RoPE module's buffers and training counters of NVIDIA's checkpoints (diffusers drops the same)
IGNORED = re.compile(r"(^|\.)(pos_embedder\.(seq|dim_spatial_range|dim_temporal_range)|accum_\w+|_extra_state)$")
TRANSFORMER_CLASS, CONDITIONER_CLASS = "CosmosTransformer3DModel", "AnimaTextConditioner"
# CosmosTransformer3DModel's constructor defaults that differ from Anima: what a config.json omitting them means
DIFFUSERS_DEFAULTS = {"extra_pos_embed_type": "learnable", "rope_scale": (2.0, 1.0, 1.0)}

# Our DiT names -> CosmosTransformer3DModel's, applied in order to each key (diffusers' Cosmos-2.0 table)
DIFFUSERS_NAMES = (
    ("blocks.", "transformer_blocks."),
    ("adaln_modulation_self_attn.", "norm1.linear_"), ("adaln_modulation_cross_attn.", "norm2.linear_"),
    ("adaln_modulation_mlp.", "norm3.linear_"),
    ("self_attn.", "attn1."), ("cross_attn.", "attn2."),
    ("q_proj", "to_q"), ("k_proj", "to_k"), ("v_proj", "to_v"), ("output_proj", "to_out.0"),
    ("q_norm", "norm_q"), ("k_norm", "norm_k"),
    ("mlp.layer1", "ff.net.0.proj"), ("mlp.layer2", "ff.net.2"),
    ("x_embedder.proj.1", "patch_embed.proj"),
    ("final_layer.adaln_modulation.", "norm_out.linear_"), ("final_layer.linear", "proj_out"),
    ("t_embedder.1", "time_embed.t_embedder"), ("t_embedding_norm", "time_embed.norm"),
)


def diffusers_name(key: str) -> tuple[str, str]:
    """(component, key) of our parameter `key` in a diffusers pipeline folder."""
    if key.startswith("llm_adapter."):
        return "text_conditioner", key[len("llm_adapter.") :]
    for ours, theirs in DIFFUSERS_NAMES:
        key = key.replace(ours, theirs)
    return "transformer", key


# ----------------------------------------------------------------------------------------------
# Config


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint") -> AnimaConfig:
    """AnimaConfig from tensor shapes in our names: widths from the embedders and the first blocks, depths from
    the block counts, heads from the QK norms' widths. The patch (2), the padding channel, the RoPE ratios, the
    QK eps and min_text_len are the released model's (files do not store them)."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the Anima config, key '{key}' is missing")
        return shapes[key]

    patch = AnimaConfig.patch_size
    hidden, embed_in = shape("x_embedder.proj.1.weight")
    vocab, text_dim = shape("llm_adapter.embed.weight")
    adapter_dim = shape("llm_adapter.blocks.0.self_attn.q_proj.weight")[0]
    try:
        return AnimaConfig(
            hidden_size=hidden,
            num_heads=hidden // shape("blocks.0.self_attn.q_norm.weight")[0],
            num_blocks=block_count(shapes, "blocks."),
            mlp_ratio=shape("blocks.0.mlp.layer1.weight")[0] / hidden,
            in_channels=embed_in // patch**2 - 1,
            out_channels=shape("final_layer.linear.weight")[0] // patch**2,
            text_dim=shape("blocks.0.cross_attn.k_proj.weight")[1],
            adaln_lora_dim=shape("blocks.0.adaln_modulation_self_attn.1.weight")[0],
            adapter_layers=block_count(shapes, "llm_adapter.blocks."),
            adapter_dim=adapter_dim,
            adapter_heads=adapter_dim // shape("llm_adapter.blocks.0.self_attn.q_norm.weight")[0],
            adapter_source_dim=shape("llm_adapter.blocks.0.cross_attn.k_proj.weight")[1],
            t5_vocab_size=vocab,
        )
    except ValueError as e:
        raise CheckpointError(f"{source}: the shapes give no Anima config: {e}") from None


def config_from_json(text: str) -> AnimaConfig:
    """The config save_anima_single_file writes in the metadata."""
    fields = json.loads(text)
    fields["rope_extrapolation"] = tuple(fields["rope_extrapolation"])
    return AnimaConfig(**fields)


def diffusers_configs(config: AnimaConfig) -> tuple[dict, dict]:
    """(CosmosTransformer3DModel, AnimaTextConditioner) config.json of `config` (no learnable position embedding,
    the conditioner's target_dim = the cross-attention width)."""
    p = config.patch_size
    transformer = dict(
        _class_name=TRANSFORMER_CLASS, in_channels=config.in_channels, out_channels=config.out_channels,
        num_attention_heads=config.num_heads, attention_head_dim=config.head_dim, num_layers=config.num_blocks,
        mlp_ratio=config.mlp_ratio, text_embed_dim=config.text_dim, adaln_lora_dim=config.adaln_lora_dim,
        patch_size=[1, p, p], rope_scale=list(config.rope_extrapolation),
        concat_padding_mask=config.concat_padding_mask, extra_pos_embed_type=None)
    conditioner = dict(
        _class_name=CONDITIONER_CLASS, source_dim=config.adapter_source_dim, target_dim=config.text_dim,
        model_dim=config.adapter_dim, num_layers=config.adapter_layers, num_attention_heads=config.adapter_heads,
        mlp_ratio=4.0, target_vocab_size=config.t5_vocab_size, use_self_attention=True, use_layer_norm=False,
        min_sequence_length=config.min_text_len)
    return transformer, conditioner


def _checked_diffusers_json(folder: str, class_name: str) -> dict:
    cfg = diffusers_config_json(folder, class_name)
    if cfg is None:
        raise CheckpointError(f"{folder}: no config.json (expected a diffusers {class_name} folder)")
    return cfg


def _from_diffusers_json(config: AnimaConfig, transformer: dict, conditioner: dict, folder: str) -> AnimaConfig:
    """The shapes' config with what only the config.json files say (RoPE ratios, min_sequence_length); a
    variant our model does not build is refused, naming the key."""
    supported_values = {"extra_pos_embed_type": None, "use_crossattn_projection": False, "img_context_dim_in": None,
                        "controlnet_block_every_n": None, "concat_padding_mask": True}
    for key, supported in supported_values.items():
        value = transformer.get(key, DIFFUSERS_DEFAULTS.get(key, supported))  # absent: diffusers' default
        if value != supported:
            raise CheckpointError(f"{folder}: transformer/config.json {key} = {value!r} is not Anima's ({supported!r})")
    for key, supported in {"use_self_attention": True, "use_layer_norm": False, "mlp_ratio": 4.0}.items():
        if conditioner.get(key, supported) != supported:
            raise CheckpointError(f"{folder}: text_conditioner/config.json {key} = {conditioner[key]!r} is not "
                                  f"Anima's ({supported!r})")
    patch = transformer.get("patch_size", [1, 2, 2])
    if list(patch) != [1, config.patch_size, config.patch_size]:
        raise CheckpointError(f"{folder}: transformer/config.json patch_size {patch}, expected "
                              f"[1, {config.patch_size}, {config.patch_size}]")
    return dataclasses.replace(config, rope_extrapolation=tuple(float(r) for r in transformer.get(
                                   "rope_scale", DIFFUSERS_DEFAULTS["rope_scale"])),
                               min_text_len=conditioner.get("min_sequence_length", config.min_text_len))


# ----------------------------------------------------------------------------------------------
# Readers: every layout seen in our names


class _PipelineReader:
    """A diffusers pipeline's transformer/ and text_conditioner/ as one reader in our names (a key we have no
    name for keeps its own, prefixed by its component, so that the key check names it)."""

    def __init__(self, root: str, parts: dict[str, CheckpointReader], ours: dict[tuple[str, str], str]):
        self.path, self.metadata = root, {}
        self.parts = parts
        self.files = [f for r in parts.values() for f in r.files]
        self._where = {}
        for component, reader in parts.items():
            for key in reader.keys():
                self._where[ours.get((component, key), f"{component}/{key}")] = (component, key)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def _at(self, key: str) -> tuple[CheckpointReader, str]:
        component, theirs = self._where[key]
        return self.parts[component], theirs

    def shape(self, key: str) -> tuple[int, ...]:
        reader, theirs = self._at(key)
        return reader.shape(theirs)

    def dtype_name(self, key: str) -> str:
        reader, theirs = self._at(key)
        return reader.dtype_name(theirs)

    def file_of(self, key: str) -> str:
        component, theirs = self._where[key]
        return f"{component}/{self.parts[component].file_of(theirs)} ('{theirs}')"

    def get(self, key: str) -> torch.Tensor:
        reader, theirs = self._at(key)
        return reader.get(theirs)


def _pipeline_root(path: str) -> str | None:
    """The pipeline folder of a diffusers layout (given the folder or its transformer/), else None."""
    if not os.path.isdir(path):
        return None
    if os.path.isdir(os.path.join(path, "transformer")):
        return path
    if os.path.isfile(os.path.join(path, "config.json")) and os.path.basename(os.path.normpath(path)) == "transformer":
        return os.path.dirname(os.path.normpath(path))
    return None


def _open_pipeline(root: str) -> tuple[_PipelineReader, AnimaConfig]:
    folders = {c: os.path.join(root, c) for c in ("transformer", "text_conditioner")}
    for component, folder in folders.items():
        if not os.path.isdir(folder):
            raise CheckpointError(f"{root}: no {component}/ folder (an Anima diffusers pipeline has transformer/ and "
                                  f"text_conditioner/)")
    jsons = (_checked_diffusers_json(folders["transformer"], TRANSFORMER_CLASS),
             _checked_diffusers_json(folders["text_conditioner"], CONDITIONER_CLASS))
    parts = {c: CheckpointReader(f) for c, f in folders.items()}
    names = _names_for(parts)
    reader = _PipelineReader(root, parts, names)
    config = config_from_shapes({k: reader.shape(k) for k in reader.keys()}, root)
    return reader, _from_diffusers_json(config, *jsons, root)


def _names_for(parts: dict[str, CheckpointReader]) -> dict[tuple[str, str], str]:
    """(component, diffusers key) -> our key, for every key our model could have at the files' depths."""
    depth = block_count(parts["transformer"].keys(), "transformer_blocks.")
    adapter_depth = block_count(parts["text_conditioner"].keys(), "blocks.")
    skeleton = AnimaConfig(num_blocks=max(depth, 1), adapter_layers=max(adapter_depth, 1), hidden_size=12,
                           num_heads=1, adaln_lora_dim=1, text_dim=2, adapter_dim=2, adapter_heads=1,
                           adapter_source_dim=1, t5_vocab_size=1, mlp_ratio=1.0)
    with torch.device("meta"):
        keys = Anima(skeleton).state_dict().keys()
    extra = ["llm_adapter.in_proj.weight", "llm_adapter.in_proj.bias"]  # present where adapter_dim != text_dim
    return {diffusers_name(k): k for k in (*keys, *extra)}


# ----------------------------------------------------------------------------------------------
# Loading


def load_anima(
    path: str,
    dtype: torch.dtype = torch.float32,
    config: AnimaConfig | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[Anima], Callable | None] | None = None,
    read_weights: bool = True,
) -> Anima:
    """Load Anima (the DiT and the LLM adapter) from the released single file ("net." prefix), the same names plain
    or under ComfyUI's prefixes (a file's other prefixes, e.g. a bundled VAE, are not read), or a diffusers pipeline
    folder (or its transformer/ folder, text_conditioner/ beside it; sharded or not).

    dtype casts floating weights on read and becomes compute_dtype. config overrides our metadata, the config.json
    files and the shapes. convert / prepare: the per-tensor and meta-model hooks (fp8 while loading).
    read_weights=False: the meta model as it would load, from the headers alone (the memory planner). Every key and
    shape is checked before any weight is read; a wrong file is one CheckpointError naming the file and the key.
    A pre-quantized single file (ComfyUI's scaled fp8 / comfy_quant, musubi-tuner's and our fp8 layouts, plain
    e4m3, city96's GGUF) is used as it is stored, whatever `prepare` asks (its fp8 layers keep the spec's FP8 Linears,
    the adapter among them, in high precision)."""
    check_compute_dtype("load_anima", dtype)
    root, stored = _pipeline_root(path), None
    if root is not None:
        view, found = _open_pipeline(root)
        reader, rename = view, (lambda key: key)
    else:
        reader = CheckpointReader(path)
        # a Cosmos-Predict2 DiT file (no LLM adapter) fails here: it is not Anima
        prefix = marked_prefix(path, reader.keys(), PREFIXES, MARKER, "an Anima checkpoint")
        stored = read_stored_layout(reader, path)  # a pre-quantized file (fp8, GGUF) is used as it is
        view = PrefixedReader(reader, prefix)
        if config is None and CONFIG_KEY in reader.metadata:
            config = metadata_config(reader, CONFIG_KEY, config_from_json)
        found = None if config is not None else config_from_shapes({k: view.shape(k) for k in view.keys()}, path)
        rename = lambda key: (key[len(prefix) :] if key.startswith(prefix) and not IGNORED.search(key)  # noqa: E731
                              else None)
    config = config or found
    with torch.device("meta"):
        model = Anima(config)
    scales = stored_extras(stored)
    check_keys_and_shapes(view, model.state_dict(), config, extra=lambda key: bool(IGNORED.search(key)) or scales(key))
    return fill_meta_model(model, reader, rename, path, dtype, stored=stored, keep_rules=FP8, prepare=prepare,
                           convert=convert, read_weights=read_weights, loader="load_anima")


# ----------------------------------------------------------------------------------------------
# Saving


def save_anima_single_file(model_or_sd, path: str, config: AnimaConfig | None = None, prefix: str = RELEASED_PREFIX,
                           metadata: dict[str, str] | None = None, extra: dict[str, torch.Tensor] | None = None):
    """Write the single file (atomic) under `prefix` ("net." as released), the config (when known) in the metadata
    as `anima_config` JSON so that non-standard sizes reload exactly. extra: tensors stored beside the weights
    under the same prefix (the RoPE buffers NVIDIA's files carry, for tests)."""
    sd, config = state_and_config(model_or_sd, config)
    tensors = {prefix + k: v.contiguous() for k, v in {**sd, **(extra or {})}.items()}
    save_with_config(tensors, path, CONFIG_KEY, config, metadata)


def save_anima_diffusers(model_or_sd, config: AnimaConfig | None, folder: str):
    """Write a diffusers pipeline's transformer/ and text_conditioner/ under `folder` (config.json + weights each)."""
    sd, config = state_and_config(model_or_sd, config)
    if config is None:
        raise ValueError("save_anima_diffusers needs an AnimaConfig (or the model) to write config.json")
    parts: dict[str, dict[str, torch.Tensor]] = {"transformer": {}, "text_conditioner": {}}
    for key, value in sd.items():
        component, theirs = diffusers_name(key)
        parts[component][theirs] = value.contiguous()
    for (component, tensors), config_json in zip(parts.items(), diffusers_configs(config)):
        save_diffusers_folder(tensors, config_json, os.path.join(folder, component))
