"""Krea 2 edit (model_type krea2_edit): Krea 2 Raw / Turbo trained and sampled with reference images,
as ai-toolkit trains it (`arch: krea2`, `model_kwargs: edit: true`) and ComfyUI runs it
(ComfyUI-Krea2-Ostris-Edit). There is no released edit checkpoint: the LoRA learns the editing on the
text-to-image weights, so everything but `predict`, the references' sizes and the caption encoding
is Krea 2's (family.py).

The references (a subset's control_directory, a sample prompt's --ci) enter the transformer as clean
tokens after the target (model.py References): reference i at positions (i + 1, r, c), modulated at
t = 0, the loss on the target's tokens only. A reference keeps its own aspect ratio and is scaled
down (never up) to at most `reference_resolution`^2 pixels (ai-toolkit's control_image_max_pixels,
1024^2), each side rounded to a multiple of 16 (VAE 8 x patch 2), whatever the target's size.
The captions are encoded with their references too (edit_encoder.py: ai-toolkit's "Picture i:" slots,
each reference at <= 384^2 pixels; the vision tower from the text encoder folder, the image processor's
preprocessor_config.json beside it or in processor/), so a text cache entry is per (caption,
references). `reference_kv_cache` (ai-toolkit's model_kwargs kv_cache) trains the asymmetric mask
where reference queries see only reference keys, which ComfyUI's kv_cache toggle needs at inference;
it is recorded in the LoRA's metadata (ss_base_model_version krea2-raw-edit-kv_cache).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from library.models.krea2.family import Krea2Family
from library.models.latents import pack_latents

REFERENCE_RESOLUTION = 1024  # ai-toolkit's control_image_max_pixels default: 1024 * 1024
SIZE_MULTIPLE = 16  # its get_bucket_divisibility: VAE 8 x patch 2


def reference_size(width: int, height: int, resolution: int = REFERENCE_RESOLUTION) -> tuple[int, int]:
    """(w, h) ai-toolkit encodes a reference of width x height at (_encode_ref_latents): scaled down to
    resolution^2 pixels when larger (aspect kept), then each side round(side / 16) * 16, at least 16."""
    w, h = float(width), float(height)
    budget = resolution * resolution
    if width * height > budget:
        ratio = height / width
        h = math.sqrt(budget * ratio)
        w = h / ratio
    return max(SIZE_MULTIPLE, round(w / SIZE_MULTIPLE) * SIZE_MULTIPLE), max(SIZE_MULTIPLE, round(h / SIZE_MULTIPLE) * SIZE_MULTIPLE)


class Krea2EditFamily(Krea2Family):
    """Krea 2 with reference images (ai-toolkit's edit scheme): predict takes their latents."""

    name = "krea2_edit"
    arch = "krea2"  # Krea 2's transformer: its LoRA targets, fp8 rules and flow-matching constants
    max_controls = 4  # ai-toolkit takes any number (each a further frame on the first RoPE axis)
    min_controls = 0  # none: the text-to-image forward exactly
    edits_without_references_warn = True  # (the text-to-image model type is krea2)
    plan_controls = 1
    text_sees_controls = True  # encode(captions, condition_images): ai-toolkit shows them to Qwen3-VL
    reference_resolution = REFERENCE_RESOLUTION  # an instance takes the config's (a planner preset keeps these)
    reference_kv_cache = False
    option_keys = ("model_version", "reference_resolution", "reference_kv_cache")

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None,
                 reference_resolution: int | None = None, reference_kv_cache: bool = False, **text_paths):
        super().__init__(model_path, vae_path, model_version, **text_paths)
        self.reference_resolution = reference_resolution or REFERENCE_RESOLUTION
        self.reference_kv_cache = bool(reference_kv_cache)

    def check_model_files(self) -> None:
        """Also Qwen3-VL's image processor the references need: without this it is looked for at the first
        caption with a reference, after the latents are cached."""
        from library.models.krea2.edit_encoder import find_image_processor

        super().check_model_files()
        find_image_processor(self.text_paths["text_encoder"])

    def model_version(self, model) -> str:
        """krea2-raw-edit (or -turbo-): the LoRA's ss_base_model_version; "-kv_cache" when trained with it."""
        return f"{self.version}-edit" + ("-kv_cache" if self.reference_kv_cache else "")

    @classmethod
    def lora_trained_options(cls, metadata: dict) -> dict:
        """A LoRA trained with the kv_cache mask (model_version's "-kv_cache") renders with it: its references never
        attended to the target in training."""
        version = metadata.get("ss_base_model_version", "")
        kv_cache = {"reference_kv_cache": (True, f"ss_base_model_version {version}")} \
            if version.endswith("-kv_cache") else {}
        return {**super().lora_trained_options(metadata), **kv_cache}

    def control_bucket(self, bucket: tuple[int, int], size: tuple[int, int],
                       resolution: tuple[int, int] | None = None) -> tuple[int, int]:
        """ai-toolkit's rule, whatever the target's size (its references keep their own size)."""
        return reference_size(size[0], size[1], self.reference_resolution)

    def largest_reference(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """A reference is scaled down to reference_resolution^2 pixels, never up: one that size, whatever the
        target's."""
        return self.reference_resolution, self.reference_resolution

    def load_text_encoder(self, precision="bf16", device=None):
        """-> encode(captions, condition_images=None): condition_images[i] is caption i's references (PIL,
        any size: edit_encoder resizes them to ai-toolkit's <= 384^2). The vision tower loads on the first
        caption with references (a batch without any encodes as text only)."""
        from library.models.krea2.edit_encoder import with_vision
        from library.models.krea2.family import per_caption
        from library.models.text_encoders import encoder_precision

        encoder, vision = self.text_encoder(precision, device), None

        def encode(captions: list[str], condition_images: list[list] | None = None) -> list[dict]:
            nonlocal vision
            images = condition_images or [[] for _ in captions]
            if not any(images):
                return per_caption(*encoder.encode(captions))
            if vision is None:
                vision = with_vision(encoder, self.text_paths["text_encoder"], encoder_precision(precision)[0])
                vision.visual.to(device)
            return per_caption(*vision.encode_with_images(captions, images))

        return encode

    def caption_token_limit(self, args):
        """Krea 2's (cut at 541 tokens) for a caption encoded as text only; one encoded with its references
        is kept whole (edit_encoder: ai-toolkit does not truncate it)."""
        return dataclasses.replace(super().caption_token_limit(args), cuts_with_references=False)

    def text_encoding_constants(self) -> dict:
        """The base's, plus how the references are shown to Qwen3-VL (their slot, their pixel budget)."""
        from library.models.krea2 import edit_encoder as ee

        return {**super().text_encoding_constants(), "image_slot": ee.IMAGE_SLOT, "vlm_area": ee.VLM_AREA,
                "vlm_min_side": ee.VLM_MIN_SIDE}

    def reference_vl_size(self, width: int, height: int) -> tuple[int, int]:
        from library.models.krea2.edit_encoder import vlm_size

        return vlm_size(width, height)  # Krea2ImageTextEncoder.vl_inputs' resize

    def reference_text_tokens(self, width: int, height: int) -> int:
        """Qwen3-VL sees a reference at <= 384^2 pixels, one token per 32 x 32 (16-pixel patches merged 2 x 2)."""
        w, h = self.reference_vl_size(width, height)
        return max(1, round(w / 32)) * max(1, round(h / 32))

    def predict(self, model, x_t, sigmas, text, h, w, guidance, control: list[torch.Tensor] | None = None):
        """x_t: packed noisy target [B, h*w, 64]; control: the references' latents, each unpacked
        [B, 16, H_i, W_i] float32 (VAE-normalized as the target's), or None. Returns the target's
        velocity [B, h*w, 64]."""
        from library.models.krea2.model import References, reference_positions

        if not control:
            return super().predict(model, x_t, sigmas, text, h, w, guidance)
        device, mask = x_t.device, text.get("mask")
        tokens = torch.cat([pack_latents(c.to(device, x_t.dtype)) for c in control], dim=1)
        grids = [(c.shape[2] // 2, c.shape[3] // 2) for c in control]
        refs = References(tokens, reference_positions(grids, device), isolate=self.reference_kv_cache)
        return model(img=x_t, txt=text["embeds"].to(device), timesteps=sigmas, h=h, w=w,
                     txt_mask=None if mask is None else mask.to(device).bool(), refs=refs)
