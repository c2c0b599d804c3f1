"""Qwen-Image-2.1's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  qwen_image21/transformer/                    diffusers QwenImage21Transformer2DModel folder
  qwen_image21/qwen_image21-tiny.safetensors   the same weights as the ComfyUI single file
                                               (`model.diffusion_model.`, img_mlp.gate_up fused)

The transformer's text width is the text encoders' (TINY lm_hidden = 32); latents enter unpatched, so
in_channels is the tiny VAE's latent channels (16). Seed offsets 50-59 are this family's.
"""

from __future__ import annotations

import os

import torch

from library.models.tiny_files import TINY, seed_component


def tiny_config():
    """width 64 = 2 heads x 32, RoPE axes (8, 12, 12), 2 blocks, MLP 3 x 64, text width 32, 16 channels."""
    from library.models.qwen_image21.model import QwenImage21Config

    return QwenImage21Config(
        in_channels=TINY["latent_channels"], out_channels=TINY["latent_channels"], num_layers=2,
        attention_head_dim=TINY["dit_hidden"] // TINY["dit_heads"], num_attention_heads=TINY["dit_heads"],
        context_in_dim=TINY["lm_hidden"], axes_dims_rope=TINY["axes"],
    )  # fmt: skip


def random_qwen_image21(config) -> "torch.nn.Module":
    """A QwenImage21 whose zero-centred norm weights are random too (the released ones are learned)."""
    from library.models.qwen_image21.model import QwenImage21

    model = QwenImage21(config)
    with torch.no_grad():
        model.txt_in.text_norm.weight.normal_(0.0, 0.1)
    return model


def write_qwen_image21(out: str, seed: int) -> dict[str, str]:
    """The transformer as a diffusers folder and as the ComfyUI single file, same weights."""
    from library.models.qwen_image21.checkpoint import save_qwen_image21_diffusers, save_qwen_image21_single_file

    seed_component(seed, 50)
    config = tiny_config()
    model = random_qwen_image21(config)
    root = os.path.join(out, "qwen_image21")
    paths = {"qwen_image21": os.path.join(root, "transformer"),
             "qwen_image21_comfy": os.path.join(root, "qwen_image21-tiny.safetensors")}
    save_qwen_image21_diffusers(model, config, paths["qwen_image21"])
    save_qwen_image21_single_file(model, paths["qwen_image21_comfy"], config)
    return paths
