"""HiDream-I1's transformer in the tiny real-format model set (tools/make_tiny_models.py, once spec.py lists it):

  hidream/hidream-tiny.safetensors   the transformer as the released single files: bare diffusers / ComfyUI names,
                                     bf16, no config metadata (the loader reads the sizes from the shapes)

Width 128 = 1 head of 128 with the released RoPE axes (64, 32, 32): the head stays the released 128 because a file
without metadata states no head width, and the loader takes ComfyUI's fixed 128 (checkpoint.config_from_shapes); a
narrower head would need a config the released layout cannot carry, and 2 heads of 128 (width 256) triple the file
(~32 MB, the experts' SwiGLU widths round up to multiples of 256). 2 double + 2 single blocks, 4 routed experts
picked top-2 plus the shared one, as released. The T5 / Llama / pooled widths are the tiny text encoders'; blocks
read Llama layers by the released rule (block i: layer min(i, 31)), which the forward clips to the `llama_layers`
hidden layers the tiny Llama gives (2: blocks read layers 0, 1, 1, 1). Seed offset 130 is this file's (130-139: the
family's).
"""

from __future__ import annotations

import os

from library.models.tiny_files import seed_component

WIDTH, DOUBLE, SINGLE = 128, 2, 2


def tiny_config(t5_dim: int = 64, llama_dim: int = 64, pooled_dim: int = 64):
    """The tiny transformer's config, as the loader infers it from the file's shapes."""
    from library.models.hidream.model import HiDreamConfig, released_llama_layers

    return HiDreamConfig(num_layers=DOUBLE, num_single_layers=SINGLE, num_attention_heads=WIDTH // 128,
                         t5_dim=t5_dim, llama_dim=llama_dim, text_emb_dim=pooled_dim,
                         llama_layers=released_llama_layers(DOUBLE + SINGLE))


def random_hidream(config):
    """A HiDream as built (torch's init; the gates N(0, 1 / sqrt(width)) as diffusers draws them) with its q / k
    RMSNorm weights N(1, 0.1) (the released ones are learned), from torch's generator as seeded."""
    import torch

    from library.models.hidream.model import HiDream

    model = HiDream(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "_rms_norm" in name:
                p.normal_(1.0, 0.1)
    return model


def write_hidream(out: str, seed: int, t5_dim: int = 64, llama_dim: int = 64, llama_layers: int = 2,
                  pooled_dim: int = 64) -> dict[str, str]:
    """The transformer as the released single file (bf16, bare keys, no metadata). llama_layers: the hidden layers
    the tiny Llama gives (the file stores no layer list; the forward clips the released rule to them)."""
    import torch

    from library.models.hidream.checkpoint import save_hidream_single_file

    if llama_layers < 1:
        raise ValueError(f"write_hidream: llama_layers {llama_layers}: the Llama text encoder gives at least 1 layer")
    seed_component(seed, 130)
    config = tiny_config(t5_dim, llama_dim, pooled_dim)
    weights = {k: v.to(torch.bfloat16) for k, v in random_hidream(config).state_dict().items()}
    path = os.path.join(out, "hidream", "hidream-tiny.safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_hidream_single_file(weights, path, config, write_config=False)
    return {"hidream": path}


def write_sized_hidream(folder: str, hidden: int, double: int, single: int, seed: int) -> str:
    """HiDream at width `hidden` (heads of 128 as released: rounded down to a multiple of 128, at least 128), `double`
    + `single` blocks, random N(0, 0.02), the tiny text encoders' widths (64): the released single-file layout with
    its config in the metadata (the spec's TINY.sized)."""
    from library.models.hidream.checkpoint import save_hidream_single_file
    from library.models.hidream.model import HiDream, HiDreamConfig, released_llama_layers
    from library.models.tiny_files import random_init

    heads = max(1, hidden // 128)
    config = HiDreamConfig(num_layers=double, num_single_layers=single, num_attention_heads=heads, t5_dim=64,
                           llama_dim=64, text_emb_dim=64, llama_layers=released_llama_layers(double + single))
    path = os.path.join(folder, "hidream_sized.safetensors")
    save_hidream_single_file(random_init(HiDream(config), seed), path, config)
    return path
