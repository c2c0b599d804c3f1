"""Qwen-Image-2.1 LoRA files: the module paths tools/convert_lora.py resolves kohya names against
(through the spec's LORA_FILES). The model has diffusers names, so every layout names the same
modules and converting changes the prefix only; a LoRA on ComfyUI's fused SwiGLU projection
(`diffusion_model.transformer_blocks.N.img_mlp.gate_up`, as ComfyUI / ai-toolkit files name it) reads
as ours by rows (comfy_module_map)."""

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
    paths = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return paths + [f"transformer_blocks.{i}{GATE_UP}" for i in range(config.num_layers)]  # ComfyUI's fused name


GATE_UP = ".img_mlp.gate_up"


def comfy_module_map(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """{ComfyUI module path: [(our module path, row0, row1)]} for the modules of `weights` on ComfyUI's fused
    img_mlp.gate_up: gate rows first (diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers
    splits the weight so), the gate half to gate_layer, the up half to proj."""
    out = {}
    for path, w in weights.items():
        if path.endswith(GATE_UP):
            block, half = path[: -len(GATE_UP)], w.up.shape[0] // 2
            out[path] = [(block + ".img_mlp.gate_layer", 0, half), (block + ".img_mlp.proj", half, 2 * half)]
    return out
