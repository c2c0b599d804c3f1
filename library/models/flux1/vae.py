"""The FLUX.1 VAE: a 16-channel diffusers AutoencoderKL (library/models/vae.py KLVAE) with the
released VAE's config, Kontext's too.

Normalisation (checked against diffusers' pipeline_flux.py): latents = (z - shift_factor) *
scaling_factor (0.1159, 0.3611 for the released VAE); decode uses z = latents / scaling_factor +
shift_factor. BFL's and sd-scripts' FLUX AutoEncoder samples the posterior; we take its mode unless
a generator is given (library/models/vae.py).

Files: BFL's single-file `ae.safetensors` (LDM key names, converted with diffusers' own
`convert_ldm_vae_checkpoint`), a diffusers folder (`vae/` or itself) or a diffusers-keyed file.
"""

from __future__ import annotations

import torch

from library.models.vae import KLVAE

# The released VAE's config (used when a single file comes without a config.json)
FLUX_VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}


class FluxVAE(KLVAE):
    """FLUX.1 VAE (diffusers AutoencoderKL). encode: images [B,3,H,W] in [-1,1] -> float32 latents
    [B,16,H/8,W/8] = (z - shift) * scale; decode: the inverse, images float32 clamped to [-1,1]."""

    default_config = FLUX_VAE_CONFIG


def load_flux_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> FluxVAE:
    """FluxVAE from BFL `ae.safetensors`, a diffusers folder (`vae/` or itself) or a diffusers file.
    config: AutoencoderKL config dict overriding the one found (default: the released FLUX VAE)."""
    return FluxVAE(path, dtype, config)
