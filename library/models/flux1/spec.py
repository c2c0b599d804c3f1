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
PLANNER = None


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(writers=(
    "library.models.flux1.tiny:write_flux", "library.models.flux1.tiny:write_flux_vae",
    "library.models.flux1.tiny:write_clip", "library.models.flux1.tiny:write_t5",
))


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
