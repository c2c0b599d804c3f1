"""FLUX.1's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py trains it, learned/flux/
ships it): a FLUX.1-dev transformer (hidden 128, 4 heads, 2 double- and 2 single-stream blocks,
guidance embedding) in BFL's single-file format, bf16 as released; a VAE of the released
AutoencoderKL architecture with small channels (8/16/32/32) in BFL's ae.safetensors layout, float32;
make_tiny_models' frozen tiny CLIP-L and T5 (seed 0)."""

from __future__ import annotations

import json
import os

import torch

from library.io import save_safetensors
from library.models import spec as S
from library.models.tiny_files import write_clip_l, write_json, write_t5_encoder

VAE_CONFIG = {"block_out_channels": [8, 16, 32, 32], "layers_per_block": 1, "norm_num_groups": 8, "latent_channels": 16}
DIT = dict(hidden_size=128, num_heads=4, depth=2, depth_single=2, axes_dim=(8, 12, 12), guidance_embed=True)
T5_TOKENS = 48  # the tiny T5's sequence: the longest scene caption has 34 tokens (configs/quickstart.toml)


def family(paths: dict[str, str]):
    from library.models.flux1.family import FluxFamily

    return FluxFamily(paths["pretrained_model_name_or_path"], paths["ae"], clip_l=paths["clip_l"], t5xxl=paths["t5xxl"])


def write_text_encoders(paths: dict[str, str]) -> None:
    write_clip_l(paths["clip_l"], 0, 3)  # make_tiny_models' encoders: seed 0, their own offsets
    write_t5_encoder(paths["t5xxl"], 0, 4)


def new_vae(image_size: int):
    from diffusers import AutoencoderKL

    from library.models.flux1.vae import FLUX_VAE_CONFIG

    return AutoencoderKL(**{**FLUX_VAE_CONFIG, **VAE_CONFIG, "sample_size": image_size})


def save_vae(vae, paths: dict[str, str], diffusers: bool) -> None:
    """BFL's layout, the config in its metadata (make_tiny_models' convention); diffusers' beside it."""
    from library.models.vae import autoencoder_kl_to_ldm_state_dict

    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
    sd = {k: v.contiguous() for k, v in vae.state_dict().items()}
    save_safetensors(autoencoder_kl_to_ldm_state_dict(sd, len(config["block_out_channels"])), paths["ae"],
                     metadata={"diffusers_config": json.dumps(config)})
    if diffusers:
        folder = os.path.join(os.path.dirname(paths["ae"]), "diffusers", "vae")
        save_safetensors(sd, os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKL", **config})


def new_transformer(text: dict[str, torch.Tensor]):
    from library.models.flux1.model import Flux, FluxConfig

    return Flux(FluxConfig(in_channels=64, vec_in_dim=text["clip_pooled"].shape[1], context_in_dim=text["t5"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    from library.models.flux1.checkpoint import save_flux_bfl, save_flux_diffusers
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_flux_bfl, save_flux_diffusers)


_HERE = __name__ + ":"
# The VAE recipe whole (its class and files, learning rate, steps, no compiled loss): a family that ships FLUX.1's
# VAE spreads it into its LearnedBase, so the pretrainer trains the same bytes as learned/flux/ae.safetensors
VAE_RECIPE = dict(new_vae=_HERE + "new_vae", save_vae=_HERE + "save_vae", vae_lr=1.5e-3, vae_steps=1500,
                  compile_vae=False)
LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "flux1-learned.safetensors"), ("ae", "ae.safetensors"),
           ("clip_l", "clip_l"), ("t5xxl", "t5xxl")),
    encode_kwargs=(("t5_max_length", T5_TOKENS),),
    config="quickstart.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-11-25, the shipped base, 2 threads), 60 steps: 0/18 before,
    # 15/18 after, 10 of 10 unrelated kept; flipped flow target 0/18 (with 10 regularisation images instead of 200,
    # 2026-11-24: 15/18, 9 of 10 kept).
    learning_test=(60, 0.6, 0.7),
    **VAE_RECIPE,
)
