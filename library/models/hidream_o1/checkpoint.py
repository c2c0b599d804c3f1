"""HiDream-O1-Image checkpoints: loading the Comfy-Org single files (split_files/diffusion_models/
hidream_o1_image{,_dev}_bf16.safetensors and their fp8 versions), the HF repos (HiDream-ai/HiDream-O1-Image{,-Dev}:
sharded with model.safetensors.index.json and config.json) and the names ComfyUI's own saves use; the config from
our metadata, a config.json or the shapes; saving the single-file layout.

The layouts name the tensors of transformers' Qwen3VLForConditionalGeneration, which our modules keep (model.py):
- Comfy-Org's file and the HF repo: `model.language_model.*`, `model.visual.*` (the vision tower, its deepstack
  mergers too), `model.t_embedder1.*`, `model.x_embedder.*`, `model.final_layer2.*`; the HF repo adds `lm_head.*`.
  These are our keys as they are.
- ComfyUI's module names drop the leading `model.` (its diffusion model holds `language_model`, `visual`,
  `t_embedder1`, ...): bare, or under "diffusion_model." / "model.diffusion_model." (a full checkpoint's); musubi-
  tuner accepts bare keys and "diffusion_model." before either naming (hidream_o1_utils.py) and so do we.
MARKER tells the family's files by `final_layer2.linear.bias` (a bias: never quantized in an fp8 file), behind
any of FILE_PREFIXES. The vision tower and lm_head are not read (text-to-image never runs them: 456 M + 120 M
deepstack + 622 M parameters); tools/merge_lora.py streams every tensor of the file it merges into, so a merge
copies them through unchanged, and save_hidream_o1_single_file writes any it is given (`passthrough`).

What the shapes do not say (a file without our metadata and without config.json): RMSNorm eps (1e-6), RoPE theta
(5e6) and the M-RoPE sections (the released proportions of the head: released_mrope_sections), the tms token's id
(151673, checked against the vocabulary) and the image's position fix point (4096).
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import torch

from library.io import CheckpointError, CheckpointReader, RowSplitView, check_keys_and_shapes, metadata_config, \
    read_json_file, save_with_config, state_and_config
from library.models.checkpoint_files import block_count, fill_meta_model, marked_prefix, open_transformer, \
    spec_fp8_rules
from library.models.hidream_o1.model import HIDREAM_O1, HiDreamO1, HiDreamO1Config, released_mrope_sections
from library.models.llm_config import LLMConfig
from library.precision.fp8 import KeepRules
from library.precision.fp8_checkpoints import Fp8Checkpoint
from library.precision.stored_layouts import read_stored_layout, stored_extras

# Before the names under our `model.`: Comfy-Org / HF ("model."), ComfyUI's full checkpoint and diffusion-model
# prefixes, musubi's "diffusion_model." before either naming, ComfyUI's bare names
FILE_PREFIXES = ("model.", "model.diffusion_model.", "diffusion_model.model.", "diffusion_model.", "")
MARKER = "final_layer2.linear.bias"  # a key under a file prefix
OURS = "model."  # our keys are OURS + the key under the file prefix
SKIPPED = ("visual.", "lm_head.")  # under a file prefix: the vision tower (deepstack too), a bare file's head
CONFIG_KEY = "hidream_o1_config"  # safetensors metadata of files we write: the config as JSON
HF_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
LAYERS = "model.language_model.layers."


# ----------------------------------------------------------------------------------------------
# The file's tensors under our names


def model_key(file_key: str, prefix: str) -> str | None:
    """Our key of a file's tensor under `prefix` (OURS + the rest), a stored layout's marker as it is (a key without
    a dot, as ComfyUI's `scaled_fp8`, under the prefix or at the top), or None: not read (the vision tower, lm_head,
    another component of a full checkpoint)."""
    if file_key.startswith(prefix):
        inner = file_key[len(prefix):]
        if "." not in inner:
            return inner
        return None if inner.startswith(SKIPPED) else OURS + inner
    return file_key if "." not in file_key else None


class ModelNamesReader(RowSplitView):
    """A checkpoint's HiDream-O1 tensors named as our modules (model_key), the rest unseen: what the key check, the
    stored-layout readers (fp8 scales looked up by module name) and load_streaming read (io.RowSplitView's renaming,
    no tensor split). The metadata is the file's."""

    parts, part_names = 1, "whole tensors"

    def __init__(self, reader: CheckpointReader, prefix: str):
        super().__init__(reader)
        self.sources = {name: (k, None) for k in reader.keys() if (name := model_key(k, prefix)) is not None}


