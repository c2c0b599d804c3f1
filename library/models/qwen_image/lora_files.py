"""Qwen-Image LoRA files: the module paths tools/convert_lora.py resolves kohya names against
(through the spec's LORA_FILES). The model has diffusers names, so every layout names the same
modules and converting changes the prefix only."""

from __future__ import annotations

import torch

from library.models.qwen_image.model import QwenImage, QwenImageConfig


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of a Qwen-Image model with as many blocks as the LoRA names."""
    with torch.device("meta"):
        model = QwenImage(QwenImageConfig(num_layers=counts.get("transformer_blocks", 0)))
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
