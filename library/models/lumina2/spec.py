"""Lumina Image 2.0 (Alpha-VLLM's 2.6 B NextDiT with Gemma-2-2B text and FLUX.1's VAE; its anime fine-tunes Neta
Lumina and NetaYume Lumina share the architecture): the architecture's facts (library/models/spec.py).

sd-scripts trains it (lumina_train_network.py, networks.lora_lumina), and ai-toolkit (model.arch "lumina2", on
diffusers' Lumina2Transformer2DModel); musubi-tuner does not. Our modules keep the released single file's names
(layers.0.attention.qkv, feed_forward.w1, adaLN_modulation.1), which sd-scripts' kohya files and ComfyUI use;
diffusers splits the fused qkv and renames the rest (lora_files.py). Z-Image is the same team's successor of this
design: its single file's names are these (ComfyUI runs both on one NextDiT class), so a LoRA in them is told
apart by its grouped-query qkv, its width or its header (LORA_FILES.names_of, recognise).
"""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# The 26 main blocks' (`layers`) attention (fused qkv, out) and SwiGLU (w1 gate, w3 up, w2 down): what Z-Image trains
# by default too. The refiners (two image `noise_refiner` and two caption `context_refiner` blocks before the stack)
# train with a rank (`refiner_dim`, or the types' own _dim); the adaLN modulation (adaLN_modulation.1 of the layers
# and the noise refiners) with train_modulation or mod_dim, as every family here. sd-scripts' default trains all of
# these and the final layer (its JointTransformerBlock and FinalLayer Linears); its converter says so (spec
# SD_SCRIPTS). The embedders (x_embedder, t_embedder, cap_embedder: sd-scripts' embedder_dims) and the final layer
# train with their own _dim.
_ATTN = r"attention\.(qkv|out)"
_FF = r"feed_forward\.(w1|w2|w3)"
_REFINER = r"(noise_refiner\.(?P<noise_refiner>\d+)|context_refiner\.(?P<context_refiner>\d+))"
LORA = S.LoRATargets(
    targets={
        "attn": rf"layers\.(?P<layer>\d+)\.{_ATTN}",
        "ff": rf"layers\.(?P<layer>\d+)\.{_FF}",
        "mod": r"layers\.(?P<layer>\d+)\.adaLN_modulation\.1",
        "refiner_attn": rf"{_REFINER}\.{_ATTN}",
        "refiner_ff": rf"{_REFINER}\.{_FF}",
        "refiner_mod": r"noise_refiner\.(?P<noise_refiner>\d+)\.adaLN_modulation\.1",
        "x_embedder": r"x_embedder",
        "t_embedder": r"t_embedder\.mlp\.(0|2)",
        "cap_embedder": r"cap_embedder\.1",
        "final_layer": r"final_layer\.(linear|adaLN_modulation\.1)",
    },
    block_args={"block_indices": "layer"},
    kohya_prefix="lora_unet",  # sd-scripts' LORA_PREFIX_LUMINA: lora_unet_layers_0_attention_qkv
    modulation_types=("mod", "refiner_mod"),
    # only with a rank (their _dim; no in_dims key)
    in_dim_types=("refiner_attn", "refiner_ff", "refiner_mod", "x_embedder", "t_embedder", "cap_embedder",
                  "final_layer"),
    type_groups={"refiner": ("refiner_attn", "refiner_ff")},
    diffusers_module_map="library.models.lumina2.lora_files:module_map_of_config",
    diffusers_blocks=("layers.", "noise_refiner.", "context_refiner.", "x_embedder", "time_caption_embed.",
                      "norm_out."),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# The single file's names are Z-Image's single file's (names_of zimage: ComfyUI's one NextDiT class). A Lumina 2 LoRA
# is told by the adaLN Linear's index (Z-Image's modulation has no SiLU before it: adaLN_modulation.0), its header
# (model_versions), or its shapes (recognise: the grouped-query qkv, whose rows are not three times its width, or the
# released width 2304); --model_type settles the rest. diffusers' names (attn.to_q, feed_forward.linear_1,
# norm1.linear) convert through the module map (lora_files.py).
LORA_FILES = S.LoRAFiles(
    markers=(*(f"layers_{n}_adaLN_modulation_1" for n in range(64)),
             *(f"noise_refiner_{n}_adaLN_modulation_1" for n in range(4)), "_feed_forward_linear_"),
    names_of="zimage",
    recognise="library.models.lumina2.lora_files:has_lumina2_shapes",
    # ours (lumina2) and ai-toolkit's; sd-scripts' modelspec lumina-2/lora (ARCH_LUMINA_2)
    model_versions=("lumina2", "lumina-2", "lumina_2"),
    block_pattern=r"(noise_refiner|context_refiner|layers)[._](\d+)[._]",
    module_paths="library.models.lumina2.lora_files:module_paths",
    module_map="library.models.lumina2.lora_files:module_map_of_lora",
    layouts=("kohya", "diffusers", "comfy"),
    # what only its names say (the layers' adaLN_modulation.1, diffusers' names of its blocks); a LoRA in the names it
    # shares with Z-Image's single file is Z-Image's by the names, its own by variant_of (recognise, header)
    info_markers=(("single_file", r"(^|_)(layers|noise_refiner)_\d+_adaLN_modulation_1$"),
                  ("diffusers", r"(^|_)(layers|noise_refiner|context_refiner)_\d+_(attn_to_(q|k|v|out_0)"
                                r"|feed_forward_linear_[123]|norm1_linear)$")),
    info_blocks=(("layer", r"(?:^|_)layers_(\d+)_"), ("noise_refiner", r"noise_refiner_(\d+)_"),
                 ("context_refiner", r"context_refiner_(\d+)_")),
    width_modules=r"attention_qkv|attn_to_[qkv]|feed_forward_(w[13]|linear_[13])",
    releases=(S.Release("Lumina Image 2.0 (Neta Lumina, NetaYume Lumina)", 2304,
                        {"layer": 26, "noise_refiner": 2, "context_refiner": 2}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (patches, caption, timestep) and the final layer stay bf16, as for every family (sd-scripts'
# fp8_scaled keeps embedders and the final layer too). The blocks' adaLN Linears are the per-block modulation.
FP8 = S.FP8Rules(
    keep=(r"x_embedder", r"cap_embedder\..*", r"t_embedder\..*", r"final_layer\..*"),
    modulation=(r".*\.adaLN_modulation\.1",),
    # one naming (the single file's); a fused qkv is ours too, so a stored scale stays its Linear's
    stored={"lumina2": S.STORED_FP8},
)


# -- GGUF: ComfyUI-GGUF's layout (library/precision/gguf_writer.py) in the single file's names: its convert.py detects
# cap_embedder.1.weight with context_refiner.0.attention.qkv.weight as "lumina2" (ModelLumina2, first written for this
# model; Z-Image's files read the same), and its llama.cpp patch leaves the embedders, the final layer and the refiner
# blocks unquantized for it (tools/lcpp.patch, LLM_ARCH_LUMINA2), as Z-Image's spec says with its line numbers.
GGUF = S.GgufLayout("lumina2", unquantized=("t_embedder.", "x_embedder.", "final_layer.", "cap_embedder.",
                                            "context_refiner.", "noise_refiner."))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# Samples: a constant shift k = 6 at every size, as ComfyUI's Lumina2 model_sampling (shift 6.0) and sd-scripts'
# sampler (FlowMatchEulerDiscreteScheduler(shift=6.0)) run it. Training draws sigmoid(randn) shifted by the same
# k = 6: sd-scripts' default (timestep_sampling "shift", discrete_flow_shift 6.0). Its recommended "nextdit_shift"
# (uniform sigmas shifted by FLUX.1's resolution line) is a draw of its own, which its converter names.
SAMPLING = S.Sampling(method="lumina2_shift", shift=6.0)


# -- memory planner shapes and presets
# Captions are cached as their own tokens (the transformer masks the rest); the pipeline pads to 256 tokens
# (max_sequence_length), system prompt included, and the plan sizes 256. Gemma-2-2B as the loader reads it: the
# embeddings and 25 of its 26 decoder layers (hidden_states[-2]), no final norm, no head (Gemma2Model on meta:
# 589.8 M embeddings, 77.9 M per layer; fp8: the decoder Linears, one scale per 64 weights).
_GEMMA2_2B_25_LAYERS = S.TextWeights(2_536_473_600, fp8_weights=1_946_419_200, fp8_scales=30_412_800)
PLANNER = S.Planner(
    transformer="library.models.lumina2.model:Lumina2",
    text_tokens=256,
    presets={"lumina2": S.PlannerPreset("lumina2", "library.models.lumina2.model:LUMINA2",
                                        {"text_encoder": _GEMMA2_2B_25_LAYERS})},
)


# -- tiny models (tests, quickstart); FLUX.1's tiny VAE is the VAE (the same AutoencoderKL)
TINY = S.TinySpec(
    writers=("library.models.lumina2.tiny:write_lumina2",
             "library.models.lumina2.tiny_text:write_lumina2_text_encoder"),
    transformer="lumina2",
    config_files={"ae": "flux_vae_single", "text_encoder": "lumina2_text_encoder"},
    sized="library.models.lumina2.tiny:write_sized_lumina2",
)


# -- the training config's keys of its text files and prompt (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Gemma-2-2B (the repo's text_encoder/ folder with tokenizer/ beside it, or a "
                                     "single file such as ComfyUI's gemma_2_2b_fp16.safetensors)"),
    S.ConfigKey("system_prompt", str, "lumina2: the system prompt before each caption ('<system prompt> <Prompt "
                                      "Start> <caption>'; default: the diffusers pipeline's; \"\" for none, as "
                                      "sd-scripts' default)", model_types=("lumina2",)),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): sd-scripts' (ARCH_LUMINA_2, IMPL_LUMINA)
MODELSPEC = {"lumina2": S.ModelSpecNames("lumina-2", "https://github.com/Alpha-VLLM/Lumina-Image-2.0")}


# -- sd-scripts' names (library/training/peers/sd_scripts.py, sd_scripts_script.py): lumina_train_network.py (its
# setup_parser: train_network's, add_dit_training_arguments and lumina_train_util.add_lumina_train_arguments) with
# networks.lora_lumina. Its parser lacks the FLUX.1 script's CLIP-L / T5 / guidance / ControlNet / model_type /
# split_mode arguments; it has its own --ae, --gemma2, --model_prediction_type (default raw: the network's output as
# the prediction, ours), draws `shift` at discrete_flow_shift 6.0 by default (ours: lumina2_shift, the same law) and
# puts no system prompt before the captions unless --system_prompt says one (ours: the pipeline's, so a config that
# sets none translates to system_prompt = ""). Its LoRA module trains more than ours by default (sd_scripts_lora.py).
_MEMORY = "memory and speed only: ours runs PyTorch's SDPA on whole batches and encodes latents once, before training"
# its nextdit_shift (lumina_train_util.get_noisy_model_input_and_timesteps): u ~ U(0, 1) time-shifted by mu =
# lin(256 -> 0.5, 4096 -> 1.15) of the (h/2)(w/2) tokens: ours' flux_shift (that line, ours' token count) of a
# uniform draw (shifted_draw)
_NEXTDIT_SHIFT = {"timestep_sampling": "flux_shift", "shifted_draw": "uniform"}
SD_SCRIPTS = S.SdScriptsModels(
    script="lumina_train_network.py", lora_module="networks.lora_lumina", models={}, model_type="lumina2",
    sample_scale=3.5,  # lumina_train_util.sample_image_inference: scale (--l) 3.5, no --g
    lacks=("model_type", "clip_l", "t5xxl", "t5xxl_max_token_length", "apply_t5_attn_mask", "guidance_scale",
           "controlnet_model_name_or_path", "split_mode"),
    files={"gemma2": "text_encoder"},
    same_args=("system_prompt",),
    defaults={"timestep_sampling": "shift", "discrete_flow_shift": 6.0, "model_prediction_type": "raw",
              "system_prompt": "", "network_args": []},
    draws_carried={"nextdit_shift": _NEXTDIT_SHIFT},
    token_lengths={"gemma2_max_token_length": 256},  # LuminaTokenizeStrategy's max_length (None: 256), the pipeline's
    ignored_args={**dict.fromkeys(("use_flash_attn", "use_sage_attn"), _MEMORY),
                  "sample_batch_size": "ours renders each sample prompt alone"},
    # its create_network's kwargs (networks.lora_lumina 48d368f; no train_block_indices, network_reg_dims / _lrs)
    lora_module_args=("conv_dim", "conv_alpha", "attn_dim", "mlp_dim", "mod_dim", "refiner_dim", "embedder_dims",
                      "train_blocks", "split_qkv", "rank_dropout", "module_dropout", "verbose", "loraplus_lr_ratio",
                      "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"),
    lora_args="library.models.lumina2.sd_scripts_lora:network_args_of",
    # its assert_extra_args lets a Gemma 2 LoRA train on cached outputs (is_partial caching): no stop
    text_lora_when_cached=True,
    one_block_kind=True,  # its JointTransformerBlocks: its N swaps N of them, as ours
)


SPEC = S.ArchSpec(
    arch="lumina2",
    title="Lumina Image 2.0",
    names=(r"lumina[-_ ]?(image[-_ ]?)?(2(\.0)?)?", r"neta[-_ ]?(yume|lumina)"),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.lumina2.checkpoint:load_lumina2",
                                   random_inputs="library.models.lumina2.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.lumina2.learned:LEARNED",
    default_config="lumina2.toml",
    config_keys=CONFIG_KEYS,
    # Lumina2Pipeline's defaults: 30 steps, CFG 4.0 with the empty negative prompt (no system prompt before it),
    # the guided velocity renormalised to the conditional one's norm (cfg_normalization; family.guided_velocity)
    sample_steps={"lumina2": 30},
    sample_guidance={"lumina2": 4.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch (or model.is_lumina2, its example's); its bucket divisibility (stable_diffusion_model.py
    # get_bucket_divisibility): 2^3 of the AE's 4 levels, x 2
    peer_bucket_steps={"ai-toolkit": 16},
    # its LoRA (lora_special.py, is_lumina2) wraps every Linear of `layers`, `noise_refiner` and `context_refiner`,
    # their adaLN too (train_modulation); the refiners ours trains with their own rank
    # (its training scheduler there: toolkit/sampler.py's lumina2_config, a fixed shift 6)
    peer_models={"ai-toolkit": {"lumina2": {"model_type": "lumina2", "fixed_shift": "6.0",
                                            "network_args": "refiner_dim={network_dim} refiner_mod_dim={network_dim}"}},
                 "sd-scripts": SD_SCRIPTS},
)
