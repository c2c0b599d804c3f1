"""Krea 2 (Raw, Turbo) as a diffusion family: the single-stream MMDiT with the released single
file's names (model.py, loaded by checkpoint.py), Qwen-Image's VAE (the same AutoencoderKLQwenImage:
qwen_image/vae.py) and Qwen3-VL-4B text, 12 tapped layers per token with a padding mask (text_encoder.py).

Raw and Turbo share the transformer config and differ in weights and in how Krea2Pipeline samples
them: Raw over 28 steps with CFG 4.5 in Krea's convention (pred = cond + g (cond - uncond), i.e.
standard CFG at 1 + g) and the resolution-aware shift; Turbo (is_distilled) over 8 steps, guidance 0,
a fixed mu 1.15. LoRAs train on Raw and run on either (musubi-tuner's recommended workflow: train
Raw, infer Turbo); training on Turbo takes a de-distillation adapter merged into the frozen base
(`base_loras`, as ai-toolkit's "assistant LoRA"). The version comes from `model_version`, else the
pipeline folder's model_index.json `is_distilled`, else a file name with "turbo" in it (the released
turbo.safetensors), else Raw.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import cached_property

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, control_kwargs
from library.models.krea2.spec import SPEC

RAW, TURBO = "krea2-raw", "krea2-turbo"
TURBO_MU = 1.15  # Krea2Pipeline's fixed mu for the distilled checkpoint
SAMPLE_DEFAULTS = {v: (SPEC.sample_guidance[k], SPEC.sample_steps[k]) for v, k in ((RAW, "raw"), (TURBO, "turbo"))}  # Krea2Pipeline: (guidance_scale, num_inference_steps)


class Krea2Family(DiffusionFamily):
    """Krea 2: original module names, the Qwen-Image VAE, Qwen3-VL text (12 layers per token) with a
    mask, CFG for Raw only."""

    name = "krea2"
    vae = "library.models.qwen_image.vae:QwenImageVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    # Raw's pipeline call (what LoRAs train on); an instance of Turbo takes Turbo's (8 steps, no CFG).
    sample_guidance, sample_steps = SAMPLE_DEFAULTS[RAW]
    true_cfg = True  # a negative prompt is encoded for samples; guided_velocity runs it when guidance > 0
    cfg_above = 0.0  # Krea2Pipeline: CFG when guidance_scale > 0
    option_keys = ("model_version",)

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None, **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        if model_version is not None and model_version not in SAMPLE_DEFAULTS:
            raise ValueError(f"model_version {model_version!r}: expected {RAW} or {TURBO}")
        self._version = model_version
        self.sample_guidance, self.sample_steps = SAMPLE_DEFAULTS[self.version]

    # -- the release ---------------------------------------------------------------------------
    def pipeline_index(self) -> dict:
        """The pipeline folder's model_index.json (Krea2Pipeline's is_distilled, text_encoder_select_layers), or {}."""
        folder = self.model_path if os.path.isdir(self.model_path) else os.path.dirname(self.model_path)
        for candidate in (folder, os.path.dirname(folder.rstrip("/"))):
            path = os.path.join(candidate, "model_index.json")
            if os.path.isfile(path):
                with open(path) as f:
                    return json.load(f)
        return {}

    @cached_property
    def version(self) -> str:
        if self._version is not None:
            return self._version
        index = self.pipeline_index()
        if "is_distilled" in index:
            return TURBO if index["is_distilled"] else RAW
        return TURBO if "turbo" in os.path.basename(self.model_path.rstrip("/")).lower() else RAW

    def model_version(self, model) -> str:
        return self.version

    def lora_release_note(self, metadata: dict) -> str | None:
        """Where the release was guessed from the file name (a pipeline folder's model_index.json says which it is)."""
        trained = metadata.get("ss_base_model_version")  # an edit LoRA's (krea2-raw-edit) names no release here
        guessed = self._version is None and "is_distilled" not in self.pipeline_index()
        if not guessed or trained not in SAMPLE_DEFAULTS or trained == self.version:
            return None
        return self.other_release_note(trained, "read from its file name, which "
                                       + ("does not say turbo" if self.version == RAW else "says turbo"))

    def inference_sampling(self):
        """Turbo samples with the fixed mu 1.15 (a constant shift e^1.15); Raw with the spec's line."""
        from library.models.flow_matching import sampling_of

        if self.version != TURBO:
            return None
        return dataclasses.replace(sampling_of(self.arch), mu=None, shift=math.exp(TURBO_MU))

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.qwen_image.vae import qwen_image_vae_file

        return [
            qwen_image_vae_file(self.vae_path),
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen3-VL language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_norm.weight": None},
                      (None, "tokenizer", "Qwen2")),  # as its loader looks for the tokenizer
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.text_hidden_dim}  # per tapped layer (num_text_layers of them)

    def text_on_meta(self, model, batch, tokens):
        # No mask: every planned caption is `tokens` long (the forward then reads nothing on the host).
        cfg = model.config
        return {"embeds": torch.empty(batch, tokens, cfg.num_text_layers, cfg.text_hidden_dim, device="meta")}

    @cached_property
    def taps(self) -> tuple[int, ...]:
        """text_encoder_select_layers: the pipeline folder's, else the released ones."""
        from library.models.krea2.text_encoder import KREA2_TAPS, pipeline_taps

        return pipeline_taps(self.text_paths.get("text_encoder"), self.model_path) or KREA2_TAPS

    def text_encoder(self, precision="bf16", device=None):
        """The Krea2TextEncoder on `device`, its taps checked against the transformer's text layers."""
        from library.models.krea2.text_encoder import load_krea2_text_encoder
        from library.models.text_encoders import encoder_precision

        # headers only; no transformer yet where tools/pretrain_tiny_base.py encodes the captions it will learn from
        layers = (self.load_transformer(torch.float32, read_weights=False).config.num_text_layers
                  if os.path.exists(self.model_path) else len(self.taps))
        if layers != len(self.taps):
            raise ValueError(f"{self.model_path}: the transformer takes {layers} text layers per token, the text "
                             f"encoder taps {len(self.taps)} ({list(self.taps)}: model_index.json or Krea 2's)")
        dtype, fp8 = encoder_precision(precision)
        encoder = load_krea2_text_encoder(self.text_paths["text_encoder"], dtype=dtype, taps=self.taps, fp8=fp8)
        encoder.llm.to(device)
        return encoder

    def load_text_encoder(self, precision="bf16", device=None):
        encoder = self.text_encoder(precision, device)

        def encode(captions: list[str]) -> list[dict]:
            return per_caption(*encoder.encode(captions))

        return encode

    def text_encoder_weights(self):
        """The embeddings, the decoder layers up to the deepest tap and the final norm (no head, no vision)."""
        from library.models.text_encoders import qwen3_vl_text_weights

        return [qwen3_vl_text_weights(self.text_paths["text_encoder"], max(self.taps))]

    def text_encoding_constants(self) -> dict:
        from library.models.krea2 import text_encoder as te

        return {"prefix": te.KREA2_PROMPT_PREFIX, "suffix": te.KREA2_PROMPT_SUFFIX, "drop": te.KREA2_DROP_TOKENS,
                "max_length": te.KREA2_MAX_SEQUENCE_LENGTH, "taps": list(self.taps)}

    def caption_token_limit(self, args):
        """The pipeline cuts the template prefix + caption at 541 tokens (512 kept after the prefix,
        the 5-token suffix included)."""
        from library.data.check import TokenLimit
        from library.io import component_folder
        from library.models.krea2 import text_encoder as te
        from library.models.text_encoders import _load_tokenizer

        tokenizer = _load_tokenizer(component_folder(self.text_paths["text_encoder"], "text_encoder"), None, "tokenizer", "Qwen2")
        limit = te.KREA2_MAX_SEQUENCE_LENGTH + te.KREA2_DROP_TOKENS - te.KREA2_SUFFIX_TOKENS
        return TokenLimit("Qwen3-VL", limit, lambda text: len(tokenizer(te.KREA2_PROMPT_PREFIX + text, verbose=False).input_ids))

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """Our (the single file's) names, plain or behind a ComfyUI prefix, or a diffusers folder's
        (renamed through the module map; nothing is fused)."""
        from library.models.krea2.checkpoint import DIFFUSERS_MARKER, MARKER, PREFIXES, config_from_shapes, original_key
        from library.models.krea2.lora_files import module_map_of_config

        prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
        if prefix is not None:
            return CheckpointNames("krea2", prefix)
        if DIFFUSERS_MARKER in keys:
            shapes = {original_key(k): shape(k) for k in keys}
            return CheckpointNames("diffusers", "", module_map_of_config(config_from_shapes(shapes)), native=False)
        return None

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """Captions of a batch differ in length: the cached ones are stacked to the longest with the
        mask (collate pads them); the padded tokens are hidden from every query."""
        device = x_t.device
        mask = text.get("mask")
        return model(img=x_t, txt=text["embeds"].to(device), timesteps=sigmas, h=h, w=w,
                     txt_mask=None if mask is None else mask.to(device).bool())

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        """Krea2Pipeline: CFG when guidance > 0, pred = cond + g (cond - uncond), in float32. control:
        the edit variant's references (edit_family.py), in both predictions."""
        refs = control_kwargs(control)
        cond = self.predict(model, x, s, text, h, w, guidance, **refs).float()
        if negative_text is None or guidance is None or guidance <= self.cfg_above:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance, **refs).float()
        return cond + guidance * (cond - uncond)


def per_caption(embeds: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """[B, T, taps, D] float32 and mask [B, T] bool (real tokens first) -> each caption's real tokens."""
    return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]
