"""HunyuanImage-2.1's transformer in the tiny real-format model set (tools/make_tiny_models.py, once spec.py lists it):

  hunyuan_image/hunyuan_image-tiny.safetensors   the transformer as Tencent's dit/hunyuanimage2.1.safetensors: the
                                                 original names, no prefix, bf16, no config metadata (the loader
                                                 reads the sizes from the shapes)

Width 64 = 2 heads of 32 (RoPE rows 16 + columns 16, as the released 64 + 64 of 128), MLP ratio 4, 2 double and 2
single blocks, 1 refiner block, byt5_in's hidden 64 (released 2048); the text and glyph widths are the tiny text
encoders' (text_dim, glyph_dim), the latent channels the released 64 (the tiny VAE keeps them: tiny_vae.py). Seed
offset 110 is this file's (110-119: the family's).
"""

from __future__ import annotations

import os

from library.models.tiny_files import seed_component

WIDTH, HEADS, GLYPH_HIDDEN = 64, 2, 64


def tiny_config(text_dim: int = 64, glyph_dim: int = 32):
    from library.models.hunyuan_image.model import HunyuanImageConfig

    return HunyuanImageConfig(hidden_size=WIDTH, num_heads=HEADS, depth=2, depth_single=2, text_dim=text_dim,
                              glyph_dim=glyph_dim, glyph_hidden=GLYPH_HIDDEN, refiner_depth=1, axes_dim=(16, 16))


def random_hunyuan_image(config):
    """A HunyuanImage as built (torch's init) with its norm weights N(1, 0.1) (the released ones are learned), from
    torch's generator as seeded."""
    import torch

    from library.models.hunyuan_image.model import HunyuanImage

    model = HunyuanImage(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name and name.endswith("weight")):
                p.normal_(1.0, 0.1)
    return model


def write_hunyuan_image(out: str, seed: int, text_dim: int = 64, glyph_dim: int = 32) -> dict[str, str]:
    """The transformer as Tencent's single file (bf16, original names, no metadata)."""
    import torch

    from library.models.hunyuan_image.checkpoint import save_hunyuan_image_single_file

    seed_component(seed, 110)
    weights = {k: v.to(torch.bfloat16) for k, v in random_hunyuan_image(tiny_config(text_dim, glyph_dim))
               .state_dict().items()}
    path = os.path.join(out, "hunyuan_image", "hunyuan_image-tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_hunyuan_image_single_file(weights, path)
    return {"hunyuan_image": path}


def write_sized_hunyuan_image(folder: str, hidden: int, depth: int, seed: int) -> str:
    """HunyuanImage at width `hidden` (heads of 128 as released where they divide, else fewer), `depth` double and
    2 x `depth` single blocks (the released 1 : 2), 2 refiner blocks, random N(0, 0.02), the tiny text encoders'
    widths (64, 32): Tencent's single-file layout with its config in the metadata (the spec's TINY.sized)."""
    from library.models.hunyuan_image.checkpoint import save_hunyuan_image_single_file
    from library.models.hunyuan_image.model import HunyuanImage, HunyuanImageConfig
    from library.models.tiny_files import random_init

    heads = max(1, hidden // 128)
    while heads > 1 and (hidden % heads or (hidden // heads) % 4):
        heads -= 1
    head_dim = hidden // heads
    config = HunyuanImageConfig(hidden_size=hidden, num_heads=heads, depth=depth, depth_single=2 * depth, text_dim=64,
                                glyph_dim=32, glyph_hidden=GLYPH_HIDDEN, axes_dim=(head_dim // 2, head_dim // 2))
    path = os.path.join(folder, "hunyuan_image_sized.safetensors")
    save_hunyuan_image_single_file(random_init(HunyuanImage(config), seed), path, config)
    return path