def skipped_keys(path: str) -> list[str]:
    """The file keys of a HiDream-O1 checkpoint the loader does not read (vision tower, lm_head, other components)."""
    reader = CheckpointReader(path)
    prefix = marked_prefix(path, reader.keys(), FILE_PREFIXES, MARKER, "a HiDream-O1-Image transformer")
    return [k for k in reader.keys() if model_key(k, prefix) is None]


# ----------------------------------------------------------------------------------------------
# Config


def hf_config_json(path: str) -> LLMConfig | None:
    """The language model's config in the HF repo's config.json (path: its folder or index; None without one); a
    diffusers component's, another architecture's or one without interleaved M-RoPE is refused."""
    config_json = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")
    if not os.path.isfile(config_json):
        return None
    cfg = read_json_file(config_json)
    architectures = cfg.get("architectures") or [HF_ARCHITECTURE]
    if "_class_name" in cfg or HF_ARCHITECTURE not in architectures:
        found = cfg.get("_class_name") or architectures
        raise CheckpointError(f"{config_json}: a config of {found}, expected HiDream-O1-Image's {HF_ARCHITECTURE}")
    try:
        llm = LLMConfig.from_hf(cfg)
    except ValueError as e:  # from_hf says "config.json: ...": name the file itself
        raise CheckpointError(f"{config_json}: {str(e).removeprefix('config.json: ')}") from None
    if not llm.mrope_interleaved:
        raise CheckpointError(f"{config_json}: its M-RoPE is not interleaved (Qwen3-VL's is)")
    return llm


