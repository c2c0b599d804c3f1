"""SD3's MMDiT in the tiny real-format model set (tools/make_tiny_models.py, once spec.py lists it):

  sd3/sd3-tiny.safetensors   the transformer as SAI's sd3.5_*.safetensors: our names under "model.diffusion_model.",
                             the position table `pos_embed`, bf16, no config metadata (the loader reads the sizes from
                             the shapes)

Width 128 = 2 heads of 64 (SD3's heads are always 64 wide: the loader's heads = width / 64), MLP ratio 4, 3 joint
blocks (the last one's text stream pre-only), block 0 MMDiT-X (x_block.attn2), qk RMSNorm (SD3.5), a 32 x 32 position
table (released: 192 or 384); the text and pooled widths are the tiny text encoders' (context_dim, pooled_dim), the
latent channels the released 16. Seed offset 120 is this file's (120-129: the family's).
"""

from __future__ import annotations

import os

from library.models.tiny_files import seed_component

WIDTH, DEPTH, POS_EMBED_MAX_SIZE = 128, 3, 32


def tiny_config(context_dim: int = 64, pooled_dim: int = 64):
    from library.models.sd3.model import SD3Config

    return SD3Config(depth=DEPTH, hidden_size=WIDTH, context_dim=context_dim, pooled_dim=pooled_dim,
                     pos_embed_max_size=POS_EMBED_MAX_SIZE, qk_norm=True, dual_attention_layers=(0,))


def random_sd3(config):
    """An SD3 as built (torch's init) with its qk-norm weights N(1, 0.1) (the released ones are learned), from torch's
    generator as seeded."""
    import torch

    from library.models.sd3.model import SD3

    model = SD3(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and (".ln_q." in name or ".ln_k." in name):
                p.normal_(1.0, 0.1)
    return model


def write_sd3(out: str, seed: int, context_dim: int = 64, pooled_dim: int = 64) -> dict[str, str]:
    """The transformer as SAI's single file (bf16, "model.diffusion_model." prefix, pos_embed, no metadata)."""
    import torch

    from library.models.sd3.checkpoint import save_sd3_single_file

    seed_component(seed, 120)
    config = tiny_config(context_dim, pooled_dim)
    weights = {k: v.to(torch.bfloat16) for k, v in random_sd3(config).state_dict().items()}
    path = os.path.join(out, "sd3", "sd3-tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_sd3_single_file(weights, path, config, write_config=False)
    return {"sd3": path}


def write_sized_sd3(folder: str, hidden: int, depth: int, seed: int) -> str:
    """SD3 at width `hidden` (heads of 64 as released: rounded down to a multiple of 64, at least 64), `depth` joint
    blocks, qk norm, no MMDiT-X, a 64 x 64 position table, random N(0, 0.02), the tiny text encoders' widths (64, 64):
    SAI's single-file layout with its config in the metadata (the spec's TINY.sized)."""
    from library.models.sd3.checkpoint import save_sd3_single_file
    from library.models.sd3.model import SD3, SD3Config
    from library.models.tiny_files import random_init

    width = max(64, hidden // 64 * 64)
    config = SD3Config(depth=depth, hidden_size=width, context_dim=64, pooled_dim=64, pos_embed_max_size=64)
    path = os.path.join(folder, "sd3_sized.safetensors")
    save_sd3_single_file(random_init(SD3(config), seed), path, config)
    return path
