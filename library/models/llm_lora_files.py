"""LLM LoRA files: the module paths tools/convert_lora.py resolves kohya names against (through
llm_spec.py's LORA_FILES), and the base a PEFT adapter folder names."""

from __future__ import annotations

import os

LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def module_paths(counts: dict[str, int]) -> list[str]:
    """The Linear paths of a Llama / Qwen2 decoder with as many layers as the LoRA names, and lm_head."""
    return [f"model.layers.{i}.{part}" for i in range(counts.get("layers", 0)) for part in LAYER_LINEARS] + ["lm_head"]


# transformers (>= 4.52) nests a vision-language checkpoint's language model (Qwen2.5-VL, Qwen3-VL, Mistral3: a
# config.json with vision_config) at `model.language_model` of its own class. A PEFT adapter of such a base names
# its modules there: under our `model.layers.N` PeftModel found none of them (the adapter did nothing) and its
# bare target_modules names added empty LoRAs to the vision tower's MLPs.
NESTED = "model.language_model."


def nests_language_model(config: dict | None) -> bool:
    """Whether a base's config.json is a vision-language one, its language model at NESTED."""
    return bool(config) and "vision_config" in config


def nested_path(path: str) -> str:
    """Our module path -> its path in a vision-language class (lm_head stays at the top)."""
    return NESTED + path.removeprefix("model.") if path.startswith("model.") else path


def module_map_of_lora(weights: dict, counts: dict[str, int]) -> dict[str, list[tuple[str, int, int]]]:
    """{our path: [(its path in the LoRA, 0, rows)]} for a LoRA in a vision-language class's names (NESTED),
    one module for one: such an adapter reads as ours."""
    ours = {p: "model." + p.removeprefix(NESTED) if p.startswith(NESTED) else p for p in weights}
    return {ours[p]: [(p, 0, w.up.shape[0])] for p, w in weights.items()}


def peft_base_path(path: str) -> str:
    """A PEFT adapter's base_model_name_or_path for a local base given as its folder, its .safetensors or its index
    file: the folder, what AutoPeftModelForCausalLM hands to from_pretrained (a file there read as a malformed hub
    id), absolute (a basename or a relative path loaded only from one working directory). Training and
    tools/convert_lora.py --model write it so."""
    path = path.rstrip("/\\")
    return os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path))
