"""FLUX.2 ([dev], [klein] 4B / 9B): the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# The double blocks' attention and SwiGLU MLP Linears and the single blocks' fused linear1 / linear2,
# as FLUX.1's block Linears (same BFL names). FLUX.2's modulation is shared (one projection per block
# kind, outside the blocks) and, with the embedders, is left out like FLUX.1's in_dims.
_FLUX1_LORA = S.load_symbol("library.models.flux1.spec:LORA")
LORA = S.LoRATargets(
    targets={t: _FLUX1_LORA.targets[t] for t in ("img_attn", "txt_attn", "img_mlp", "txt_mlp", "single")},
    block_args=_FLUX1_LORA.block_args,
    type_groups={"attn": ("img_attn", "txt_attn"), "mlp": ("img_mlp", "txt_mlp")},
    diffusers_module_map="library.models.flux2.lora_files:module_map_of_config",
    diffusers_blocks=_FLUX1_LORA.diffusers_blocks,
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# FLUX.2 keeps FLUX.1's BFL block names: a LoRA with them is told apart by flux2/lora_files.py.
_FLUX1_FILES = S.load_symbol("library.models.flux1.spec:LORA_FILES")
LORA_FILES = S.LoRAFiles(
    markers=("_ff_linear_in", "_ff_linear_out", "_ff_context_linear_", "_to_qkv_mlp_proj", "stream_modulation"),
    names_of="flux",
    recognise="library.models.flux2.lora_files:has_flux2_mlp",
    refuses="library.models.flux2.lora_files:has_flux1_mlp",
    model_versions=("flux2", "flux.2"),  # ours (flux2-dev, flux2-klein-4b), musubi-tuner's modelspec Flux.2-dev/lora
    block_pattern=_FLUX1_FILES.block_pattern,
    module_paths="library.models.flux2.lora_files:module_paths",
    module_map="library.models.flux2.lora_files:module_map_of_lora",
    diffusers_lokr="Flux2",
    info_markers=(
        ("bfl", r"(double|single)_stream_modulation_(img_|txt_)?lin$"),
        ("diffusers", r"_ff(_context)?_linear_(in|out)|_to_qkv_mlp_proj|(double|single)_stream_modulation_(img_|txt_)?linear"),
    ),
    info_blocks=_FLUX1_FILES.info_blocks,
    width_modules=r"_attn_qkv|_attn_proj|_linear1|_modulation_lin|_mlp_0|attn_to_[qkv]|attn_add_[qkv]_proj",
    releases=(S.Release("FLUX.2 [klein] 4B", 3072, {"double": 5, "single": 20}),
              S.Release("FLUX.2 [klein] 9B", 4096, {"double": 8, "single": 24}),
              S.Release("FLUX.2 [dev]", 6144, {"double": 8, "single": 48})),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# FLUX.2 has no per-block modulation: three shared Linears (15 h^2 weights: 3.7% of klein 4B, 2.8% of
# klein 9B, 1.8% of dev) feed every block, so an fp8 error there reaches all blocks at once. Measured
# on a tiny FLUX.2 (width 256, 2 double + 4 single blocks, weights N(0, 0.02), relative error of the
# blocks' residual update vs fp32, 3 seeds): fp8_scaled 5.18% with them quantized vs 4.51% kept
# (plain fp8: 6.74% vs 5.93%). Keeping them cuts the error by 13% for +3.4% memory on klein 4B (less
# on the larger ones): unlike FLUX.1's per-block modulation (27% of the weights) they stay high
# precision. tests/test_flux2.py::test_fp8_keeping_shared_modulation_pays repeats it (1 double block, 1 seed).
SHARED_MODULATION = (r"double_stream_modulation_(img|txt)\.lin", r"single_stream_modulation\.lin")
FP8 = S.FP8Rules(
    keep=(r"img_in", r"txt_in", r"time_in\..*", r"guidance_in\..*", r"final_layer\..*", *SHARED_MODULATION),
    stored={"bfl": S.STORED_FP8},  # BFL names only: a diffusers folder splits the fused qkv rows (one stored scale)
)


# -- GGUF: ComfyUI-GGUF's layout (library/precision/gguf_writer.py)
# FLUX.1's and more: convert.py detects the BFL block keys as "flux" and its llama.cpp patch's "flux" rules
# apply (flux1/spec.py GGUF), which on city96's auto_convert branch (ec7506d "Flux2 specific filter",
# tools/lcpp.patch:385-387) also leave the three shared modulation Linears unquantized (BF16), as the fp8
# rules keep them. ComfyUI tells FLUX.2 by its keys.
_FLUX1_GGUF = S.load_symbol("library.models.flux1.spec:GGUF")
GGUF = S.GgufLayout(_FLUX1_GGUF.arch, unquantized=(*_FLUX1_GGUF.unquantized, "single_stream_modulation.",
                                                   "double_stream_modulation_"))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# [klein] and [dev]: mu = compute_empirical_mu(image_seq_len, num_steps) (flux2/sampling.py), no
# shift_terminal. Training has no step count: it takes mu at 50 steps, the klein base models'
# default step count (the distilled models sample in 4 steps, where mu is higher by at most 0.35 below
# 4300 tokens). Training guidance as FLUX.1-dev's, used by [dev] only ([klein] has no guidance embedding).
SAMPLING = S.Sampling(method="flux2_shift", mu="library.models.flux2.sampling:compute_empirical_mu",
                      train_mu_steps=50, guidance_scale=1.0)


# -- memory planner shapes and presets
# Both text encoders pad every caption to 512 tokens, and the transformer sees them all (no mask).
# klein's Qwen3 as load_klein_text_encoder reads it: embeddings + the first 27 of 36 layers, no head; [dev]'s
# Mistral Small 3.1 as load_dev_text_encoder reads it: embeddings + the first 30 of 40 layers, no head (fp8: the
# decoder Linears, LLM(...) on meta).
_QWEN3_4B_27_LAYERS = S.TextWeights(3_114_090_752, fp8_weights=2_724_986_880, fp8_scales=42_577_920)
_QWEN3_8B_27_LAYERS = S.TextWeights(5_831_887_616, fp8_weights=5_209_325_568, fp8_scales=81_395_712)
_MISTRAL_SMALL_3_1_30_LAYERS = S.TextWeights(17_343_759_360, fp8_weights=16_672_358_400, fp8_scales=260_505_600)
PLANNER = S.Planner(
    transformer="library.models.flux2.model:Flux2",
    text_tokens=512,
    text_length_option="max_length",
    presets={
        "flux2-klein-4b": S.PlannerPreset("flux2", "library.models.flux2.model:FLUX2_KLEIN_4B",
                                          {"text_encoder": _QWEN3_4B_27_LAYERS}),
        "flux2-klein-9b": S.PlannerPreset("flux2", "library.models.flux2.model:FLUX2_KLEIN_9B",
                                          {"text_encoder": _QWEN3_8B_27_LAYERS}),
        "flux2-dev": S.PlannerPreset("flux2", "library.models.flux2.model:FLUX2_DEV",
                                     {"text_encoder": _MISTRAL_SMALL_3_1_30_LAYERS}),
    },
)


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(
    writers=(
        "library.models.flux2.tiny:write_qwen3_text_encoder", "library.models.flux2.tiny:write_flux2",
        "library.models.flux2.tiny:write_flux2_vae", "library.models.flux2.tiny:write_flux2_dev_text_encoder",
    ),
    dims=(("flux2_latent_channels", 32),),  # AutoencoderKLFlux2's latent channels
    transformer="flux2_tiny",
)


# model_version: musubi-tuner's names; the step-distilled [klein] samples in 4 steps without CFG, the base in 50 with it
DISTILLED_VERSIONS = ("klein-4b", "klein-9b")
VERSIONS = ("dev", *DISTILLED_VERSIONS, "klein-base-4b", "klein-base-9b")

# -- the training config's keys of its text encoder files and version (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "[klein] Qwen3, [dev] Mistral Small 3.1's language model (the repo's "
                                     "text_encoder/ folder or a single file, tokenizer/ beside it)"),
    S.ConfigKey("max_sequence_length", int, "text tokens a caption is padded / cut to, chat template included "
                                            "(default 512, as Flux2Pipeline / Flux2KleinPipeline's max_sequence_length)",
                renders=True),
    S.ConfigKey("model_version", str, "flux2: klein-4b / klein-9b (the step-distilled [klein]: samples in 4 steps "
                "without CFG) or klein-base-4b / klein-base-9b (50 steps with CFG), dev, musubi-tuner's names; the "
                "size is read from the checkpoint (default: the pipeline folder's model_index.json is_distilled, else "
                "the file name: a [klein] file whose name does not say base is the distilled one, as BFL names them)"),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata), by release (the family's model_version):
# musubi-tuner's (ARCH_FLUX_2_DEV / _KLEIN_4B / _KLEIN_9B, IMPL_FLUX_2); a klein of another width (flux2-klein,
# no peer names one) ours in their style.
_BFL = "https://github.com/black-forest-labs/flux2"
MODELSPEC = {
    "flux2-dev": S.ModelSpecNames("Flux.2-dev", _BFL),
    "flux2-klein-4b": S.ModelSpecNames("Flux.2-klein-4b", _BFL),
    "flux2-klein-9b": S.ModelSpecNames("Flux.2-klein-9b", _BFL),
    "flux2-klein": S.ModelSpecNames("Flux.2-klein", _BFL),
}


# -- musubi-tuner's names (library/training/peers/musubi_tuner.py): its model_version says [dev] / [klein], which
# ours reads from the checkpoint. Its latents are the token grid; its blocks_to_swap counts as FLUX.1's there;
# its flux2_shift is FLUX.1's mu line at the token count (ours: flux_shift; our flux2_shift is the empirical mu).
MUSUBI = S.MusubiModels(
    script="flux_2_train_network.py",
    lora_module="networks.lora_flux_2",
    model_type="flux2",
    versions={v: {"model_type": "flux2", "model_version": v} for v in VERSIONS},
    swap_scale=2,
    token_grid=True,
    references={"flux2": "own"},  # each keeps its own size up to 1 MP (the pipelines'); its default fits the target's
    draws={"flux2_shift": S.PeerDraw("flux_shift", note="its flux2_shift is FLUX.1's mu line at the token count: "
                                                        "ours' flux_shift (our flux2_shift is the empirical mu)",
                                     elsewhere="on this model its flux2_shift counts 4x the tokens")},
)


SPEC = S.ArchSpec(
    arch="flux2",
    title="FLUX.2",
    names=(r"flux\.?2", r"klein"),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.flux2.checkpoint:load_flux2",
                                   random_inputs="library.models.flux2.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.flux2.learned:LEARNED",
    default_config="flux2_klein_4b.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"dev": 50, "klein base": 50, "klein distilled": 4},  # Flux2Pipeline / Flux2KleinPipeline; the distilled cards
    sample_guidance={"dev": 4.0, "klein base": 4.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch: [dev] and both [klein] sizes are one model_type here ([klein] / [dev] read from the checkpoint)
    peer_bucket_steps={"ai-toolkit": 16},  # ai-toolkit's get_bucket_divisibility: 8 x 2
    # ([klein]'s model writes its LoKr in the PEFT format whatever old_lokr_format says; [dev]'s keeps the old one)
    peer_models={"ai-toolkit": {"flux2": {"model_type": "flux2"},
                                **{name: {"model_type": "flux2", "lokr_format": "peft"}
                                   for name in ("flux2_klein_4b", "flux2_klein_9b")}},
                 "musubi-tuner": MUSUBI},
)
