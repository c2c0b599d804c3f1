"""Ideogram 4 LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through
the spec's LORA_FILES). The model has diffusers' names, so the kohya and diffusers layouts name the
same modules and converting changes the prefix only. (ai-toolkit's `diffusion_model.` files fuse
q, k, v in `attention.qkv`: diffusers' Ideogram4LoraLoaderMixin splits them on load.)"""

from __future__ import annotations

import torch

from library.models.ideogram4.model import Ideogram4, Ideogram4Config


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of an Ideogram 4 model with as many blocks as the LoRA names (tiny widths:
    only the names matter)."""
    config = Ideogram4Config(num_layers=counts.get("layers", 0), attention_head_dim=64, num_attention_heads=1,
                             intermediate_size=8, adaln_dim=8, llm_features_dim=8, in_channels=8,
                             mrope_section=(6, 5, 5))
    with torch.device("meta"):
        model = Ideogram4(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


METADATA_KEYS = ("ss_base_model_version", "modelspec.architecture")


def is_own_lora(tensors: dict, metadata: dict[str, str]) -> bool:
    """True for an Ideogram 4 LoRA among those with Z-Image's block names: a module only Ideogram 4 has
    (spec LORA_FILES.markers), else metadata naming it (our LoRAs record ss_base_model_version)."""
    from library.models.ideogram4.spec import LORA_FILES

    flat = [k.replace(".", "_") for k in tensors]
    if any(m in k for k in flat for m in LORA_FILES.markers):
        return True
    return any(metadata.get(key, "").lower().startswith("ideogram4") for key in METADATA_KEYS)
