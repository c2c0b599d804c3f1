"""Anima's transformer in the tiny real-format model set (tools/make_tiny_models.py, once spec.py lists it):

  anima/anima-tiny.safetensors   the DiT and the LLM adapter as the released single file: "net." prefix, the
                                 original names, bf16, the RoPE module's buffers beside the weights (as NVIDIA's
                                 training code and sd-scripts' save_anima_model store them), no config metadata
                                 (the loader reads the sizes from the shapes)

Width 64 (2 heads of 32: RoPE (12, 10, 10)), 2 blocks, adaLN-LoRA rank 32; the adapter 2 layers of width 64
(2 heads of 32) reading the tiny Qwen3 text encoder's width 64 (TEXT_WIDTH, library/models/anima/tiny_text.py)
and T5's full vocabulary (32128: the tiny T5 tokenizer's ids stay below it). Seed offset 80 is this file's.
"""

from __future__ import annotations

import os

from library.models.anima.tiny_text import TEXT_WIDTH  # the tiny Qwen3's width: the adapter's source dim
from library.models.tiny_files import TINY, seed_component


def tiny_config():
    from library.models.anima.model import AnimaConfig

    return AnimaConfig(hidden_size=TINY["dit_hidden"], num_heads=TINY["dit_heads"], num_blocks=2,
                       in_channels=TINY["latent_channels"], out_channels=TINY["latent_channels"], text_dim=64,
                       adaln_lora_dim=32, adapter_layers=2, adapter_dim=64, adapter_heads=2,
                       adapter_source_dim=TEXT_WIDTH)


def random_anima(config):
    """An Anima as built (torch's Linear and Embedding init) with its norm weights N(1, 0.1) (the released ones are
    learned), from torch's generator as seeded."""
    import torch

    from library.models.anima.model import Anima

    model = Anima(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
    return model


def position_buffers(config) -> dict:
    """The RoPE module's persistent buffers of a released file (sd-scripts' VideoRopePosition3DEmb at its
    512 x 512 x 128 maximum, patch 2): not weights, the loader skips them."""
    import torch

    dim_t, dim_h, _ = config.rope_dims
    return {"pos_embedder.seq": torch.arange(256, dtype=torch.float32),
            "pos_embedder.dim_spatial_range": torch.arange(0, dim_h, 2, dtype=torch.float32) / dim_h,
            "pos_embedder.dim_temporal_range": torch.arange(0, dim_t, 2, dtype=torch.float32) / dim_t}


def write_anima(out: str, seed: int) -> dict[str, str]:
    """The transformer as the released single file."""
    import torch

    from library.models.anima.checkpoint import save_anima_single_file

    seed_component(seed, 80)
    config = tiny_config()
    weights = {k: v.to(torch.bfloat16) for k, v in random_anima(config).state_dict().items()}
    path = os.path.join(out, "anima", "anima-tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_anima_single_file(weights, path, extra=position_buffers(config))
    return {"anima": path}


def write_sized_anima(folder: str, hidden: int, depth: int, seed: int) -> str:
    """Anima at width `hidden` (heads of 128, as released) and `depth` DiT blocks, the tiny adapter (2 layers of
    width 64 reading TEXT_WIDTH), random N(0, 0.02): the released single-file layout with its config in the
    metadata (the spec's TINY.sized)."""
    from library.models.anima.checkpoint import save_anima_single_file
    from library.models.anima.model import Anima, AnimaConfig
    from library.models.tiny_files import random_init

    config = AnimaConfig(hidden_size=hidden, num_heads=max(1, hidden // 128), num_blocks=depth, text_dim=64,
                         adapter_layers=2, adapter_dim=64, adapter_heads=2, adapter_source_dim=TEXT_WIDTH)
    path = os.path.join(folder, "anima_sized.safetensors")
    save_anima_single_file(random_init(Anima(config), seed), path, config)
    return path
