"""Llama / Mistral / Qwen2 / Qwen3 causal language models (library/models/llm.py): the architecture's facts
(library/models/spec.py). Not a diffusion family: registered in registry.OTHER_ARCHS."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
LORA = S.LoRATargets(
    targets={
        "attn": r"model\.layers\.(?P<block>\d+)\.self_attn\.(q|k|v|o)_proj",
        "mlp": r"model\.layers\.(?P<block>\d+)\.mlp\.(gate|up|down)_proj",
    },
    block_args={"block_indices": "block"},
    kohya_prefix="lora_te",
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# kohya files (`lora_te_model_layers_0_self_attn_q_proj...`) <-> PEFT adapter folders, the layout
# PeftModel.from_pretrained, vLLM and llama.cpp's convert_lora_to_gguf.py read.
# Markers: the attention of a decoder layer and down_proj; `layers.N.mlp.gate_proj / up_proj` are a diffusion family's
# block names too (an LLM LoRA on the MLP holds its down_proj), and so is `blocks.N.self_attn.q_proj` (a Cosmos DiT's):
# the attention's marker names the layer (`layers_N_self_attn_`, N below 128: deeper LLMs show by their first layers).
LORA_FILES = S.LoRAFiles(
    markers=(*(f"layers_{n}_self_attn_" for n in range(128)), "_mlp_down_proj"),
    block_pattern=r"(layers)[._](\d+)[._]",
    module_paths="library.models.llm_lora_files:module_paths",
    module_map="library.models.llm_lora_files:module_map_of_lora",  # a vision-language base's PEFT names
    layouts=("kohya", "peft"),
    model_versions=("llm",),  # training's ss_base_model_version: llm-<layers>x<width>
    info_markers=(("hf", r"layers_\d+_(self_attn|mlp)_"),),
    info_blocks=(("block", r"layers_(\d+)_"),),
    width_modules=r"self_attn_[qkv]_proj|mlp_(gate|up)_proj",
    fits_text="an LLM (Llama / Qwen2 layout) of width {width}, at least {block} layers",
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# stored: transformers reads plain e4m3 weights and drops a block64 file's scales
FP8 = S.FP8Rules(keep=(r"lm_head", r"model\.embed_tokens"), stored={"hf": ("fp8",)})


# -- memory planner shapes and presets
PLANNER = None


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(writers=("library.models.tiny_files:write_llm",))


SPEC = S.ArchSpec(
    arch="llm",
    title="LLM",
    names=(),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    planner=PLANNER,
    tiny=TINY,
    default_config="llm_lora.toml",
)
