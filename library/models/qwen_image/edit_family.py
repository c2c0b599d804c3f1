"""Qwen-Image-Edit (Edit, Edit-2509, Edit-2511) as a diffusion family: Qwen-Image's transformer
with the condition images' latents appended to the target's, the Qwen2.5-VL text encoder that
sees the condition images, and the version's condition sizes (edit.py).

The version comes from `model_version` or from the transformer's config.json (zero_cond_t means
2511; Edit and 2509 share their config, and without model_version a folder is taken as 2509). A
single transformer file has no config: pass model_version.

Training (the FLUX.1 Kontext interface, family.py): `control` is the list of reference latents
(a subset's control_directory, a sample prompt's --ci), appended to the target's tokens; the loss
is on the target's tokens. Edit takes one reference, 2509 / 2511 up to three (the Plus pipeline's
prompt names "Picture 1..n"; three is what the releases were trained with). For the VAE a
reference keeps its own aspect ratio: in samples (sample_control_bucket) at the pipelines' ~1024x1024
area whatever the target's size (calculate_dimensions(VAE_IMAGE_SIZE, ratio)); in training
(control_bucket) at the dataset resolution's area whatever the target's bucket, which is the same at
the 1024 training resolution (musubi-tuner's recommended control_resolution = [1024, 1024]) and
scales down with a lower one. The text sees the references too, at the pipeline's fixed
VL-encoder size (edit_sizes: ~384x384 area for 2509 / 2511, ~1024x1024 for Edit), so a text cache
entry is per (caption, references) (text_sees_controls; library/data/caches.py cache_text). LoRA targets, fp8 rules and
flow-matching constants are Qwen-Image's (arch). Samples use true CFG with the negative prompt,
encoded with the same references, as the pipelines do.
"""

from __future__ import annotations

from functools import cached_property

import torch

from library.models.qwen_image import edit
from library.models.qwen_image.edit import (EDIT, EDIT_2509, SIZE_MULTIPLE, TRANSFORMER_FLAGS,
                                            VL_TOKEN_PIXELS, area_size, check_version, edit_sizes, resize_condition,
                                            version_from_flags)
from library.models.qwen_image.family import QwenImageFamily, per_caption, refuse_layered
from library.models.qwen_image.spec import SPEC
from library.models.latents import pack_latents


