"""Lumina 2's transformer in the tiny real-format model set (tools/make_tiny_models.py, once spec.py lists it):

  lumina2/lumina2-tiny.safetensors   the transformer as the released single file: the original names, no prefix,
                                     bf16, the unused `norm_final.weight` beside the weights (as Comfy-Org's
                                     lumina_2_model_bf16.safetensors), no config metadata (the loader reads the
                                     sizes from the shapes)

Width 96 = 3 query heads of 32 sharing 1 key/value head (grouped-query attention kept, as the released 24 / 8),
RoPE (12, 10, 10) (checkpoint.default_axes_dims), feed-forward 512 (4 x 96 rounded up to 256), 2 joint layers and
one refiner of each kind; the caption width is the tiny text encoder's (cap_feat_dim), the latent channels
FLUX.1's AE's (16). Seed offset 90 is this file's.
"""

from __future__ import annotations

import os

from library.models.tiny_files import TINY, seed_component

DIM, HEADS, KV_HEADS = 96, 3, 1


def tiny_config(cap_feat_dim: int = 64):
    from library.models.lumina2.checkpoint import default_axes_dims
    from library.models.lumina2.model import Lumina2Config

    return Lumina2Config(in_channels=TINY["latent_channels"], dim=DIM, n_layers=2, n_refiner_layers=1, n_heads=HEADS,
                         n_kv_heads=KV_HEADS, cap_feat_dim=cap_feat_dim, axes_dims=default_axes_dims(DIM // HEADS))


def random_lumina2(config):
    """A Lumina2 as built (torch's Linear init) with its norm weights N(1, 0.1) (the released ones are learned),
    from torch's generator as seeded."""
    import torch

    from library.models.lumina2.model import Lumina2

    model = Lumina2(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.1)
    return model


def write_lumina2(out: str, seed: int, cap_feat_dim: int = 64) -> dict[str, str]:
    """The transformer as the released single file (bf16, original names, norm_final.weight, no metadata)."""
    import torch

    from library.models.lumina2.checkpoint import save_lumina2_single_file

    seed_component(seed, 90)
    config = tiny_config(cap_feat_dim)
    weights = {k: v.to(torch.bfloat16) for k, v in random_lumina2(config).state_dict().items()}
    unused_norm = {"norm_final.weight": torch.ones(config.dim, dtype=torch.bfloat16)}
    path = os.path.join(out, "lumina2", "lumina2-tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_lumina2_single_file(weights, path, extra=unused_norm)
    return {"lumina2": path}


def write_sized_lumina2(folder: str, hidden: int, depth: int, seed: int) -> str:
    """Lumina 2 at width `hidden` (heads of about 96, as released; a third of them key/value heads where they
    divide), 2 x `depth` joint blocks and one refiner of each kind, random N(0, 0.02), the tiny text encoder's
    width (64): the single-file layout with its config in the metadata (the spec's TINY.sized)."""
    from library.models.lumina2.checkpoint import default_axes_dims, save_lumina2_single_file
    from library.models.lumina2.model import Lumina2, Lumina2Config
    from library.models.tiny_files import random_init

    heads = max(1, hidden // 96)
    while heads > 1 and (hidden % heads or (hidden // heads) % 2):
        heads -= 1
    config = Lumina2Config(in_channels=TINY["latent_channels"], dim=hidden, n_layers=2 * depth, n_refiner_layers=1,
                           n_heads=heads, n_kv_heads=heads // 3 if heads % 3 == 0 else 1, cap_feat_dim=64,
                           axes_dims=default_axes_dims(hidden // heads))
    path = os.path.join(folder, "lumina2_sized.safetensors")
    save_lumina2_single_file(random_init(Lumina2(config), seed), path, config)
    return path
