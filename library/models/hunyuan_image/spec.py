"""HunyuanImage-2.1 (Tencent's 17 B text-to-image DiT: 20 double-stream and 40 single-stream blocks of width 3584 on a
64-channel VAE that downsamples 32x, Qwen2.5-VL-7B text with a byT5 glyph encoder of the prompt's quoted text): the
architecture's facts (library/models/spec.py).

sd-scripts trains it (hunyuan_image_train_network.py, networks.lora_hunyuan_image); diffusers runs it
(HunyuanImagePipeline) and ComfyUI (its HunyuanVideo model class). Our modules keep Tencent's released names
(double_blocks.0.img_attn_qkv, img_mlp.fc1, img_mod.linear, single_blocks.0.linear1), which sd-scripts' kohya files
use. ComfyUI's repackaged file renames a few to FLUX.1's (img_mlp.0, img_mod.lin, modulation.lin: comfy_map), so a
LoRA in ComfyUI's names has FLUX.1's names: it is told by its width 3584 (LORA_FILES.recognise).
"""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# sd-scripts' networks.lora_hunyuan_image (on lora_flux's network) trains every Linear of the MMDoubleStreamBlocks and
# MMSingleStreamBlocks by default, modulation included: ours too (modulation_default, as FLUX.1's). The block kinds
# are FLUX.1's "double" and "single" (train_double_block_indices / train_single_block_indices). The text refiner
# (txt_in's individual_token_refiner blocks), the embedders and the final layer train only with a rank (their _dim).
_DOUBLE, _SINGLE = r"double_blocks\.(?P<double>\d+)\.", r"single_blocks\.(?P<single>\d+)\."
_REFINER = r"txt_in\.individual_token_refiner\.blocks\.(?P<refiner>\d+)\."
LORA = S.LoRATargets(
    targets={
        "img_attn": _DOUBLE + r"img_attn_(qkv|proj)",
        "txt_attn": _DOUBLE + r"txt_attn_(qkv|proj)",
        "img_mlp": _DOUBLE + r"img_mlp\.(fc1|fc2)",
        "txt_mlp": _DOUBLE + r"txt_mlp\.(fc1|fc2)",
        "img_mod": _DOUBLE + r"img_mod\.linear",
        "txt_mod": _DOUBLE + r"txt_mod\.linear",
        "single": _SINGLE + r"(linear1|linear2)",
        "single_mod": _SINGLE + r"modulation\.linear",
        "refiner": _REFINER + r"(self_attn_qkv|self_attn_proj|mlp\.fc1|mlp\.fc2)",
        "refiner_mod": _REFINER + r"adaLN_modulation\.1",
        "txt_in": r"txt_in\.(input_embedder|t_embedder\.mlp\.(0|2)|c_embedder\.linear_(1|2))",
        "byt5_in": r"byt5_in\.fc(1|2|3)",
        "time_in": r"time_in\.mlp\.(0|2)",
        "final_layer": r"final_layer\.(linear|adaLN_modulation\.1)",
    },
    block_args={"train_double_block_indices": "double", "train_single_block_indices": "single"},
    modulation_types=("img_mod", "txt_mod", "single_mod", "refiner_mod"),
    modulation_default=True,
    in_dim_types=("refiner", "refiner_mod", "txt_in", "byt5_in", "time_in", "final_layer"),
    type_groups={"attn": ("img_attn", "txt_attn"), "mlp": ("img_mlp", "txt_mlp"),
                 "mod": ("img_mod", "txt_mod", "single_mod")},
    extra_args=("train_blocks",),  # train_blocks: "all", "double" or "single"
    refused_args={
        "split_qkv": "sd-scripts saves split q/k/v adapters as one block-diagonal LoRA of rank 3r with the alpha "
                     "of rank r, so every loader applies 1/3 of the trained qkv delta; train the fused qkv LoRA "
                     "(the default) instead",
    },
    diffusers_module_map="library.models.hunyuan_image.lora_files:module_map_of_config",
    diffusers_blocks=("transformer_blocks.", "single_transformer_blocks.", "context_embedder.",
                      "context_embedder_2.", "time_guidance_embed.", "x_embedder.", "norm_out.", "proj_out"),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# Its names are FLUX.1's block layout (double_blocks / single_blocks: names_of flux). Only it has Tencent's module
# names (img_mlp.fc1, img_mod.linear, single blocks' modulation.linear), the text refiner and the glyph mapper; in
# ComfyUI's names (FLUX.1's: img_mlp.0, img_mod.lin) or diffusers' (FLUX.1's transformer_blocks) a LoRA is told by
# its width 3584 (recognise), its header (model_versions), or --model_type.
LORA_FILES = S.LoRAFiles(
    markers=("_img_mlp_fc1", "_img_mlp_fc2", "_txt_mlp_fc1", "_txt_mlp_fc2", "_img_mod_linear", "_txt_mod_linear",
             *(f"single_blocks_{n}_modulation_linear" for n in range(64)), "individual_token_refiner", "byt5_in_",
             "context_embedder_2_", "token_refiner_refiner_blocks_", "time_guidance_embed_"),
    names_of="flux",
    recognise="library.models.hunyuan_image.lora_files:has_hunyuan_image_shapes",
    # ours; sd-scripts' modelspec hunyuan-image-2.1 (ARCH_HUNYUAN_IMAGE_2_1) and hunyuan-image
    model_versions=("hunyuan_image", "hunyuan-image"),
    block_pattern=r"(double_blocks|single_blocks|transformer_blocks|single_transformer_blocks|refiner_blocks|blocks)"
                  r"[._](\d+)[._]",
    module_paths="library.models.hunyuan_image.lora_files:module_paths",
    module_map="library.models.hunyuan_image.lora_files:module_map_of_lora",
    layouts=("kohya", "diffusers", "comfy"),
    comfy_map="library.models.hunyuan_image.lora_files:comfy_module_map",
    comfy_names="library.models.hunyuan_image.lora_files:comfy_module",
    info_markers=(("tencent", r"(_img_mlp_fc[12]|_img_mod_linear|single_blocks_\d+_modulation_linear|"
                              r"individual_token_refiner|byt5_in_fc)"),
                  ("diffusers", r"(context_embedder_2_|token_refiner_refiner_blocks_|time_guidance_embed_)")),
    info_blocks=(("double", r"double_blocks_(\d+)_"),
                 ("single", r"single_blocks_(\d+)_|single_transformer_blocks_(\d+)_"),
                 ("double", r"(?<!single_)transformer_blocks_(\d+)_")),
    width_modules=(r"_attn_qkv|_attn_proj|_linear1|_modulation_lin(ear)?|_mod_lin(ear)?|_mlp_(0|fc1)|attn_to_[qkv]|"
                   r"attn_add_[qkv]_proj|norm1?(_context)?_linear|proj_mlp"),
    releases=(S.Release("HunyuanImage-2.1", 3584, {"double": 20, "single": 40}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (text refiner input, conditioning MLPs, glyph mapper, timestep) and the final layer stay bf16, as
# FLUX.1's (img_in is a 1x1 convolution: never quantized). The refiner blocks are 2 of the 62 blocks and run on text
# only: quantized with the rest. The per-block modulation Linears (6 x 3584 rows in a double stream) are quantized
# while fp8.QUANTIZE_MODULATION says so, as every family's.
FP8 = S.FP8Rules(
    keep=(r"txt_in\.(input_embedder|t_embedder\..*|c_embedder\..*)", r"byt5_in\..*", r"time_in\..*",
          r"final_layer\..*"),
    modulation=(r".*_mod\.linear", r".*\.modulation\.linear", r".*\.adaLN_modulation\.1"),
    stored={"tencent": S.STORED_FP8, "comfy": S.STORED_FP8},  # ComfyUI's file renames, never fuses
)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# Samples: a constant shift k = 5 at every size, as sd-scripts' sampler (flow_shift 5.0) and the diffusers repo's
# scheduler run it. Training draws sigmoid(randn) shifted by the same k = 5: what sd-scripts' docs run
# (discrete_flow_shift 5.0; its default draw "sigma" takes the shifted scheduler's discrete sigmas, its converter says).
SAMPLING = S.Sampling(method="hunyuan_image_shift", shift=5.0)


# -- memory planner shapes and presets
# Captions are cached as their own tokens (the transformer masks the rest); the pipeline pads Qwen's to 1000 tokens
# after the template's 34, byT5's to 128, and the plan sizes those. The text encoders as their loaders read them:
# Qwen2.5-VL-7B's embeddings and the decoder layers up to hidden_states[-3] (26 of 28), no final norm, no head, no
# vision tower; byT5-small's encoder.
# Qwen2.5-VL-7B on meta: 545.0 M embeddings, 233.1 M per decoder layer; fp8: the decoder Linears, one scale per 64
_QWEN25_VL_7B_26_LAYERS = S.TextWeights(6_604_499_968, fp8_weights=6_059_196_416, fp8_scales=94_674_944)
_BYT5_SMALL = S.TextWeights(217_657_472)
PLANNER = S.Planner(
    transformer="library.models.hunyuan_image.model:HunyuanImage",
    text_tokens=1000,
    presets={"hunyuan_image": S.PlannerPreset("hunyuan_image", "library.models.hunyuan_image.model:HUNYUAN_IMAGE",
                                              {"text_encoder": _QWEN25_VL_7B_26_LAYERS, "byt5": _BYT5_SMALL})},
)


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(
    writers=("library.models.hunyuan_image.tiny:write_hunyuan_image",
             "library.models.hunyuan_image.tiny_vae:write_hunyuan_image_vae",
             "library.models.hunyuan_image.tiny_text:write_hunyuan_image_text_encoders"),
    transformer="hunyuan_image",
    config_files={"ae": "hunyuan_image_vae_single", "text_encoder": "hunyuan_image_text_encoder",
                  "byt5": "hunyuan_image_glyph_encoder"},
    sized="library.models.hunyuan_image.tiny:write_sized_hunyuan_image",
)


# -- the training config's keys of its text files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen2.5-VL-7B (the diffusers repo's text_encoder/ folder with tokenizer/ "
                                     "beside it, or a single file such as ComfyUI's qwen_2.5_vl_7b.safetensors)"),
    S.ConfigKey("byt5", str, "hunyuan_image: the byT5 glyph encoder of the captions' quoted text (ComfyUI's "
                             "byt5_small_glyphxl_fp16.safetensors or the diffusers repo's text_encoder_2/; sd-scripts' "
                             "--byt5)", model_types=("hunyuan_image",)),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): sd-scripts' (ARCH_HUNYUAN_IMAGE_2_1,
# IMPL_HUNYUAN_IMAGE)
MODELSPEC = {"hunyuan-image-2.1": S.ModelSpecNames("hunyuan-image-2.1",
                                                   "https://github.com/Tencent-Hunyuan/HunyuanImage-2.1")}


# -- sd-scripts' names (library/training/peers/sd_scripts.py, sd_scripts_script.py): hunyuan_image_train_network.py
# (its setup_parser: train_network's, add_dit_training_arguments and its own; sd-scripts 48d368f) with
# networks.lora_hunyuan_image. Its parser lacks the FLUX.1 script's add_flux_train_arguments (CLIP-L, T5, --ae,
# guidance, ControlNet, model_type) and split_mode; it has its own --text_encoder (Qwen2.5-VL), --byt5, --vae (the
# Stable Diffusion argument, read for its VAE), and its own draw arguments: timestep_sampling "sigma" by default
# (u ~ U(0, 1) picks one of the 1000 sigmas of a FlowMatchEulerDiscreteScheduler shifted by discrete_flow_shift,
# default 5.0: flux_train_utils.get_noisy_model_input_and_timesteps), sigmoid / uniform / shift as ours and FLUX.1's,
# model_prediction_type default raw (ours). Its "sigma" is ours' shift of a uniform draw (of a logit-normal or mode
# one by its weighting_scheme: sd_scripts_training.sigma_draw); its flux_shift reads FLUX.1's line at (h / 2)(w / 2)
# of the 32x latent, a quarter of this model's patch-1 tokens (ours reads the line at the model's tokens). Its LoRA
# module trains every Linear of the MMDoubleStreamBlocks and MMSingleStreamBlocks at network_dim (modulation
# included): ours' default, module for module; its create_network reads none of lora_flux's type ranks, block
# indices, train_blocks or in_dims.
_MEMORY = "memory and speed only: ours runs PyTorch's SDPA on whole batches and encodes latents once, before training"
# flux_shift at one size: time_shift(mu) of sigmoid(s randn) is the `shift` draw at k = e^mu, mu = 0.5 + 0.65
# ((h / 2)(w / 2) - 256) / 3840 for an h x w latent (h = height / 32)
_FLUX_SHIFT = ("FLUX.1's resolution line read at (h/2)(w/2) of the 32x latent, a quarter of this model's tokens "
               "(patch 1): ours' flux_shift reads it at the model's tokens; at one size it is timestep_sampling = "
               "\"shift\" with the same sigmoid_scale and discrete_flow_shift = exp(0.5 + 0.65 ((h/2)(w/2) - 256) / "
               "3840): 1.65 at 1024 px, 1.88 at 2048 px")
SD_SCRIPTS = S.SdScriptsModels(
    script="hunyuan_image_train_network.py", lora_module="networks.lora_hunyuan_image", models={},
    model_type="hunyuan_image",
    sample_scale=3.5, sample_flags=("fs",),  # its sample_image_inference: scale (--l) 3.5, no --g; --fs 5.0
    lacks=("model_type", "clip_l", "t5xxl", "ae", "t5xxl_max_token_length", "apply_t5_attn_mask", "guidance_scale",
           "controlnet_model_name_or_path", "split_mode"),
    files={"vae": "ae"},
    same_args=("text_encoder", "byt5"),
    defaults={"discrete_flow_shift": 5.0, "model_prediction_type": "raw"},  # (timestep_sampling "sigma", as FLUX.1's)
    draws_refused={"flux_shift": _FLUX_SHIFT},
    ignored_args={
        **dict.fromkeys(("attn_mode", "split_attn", "vae_chunk_size"), _MEMORY),
        "text_encoder_cpu": "where the text encoders run: ours encodes the captions once, before training, on the GPU",
    },
    # its fp8_scaled: the DiT's Linears in e4m3 with scales (musubi-tuner's; ours: one scale per 64 weights), which
    # its script takes over fp8_base; fp8_vl: Qwen2.5-VL cast to e4m3 (its whole model; ours: the decoder Linears),
    # byT5 as stored in both
    fp8_args={"fp8_scaled": "base_precision=fp8_scaled", "fp8_vl": "text_encoder_precision=fp8"},
    # its create_network's kwargs (networks.lora_hunyuan_image 48d368f); lora_flux's type ranks, train_blocks,
    # in_dims and block indices are not among them (sd_scripts.network_arg_verdict drops them: unread there)
    lora_module_args=("conv_dim", "conv_alpha", "rank_dropout", "module_dropout", "split_qkv", "ggpo_beta",
                      "ggpo_sigma", "verbose", "network_reg_lrs", "network_reg_dims", "loraplus_lr_ratio",
                      "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"),
    makes_text_lora=False,  # its network's text_encoder_loras is always empty (its docs: network_train_unet_only)
    # 20 double and 40 single blocks: its enable_block_swap swaps N // 2 double and 2 (N - N // 2) single ones
    one_block_kind=False,
    timestep_feed=("sd-scripts feeds the transformer int64(1000 sigma), a whole-number timestep (its TODO: bf16 is too "
                   "coarse for 0-1000); ours feeds 1000 sigma in float32, up to 1 apart in the embedding's input"),
)


SPEC = S.ArchSpec(
    arch="hunyuan_image",
    title="HunyuanImage-2.1",
    names=(r"hunyuan[-_ ]?image", r"hy[-_]?image"),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.hunyuan_image.checkpoint:load_hunyuan_image",
                                   random_inputs="library.models.hunyuan_image.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.hunyuan_image.learned:LEARNED",  # the learned tiny base (learned/hunyuan_image/)
    default_config="hunyuan_image.toml",
    config_keys=CONFIG_KEYS,
    # HunyuanImagePipeline's 50 steps; guidance 3.5 with the empty negative prompt (sd-scripts' sample default, the
    # release's guider's scale), mixed with adaptive projected guidance as the release's guiders (family.py)
    sample_steps={"hunyuan-image-2.1": 50},
    sample_guidance={"hunyuan-image-2.1": 3.5},
    modelspec=MODELSPEC,
    peer_models={"sd-scripts": SD_SCRIPTS},
)
