"""HunyuanImage-2.1's VAE in the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  hunyuan_image/vae/                                   diffusers AutoencoderKLHunyuanImage folder (float32)
  hunyuan_image/hunyuan_image_2.1_vae-tiny.safetensors the same weights as the ComfyUI / sd-scripts single file
                                                       (Tencent's names, float16 as released, config in metadata)

The tiny VAE keeps what the family relies on: 64 latent channels and 32x (six levels, five 2x samplings); it has
32 channels per level up to 64 and 128 (GroupNorm's 32 groups and the encoder head's 2 x 64 set the floor) and one
resnet per encoder level. Seed offsets 110-119 are this family's (112: the VAE).
"""

from __future__ import annotations

import json
import os

import torch

from library.io import save_diffusers_folder, save_safetensors
from library.models.tiny_files import seed_component

TINY_VAE_SIZES = {"block_out_channels": [32, 32, 32, 32, 64, 128], "layers_per_block": 1}


def tiny_vae_config() -> dict:
    """The released VAE's config at the tiny sizes (the scaling factor and 64 latent channels kept)."""
    from library.models.hunyuan_image.vae import HUNYUAN_IMAGE_VAE_CONFIG

    return {**HUNYUAN_IMAGE_VAE_CONFIG, **TINY_VAE_SIZES}


def random_hunyuan_image_vae(config: dict) -> torch.nn.Module:
    """An AutoencoderKLHunyuanImage of `config`, float16-representable weights, its GroupNorms random too
    (weight 1 + N(0, 0.1), bias N(0, 0.1): the released ones are learned, and a block the conversion table put in
    the wrong place then changes the output through its norms as well as its convolutions)."""
    from diffusers import AutoencoderKLHunyuanImage

    vae = AutoencoderKLHunyuanImage(**config)
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.weight.add_(0.1 * torch.randn_like(module.weight))
                module.bias.normal_(0.0, 0.1)
        for p in vae.parameters():  # the single file is float16: both layouts then hold the same numbers
            p.copy_(p.half().float())
    return vae.eval()


def write_hunyuan_image_vae(out: str, seed: int) -> dict[str, str]:
    """The tiny VAE as a diffusers folder and as the single file people download, same weights."""
    from library.models.hunyuan_image.vae import diffusers_to_single_file

    seed_component(seed, 112)
    config = tiny_vae_config()
    vae = random_hunyuan_image_vae(config)
    root = os.path.join(out, "hunyuan_image")
    paths = {"hunyuan_image_vae": os.path.join(root, "vae"),
             "hunyuan_image_vae_single": os.path.join(root, "hunyuan_image_2.1_vae-tiny.safetensors")}
    sd = vae.state_dict()
    save_diffusers_folder(sd, {"_class_name": "AutoencoderKLHunyuanImage", **config}, paths["hunyuan_image_vae"])
    # The released file carries no config; this one records its toy sizes so that the loader finds them.
    single = {k: v.half() for k, v in diffusers_to_single_file(sd, config).items()}
    save_safetensors(single, paths["hunyuan_image_vae_single"], metadata={"diffusers_config": json.dumps(config)})
    return paths
