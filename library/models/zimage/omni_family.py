"""Z-Image Omni as a diffusion family (model_type zimage_omni): the Z-Image transformer in its omni
mode (omni.py), FLUX.1's VAE, Qwen3-4B on Omni's segmented template plus SigLIP2 features of each
reference (omni_encoder.py), as ZImageOmniPipeline drives them.

Training takes the Kontext interface (family.py): `control` is the list of reference latents (a
subset's control_directory, a sample prompt's --ci), the loss is on the target's tokens. The
references are seen twice, as the pipeline sees them: their VAE latents (cached with the target's
latents, at control_bucket's size) and their SigLIP features, which are cached with the caption
(text_sees_controls: the text cache entry is per (caption, references), like Qwen-Image-Edit's),
because the caption's template depends on the reference count too. Zero references is the
pipeline's text-to-image mode. LoRA targets, fp8 rules and the LoRA layout are Z-Image's (arch).

Sampling as the pipeline: CFG pred = pos + g (pos - neg) with the negative prompt encoded with the
same references (its defaults: guidance 5, 50 steps, no normalisation or truncation); the sigma
shift is the repo's scheduler_config.json (its constant `shift`, or the resolution shift with its
constants where use_dynamic_shifting is set; without a file Z-Image Base's constant 6).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from library.models.family import ModelFile, file_fingerprint, fp8_prepare
from library.models.zimage.family import ZImageFamily
from library.models.zimage.spec import SPEC

OMNI = "zimage-omni"
SIGLIP_PLAN_GRID = (16, 16)  # planner: SigLIP patches of a reference (Siglip2ImageProcessor's max_num_patches 256)
DEFAULT_SHIFT = 6.0  # no scheduler config: Z-Image Base's constant shift (Omni samples like Base: CFG, 50 steps)


class ZImageOmniFamily(ZImageFamily):
    name = "zimage_omni"
    arch = "zimage"  # Z-Image's transformer: its LoRA targets, fp8 rules and layouts
    sample_guidance = SPEC.sample_guidance["omni"]  # ZImageOmniPipeline's defaults
    sample_steps = SPEC.sample_steps["omni"]
    true_cfg = True
    max_controls = 4  # the pipeline takes any number; each adds its grid and 256 SigLIP tokens to every step
    min_controls = 0  # no reference: the pipeline's text-to-image mode
    plan_controls = 1
    text_sees_controls = True  # encode(captions, condition_images): segments + SigLIP features
    optional_path_keys = ("siglip",)  # the repo's siglip/ where unset
    option_keys = ("model_version", "siglip")

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None,
                 siglip: str | None = None, **text_paths):
        if model_version not in (None, OMNI):
            raise ValueError(f"model_version {model_version!r}: zimage_omni is {OMNI}")
        super().__init__(model_path, vae_path, None, **text_paths)
        self.siglip_path = siglip or model_path  # the repo's siglip/ (+ siglip_processor/) by default

    @property
    def version(self) -> str:
        return OMNI

    def inference_sampling(self):
        """The folder's scheduler: a constant shift, or the resolution shift where it shifts dynamically."""
        from library.models.flow_matching import sampling_of
        from library.models.spec import MuLine

        config = self._scheduler_config() or {}
        sampling = sampling_of(self.arch)
        if config.get("use_dynamic_shifting"):
            mu = MuLine(config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                        config.get("base_shift", 0.5), config.get("max_shift", 1.15))  # the pipeline's fallbacks
            return dataclasses.replace(sampling, mu=mu, shift=None)
        return dataclasses.replace(sampling, shift=float(config.get("shift", DEFAULT_SHIFT)))

    def _scheduler_config(self) -> dict | None:
        folder = self.model_path if os.path.isdir(self.model_path) else os.path.dirname(self.model_path)
        for candidate in (folder, os.path.dirname(folder.rstrip("/"))):
            path = os.path.join(candidate, "scheduler", "scheduler_config.json")
            if os.path.isfile(path):
                with open(path) as f:
                    return json.load(f)
        return None

    # -- loading -------------------------------------------------------------------------------
    def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
        from library.models.zimage.checkpoint import load_zimage
        from library.models.zimage.omni import ZImageOmni

        return load_zimage(self.model_path, dtype=dtype, prepare=fp8_prepare(base_precision, self.arch),
                           read_weights=read_weights, model_class=ZImageOmni)

    def model_files(self) -> list[ModelFile]:
        return super().model_files() + [
            ModelFile("siglip", self.siglip_path, "a SigLIP2 vision model (the Omni repo's siglip/)", "siglip",
                      {"embeddings.patch_embedding.weight": None, "post_layernorm.weight": None}),
        ]

    def load_text_encoder(self, precision="bf16", device=None):
        """-> encode(captions, condition_images): per caption its segments and its references' SigLIP
        features (omni_encoder.py); SigLIP runs in the text encoder's float dtype (fp8: bf16)."""
        from library.models.text_encoders import encoder_precision
        from library.models.zimage.omni_encoder import OmniConditionEncoder, ZImageOmniTextEncoder, load_siglip
        from library.models.zimage.text_encoder import load_zimage_text_encoder

        dtype, fp8 = encoder_precision(precision)
        text = load_zimage_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8)
        text.llm.to(device)
        siglip = load_siglip(self.siglip_path, dtype)
        siglip.model.to(device)
        return OmniConditionEncoder(ZImageOmniTextEncoder(text.llm, text.tokenizer, text.max_length), siglip)

    def text_cache_key(self, options: dict, precision: str) -> str:
        """The SigLIP files are part of the text cache (its features are cached with the caption)."""
        return f"{super().text_cache_key(options, precision)}_{file_fingerprint(self.siglip_path)}"

    def text_encoding_constants(self) -> dict:
        from library.models.zimage import omni_encoder as oe
        from library.models.zimage import text_encoder as te

        return {"template": oe.omni_prompt_segments("{}", 1), "max_length": te.ZIMAGE_MAX_LENGTH, "hidden_state": -2,
                "siglip_max_area": oe.SIGLIP_MAX_AREA}

    def largest_image(self) -> None:
        """Any size: the omni forward (omni.py) computes RoPE for every position; only the text-to-image one
        refuses positions past axes_lens."""
        return None

    def caption_token_limit(self, args):
        """Each segment is cut at 512 tokens: the prompt's segment (with one reference) is the long one."""
        from library.data.check import TokenLimit
        from library.io import component_folder
        from library.models.text_encoders import _load_tokenizer
        from library.models.zimage import text_encoder as te
        from library.models.zimage.omni_encoder import omni_prompt_segments

        tokenizer = _load_tokenizer(component_folder(self.text_paths["text_encoder"], "text_encoder"), None, "tokenizer", "Qwen2")
        return TokenLimit("Qwen3", te.ZIMAGE_MAX_LENGTH,
                          lambda text: len(tokenizer(omni_prompt_segments(text, 1)[1], verbose=False).input_ids))

    def text_encoder_weights(self):
        """Qwen3's (the layers read) and the SigLIP vision model's (never fp8: bf16 under fp8)."""
        from library.io import CheckpointReader, component_folder
        from library.models.family import TextWeights

        siglip = CheckpointReader(component_folder(self.siglip_path, "siglip")).numel()
        return super().text_encoder_weights() + [TextWeights(siglip)]

    def reference_text_tokens(self, width: int, height: int) -> int:
        """The planner's caption length grows by one 32-token segment per reference (text_on_meta)."""
        from library.models.zimage.model import SEQ_MULTIPLE

        return SEQ_MULTIPLE

    def control_bucket(self, bucket: tuple[int, int], size: tuple[int, int],
                       resolution: tuple[int, int] | None = None) -> tuple[int, int]:
        """ZImageOmniPipeline's size for a condition image when the output is `bucket` (a training pair's target,
        a sample's size): its Flux2ImageProcessor's rule (library/models/flux2/references.py) with the output's
        area for one over 1024 x 1024 pixels. Until 2026-12-01 training scaled every reference to its target's
        area: a 512 x 512 one beside a 1024 x 1024 target trained on a 128 x 128 latent, sampled (as the pipeline
        runs it) on 64 x 64."""
        from library.models.flux2.references import condition_size

        return condition_size(size, bucket[0] * bucket[1])

    def largest_reference(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """The planner's reference without files: up to 1024 x 1024 pixels at its own size, or the bucket's area."""
        from library.models.flux2.references import KEEP_AREA

        return bucket if bucket[0] * bucket[1] >= KEEP_AREA else (1024, 1024)

    def reference_resize(self, bucket: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
        """ZImageOmniPipeline's pixels of each condition image, in training and samples: one over 1024 x 1024
        pixels resized (Lanczos) to the output's area, then centre-cropped, never resized, to sides floored to 16
        (the other families' cover-and-shrink left a 100 x 72 reference up to 0.69 from the pipeline's pixels)."""
        from library.models.flux2.references import resized_size

        return resized_size(size, bucket[0] * bucket[1])

    def sample_text_size(self, paths, width: int, height: int) -> tuple[int, int] | None:
        """Given a size, ZImageOmniPipeline shows SigLIP a condition image over 1024 x 1024 pixels at the
        output's area, the image its VAE path takes (sample_control_bucket). Training's references are
        encoded by its rule without a size (at most 1024 x 1024)."""
        return (width, height) if paths else None

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance, control: list[torch.Tensor] | None = None):
        """x_t: packed noisy target [B, h*w, 64]; control: reference latents [B, 16, H_k, W_k] float32;
        text: the cache dicts stacked (omni_encoder.py), or the planner's meta text (embeds only)."""
        from library.models.zimage.omni_encoder import unpack_condition

        references = list(control or [])
        if "segments" in text:
            captions, siglip = unpack_condition(text, len(references))
        else:
            captions, siglip = planned_condition(text["embeds"], len(references), model.config.siglip_feat_dim)
        device = x_t.device
        captions = [[c.to(device) for c in row] for row in captions]
        siglip = None if siglip is None else [[s.to(device) for s in row] for row in siglip]
        return model(x_t, sigmas, h, w, captions, [r.to(device) for r in references], siglip)

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        """ZImageOmniPipeline: pos + g (pos - neg) in float32 when guidance > 0; both with the references."""
        pos = self.predict(model, x, s, text, h, w, guidance, control).float()
        if negative_text is None or guidance is None or guidance <= self.cfg_above:
            return pos
        neg = self.predict(model, x, s, negative_text, h, w, guidance, control).float()
        return pos + guidance * (pos - neg)

    def text_on_meta(self, model, batch, tokens):
        return {"embeds": torch.empty(batch, tokens, model.config.cap_feat_dim, device="meta")}


def planned_condition(embeds: torch.Tensor, references: int, siglip_width: int):
    """The memory planner's stand-in for a cached condition (text_on_meta gives `embeds` alone): the
    caption's tokens cut into the segments a real one has (32 per reference, the closing 32, the
    rest the prompt's) and a SigLIP grid of SIGLIP_PLAN_GRID per reference, all on embeds' device."""
    b, tokens, _ = embeds.shape
    if not references:
        return [[e] for e in embeds], None
    lengths = [32] * references + [tokens - 32 * (references + 1), 32]
    grid = torch.empty(*SIGLIP_PLAN_GRID, siglip_width, device=embeds.device)
    return [list(e.split(lengths)) for e in embeds], [[grid] * references for _ in range(b)]
