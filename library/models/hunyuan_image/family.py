"""HunyuanImage-2.1 as a diffusion family: Tencent's 17 B double/single-stream DiT in its released names (model.py,
loaded by checkpoint.py), its own VAE (vae.py: diffusers' AutoencoderKLHunyuanImage, 64 latent channels, 32x), and two
text encoders (text_encoder.py): Qwen2.5-VL-7B's hidden_states[-3] of a templated caption, and byT5-small's states of
the caption's quoted text ("glyph" text, which the model renders into the image), absent where nothing is quoted.

Latents enter the transformer unpatched (patch 1: one token per latent pixel, latents.to_tokens), so a token is 32 px:
1024 px is 32 x 32 = 1024 tokens, a quarter of FLUX.1's.

Text: each caption's real tokens are cached with their masks (the glyph's as [0, 1472] where the caption quotes
nothing); a batch pads to its longest (collate) and the transformer masks the rest, so a padded caption predicts as it
does alone. A batch whose captions all quote nothing runs without glyph tokens, as the pipeline's all-False glyph mask.

Inference: the release's constant shift 5 (sd-scripts' flow_shift, the diffusers repo's scheduler), 50 steps (the
pipeline's), guidance 3.5 with the empty negative prompt, mixed as the release guides (diffusers'
AdaptiveProjectedMixGuidance, run as it is: sample_latents): classifier-free guidance at --g for the first steps, then
adaptive projected guidance (scale 10, momentum -0.5, rescale 10, eta 0) from step 5, or from step 38 for a prompt
with quoted text (the pipeline's ocr_guider; sd-scripts' apg_start_step_general / _ocr).
"""

from __future__ import annotations

import functools

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile
from library.models.hunyuan_image.spec import SPEC
from library.models.latents import from_tokens, to_tokens

RELEASE = "hunyuan-image-2.1"  # model_version (sd-scripts' modelspec hunyuan_image 2.1)
APG_START_STEP, APG_START_STEP_QUOTED = 5, 38  # the release's guider / ocr_guider (sd-scripts' apg_start_step_*)


