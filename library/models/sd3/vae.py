"""SD3 / SD3.5's VAE: a 16-channel diffusers AutoencoderKL (library/models/vae.py KLVAE), FLUX.1's architecture with
its own normalisation.

Normalisation: latents = (z - 0.0609) * 1.5305 (the diffusers repos' vae/config.json shift_factor / scaling_factor,
which StableDiffusion3Pipeline applies; sd-scripts' sd3_models VAE_SHIFT_FACTOR / VAE_SCALE_FACTOR and ComfyUI's
latent_formats.SD3 are the same numbers); decode uses z = latents / 1.5305 + 0.0609.

Files: SAI's single files (the VAE under `first_stage_model.` in the all-in-one checkpoints, LDM names, converted with
diffusers' own convert_ldm_vae_checkpoint), a diffusers folder (`vae/` or itself) or a diffusers-keyed file.
"""

from __future__ import annotations

import torch

from library.models.flux1.vae import FLUX_VAE_CONFIG
from library.models.vae import KLVAE

# The released VAE's config (stabilityai/stable-diffusion-3.5-large vae/config.json): FLUX.1's layers, SD3's factors
SD3_VAE_CONFIG = {**FLUX_VAE_CONFIG, "scaling_factor": 1.5305, "shift_factor": 0.0609}


class SD3VAE(KLVAE):
    """SD3's VAE (diffusers AutoencoderKL). encode: images [B,3,H,W] in [-1,1] -> float32 latents [B,16,H/8,W/8] =
    (z - 0.0609) * 1.5305; decode: the inverse, images float32 clamped to [-1,1]."""

    default_config = SD3_VAE_CONFIG

