"""FLUX.1 (dev, schnell) and FLUX.1 Kontext [dev]: the architecture's facts (library/models/spec.py)."""

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
# The text encoders' parameters: CLIP-L and T5-XXL. T5 pads a caption to 512 tokens for dev and
# Kontext [dev], 256 for schnell (the checkpoint tells them apart by its guidance embedding).
_TEXT_PARAMS = {"clip_l": 123_060_480, "t5xxl": 4_762_310_656}
PLANNER = S.Planner(
    transformer="library.models.flux1.model:Flux",
    text_length_option="t5_max_length",
    presets={
        "flux1-dev": S.PlannerPreset("flux", "library.models.flux1.model:FLUX_DEV", _TEXT_PARAMS, {"t5_max_length": 512}),
        "flux1-schnell": S.PlannerPreset("flux", "library.models.flux1.model:FLUX_SCHNELL", _TEXT_PARAMS,
                                         {"t5_max_length": 256}),
        # Kontext [dev]: dev's transformer; the plan adds one reference's tokens.
        "flux1-kontext-dev": S.PlannerPreset("flux_kontext", "library.models.flux1.model:FLUX_DEV", _TEXT_PARAMS,
                                             {"t5_max_length": 512}),
    },
)


# -- tiny models (tests, quickstart)
TINY = None


SPEC = S.ArchSpec(
    arch="flux",
    title="FLUX.1",
    names=(r"flux(?!\.?2)", r"flux\.?1", r"kontext", r"schnell"),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    blocks=BLOCKS,
    planner=PLANNER,
    tiny=TINY,
    default_config="flux1_dev_24gb.toml",
)