class HunyuanImageFamily(DiffusionFamily):
    """HunyuanImage-2.1: Tencent's names, its 32x VAE, Qwen2.5-VL + byT5 glyph text with padding masks, true CFG."""

    name = "hunyuan_image"
    vae = "library.models.hunyuan_image.vae:HunyuanImageVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder", "byt5")
    sample_guidance = SPEC.sample_guidance[RELEASE]
    sample_steps = SPEC.sample_steps[RELEASE]
    true_cfg = True
    render_size = 2048  # HunyuanImagePipeline's default_sample_size 64 x its 32x VAE: a 2K model
    patch = 1  # the transformer takes latent pixels
    latent_channels = 64

    @functools.cached_property
    def vae_downsample(self) -> int:
        """32, the release's; a VAE whose config says another (the learned tiny base's 16) is read at its own, so
        buckets, latents and samples agree with it."""
        from library.models.hunyuan_image.vae import hunyuan_image_vae_downsample

        return hunyuan_image_vae_downsample(self.vae_path)

    def model_version(self, model) -> str:
        return RELEASE

    # -- latents as tokens ---------------------------------------------------------------------
    def pack_target(self, latents: torch.Tensor) -> torch.Tensor:
        return to_tokens(latents)

    def unpack_target(self, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return from_tokens(tokens, shape[-2], shape[-1])

    # -- loading -------------------------------------------------------------------------------
    def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
        """The base release; the distilled one (its guidance and MeanFlow embedders) is refused before a weight is
        read: its sampling (distilled guidance, the next step's sigma) is not ours, and sd-scripts trains the base."""
        from library.io import CheckpointError

        model = super().load_transformer(dtype, base_precision, read_weights=False)
        if model.config.guidance_embeds or model.config.use_meanflow:
            raise CheckpointError(f"{self.model_path}: the distilled HunyuanImage-2.1 (guidance_in / time_r_in); "
                                  f"LoRAs train on the base release, dit/hunyuanimage2.1.safetensors")
        return model if not read_weights else super().load_transformer(dtype, base_precision, read_weights)

    def model_files(self) -> list[ModelFile]:
        from library.models.hunyuan_image.vae import hunyuan_image_vae_file

        return [
            hunyuan_image_vae_file(self.vae_path),
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen2.5-VL language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_proj.bias": None},
                      (None, "tokenizer", "Qwen2")),
            ModelFile("byt5", self.text_paths["byt5"], "a byT5 encoder (T5, byte vocabulary)", "text_encoder_2",
                      {"encoder.block.0.layer.0.SelfAttention.q.weight": None}),
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.text_dim, "byt5": config.glyph_dim}

    def text_on_meta(self, model, batch, tokens):
        # No masks: every planned caption is `tokens` long with the glyph encoder's whole 128 quoted tokens
        from library.models.hunyuan_image.text_encoder import GLYPH_MAX_TOKENS

        c = model.config
        text = {"embeds": torch.empty(batch, tokens, c.text_dim, device="meta")}
        if c.glyph_dim:  # a model without byt5_in takes no glyph states
            text["glyph"] = torch.empty(batch, GLYPH_MAX_TOKENS, c.glyph_dim, device="meta")
        return text

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """Tencent's names (ours), plain or behind a ComfyUI prefix; ComfyUI's renamed file (FLUX.1's names, told by
        its text refiner's `self_attn.qkv`) and a diffusers transformer/ folder through their module maps."""
        from library.models.hunyuan_image.checkpoint import COMFY_MARKER, DIFFUSERS_MARKER, MARKER, PREFIXES, module_map

        for prefix in PREFIXES:
            if prefix + MARKER in keys:
                return CheckpointNames("tencent", prefix)
            if prefix + COMFY_MARKER in keys:
                inner = [k[len(prefix):] for k in keys if k.startswith(prefix)]
                return CheckpointNames("comfy", prefix, module_map(inner, lambda k: shape(prefix + k), "comfy"),
                                       native=False)
        if DIFFUSERS_MARKER in keys:
            return CheckpointNames("diffusers", "", module_map(keys, shape, "diffusers"), native=False)
        return None

    # -- text ----------------------------------------------------------------------------------
    def text_encoding_constants(self) -> dict:
        from library.models.hunyuan_image import text_encoder as te

        return {"template": te.HUNYUAN_IMAGE_TEMPLATE, "drop": te.HUNYUAN_IMAGE_DROP_TOKENS,
                "hidden_state": te.HUNYUAN_IMAGE_HIDDEN_STATE, "max_length": te.HUNYUAN_IMAGE_MAX_TOKENS,
                "glyph_max_length": te.GLYPH_MAX_TOKENS, "glyph_quotes": te.GLYPH_QUOTES}

    def caption_token_limit(self, args):
        """The pipeline keeps 1000 Qwen tokens after the template's 34 (the caption and the template's end)."""
        from library.models.hunyuan_image.text_encoder import hunyuan_image_caption_token_limit

        return hunyuan_image_caption_token_limit(self.text_paths["text_encoder"])

    def load_text_encoder(self, precision="bf16", device=None):
        """encode(captions) -> each caption's real tokens of Qwen2.5-VL's hidden_states[-3] ("embeds", float32) with
        its mask, and of byT5's states of its quoted text ("glyph" [G, 1472] with "glyph_mask"; G = 0 where the
        caption quotes nothing, so every cached caption has the same keys for collate)."""
        from library.models.hunyuan_image.text_encoder import load_hunyuan_image_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_hunyuan_image_text_encoder(self.text_paths["text_encoder"], self.text_paths["byt5"],
                                                  dtype=dtype, fp8=fp8)
        encoder.llm.to(device)
        encoder.glyph_model.to(device)
        width = encoder.glyph_model.config.d_model

        def encode(captions: list[str]) -> list[dict]:
            out = encoder.encode(captions)
            for row in out:
                if "glyph" not in row:
                    row["glyph"] = torch.zeros(0, width, device=row["embeds"].device)
                    row["glyph_mask"] = torch.zeros(0, dtype=torch.bool, device=row["embeds"].device)
            return out

        return encode

    def text_encoder_weights(self):
        """Qwen2.5-VL's embeddings and the decoder layers up to the one read (26 of 28), no final norm, no head; byT5's
        encoder (never fp8)."""
        from library.io import component_folder
        from library.models.hunyuan_image.text_encoder import glyph_t5_config, hunyuan_image_text_weights
        from library.models.text_encoders import qwen2_5_vl_language_config

        glyph = component_folder(self.text_paths["byt5"], "text_encoder_2")
        return hunyuan_image_text_weights(qwen2_5_vl_language_config(self.text_paths["text_encoder"]),
                                          glyph_t5_config(glyph))

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t [B, h*w, 64]: the latent's pixels as tokens (to_tokens). The cached captions are stacked to the
        longest with their masks (collate pads them); a batch with no quoted text runs without glyph tokens.
        Returns the velocity noise - x0 [B, h*w, 64]."""
        device = x_t.device
        mask, glyph = text.get("mask"), text.get("glyph")
        glyph_mask = text.get("glyph_mask")
        if glyph is not None and glyph.shape[1] == 0:
            glyph = glyph_mask = None
        return model(img=x_t, txt=text["embeds"].to(device), timesteps=sigmas, h=h, w=w,
                     txt_mask=None if mask is None else mask.to(device).bool(),
                     glyph=None if glyph is None else glyph.to(device),
                     glyph_mask=None if glyph_mask is None else glyph_mask.to(device).bool())

    # -- sampling: the release's guidance mix ---------------------------------------------------
    @torch.no_grad()
    def sample_latents(self, model, text, width, height, steps, seed, guidance, negative_text=None, control=None,
                       flow_shift=None):
        """DiffusionFamily.sample_latents with the release's guider for this prompt (guided_velocity takes it step by
        step): its ocr_guider where the prompt quotes text (its glyph states are not all zero), else its guider."""
        from diffusers import AdaptiveProjectedMixGuidance
        from diffusers.guiders.adaptive_projected_guidance_mix import MomentumBuffer

        quoted = "glyph" in text and text["glyph"].shape[1] > 0 and bool(text["glyph"].abs().sum() > 0)
        guider = AdaptiveProjectedMixGuidance(guidance_scale=guidance or 1.0, adaptive_projected_guidance_start_step=(
            APG_START_STEP_QUOTED if quoted else APG_START_STEP))
        guider.momentum_buffer = MomentumBuffer(guider.adaptive_projected_guidance_momentum)  # its prepare_inputs' at 0
        self._guiding = [guider, 0, steps]
        try:
            return super().sample_latents(model, text, width, height, steps, seed, guidance, negative_text, control,
                                          flow_shift)
        finally:
            self._guiding = None

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        """The conditional velocity (float32); with a negative prompt and guidance above 1, the release's guider's
        mix of it and the negative's at this step (sample_latents'); outside sample_latents plain CFG."""
        cond = self.predict(model, x, s, text, h, w, guidance).float()
        if negative_text is None or guidance is None or guidance <= self.cfg_above:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance).float()
        if getattr(self, "_guiding", None) is None:
            return uncond + guidance * (cond - uncond)
        guider, step, steps = self._guiding
        guider.set_state(step=step, num_inference_steps=steps, timestep=1000 * s[0])
        self._guiding[1] += 1
        return guider.forward(cond, uncond).pred
