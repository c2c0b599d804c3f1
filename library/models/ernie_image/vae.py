"""The ERNIE-Image VAE: FLUX.2's (diffusers AutoencoderKLFlux2, flux2/vae.py), its latents patchified (2 x 2 -> 128
channels) and normalised with the VAE's BatchNorm statistics as FLUX.2's, but with eps 1e-5 whatever the VAE's
config says: ErnieImagePipeline adds 1e-5 to running_var ("switch to `self.vae.config.batch_norm_eps` once the hub
config is updated to match the trained value (1e-5)"; the released config holds AutoencoderKLFlux2's 1e-4), and
ai-toolkit's encode_images / decode_latents do the same."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2

from library.models.flux2.vae import Flux2VAE

BN_EPS = 1e-5  # ErnieImagePipeline's, the value ERNIE-Image was trained with


class ErnieImageVAE(Flux2VAE):
    """Flux2VAE (encode: images [B, 3, H, W] in [-1, 1] -> float32 latents [B, 32, H/8, W/8]; decode: the inverse)
    with the BatchNorm's eps ErnieImagePipeline uses."""

    def __init__(self, vae: str | AutoencoderKLFlux2, dtype: torch.dtype = torch.float32, config: dict | None = None):
        super().__init__(vae, dtype, config)
        self.bn_std = torch.sqrt(self.vae.bn.running_var.float().view(1, -1, 1, 1) + BN_EPS)  # float32 [1, 128, 1, 1]


def load_ernie_image_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> ErnieImageVAE:
    """From a diffusers folder (`vae/` or itself), its diffusion_pytorch_model.safetensors or FLUX.2's
    ae.safetensors."""
    return ErnieImageVAE(path, dtype, config)
