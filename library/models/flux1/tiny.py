"""FLUX.1's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  flux/flux1-tiny.safetensors          BFL single file (FLUX.1-dev layout, with guidance_in)
  flux/diffusers/transformer/          the same weights as a diffusers transformer folder
  flux/ae/                             AutoencoderKL diffusers folder (16 latent channels, FLUX shift/scale)
  flux/ae.safetensors                  the same VAE in BFL's single-file `ae.safetensors` layout
  flux/clip_l/  flux/t5xxl/            CLIPTextModel / T5EncoderModel HF folders with tokenizers

T5 d_model == context_in_dim, CLIP hidden == vec_in_dim, 16 latent channels (64 packed).
"""

from __future__ import annotations

import json
import os

from library.io import save_safetensors
from library.models.tiny_files import TINY, seed_component, write_clip_l, write_json, write_t5_encoder


def write_flux(out: str, seed: int) -> dict[str, str]:
    from library.models.flux1.checkpoint import save_flux_bfl, save_flux_diffusers
    from library.models.flux1.model import Flux, FluxConfig

    seed_component(seed, 1)
    config = FluxConfig(
        in_channels=4 * TINY["latent_channels"], vec_in_dim=TINY["clip_hidden"], context_in_dim=TINY["t5_d_model"],
        hidden_size=TINY["dit_hidden"], num_heads=TINY["dit_heads"], depth=2, depth_single=2,
        axes_dim=TINY["axes"], guidance_embed=True,
    )
    model = Flux(config)
    bfl = os.path.join(out, "flux", "flux1-tiny.safetensors")
    folder = os.path.join(out, "flux", "diffusers", "transformer")
    save_flux_bfl(model, bfl, config)
    save_flux_diffusers(model, config, folder)
    return {"flux_bfl": bfl, "flux_diffusers": folder}


def write_flux_vae(out: str, seed: int) -> dict[str, str]:
    from diffusers import AutoencoderKL

    from library.models.flux1.vae import FLUX_VAE_CONFIG
    from library.models.vae import autoencoder_kl_to_ldm_state_dict

    seed_component(seed, 2)
    config = {**FLUX_VAE_CONFIG, "block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4,
              "layers_per_block": 1, "sample_size": 64, "latent_channels": TINY["latent_channels"]}
    vae = AutoencoderKL(**config)
    folder = os.path.join(out, "flux", "ae")
    os.makedirs(folder, exist_ok=True)
    sd = vae.state_dict()
    save_safetensors(sd, os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKL", **config})
    single = os.path.join(out, "flux", "ae.safetensors")
    # BFL files carry no config; this one records its toy sizes so that load_flux_vae finds them.
    save_safetensors(autoencoder_kl_to_ldm_state_dict(sd, len(config["block_out_channels"])), single,
                     metadata={"diffusers_config": json.dumps(config)})
    return {"flux_vae": folder, "flux_vae_single": single}


def write_clip(out: str, seed: int) -> dict[str, str]:
    folder = os.path.join(out, "flux", "clip_l")
    write_clip_l(folder, seed, 3)
    return {"clip_l": folder}


def write_t5(out: str, seed: int) -> dict[str, str]:
    folder = os.path.join(out, "flux", "t5xxl")
    write_t5_encoder(folder, seed, 4)
    return {"t5xxl": folder}


def write_sized_flux(folder: str, hidden: int, depth: int, seed: int) -> str:
    """FLUX.1-dev at width `hidden` (heads of 128, RoPE axes (16, 56, 56)), `depth` double and single
    blocks, random N(0, 0.02), the tiny CLIP / T5 widths: a BFL single file (the spec's TINY.sized)."""
    from library.models.flux1.checkpoint import save_flux_bfl
    from library.models.flux1.model import Flux, FluxConfig
    from library.models.tiny_files import random_init

    config = FluxConfig(vec_in_dim=TINY["clip_hidden"], context_in_dim=TINY["t5_d_model"], hidden_size=hidden,
                        num_heads=hidden // 128, depth=depth, depth_single=depth, guidance_embed=True)
    path = os.path.join(folder, "flux_sized.safetensors")
    save_flux_bfl(random_init(Flux(config), seed), path, config)
    return path
