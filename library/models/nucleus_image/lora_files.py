"""Nucleus-Image LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through the spec's
LORA_FILES). The model has diffusers' module names, which the single file shares, so every layout names the same
modules: kohya `lora_unet_transformer_blocks_0_attn_to_q`, PEFT `transformer.transformer_blocks.0.attn.to_q`
(NucleusMoEImageTransformer2DModel.load_lora_adapter) and ai-toolkit's
`diffusion_model.transformer_blocks.0.attn.to_q` (its convert_lora_weights_before_save): converting changes the
prefix only."""

from __future__ import annotations

DENSE_BLOCKS = 3  # dense_moe_strategy "leave_first_three_blocks_dense": blocks 0-2 dense, the rest mixtures of experts

# every Linear of a block and those outside the blocks; a MoE block's packed experts by their Parameters' paths (the
# experts LoRA type: networks/lora_packed.py)
BLOCK_LINEARS = ("img_mod.1", "encoder_proj", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_out.0")
DENSE_MLP = ("img_mlp.net.0.proj", "img_mlp.net.2")
MOE_MLP = ("img_mlp.gate", "img_mlp.shared_expert.net.0.proj", "img_mlp.shared_expert.net.2",
           "img_mlp.experts.gate_up_proj", "img_mlp.experts.down_proj")
OUTER_LINEARS = ("img_in", "time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
                 "norm_out.linear", "proj_out")


def module_paths(counts: dict[str, int]) -> list[str]:
    """Every Linear path and packed expert weight of a Nucleus-Image with as many blocks as the LoRA names
    (counts["transformer_blocks"]), the first DENSE_BLOCKS dense as released."""
    paths = []
    for i in range(counts.get("transformer_blocks", 0)):
        mlp = DENSE_MLP if i < DENSE_BLOCKS else MOE_MLP
        paths += [f"transformer_blocks.{i}.{name}" for name in BLOCK_LINEARS + mlp]
    return paths + list(OUTER_LINEARS)
