"""The FLUX.2 VAE (diffusers AutoencoderKLFlux2, not reimplemented): 32 latent channels, normalised in
patch space.

Normalisation (checked against diffusers' Flux2Pipeline._encode_vae_image and the end of __call__):
the pipeline patchifies z (2x2 -> 128 channels) and normalises each of those channels with the VAE's
BatchNorm statistics, (p - running_mean) / sqrt(running_var + eps); decode is the inverse, then
unpatchify. Our latents are that normalised tensor unpatchified back to [B, 32, H/8, W/8]: patchify
is a permutation, so pack_latents of them is bit for bit the pipeline's packed tokens, and the shared
packing, masks and latent caches keep FLUX.1's shapes.

Files: a diffusers folder (`vae/` or itself), a diffusers-keyed file, or BFL's single file
(`ae.safetensors`, ComfyUI's `flux2-vae.safetensors`: bfl_to_diffusers).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

from library.models.latents import patchify, unpatchify
from library.models.vae import frozen_in, load_vae

# AutoencoderKLFlux2's constructor defaults follow the released VAE (a config.json beside the
# weights, as in the released repositories, wins).
FLUX2_VAE_CONFIG: dict = {}

# BFL's AutoEncoder keeps its quant convs inside the encoder / decoder; AutoencoderKL's LDM files (and
# diffusers' converter for them) have them at the top.
_BFL_QUANT_CONVS = (("encoder.quant_conv.", "quant_conv."), ("decoder.post_quant_conv.", "post_quant_conv."))


def bfl_to_diffusers(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """BFL's single-file FLUX.2 VAE -> AutoencoderKLFlux2 keys: with its quant convs moved to the top it
    is an LDM AutoencoderKL for diffusers' convert_ldm_vae_checkpoint (`config`: the model's), and its
    latents' BatchNorm (`bn.*`, no affine) is named as diffusers names it."""
    moved = {}
    for key, value in sd.items():
        for bfl, ldm in _BFL_QUANT_CONVS:
            key = key.replace(bfl, ldm)
        moved[key] = value
    converted = convert_ldm_vae_checkpoint(moved, config)
    return {**converted, **{k: v for k, v in sd.items() if k.startswith("bn.")}}


class Flux2VAE:
    """FLUX.2 VAE (diffusers AutoencoderKLFlux2). encode: images [B,3,H,W] in [-1,1] -> float32
    latents [B,32,H/8,W/8], normalised in patch space with the VAE's BatchNorm statistics (module
    docstring); decode: the inverse, images float32 clamped to [-1,1]."""

    diffusers_class = AutoencoderKLFlux2
    default_config = FLUX2_VAE_CONFIG
    convert_single_file = staticmethod(bfl_to_diffusers)

    def __init__(self, vae: str | AutoencoderKLFlux2, dtype: torch.dtype = torch.float32, config: dict | None = None):
        if isinstance(vae, str):
            vae = load_vae(self.diffusers_class, vae, self.default_config, dtype, config, self.convert_single_file)
        if tuple(vae.config.patch_size) != (2, 2):
            raise ValueError(f"Flux2VAE: patch_size {tuple(vae.config.patch_size)} is not FLUX.2's (2, 2)")
        self.vae = frozen_in(vae, dtype)
        self.dtype = dtype
        self.latent_channels = int(vae.config.latent_channels)
        # float32 [1, 4C, 1, 1] per patch channel, as the VAE holds them (float32 for a float32 VAE).
        self.bn_mean = vae.bn.running_mean.float().view(1, -1, 1, 1)
        self.bn_std = torch.sqrt(vae.bn.running_var.float().view(1, -1, 1, 1) + vae.config.batch_norm_eps)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        posterior = self.vae.encode(images.to(self.dtype)).latent_dist
        z = posterior.mode() if generator is None else posterior.sample(generator)
        p = patchify(z.float())
        return unpatchify((p - self.bn_mean.to(p.device)) / self.bn_std.to(p.device))  # float32

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        p = patchify(latents.float())
        z = unpatchify(p * self.bn_std.to(p.device) + self.bn_mean.to(p.device))  # float32, then VAE dtype
        images = self.vae.decode(z.to(self.dtype)).sample
        return images.float().clamp(-1, 1)


def load_flux2_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> Flux2VAE:
    """Flux2VAE from a diffusers folder (`vae/` or itself), its diffusion_pytorch_model.safetensors or BFL's
    ae.safetensors."""
    return Flux2VAE(path, dtype, config)
