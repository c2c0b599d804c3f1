"""ERNIE-Image as a diffusion family: the diffusers-named single-stream transformer (model.py, loaded by
checkpoint.py), FLUX.2's VAE with ERNIE-Image's BatchNorm eps (vae.py: 32 latent channels, patchified to 128 and
normalised) and Ministral 3 text (text_encoder.py: the second-to-last hidden state of each prompt's own tokens).

Inference as ErnieImagePipeline runs it: a constant shift 4.0 over sigmas linspace(1, 1/N, N) (spec.py SAMPLING),
50 steps, classifier-free guidance 4.0 with the empty negative prompt when the guidance is above 1,
pred = uncond + g (cond - uncond); the noise drawn patchified [B, 128, lh / 2, lw / 2].

Text: each caption is cached as its own tokens (no template, no padding). A batch pads them to its longest with
zeros and a mask (collate); the transformer reads each caption's length: its text tokens past the length are
masked out of attention and the image tokens' first RoPE axis is that length (ErnieImageTransformer2DModel's
text_lens), so a padded caption predicts as it does alone.
"""

from __future__ import annotations

import torch

from library.models.ernie_image.spec import SPEC
from library.models.family import CheckpointNames, DiffusionFamily, ModelFile

RELEASE = "ernie-image"  # model_version (ai-toolkit's get_base_model_version: ernie_image)


class ErnieImageFamily(DiffusionFamily):
    """ERNIE-Image: diffusers module names, 32 latent channels, Ministral 3 text with a mask, true CFG."""

    name = "ernie_image"
    vae = "library.models.ernie_image.vae:ErnieImageVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance = SPEC.sample_guidance[RELEASE]  # the pipeline's CFG scale, run with the (empty) negative prompt
    sample_steps = SPEC.sample_steps[RELEASE]
    true_cfg = True  # CFG above 1 (cfg_above), as the pipeline's do_classifier_free_guidance
    latent_channels = 32

    def model_version(self, model) -> str:
        return RELEASE

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        return [
            ModelFile("ae", self.vae_path, "a FLUX.2 VAE (32 latent channels)", "vae",
                      {**vae_markers(self.latent_channels), "bn.running_mean": None}),  # the BatchNorm of its latents
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Ministral 3 language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_proj.weight": None},
                      (None, "tokenizer", "Mistral")),  # as its loader looks for the tokenizer
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.text_in_dim}

    def text_on_meta(self, model, batch, tokens):
        return {"embeds": torch.empty(batch, tokens, model.config.text_in_dim, device="meta"),
                "mask": torch.ones(batch, tokens, dtype=torch.bool, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """diffusers' names (the model's own), in a diffusers folder or a single file, plain or behind a ComfyUI
        prefix; nothing fused."""
        from library.models.ernie_image.checkpoint import MARKER, PREFIXES

        prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
        return None if prefix is None else CheckpointNames("diffusers", prefix)

    # -- text ----------------------------------------------------------------------------------
    def text_encoding_constants(self) -> dict:
        from library.models.ernie_image.text_encoder import ERNIE_HIDDEN_STATE

        return {"hidden_state": ERNIE_HIDDEN_STATE}  # each prompt's own tokens, no template

    def caption_token_limit(self, args):
        """The pipeline keeps a prompt's tokens up to the tokenizer's model_max_length (<s> included)."""
        from library.data.check import TokenLimit
        from library.io import component_folder
        from library.models.text_encoders import _load_tokenizer

        tokenizer = _load_tokenizer(component_folder(self.text_paths["text_encoder"], "text_encoder"), None,
                                    "tokenizer", "Mistral")
        return TokenLimit("Ministral 3", tokenizer.model_max_length,
                          lambda text: len(tokenizer(text, add_special_tokens=True, verbose=False).input_ids))

    def load_text_encoder(self, precision="bf16", device=None):
        from library.models.ernie_image.text_encoder import load_ernie_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_ernie_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8)
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            embeds, mask = encoder.encode(captions)  # [B, T, D] float32, mask [B, T]: each caption's own tokens
            return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]

        return encode

    def text_encoder_weights(self):
        """Ministral 3's embeddings and decoder layers up to hidden_states[-2] (25 of 26), no head, no vision."""
        from library.io import component_folder
        from library.models.ernie_image.text_encoder import ernie_llm_config, ernie_text_weights

        config, _ = ernie_llm_config(component_folder(self.text_paths["text_encoder"], "text_encoder"))
        return [ernie_text_weights(config)]

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t: the packed noisy target [B, h*w, 128] (our latents packed: the pipeline's patchified latent grid, row
        by row); text: embeds [B, T, D], with mask [B, T] where captions differ in length (the model reads each
        row's length from it). Returns the velocity of the target's tokens [B, h*w, 128]."""
        mask = text.get("mask")
        return model(img=x_t, txt=text["embeds"].to(x_t.device), timesteps=sigmas, h=h, w=w,
                     txt_mask=None if mask is None else mask.to(x_t.device))

    def initial_noise(self, batch, lh, lw, generator):
        # ErnieImagePipeline draws [B, 4C, lh/2, lw/2] (patchified; in the transformer's dtype, here float32)
        from library.models.latents import unpatchify

        return unpatchify(torch.randn(batch, 4 * self.latent_channels, lh // 2, lw // 2, generator=generator,
                                      dtype=torch.float32))

