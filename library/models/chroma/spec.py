"""Chroma (Chroma1-HD, Chroma1-Base, chroma-unlocked-v*): the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# FLUX.1's block Linears under FLUX.1's BFL names: the double blocks' attention qkv / proj and MLP 0 /
# 2, the single blocks' fused linear1 / linear2. Chroma has no per-block modulation Linears (its
# approximator makes every shift / scale / gate), so there is nothing for train_modulation to switch;
# the approximator and the embedders are left out, as FLUX.1's in_dims are off by default. kohya
# names are `lora_unet_double_blocks_0_img_attn_qkv`, as sd-scripts and ai-toolkit write Chroma
# LoRAs; a diffusers-named LoRA (transformer_blocks.N.attn.to_q ..., diffusers' ChromaTransformer2DModel
# keeps FluxTransformer2DModel's block names) is converted to ours through the module map.
_FLUX1_LORA = S.load_symbol("library.models.flux1.spec:LORA")
LORA = S.LoRATargets(
    targets={t: _FLUX1_LORA.targets[t] for t in ("img_attn", "txt_attn", "img_mlp", "txt_mlp", "single")},
    block_args=_FLUX1_LORA.block_args,
    type_groups={"attn": ("img_attn", "txt_attn"), "mlp": ("img_mlp", "txt_mlp")},
    extra_args=("train_blocks",),  # "all", "double" or "single", as FLUX.1's
    refused_args=_FLUX1_LORA.refused_args,  # split_qkv, train_t5xxl: the same reasons as FLUX.1's
    diffusers_module_map="library.models.chroma.lora_files:module_map_of_config",
    diffusers_blocks=_FLUX1_LORA.diffusers_blocks,
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# Chroma keeps FLUX.1's BFL block names and shapes, so a LoRA of its blocks is told apart by the
# approximator's names (the marker below) or its header (train_lora.py writes ss_base_model_version "chroma").
_FLUX1_FILES = S.load_symbol("library.models.flux1.spec:LORA_FILES")
LORA_FILES = S.LoRAFiles(
    markers=("distilled_guidance_layer_",),
    layouts=("kohya", "diffusers", "comfy"),  # ComfyUI's Chroma keeps the BFL names our kohya files have
    names_of="flux",
    text_encoders=_FLUX1_FILES.text_encoders,  # in the FLUX.1 LoRAs it takes (OneTrainer's T5-XXL lora_te2_)
    takes_base_loras="Chroma's approximator computes every block's modulation, FLUX.1's time / vector / guidance "
                     "embedders and modulation Linears are pruned",
    model_versions=("chroma",),
    block_pattern=_FLUX1_FILES.block_pattern,
    module_paths="library.models.chroma.lora_files:module_paths",
    module_map="library.models.chroma.lora_files:module_map_of_lora",
    info_markers=(("bfl", r"distilled_guidance_layer_(in_proj|out_proj|layers_\d+_(in|out)_layer)$"),
                  ("diffusers", r"distilled_guidance_layer_layers_\d+_linear_[12]$")),
    info_blocks=_FLUX1_FILES.info_blocks,
    width_modules=r"_attn_qkv|_attn_proj|_linear1|_mlp_0|attn_to_[qkv]|attn_add_[qkv]_proj|proj_mlp",
    releases=(S.Release("Chroma1-HD / Chroma1-Base", 3072, {"double": 19, "single": 38}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# As FLUX.1's embedders and final layer: img_in, txt_in and the final projection, plus the whole
# approximator (distilled_guidance_layer, 278 M of the 8.9 B weights: 3.1%), whose one output carries every
# block's modulation, so an fp8 error there would reach all blocks at once (FLUX.2's shared modulation
# measured 13% less block error kept, flux2/spec.py). No per-block modulation Linears to quantize.
FP8 = S.FP8Rules(
    keep=(r"img_in", r"txt_in", r"distilled_guidance_layer\..*", r"final_layer\..*"),
    # BFL names only: a diffusers folder splits the fused qkv / linear1 rows, which one stored scale does not survive
    stored={"bfl": S.STORED_FP8},
)


# -- GGUF: ComfyUI-GGUF's layout (library/precision/gguf_writer.py)
# FLUX.1's: convert.py detects the BFL block keys as "flux" and its llama.cpp patch's "flux" rules apply
# (flux1/spec.py GGUF): every 2-D weight outside its unquantized list is quantized, the
# distilled_guidance_layer (the fp8 rules keep it) included. ComfyUI tells Chroma by its keys.
GGUF = S.load_symbol("library.models.flux1.spec:GGUF")


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# ChromaPipeline computes mu on FLUX.1-dev's line (calculate_shift with the scheduler config's
# base_image_seq_len 256, max_image_seq_len 4096, base_shift 0.5, max_shift 1.15, its defaults) and
# hands it to FlowMatchEulerDiscreteScheduler, which applies it when the config says
# use_dynamic_shifting (the class default is False with shift 1.0, schnell's). The peers that train
# Chroma shift as FLUX.1-dev does: ai-toolkit's Chroma scheduler config is FLUX.1-dev's (dynamic
# shifting on, those four constants) and lodestones' own sampler takes time_shift with mu on the same
# line. So training draws a logit-normal sigma shifted with these constants and samples shift the
# same way (the family's dynamic_shift stays on). The constants are FLUX.1's: "flux_shift", no new
# method name. No guidance: Chroma's approximator was distilled with its guidance input fixed at 0.
SAMPLING = S.Sampling(method="flux_shift", mu=S.MuLine(256, 4096, 0.5, 1.15))


# -- memory planner shapes and presets
# T5-XXL pads a caption to 512 tokens at most (the pipeline's max_sequence_length); the cache keeps
# the caption's tokens, its EOS and one padding token (text_encoder.py), the planner sizes 512.
PLANNER = S.Planner(
    transformer="library.models.chroma.model:Chroma",
    text_tokens=512,
    text_length_option="t5_max_length",
    presets={
        # Chroma1-HD / Chroma1-Base / chroma-unlocked-v*: one released size; T5-XXL's encoder as load_t5 reads it.
        "chroma": S.PlannerPreset("chroma", "library.models.chroma.model:CHROMA",
                                  {"t5xxl": S.load_symbol("library.models.flux1.spec:T5_XXL_TEXT")},
                                  {"t5_max_length": 512}),
    },
)


# -- tiny models (tests, quickstart); the VAE is FLUX.1's tiny one (flux1/tiny.py writes it)
TINY = S.TinySpec(writers=("library.models.chroma.tiny:write_chroma", "library.models.chroma.tiny:write_t5"),
                  transformer="chroma_bfl", config_files={"ae": "flux_vae_single", "t5xxl": "chroma_t5xxl"},
                  config_values={"t5xxl_max_token_length": 32}, sized="library.models.chroma.tiny:write_sized_chroma")


# -- the training config's keys of its text encoder files (library/training/config.py); FLUX.1 reads
# the same keys (one T5-XXL file role, same types: the helps join).
CONFIG_KEYS = (
    S.ConfigKey("t5xxl", str, "T5-XXL text encoder (HF folder, or the repo's text_encoder/ with tokenizer/ beside it)"),
    S.ConfigKey("t5xxl_max_token_length", int, "T5 tokens per caption, at most 512 (default 512, as ChromaPipeline)",
                most=512, renders=True),  # text_encoder.T5_MAX_LENGTH: the encoder (and ChromaPipeline) refuses more
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): sd-scripts' (ARCH_FLUX_1_CHROMA, IMPL_CHROMA)
MODELSPEC = {"chroma": S.ModelSpecNames("chroma", "https://huggingface.co/lodestones/Chroma")}


SPEC = S.ArchSpec(
    arch="chroma",
    title="Chroma",
    names=(r"chroma",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.chroma.checkpoint:load_chroma",
                                   random_inputs="library.models.chroma.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.chroma.learned:LEARNED",  # the learned tiny base (learned.py; learned/chroma/)
    default_config="chroma.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"chroma": 35},  # ChromaPipeline
    sample_guidance={"chroma": 5.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch
    # sd-scripts' FLUX.1 script and LoRA module train it as --model_type chroma
    peer_bucket_steps={"ai-toolkit": 32},  # ai-toolkit's get_bucket_divisibility (32)
    # ai-toolkit's chroma_model.py reads the transformer alone from name_or_path (a single file) and the VAE and T5
    # from ostris/Flex.1-alpha whatever the YAML says (its vae/, text_encoder_2/ + tokenizer_2/)
    peer_models={"ai-toolkit": {"chroma": {
        "model_type": "chroma", "ae": "ostris/Flex.1-alpha", "t5xxl": "ostris/Flex.1-alpha",
        "file_note": "ai-toolkit reads one file from it: lodestones/Chroma's newest chroma-unlocked-vNN.safetensors "
                     "(lodestones/Chroma/vNN: that version's), a lodestones/Chroma1-* repo's Chroma1-*.safetensors; "
                     "set pretrained_model_name_or_path to that file"}},
                 # its FLUX.1 samples: --g the embedded guidance Chroma has none of, CFG --l (1.0: none)
                 "sd-scripts": S.SdScriptsModels("flux_train_network.py", "networks.lora_flux",
                                                 {"chroma": {"model_type": "chroma"}}, sample_scale=1.0)},
    masks_text_padding=True,  # ChromaPipeline masks T5's padding (FluxPipeline does not)
)
