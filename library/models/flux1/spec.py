"""FLUX.1 (dev, schnell) and FLUX.1 Kontext [dev]: the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# sd-scripts' networks/lora_flux.py default: every Linear of DoubleStreamBlock and SingleStreamBlock,
# modulation included (on by default, as sd-scripts); the embedders only when given a rank through
# in_dims (sd-scripts `in_dims = [img, time, vector, guidance, txt]`). The block kinds are "double"
# and "single"; a diffusers-named LoRA (transformer_blocks.N.attn.to_q ...) is converted to the
# model's BFL names through the module map (flux1/lora_files.py).
LORA = S.LoRATargets(
    targets={
        "img_attn": r"double_blocks\.(?P<double>\d+)\.img_attn\.(qkv|proj)",
        "txt_attn": r"double_blocks\.(?P<double>\d+)\.txt_attn\.(qkv|proj)",
        "img_mlp": r"double_blocks\.(?P<double>\d+)\.img_mlp\.(0|2)",
        "txt_mlp": r"double_blocks\.(?P<double>\d+)\.txt_mlp\.(0|2)",
        "img_mod": r"double_blocks\.(?P<double>\d+)\.img_mod\.lin",
        "txt_mod": r"double_blocks\.(?P<double>\d+)\.txt_mod\.lin",
        "single": r"single_blocks\.(?P<single>\d+)\.(linear1|linear2)",
        "single_mod": r"single_blocks\.(?P<single>\d+)\.modulation\.lin",
        "img_in": r"img_in",
        "time_in": r"time_in\.(in_layer|out_layer)",
        "vector_in": r"vector_in\.(in_layer|out_layer)",
        "guidance_in": r"guidance_in\.(in_layer|out_layer)",
        "txt_in": r"txt_in",
    },
    block_args={"train_double_block_indices": "double", "train_single_block_indices": "single"},
    modulation_types=("img_mod", "txt_mod", "single_mod"),
    modulation_default=True,
    in_dim_types=("img_in", "time_in", "vector_in", "guidance_in", "txt_in"),
    type_groups={"attn": ("img_attn", "txt_attn"), "mlp": ("img_mlp", "txt_mlp"), "mod": ("img_mod", "txt_mod", "single_mod")},
    extra_args=("train_blocks", "in_dims"),  # train_blocks: "all", "double" or "single"
    refused_args={
        "split_qkv": "sd-scripts saves split q/k/v adapters as one block-diagonal LoRA of rank 3r with the alpha "
                     "of rank r, so every loader (ComfyUI, diffusers, sd-scripts itself) applies 1/3 of the trained "
                     "qkv delta; train the fused qkv LoRA (the default) instead",
        "train_t5xxl": "text encoder outputs are cached before training and the encoders are freed, so T5-XXL "
                       "cannot carry a LoRA here",
    },
    diffusers_module_map="library.models.flux1.lora_files:module_map_of_config",
    diffusers_blocks=("transformer_blocks.", "single_transformer_blocks."),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# FLUX.2 keeps these BFL block names (its spec: names_of="flux"). diffusers' double blocks are told by their text
# stream's ff_context / norm1_context and their image stream's norm1.linear (Qwen-Image's blocks have attn.add_*_proj
# too, and a Cosmos DiT's transformer_blocks.N.ff.net.0.proj and norm1.linear_1: no marker of FLUX.1's).
LORA_FILES = S.LoRAFiles(
    # diffusers' norm1.linear by its transformer_blocks index (Lumina 2's diffusers names have layers.N.norm1.linear)
    markers=("double_blocks_", "single_blocks_", "single_transformer_blocks_", "_ff_context_", "_norm1_context_",
             *(f"transformer_blocks_{n}_norm1_linear_{part}" for n in range(64) for part in ("lora", "alpha", "dora"))),
    layouts=("kohya", "diffusers", "comfy"),  # ComfyUI's FLUX.1 has the BFL names our kohya files have
    # single_transformer_blocks first: findall takes the first alternative that matches at a position.
    block_pattern=r"(single_transformer_blocks|double_blocks|single_blocks|transformer_blocks)[._](\d+)[._]",
    module_paths="library.models.flux1.lora_files:module_paths",
    module_map="library.models.flux1.lora_files:module_map_of_lora",
    info_markers=(
        ("bfl", r"(^|_)(double_blocks|single_blocks)_\d+_"),
        ("diffusers", r"single_transformer_blocks_\d+_|_ff_context_|_norm1_context_"),
    ),
    # diffusers' transformer_blocks are the double blocks
    info_blocks=(("double", r"double_blocks_(\d+)_"), ("single", r"single_blocks_(\d+)_|single_transformer_blocks_(\d+)_"),
                 ("double", r"(?<!single_)transformer_blocks_(\d+)_")),
    width_modules=(r"_attn_qkv|_attn_proj|_linear1|_modulation_lin|_mod_lin|_mlp_0|attn_to_[qkv]|attn_add_[qkv]_proj|"
                   r"norm1?(_context)?_linear|proj_mlp"),
    releases=(S.Release("FLUX.1 dev / schnell", 3072, {"double": 19, "single": 38}),),
    # ours and sd-scripts' flux1 / modelspec flux-1-dev, flux-1-schnell, flux-1; musubi-tuner's modelspec Flux.1-dev/lora
    model_versions=("flux1", "flux-1", "flux.1"),
    # OneTrainer writes FLUX.1's text encoders as its text_encoder_1 / _2: CLIP-L lora_te1_, T5-XXL lora_te2_
    # (sd-scripts' T5-XXL is lora_te3_; lora_te2_ is SDXL's CLIP-G there). Left out as any text encoder's.
    text_encoders={"lora_te2_": "T5-XXL"},
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The modulation Linears are 27% of FLUX.1's weights (3.2 B of 11.9 B). Measured on a tiny FLUX-like
# double + single block (tests/test_fp8.py::test_modulation_choice_matches_measurement, width 256,
# weights N(0, 0.02), relative error of the blocks' residual update vs fp32, 2 seeds): fp8_scaled
# 4.47% with modulation quantized vs 3.61% kept in bf16 (plain fp8: 5.85% vs 4.71%). Keeping them
# would cut the error by 19% but add 25% memory (whole-model bytes/param ~1.30 instead of ~1.04,
# +3.2 GB on FLUX.1), and fp8 is chosen to save memory: they are quantized (fp8.QUANTIZE_MODULATION),
# as sd-scripts' fp8_base does. Scaled with modulation quantized still beats plain with it kept.
FP8 = S.FP8Rules(
    keep=(r"img_in", r"txt_in", r"time_in\..*", r"vector_in\..*", r"guidance_in\..*", r"final_layer\..*"),
    modulation=(r".*_mod\.lin", r".*\.modulation\.lin"),
    # BFL names only: a diffusers folder splits the fused qkv / linear1 rows, which one stored scale does not survive
    stored={"bfl": S.STORED_FP8},
)


# -- GGUF: ComfyUI-GGUF's layout (library/precision/gguf_writer.py)
# convert.py detects BFL block keys (double_blocks.0.img_attn.proj.weight) as "flux" (ModelFlux, no
# keys_hiprec); its llama.cpp patch leaves these unquantized for "flux" (tools/lcpp.patch, the
# LLM_ARCH_FLUX rules of llama_model_quantize_internal) and quantizes every other 2-D weight.
GGUF = S.GgufLayout("flux", unquantized=("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer."))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# sd-scripts' FLUX flags default to timestep_sampling "sigma" with model_prediction_type
# "sigma_scaled", while its FLUX.1 docs recommend "shift" 3.1582 with "raw" predictions; we default
# instead to what the released scheduler does at inference: the resolution-dependent shift with
# FLUX.1-dev's constants (diffusers pipeline_flux.calculate_shift defaults = black-forest-labs/
# FLUX.1-dev scheduler_config.json: base_image_seq_len 256, max_image_seq_len 4096, base_shift 0.5,
# max_shift 1.15, no shift_terminal) on a logit-normal draw. Training guidance 1.0 (the common choice:
# the distilled guidance embedding is kept near its "no extra guidance" end). [schnell]'s scheduler
# has no shift: its samples run unshifted (the family's dynamic_shift).
SAMPLING = S.Sampling(method="flux_shift", mu=S.MuLine(256, 4096, 0.5, 1.15), guidance_scale=1.0)


# -- memory planner shapes and presets
# The text encoders' parameters: CLIP-L and T5-XXL. T5 pads a caption to 512 tokens for dev and
# Kontext [dev], 256 for schnell (the checkpoint tells them apart by its guidance embedding).
# T5-XXL as load_t5 keeps it (text_encoders.t5_text_weights): under fp8 every Linear but `wo`, in fp16 `wo` float32.
T5_XXL_TEXT = S.TextWeights(4_762_310_656, fp8_weights=3_623_878_656, fp8_scales=56_623_104, fp32_in_fp16=1_006_632_960)
_TEXT_PARAMS = {"clip_l": S.TextWeights(123_060_480), "t5xxl": T5_XXL_TEXT}
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
TINY = S.TinySpec(writers=(
    "library.models.flux1.tiny:write_flux", "library.models.flux1.tiny:write_flux_vae",
    "library.models.flux1.tiny:write_clip", "library.models.flux1.tiny:write_t5",
), transformer="flux_bfl", config_files={"ae": "flux_vae_single", "clip_l": "clip_l", "t5xxl": "t5xxl"},
    config_values={"t5xxl_max_token_length": 32}, sized="library.models.flux1.tiny:write_sized_flux")


# -- the training config's keys of its text encoder files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("clip_l", str, "CLIP-L text encoder (HF folder)"),
    S.ConfigKey("t5xxl", str, "T5-XXL text encoder (HF folder)"),
    S.ConfigKey("t5xxl_max_token_length", int, "T5 tokens per caption; default 512 for dev, 256 for schnell "
                                               "(read from the checkpoint)", renders=True),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata), by release (the family's model_version)
# sd-scripts' sai_model_spec (flux_train_network get_sai_model_spec: "dev" / "schnell", else ARCH_FLUX_1_UNKNOWN)
# for FLUX.1 dev / schnell / another flux1-*; musubi-tuner's ARCH_FLUX_KONTEXT ("Flux.1-dev", the only trainer of
# Kontext LoRAs that writes one) for Kontext [dev]. Implementation: both peers' IMPL_FLUX.
_BFL = "https://github.com/black-forest-labs/flux"
MODELSPEC = {
    "flux1": S.ModelSpecNames("flux-1", _BFL),
    "flux1-dev": S.ModelSpecNames("flux-1-dev", _BFL),
    "flux1-schnell": S.ModelSpecNames("flux-1-schnell", _BFL),
    "flux1-kontext-dev": S.ModelSpecNames("Flux.1-dev", _BFL),
}


# -- musubi-tuner's names (library/training/peers/musubi_tuner.py): it trains Kontext [dev] only. Its
# text_encoder1 / 2 are T5-XXL / CLIP-L; its blocks_to_swap counts as sd-scripts' (N // 2 double blocks, twice
# the rest in single ones); its default exclude_patterns leave the modulation out; references fit their target.
MUSUBI = S.MusubiModels(
    script="flux_kontext_train_network.py",
    lora_module="networks.lora_flux",
    model_type="flux_kontext",
    references={"flux_kontext": "target"},
    dataset_renames={"flux_kontext_no_resize_control": "no_resize_control"},
    text_encoder_files={"text_encoder1": "t5xxl", "text_encoder2": "clip_l"},
    swap_scale=2,
    draws={"flux_shift": S.PeerDraw("flux_shift")},
    # its hybrid sampler's qinglong_flux (PR #407): 79% flux_shift, 11% logsnr, 10% log-SNR 5.36 / 1
    mixtures={"qinglong_flux": S.PeerMixture("flux_shift", 0.11, 0.10)},
    lora_args=(S.PeerLoRAArg("train_modulation=false", "its default exclude_patterns leave the modulation out",
                             unless="exclude_patterns"),),
)

# -- sd-scripts' names (library/training/peers/sd_scripts.py): flux_train_network.py trains FLUX.1 (and Chroma:
# chroma/spec.py) as --model_type flux, its default, with networks.lora_flux; its timestep_sampling flux_shift
# is ours (the resolution shift with FLUX.1-dev's constants).
SD_SCRIPTS = S.SdScriptsModels(script="flux_train_network.py", lora_module="networks.lora_flux",
                               models={"flux": {"model_type": "flux"}}, default="flux", draws=("flux_shift",),
                               merge_flags={"--flux_model": "--model"})  # networks/flux_merge_lora.py


SPEC = S.ArchSpec(
    arch="flux",
    title="FLUX.1",
    names=(r"flux(?![.-]?[23])", r"flux\.?1", r"kontext", r"schnell"),  # not FLUX.2 / FLUX.3
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.flux1.checkpoint:load_flux",
                                   random_inputs="library.models.flux1.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.flux1.learned:LEARNED",
    default_config="flux1_dev_24gb.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"dev": 28, "kontext": 28, "schnell": 4},  # FluxPipeline / FluxKontextPipeline; schnell's card
    sample_guidance={"dev": 3.5, "kontext": 2.5},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch (or its older is_flux: true): dev and schnell are one arch there and here
    peer_bucket_steps={"ai-toolkit": 16},  # ai-toolkit's get_bucket_divisibility: 8 x 2
    # (its FLUX.1 model reads an assistant_lora_path folder's or Hub repository's pytorch_lora_weights.safetensors)
    # (its training scheduler there: toolkit/sampler.py's flux_config, dynamic on FLUX.1's line 256 / 4096 tokens at
    # 0.5 / 1.15, its token count (h / 2)(w / 2) of the latent: ours' flux_shift; Kontext's counts h w: not ours)
    peer_models={"ai-toolkit": {"flux": {"model_type": "flux", "assistant_file": "pytorch_lora_weights.safetensors",
                                         "shift_method": "flux_shift"},
                                "flux_kontext": {"model_type": "flux_kontext"}},
                 "sd-scripts": SD_SCRIPTS, "musubi-tuner": MUSUBI},
)
