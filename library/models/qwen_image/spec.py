"""Qwen-Image and Qwen-Image-Edit (2509, 2511): the architecture's facts (library/models/spec.py)."""

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
TINY = S.TinySpec(writers=(
    "library.models.qwen_image.tiny:write_qwen_image", "library.models.qwen_image.tiny:write_qwen_vae",
    "library.models.qwen_image.tiny:write_qwen_text_encoder", "library.models.qwen_image.tiny:write_qwen_image_edit",
    "library.models.qwen_image.tiny:write_qwen_vl_text_encoder",
))


SPEC = S.ArchSpec(
    arch="qwen_image",
    title="Qwen-Image",
    names=(r"qwen[-_ ]?image",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    blocks=BLOCKS,
    planner=PLANNER,
    tiny=TINY,
    default_config="qwen_image.toml",
)
