"""FLUX.2 ([dev], [klein] 4B / 9B): the architecture's facts (library/models/spec.py)."""

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
TINY = S.TinySpec(
    writers=(
        "library.models.flux2.tiny:write_qwen3_text_encoder", "library.models.flux2.tiny:write_flux2",
        "library.models.flux2.tiny:write_flux2_vae", "library.models.flux2.tiny:write_flux2_dev_text_encoder",
    ),
    dims=(("flux2_latent_channels", 32),),  # AutoencoderKLFlux2's latent channels
)


SPEC = S.ArchSpec(
    arch="flux2",
    title="FLUX.2",
    names=(r"flux\.?2", r"klein"),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    blocks=BLOCKS,
    planner=PLANNER,
    tiny=TINY,
    default_config="flux2_klein_4b.toml",
)
