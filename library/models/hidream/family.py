"""HiDream-I1 (Full, Dev, Fast) as a diffusion family: the released (diffusers' and ComfyUI's) module names (model.py,
loaded by checkpoint.py), FLUX.1's VAE (the same AutoencoderKL: flux1/vae.py), and four text encoders
(text_encoder.py): CLIP-L's and CLIP-G's projected pooled outputs joined (2048), T5-XXL's 128 tokens and
Llama-3.1-8B-Instruct's states of every layer (32 x 128 tokens), all as HiDreamImagePipeline.encode_prompt.

Latents enter the transformer as 2x2 patches (pack_latents, the base class's): 1024 px is 64 x 64 = 4096 tokens,
RoPE over (0, row, col) with no largest size (ComfyUI's way: only the image's own tokens; diffusers pads a non-square
image to 4096 tokens, model.py).

Full, Dev and Fast share the transformer; they differ in weights and in how the pipeline samples them (the model
cards): Full 50 steps at CFG 5.0 against the empty negative prompt, its scheduler's shift 3.0; Dev 28 steps without
guidance, shift 6.0; Fast 16 steps without guidance, shift 3.0; Dev and Fast with the flash scheduler (integrate).
The release comes from `model_version`, else from the model path's name (ComfyUI's hidream_i1_dev_fp8.safetensors,
the HiDream-I1-Fast folder), else Full.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, NamedReleases

FULL, DEV, FAST = "hidream-i1-full", "hidream-i1-dev", "hidream-i1-fast"
VERSION_SHIFT = {FULL: 3.0, DEV: 6.0, FAST: 3.0}  # each release's scheduler shift (flow_shift / shift)


def release_in_name(path: str) -> str | None:
    """The release a file or folder name says ("hidream_i1_dev_fp8.safetensors", "HiDream-I1-Fast"), else None."""
    name = os.path.basename(os.path.normpath(path)).lower()
    found = re.findall(r"(?<![a-z])(full|dev|fast)(?![a-z])", name)
    return f"hidream-i1-{found[-1]}" if found else None


class HiDreamFamily(NamedReleases, DiffusionFamily):
    """HiDream-I1: the released names, FLUX.1's VAE, CLIP-L + CLIP-G + T5-XXL + Llama-3.1 text, CFG for Full."""

    name = "hidream"
    vae = "library.models.flux1.vae:FluxVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("clip_l", "clip_g", "t5xxl", "llama")
    true_cfg = True  # Full runs the negative prompt; Dev and Fast default to guidance 0 (none run)
    cfg_above = 1.0  # HiDreamImagePipeline: do_classifier_free_guidance is guidance_scale > 1
    # CLIP-L resident; CLIP-G, T5-XXL and Llama take turns on a card that cannot hold the four together (14.8 GiB in
    # fp8_scaled; 7.9 taking turns): HiDreamTextEncoder.place
    text_encoders_take_turns = True
    releases = (FULL, DEV, FAST)
    release_in_name = staticmethod(release_in_name)
    option_keys = ("model_version",)

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None, **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        self.set_release(model_version)

    # -- the release (NamedReleases: model_version, else the path's name, else Full) ----------------
    def inference_sampling(self):
        """The spec's constant shift is Full's and Fast's (3.0); Dev's scheduler shifts by 6.0."""
        from library.models.flow_matching import sampling_of

        sampling = sampling_of(self.arch)
        shift = VERSION_SHIFT[self.version]
        return None if shift == sampling.shift else dataclasses.replace(sampling, shift=shift)

    def integrate(self, velocity, noise, sigmas, fresh_noise):
        """Dev and Fast sample with the flash scheduler (the official inference.py's FlashFlowMatchEulerDiscrete-
        Scheduler, diffusers' FlowMatchLCMScheduler, ComfyUI's lcm sampler): x0 from the velocity, re-noised to the
        next sigma each step. Full: Euler (its release's UniPC multistep solver is not ours: the spec says so)."""
        from library.models import flow_matching as fm

        if self.version == FULL:
            return super().integrate(velocity, noise, sigmas, fresh_noise)
        return fm.flash_sample(velocity, noise, sigmas, fresh_noise)

    # -- files ---------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.sd3.family import clip_t5_model_files
        from library.models.vae import vae_markers

        return [
            ModelFile("ae", self.vae_path, "a FLUX.1 VAE (16 latent channels)", "vae", vae_markers(self.latent_channels)),
            *clip_t5_model_files(self.text_paths),  # SD3's three encoders' roles and folders
            ModelFile("llama", self.text_paths["llama"], "a Llama language model", "text_encoder_4",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_proj.weight": None},
                      (None, "tokenizer_4", "Llama", True)),
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"t5xxl": config.t5_dim, "llama": config.llama_dim}

    def text_on_meta(self, model, batch, tokens):
        c = model.config
        return {"t5": torch.empty(batch, tokens, c.t5_dim, device="meta"),
                "llama": torch.empty(batch, max(c.llama_layers) + 1, tokens, c.llama_dim, device="meta"),
                "pooled": torch.empty(batch, c.text_emb_dim, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """The released names (ours), plain or behind a prefix (model.diffusion_model., ComfyUI's diffusion_model.);
        a diffusers transformer/ folder has the same names."""
        from library.models.hidream.checkpoint import MARKER, PREFIXES

        for prefix in PREFIXES:
            if prefix + MARKER in keys:
                return CheckpointNames("released", prefix)
        return None

    # -- text ----------------------------------------------------------------------------------
    def text_encoding_constants(self) -> dict:
        from library.models.hidream import text_encoder as te

        return te.ENCODING_CONSTANTS

    def caption_token_limit(self, args):
        """T5-XXL and Llama each keep 128 tokens; T5's tokenizer counts more for the same words, so its count warns."""
        from library.models.sd3.text_encoder import sd3_caption_token_limit
        from library.models.hidream.text_encoder import HIDREAM_MAX_LENGTH

        return sd3_caption_token_limit(self.text_paths["t5xxl"], HIDREAM_MAX_LENGTH)

    def load_text_encoder(self, precision="bf16", device=None, one_at_a_time: bool = False):
        """encode(captions) -> per caption {"t5": float32 [128, 4096], "llama": float32 [32, 128, 4096],
        "pooled": float32 [2048]}. one_at_a_time: they take turns on the device (text_encoders_take_turns)."""
        from library.models.hidream.text_encoder import load_hidream_text_encoders
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_hidream_text_encoders(self.text_paths["clip_l"], self.text_paths["clip_g"],
                                             self.text_paths["t5xxl"], self.text_paths["llama"], dtype=dtype, fp8=fp8)
        encoder.place(device, one_at_a_time)
        return encoder.encode

    def text_encoder_weights(self):
        """CLIP-L and CLIP-G with their projections (never fp8), T5-XXL and Llama as their loaders keep them."""
        from library.models.hidream.text_encoder import hidream_text_weights

        return hidream_text_weights(*(self.text_paths[k] for k in self.text_path_keys))

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t [B, h*w, 64]: 2x2 latent patches (pack_latents). Returns the velocity noise - x0 [B, h*w, 64]."""
        device = x_t.device
        llama = text["llama"].to(device).transpose(0, 1)  # cached [B, layers, L, D] -> the model's [layers, B, L, D]
        return model(img=x_t, t5=text["t5"].to(device), llama=llama, pooled=text["pooled"].to(device),
                     timesteps=sigmas, h=h, w=w)
