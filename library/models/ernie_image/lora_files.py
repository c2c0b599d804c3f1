"""ERNIE-Image LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through the spec's
LORA_FILES). The model has diffusers' module names, which the single file shares (diffusers'
convert_ernie_image_transformer_checkpoint_to_diffusers only strips ComfyUI's `model.diffusion_model.`), so every
layout names the same modules: kohya `lora_unet_layers_0_self_attention_to_q`, PEFT
`transformer.layers.0.self_attention.to_q` and ai-toolkit's `diffusion_model.layers.0.self_attention.to_q`
(ErnieImageLoraLoaderMixin swaps that prefix for transformer.): converting changes the prefix only."""

from __future__ import annotations

# every Linear of a block, and those outside the blocks (ErnieImageTransformer2DModel's names)
BLOCK_LINEARS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")
OUTER_LINEARS = ("text_proj", "time_embedding.linear_1", "time_embedding.linear_2", "adaLN_modulation.1",
                 "final_norm.linear", "final_linear")


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path of an ERNIE-Image with as many blocks as the LoRA names (counts["layers"])."""
    blocks = [f"layers.{i}.{name}" for i in range(counts.get("layers", 0)) for name in BLOCK_LINEARS]
    return blocks + list(OUTER_LINEARS)