class QwenImageEditFamily(QwenImageFamily):
    """Qwen-Image-Edit: predict takes the condition images' latents besides the noisy target's."""

    name = "qwen_image_edit"
    arch = "qwen_image"  # Qwen-Image's transformer: its LoRA targets, fp8 rules and flow-matching constants
    sample_steps = SPEC.sample_steps["edit"]  # the edit pipelines' 50
    min_controls = 1  # the pipelines always condition on an image
    plan_controls = 1
    text_sees_controls = True  # encode(captions, condition_images)
    stretches_references = True  # the pipelines' VaeImageProcessor.resize: what the VL encoder sees too
    # Qwen2.5-VL with its vision tower: the text encoder sees the condition images.
    text_encoder_kind = ("Qwen2.5-VL with its vision tower",
                         {**QwenImageFamily.text_encoder_kind[1], "patch_embed.proj.weight": None})
    text_tokenizer = None  # the tokenizer is the processor folder's (check_model_files finds it)
    option_keys = ("model_version",)

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None, **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        self._version = check_version(model_version) if model_version else None

    @cached_property
    def version(self) -> str:
        """model_version, checked against the transformer's config flags, else the flags' version
        (read once: the text encoder asks for every caption batch)."""
        path, config = self.transformer_config()
        refuse_layered(f"{path}/config.json", config or {})  # a single file's flags are model_version's
        if config is None:
            if self._version is None:
                raise ValueError(f"{path}: a single transformer file has no config.json; set model_version "
                                 f"(qwen-image-edit, qwen-image-edit-2509 or qwen-image-edit-2511)")
            return self._version
        if self._version is None:
            return version_from_flags(config)
        for flag, value in TRANSFORMER_FLAGS[self._version].items():
            if bool(config.get(flag, False)) != value:
                raise ValueError(f"{path}/config.json: {flag}={config.get(flag, False)!r} but model_version "
                                 f"{self._version} expects {value!r}")
        return self._version

    def check_model_files(self) -> None:
        """Also the processor (tokenizer + image processor) the text encoder loads with: without this it is
        looked for when the text encoder loads, after the latents are cached."""
        from library.models.qwen_image.edit_encoder import find_processor

        super().check_model_files()
        find_processor(self.text_paths["text_encoder"])

    def model_version(self, model) -> str:
        return self.version

    def lora_release_note(self, metadata: dict) -> str | None:
        """Edit and 2509 share their config.json: a folder read as 2509 may be Edit (2511's flags say which it is)."""
        trained = metadata.get("ss_base_model_version")
        if self._version is not None or {trained, self.version} != {EDIT, EDIT_2509}:
            return None
        return self.other_release_note(trained, "read from its config.json, which Edit and 2509 share")

    @property
    def max_controls(self) -> int:
        """Edit: one condition image; 2509 / 2511: up to three."""
        return 1 if self.version == EDIT else 3

    def control_bucket(self, bucket: tuple[int, int], size: tuple[int, int],
                       resolution: tuple[int, int] | None = None) -> tuple[int, int]:
        """Training: a reference keeps its aspect ratio at the training resolution's area (the dataset's
        `resolution`; None: the target bucket's), sides multiples of 32: the pipelines' rule scaled to it.
        Not the bucket's: a non-square bucket's area is under the resolution's, so a reference came out
        one 32-pixel step smaller than the pipelines' at 1024 (1344 x 768, not 1376 x 768, for 1920 x 1080)."""
        w, h = resolution or bucket
        w, h = area_size(size[0], size[1], w * h)
        return max(w, SIZE_MULTIPLE), max(h, SIZE_MULTIPLE)

    def sample_control_bucket(self, target: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
        """Samples: a reference keeps its aspect ratio at the VAE area (~1024x1024) whatever the
        target, as the pipelines' calculate_dimensions(VAE_IMAGE_SIZE, ratio)."""
        w, h = area_size(size[0], size[1], edit.VAE_IMAGE_AREA)
        return max(w, SIZE_MULTIPLE), max(h, SIZE_MULTIPLE)

    def reference_vl_size(self, width: int, height: int) -> tuple[int, int]:
        return edit_sizes(self.version, [(width, height)]).encoder[0]  # load_text_encoder's resize

    def reference_text_tokens(self, width: int, height: int) -> int:
        """The VL encoder sees each reference at the version's size (edit_sizes: ~384x384 area for
        2509 / 2511, ~1024x1024 for Edit), one vision token per 28x28 pixels, as the processor rounds."""
        w, h = self.reference_vl_size(width, height)
        return round(w / VL_TOKEN_PIXELS) * round(h / VL_TOKEN_PIXELS)

    def text_encoding_constants(self) -> dict:
        from library.models.qwen_image import edit_encoder as te

        template = te.EDIT_PROMPT_TEMPLATE if self.version == "qwen-image-edit" else te.EDIT_PLUS_PROMPT_TEMPLATE
        return {"version": self.version, "template": template, "drop": te.EDIT_DROP_TOKENS,
                "picture": te.PICTURE_TEMPLATE if self.version != "qwen-image-edit" else None}

    def caption_token_limit(self, args):
        return None  # the edit pipelines tokenize without truncation: every token is kept

    def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
        """The transformer; a single file gets the version's config flags (its shapes give the rest)."""
        return self.load_flagged_transformer(TRANSFORMER_FLAGS[self.version], dtype, base_precision, read_weights)

    def load_text_encoder(self, precision="bf16", device=None):
        """-> encode(captions, condition_images): condition_images[i] is sample i's list of PIL
        images at any size; each is resized to the version's VL-encoder size (edit_sizes)."""
        from library.models.qwen_image.edit_encoder import load_qwen_image_edit_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_qwen_image_edit_text_encoder(self.text_paths["text_encoder"], self.version, dtype=dtype, fp8=fp8)
        encoder.llm.to(device)
        encoder.visual.to(device)

        def encode(captions: list[str], condition_images: list[list]) -> list[dict]:
            sized = [[resize_condition(img, size) for img, size in
                      zip(images, edit_sizes(self.version, [img.size for img in images]).encoder)]
                     for images in condition_images]
            return per_caption(*encoder.encode(captions, sized))

        return encode

    def predict(self, model, x_t, sigmas, text, h, w, guidance, control: list[torch.Tensor] | None = None):
        """x_t: packed noisy target [B, h*w, 64]; control: the condition images' latents, each
        unpacked [B, 16, H_i, W_i] float32 (VAE-normalized as the target's). Returns the target's
        velocity [B, h*w, 64]: the condition tokens' outputs are dropped, as the pipelines do."""
        if not control:
            raise ValueError("qwen_image_edit: predict needs the condition images' latents (control=[...])")
        packed = [pack_latents(c.to(x_t.device, x_t.dtype)) for c in control]
        shapes = [(1, h, w)] + [(1, c.shape[2] // self.patch, c.shape[3] // self.patch) for c in control]
        pred = self.transformer_call(model, torch.cat([x_t, *packed], dim=1), [shapes] * x_t.shape[0], sigmas, text)
        return pred[:, : x_t.shape[1]]
