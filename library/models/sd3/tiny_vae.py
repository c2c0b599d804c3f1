"""SD3's VAE in the tiny real-format model set (tools/make_tiny_models.py, listed in spec.py TINY):

  sd3/sd3-vae-tiny.safetensors   the VAE as SAI's all-in-one checkpoints hold it: LDM names under
                                 `first_stage_model.`, bf16, its toy sizes in the `diffusers_config` metadata (SAI's
                                 files carry none: the released config is the default)

Seed offset 126 is this file's (120-129: the family's).
"""

from __future__ import annotations

import json
import os


def write_sd3_vae(out: str, seed: int) -> dict[str, str]:
    """The tiny VAE (16 latent channels, 4 blocks of 8-16 channels) as an all-in-one checkpoint's part."""
    import torch
    from diffusers import AutoencoderKL

    from library.io import save_safetensors
    from library.models.sd3.vae import SD3_VAE_CONFIG
    from library.models.tiny_files import TINY, seed_component
    from library.models.vae import autoencoder_kl_to_ldm_state_dict

    seed_component(seed, 126)
    config = {**SD3_VAE_CONFIG, "block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4, "layers_per_block": 1,
              "sample_size": 64, "latent_channels": TINY["latent_channels"]}
    ldm = autoencoder_kl_to_ldm_state_dict(AutoencoderKL(**config).state_dict(), len(config["block_out_channels"]))
    path = os.path.join(out, "sd3", "sd3-vae-tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_safetensors({f"first_stage_model.{k}": v.to(torch.bfloat16) for k, v in ldm.items()}, path,
                     metadata={"diffusers_config": json.dumps(config)})
    return {"sd3_vae": path}