def config_from_shapes(shapes: dict[str, tuple[int, ...]], source: str = "checkpoint",
                       hf_config: LLMConfig | None = None) -> HiDreamO1Config:
    """HiDreamO1Config from tensor shapes under our names: vocabulary and width from embed_tokens, the layers, the
    head width from q_norm, the heads from q_proj / k_proj, the MLP from gate_proj, the patch and bottleneck from
    x_embedder.proj1; eps, theta and the M-RoPE sections from an HF config.json's (hf_config_json) when given,
    else as released (module docstring)."""

    def shape(key):
        if key not in shapes:
            raise CheckpointError(f"{source}: cannot infer the HiDream-O1 config, key '{key}' is missing")
        return shapes[key]

    vocab, hidden = shape("model.language_model.embed_tokens.weight")
    head_dim = shape(LAYERS + "0.self_attn.q_norm.weight")[0]
    bottleneck, features = shape("model.x_embedder.proj1.weight")
    patch = math.isqrt(features // HIDREAM_O1.in_channels)
    rope = dict(rms_norm_eps=HIDREAM_O1.rms_norm_eps, rope_theta=HIDREAM_O1.rope_theta,
                mrope_section=released_mrope_sections(head_dim))
    if hf_config is not None:
        rope = dict(rms_norm_eps=hf_config.rms_norm_eps, rope_theta=hf_config.rope_theta,
                    mrope_section=hf_config.mrope_section)
    try:
        if patch * patch * HIDREAM_O1.in_channels != features:
            raise ValueError(f"x_embedder.proj1 takes {features} values, no RGB square patch")
        return HiDreamO1Config(
            hidden_size=hidden, num_layers=block_count(shapes, LAYERS),
            num_heads=shape(LAYERS + "0.self_attn.q_proj.weight")[0] // head_dim,
            num_kv_heads=shape(LAYERS + "0.self_attn.k_proj.weight")[0] // head_dim, head_dim=head_dim,
            intermediate_size=shape(LAYERS + "0.mlp.gate_proj.weight")[0], vocab_size=vocab, patch_size=patch,
            bottleneck_dim=bottleneck, **rope)
    except ValueError as e:
        raise CheckpointError(f"{source}: the shapes give no HiDream-O1 config: {e} (a file of other sizes than the "
                              f"release's needs its config: our metadata, or config=)") from None


def config_from_json(text: str) -> HiDreamO1Config:
    """The config save_hidream_o1_single_file writes in the metadata (JSON lists back to tuples)."""
    fields = json.loads(text)
    return HiDreamO1Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


# ----------------------------------------------------------------------------------------------
# Loading


def load_hidream_o1(
    path: str,
    dtype: torch.dtype = torch.float32,
    prepare: Callable[[HiDreamO1], Callable | None] | None = None,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
    read_weights: bool = True,
    config: HiDreamO1Config | None = None,
    fp8_rules: KeepRules | None = None,
) -> HiDreamO1:
    """Load the HiDream-O1 transformer from a single file (Comfy-Org's `model.*` names, or ComfyUI's bare names,
    either behind "diffusion_model." / "model.diffusion_model.") or an HF repo folder (sharded with its index; its
    config.json read). The vision tower and lm_head are not read.

    dtype casts floating weights on read and becomes compute_dtype. prepare / convert: the meta-model and per-tensor
    hooks (fp8 while loading). read_weights=False: the meta model as it would load, from the headers alone (the
    memory planner). config overrides our `hidream_o1_config` metadata, config.json and the shapes. Every key and
    shape is checked before any weight is read; another family's file is one CheckpointError naming the missing
    key. A pre-quantized file is used as it is stored, whatever `prepare` asks; fp8_rules: the Linears its fp8
    layers keep in high precision (default: the family spec's FP8)."""
    path, reader = open_transformer(path, "load_hidream_o1", dtype)
    hf_config = hf_config_json(path) if os.path.isdir(path) or path.endswith(".index.json") else None
    prefix = marked_prefix(path, reader.keys(), FILE_PREFIXES, MARKER, "a HiDream-O1-Image transformer")
    view = ModelNamesReader(reader, prefix)
    stored = read_stored_layout(view, path)  # a pre-quantized file (fp8, GGUF) is used as it is
    extra = stored_extras(stored)
    if config is None and CONFIG_KEY in reader.metadata:
        config = metadata_config(reader, CONFIG_KEY, config_from_json)
    if config is None:
        config = config_from_shapes({k: view.shape(k) for k in view.keys() if not extra(k)}, path, hf_config)
    with torch.device("meta"):
        model = HiDreamO1(config)
    check_keys_and_shapes(view, model.state_dict(), config, extra)
    if fp8_rules is None and isinstance(stored, Fp8Checkpoint):  # fp8 layouts follow keep rules; GGUF's the file
        fp8_rules = spec_fp8_rules(path, stored, "library.models.hidream_o1", "HiDream-O1-Image")
    return fill_meta_model(model, view, lambda key: key, path, dtype, stored=stored, keep_rules=fp8_rules,
                           prepare=prepare, convert=convert, read_weights=read_weights, loader="load_hidream_o1")


# ----------------------------------------------------------------------------------------------
# Saving


def save_hidream_o1_single_file(weights, path: str, config: HiDreamO1Config | None = None, prefix: str = "",
                                metadata: dict[str, str] | None = None, write_config: bool = True,
                                passthrough: dict[str, torch.Tensor] | None = None):
    """Write the single-file layout (atomic): our keys, the Comfy-Org file's (or under `prefix`), the config (given
    or the model's) in the metadata as `hidream_o1_config` JSON unless write_config is False (a released file has
    none: the loader reads the sizes from the shapes). passthrough: tensors the model does not hold, written under
    their own keys as they are (a merge keeps the source's `model.visual.*`: skipped_keys names them)."""
    sd, config = state_and_config(weights, config)
    tensors = {prefix + k: v.contiguous() for k, v in sd.items()}
    clash = sorted(tensors.keys() & (passthrough or {}).keys())
    if clash:
        raise ValueError(f"save_hidream_o1_single_file: passthrough key '{clash[0]}' is a model tensor's")
    tensors.update({k: v.contiguous() for k, v in (passthrough or {}).items()})
    save_with_config(tensors, path, CONFIG_KEY, config if write_config else None, metadata)
