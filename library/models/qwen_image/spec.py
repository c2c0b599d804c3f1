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
# Captions vary in length (a mask pads them): the plan sizes a long one, 512 tokens.
PLANNER = S.Planner(
    transformer="library.models.qwen_image.model:QwenImage",
    text_tokens=512,
    presets={
        "qwen-image": S.PlannerPreset("qwen_image", "library.models.qwen_image.model:QWEN_IMAGE",
                                      {"text_encoder": 7_615_616_512}),  # Qwen2.5-VL-7B's language model
        # Edit(-2509/-2511): Qwen-Image's transformer, one reference's tokens; Qwen2.5-VL-7B with its vision
        # tower (0.68 B) as the text encoder. No config.json to read the version from: 2509 (2511 plans the
        # same: its text sees the references alike).
        "qwen-image-edit": S.PlannerPreset("qwen_image_edit", "library.models.qwen_image.model:QWEN_IMAGE",
                                           {"text_encoder": 8_292_166_656},
                                           attributes={"version": "qwen-image-edit-2509"}),
    },
)


# -- tiny models (tests, quickstart)
TINY = None


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
