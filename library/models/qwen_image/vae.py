"""The Qwen-Image VAE (diffusers AutoencoderKLQwenImage, not reimplemented), Qwen-Image-Edit's too.

Normalisation (checked against diffusers' pipeline_qwenimage*.py): latents = (z - latents_mean) /
latents_std per channel; decode z = latents * std + mean. It is a video VAE: images get a time axis
of 1 on the way in and lose it on the way out, so the wrapper speaks 4-D tensors as the others do.
diffusers' Qwen-Image edit pipelines take the posterior's mode, as we do unless a generator is given.

Files: a diffusers folder (`vae/` or itself), a diffusers-keyed file, or the Wan-layout single file
(ComfyUI's `qwen_image_vae.safetensors`, converted with diffusers' convert_wan_vae_to_diffusers).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

from library.models.vae import frozen_in, load_vae

# AutoencoderKLQwenImage's constructor defaults follow the released VAE (a config.json beside the
# weights, as in the released repositories, wins).
QWEN_IMAGE_VAE_CONFIG: dict = {}


def wan_to_diffusers(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A Wan-layout single file (conv1, encoder.downsamples.*, ...) -> AutoencoderKLQwenImage keys
    (diffusers' converter; it needs no config)."""
    return convert_wan_vae_to_diffusers(sd)


class QwenImageVAE:
    """Qwen-Image VAE (diffusers AutoencoderKLQwenImage). encode: images [B,3,H,W] in [-1,1] ->
    float32 latents [B,16,H/8,W/8] = (z - mean) / std per channel; decode: the inverse, images
    float32 in [-1,1] (clamped here too: diffusers' tiled decode does not clamp, its whole one does)."""

    diffusers_class = AutoencoderKLQwenImage
    default_config = QWEN_IMAGE_VAE_CONFIG
    convert_single_file = staticmethod(wan_to_diffusers)  # ComfyUI's qwen_image_vae.safetensors

    def __init__(self, vae: str | AutoencoderKLQwenImage, dtype: torch.dtype = torch.float32, config: dict | None = None):
        if isinstance(vae, str):
            vae = load_vae(self.diffusers_class, vae, self.default_config, dtype, config, self.convert_single_file)
        self.vae = frozen_in(vae, dtype)
        self.dtype = dtype
        self.latent_channels = int(vae.config.z_dim)
        # float32 [1, C, 1, 1]: per-channel statistics broadcast over the image.
        self.latents_mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.latents_std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        posterior = self.vae.encode(images.to(self.dtype)[:, :, None]).latent_dist  # [B, 3, T=1, H, W]
        z = posterior.mode() if generator is None else posterior.sample(generator)
        z = z[:, :, 0].float()
        return (z - self.latents_mean.to(z.device)) / self.latents_std.to(z.device)  # float32

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() == 5:  # [B, C, 1, H, W] as diffusers' pipeline unpacks them
            latents = latents[:, :, 0]
        z = latents.float() * self.latents_std.to(latents.device) + self.latents_mean.to(latents.device)
        images = self.vae.decode(z.to(self.dtype)[:, :, None]).sample  # [B, 3, 1, H, W]
        return images[:, :, 0].float().clamp(-1, 1)  # (diffusers' tiled decode does not clamp: vae_tiling)


def qwen_image_vae_file(path: str | None):
    """What the `ae` file of a family that encodes with this VAE must be (DiffusionFamily.model_files)."""
    from library.models.family import ModelFile
    from library.models.vae import vae_markers

    return ModelFile("ae", path, "a Qwen-Image VAE (16 latent channels, 3-D convolutions)", "vae",
                     vae_markers(16, video=True))


def load_qwen_image_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> QwenImageVAE:
    """QwenImageVAE from a diffusers folder (`vae/` or itself), its diffusion_pytorch_model.safetensors or
    ComfyUI's qwen_image_vae.safetensors."""
    return QwenImageVAE(path, dtype, config)
