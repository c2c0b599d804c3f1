"""The Qwen-Image-2.1 VAE (diffusers AutoencoderKLQwenImage21, not reimplemented).

From diffusers' QwenImage21Pipeline: a 16x spatial video VAE of 64 latent channels with RGBA images
(in_channels = out_channels = 4); latents = (z - latents_mean) / latents_std per channel, the posterior's
mode (`sample_mode="argmax"`); decode z = latents * std + mean, a time axis of 1. The pipeline feeds an
opaque picture as RGBA with alpha 255, which its image processor maps to +1 like every channel: an
RGB batch in [-1, 1] gets an alpha plane of +1 here, and decode returns the RGB planes (alpha dropped).

Files: a diffusers folder (`vae/` or itself) or a diffusers-keyed file.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLQwenImage21

from library.models.qwen_image.vae import QwenImageVAE


class QwenImage21VAE(QwenImageVAE):
    """encode: images [B, 3 or 4, H, W] in [-1, 1] -> float32 latents [B, 64, H/16, W/16]; decode: the
    inverse, float32 RGB [B, 3, H, W] in [-1, 1]."""

    diffusers_class = AutoencoderKLQwenImage21
    default_config: dict = {}  # the class defaults are the released VAE's

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if images.shape[1] == 3:  # opaque: alpha +1, as the pipeline's preprocess gives an RGBA picture
            images = torch.cat((images, torch.ones_like(images[:, :1])), dim=1)
        return super().encode(images, generator)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return super().decode(latents)[:, :3]


def load_qwen_image21_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> QwenImage21VAE:
    """QwenImage21VAE from a diffusers folder (`vae/` or itself) or its diffusion_pytorch_model.safetensors."""
    return QwenImage21VAE(path, dtype, config)
