"""LLM LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through
llm_spec.py's LORA_FILES)."""

from __future__ import annotations

LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def module_paths(counts: dict[str, int]) -> list[str]:
    """The Linear paths of a Llama / Qwen2 decoder with as many layers as the LoRA names, and lm_head."""
    return [f"model.layers.{i}.{part}" for i in range(counts.get("layers", 0)) for part in LAYER_LINEARS] + ["lm_head"]
