"""Chroma's part of the tiny real-format model set (tools/make_tiny_models.py, once the family is registered):

  chroma/chroma-tiny.safetensors      BFL-style single file (the released Chroma layout)
  chroma/diffusers/transformer/       the same weights as a diffusers ChromaTransformer2DModel folder
  chroma/t5xxl/                       T5EncoderModel HF folder with its tokenizer

T5 d_model == context_in_dim, 16 latent channels (64 packed). The VAE is FLUX.1's (flux1/tiny.py).
"""

from __future__ import annotations

import os

from library.models.tiny_files import TINY, seed_component, write_t5_encoder


def tiny_chroma_config():
    from library.models.chroma.model import ChromaConfig

    return ChromaConfig(
        in_channels=4 * TINY["latent_channels"], context_in_dim=TINY["t5_d_model"], hidden_size=TINY["dit_hidden"],
        num_heads=TINY["dit_heads"], depth=2, depth_single=2, axes_dim=TINY["axes"],
        approximator_in_dim=64, approximator_hidden=32, approximator_layers=2,
    )  # fmt: skip


def write_chroma(out: str, seed: int) -> dict[str, str]:
    from library.models.chroma.checkpoint import save_chroma_bfl, save_chroma_diffusers
    from library.models.chroma.model import Chroma

    seed_component(seed, 21)
    config = tiny_chroma_config()
    model = Chroma(config)
    single = os.path.join(out, "chroma", "chroma-tiny.safetensors")
    folder = os.path.join(out, "chroma", "diffusers", "transformer")
    save_chroma_bfl(model, single, config)
    save_chroma_diffusers(model, config, folder)
    return {"chroma_bfl": single, "chroma_diffusers": folder}


def write_t5(out: str, seed: int) -> dict[str, str]:
    folder = os.path.join(out, "chroma", "t5xxl")
    write_t5_encoder(folder, seed, 22)
    return {"chroma_t5xxl": folder}


def write_sized_chroma(folder: str, hidden: int, depth: int, seed: int) -> str:
    """Chroma at width `hidden` (heads of 128, RoPE axes (16, 56, 56)), `depth` double and single blocks,
    a 2-layer approximator of width `hidden` (the released one is 5 x 5120 wide), random N(0, 0.02),
    the tiny T5's width: a BFL-style single file (the spec's TINY.sized)."""
    from library.models.chroma.checkpoint import save_chroma_bfl
    from library.models.chroma.model import Chroma, ChromaConfig
    from library.models.tiny_files import random_init

    config = ChromaConfig(context_in_dim=TINY["t5_d_model"], hidden_size=hidden, num_heads=hidden // 128, depth=depth,
                          depth_single=depth, approximator_hidden=hidden, approximator_layers=2)
    path = os.path.join(folder, "chroma_sized.safetensors")
    save_chroma_bfl(random_init(Chroma(config), seed), path, config)
    return path
