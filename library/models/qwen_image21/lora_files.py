"""Qwen-Image-2.1 LoRA files: the module paths tools/convert_lora.py resolves kohya names against
(through the spec's LORA_FILES). The model has diffusers names, so every layout names the same
modules and converting changes the prefix only."""

from __future__ import annotations

import torch

from library.models.qwen_image21.model import QwenImage21, QwenImage21Config


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of a Qwen-Image-2.1 model with as many blocks as the LoRA names (small widths:
    only the names matter)."""
    config = QwenImage21Config(num_layers=counts.get("transformer_blocks", 0), attention_head_dim=32,
                               num_attention_heads=1, context_in_dim=8, axes_dims_rope=(8, 12, 12))
    with torch.device("meta"):
        model = QwenImage21(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
