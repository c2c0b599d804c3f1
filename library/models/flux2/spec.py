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
# Both text encoders pad every caption to 512 tokens, and the transformer sees them all (no mask).
PLANNER = S.Planner(
    transformer="library.models.flux2.model:Flux2",
    text_tokens=512,
    presets={
        # klein's Qwen3 as load_klein_text_encoder reads it: embeddings + the first 27 of 36 layers, no head.
        "flux2-klein-4b": S.PlannerPreset("flux2", "library.models.flux2.model:FLUX2_KLEIN_4B", {"text_encoder": 3_114_090_752}),
        "flux2-klein-9b": S.PlannerPreset("flux2", "library.models.flux2.model:FLUX2_KLEIN_9B", {"text_encoder": 5_831_887_616}),
        # [dev]'s Mistral Small 3.1 as load_dev_text_encoder reads it: embeddings + the first 30 of 40 layers, no head.
        "flux2-dev": S.PlannerPreset("flux2", "library.models.flux2.model:FLUX2_DEV", {"text_encoder": 17_343_759_360}),
    },
)


# -- tiny models (tests, quickstart)
TINY = None


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
