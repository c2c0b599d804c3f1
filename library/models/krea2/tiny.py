"""Krea 2's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  krea2/krea2-tiny.safetensors         the released single-file layout (original names, as
                                       raw.safetensors / turbo.safetensors), the config in its metadata
  krea2/transformer/                   the same weights as a diffusers Krea2Transformer2DModel folder

The VAE is Qwen-Image's (qwen_image/vae, the same AutoencoderKLQwenImage). The transformer's text
width is the text encoders' (TINY lm_hidden = 32), 3 tapped layers, 16 latent channels (64 packed).
Seed offset 30 is this family's.
"""

from __future__ import annotations

import os

import torch

from library.models.tiny_files import TINY, seed_component

TEXT_TAPS = (1, 2, 3)  # the tiny pipeline's text_encoder_select_layers (the released: 2, 5, ..., 35)


def tiny_config():
    """width 64 = 2 heads x 32 (1 key-value head: grouped-query), RoPE axes (8, 12, 12) (the original
    split of head_dim 32), 2 main blocks, text fusion 2 heads over 3 tapped layers of width 32."""
    from library.models.krea2.model import Krea2Config

    return Krea2Config(
        in_channels=4 * TINY["latent_channels"], num_layers=2, attention_head_dim=TINY["dit_hidden"] // TINY["dit_heads"],
        num_attention_heads=TINY["dit_heads"], num_key_value_heads=1, intermediate_size=128, timestep_embed_dim=256,
        text_hidden_dim=TINY["lm_hidden"], num_text_layers=len(TEXT_TAPS), text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=64, axes_dims_rope=TINY["axes"],
    )  # fmt: skip


def random_krea2(config) -> "torch.nn.Module":
    """A Krea2 whose zero-initialised tables and norm scales are random too (the released ones are learned)."""
    from library.models.krea2.model import Krea2

    model = Krea2(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".scale", ".lin")):
                p.normal_(0.0, 0.1)
    return model


def write_krea2(out: str, seed: int) -> dict[str, str]:
    """The transformer as a single file and as a diffusers folder, same weights."""
    from library.models.krea2.checkpoint import save_krea2_diffusers, save_krea2_single_file

    seed_component(seed, 30)
    config = tiny_config()
    model = random_krea2(config)
    root = os.path.join(out, "krea2")
    paths = {"krea2": os.path.join(root, "krea2-tiny.safetensors"), "krea2_diffusers": os.path.join(root, "transformer")}
    save_krea2_single_file(model, paths["krea2"], config)
    save_krea2_diffusers(model, config, paths["krea2_diffusers"])
    return paths
