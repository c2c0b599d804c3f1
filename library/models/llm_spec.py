"""Llama / Mistral / Qwen2 / Qwen3 causal language models (library/models/llm.py): the architecture's facts
(library/models/spec.py). Not a diffusion family: registered in registry.OTHER_ARCHS."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
LORA = None


# -- LoRA files: converters' and inspectors' key tables (tools/)
LORA_FILES = None


# -- fp8: modules kept in high precision
FP8 = None


# -- timestep sampling and shift defaults
SAMPLING = None


# -- the repeated blocks (compile, block swap, FSDP)
BLOCKS = None


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
    sampling=SAMPLING,
    blocks=BLOCKS,
    planner=PLANNER,
    tiny=TINY,
    default_config="llm_lora.toml",
)
