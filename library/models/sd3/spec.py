"""Stable Diffusion 3 / 3.5 (Stability AI's MMDiT: SD3-Medium 2 B, SD3.5-Medium 2.5 B with a second self-attention in
its first 13 blocks (MMDiT-X), SD3.5-Large 8 B of 38 blocks at width 2432; patch 2 on a 16-channel 8x VAE; text:
CLIP-L + CLIP-G states joined by channels, then T5-XXL's, and both CLIPs' pooled outputs): the architecture's facts
(library/models/spec.py).

sd-scripts trains it (sd3_train_network.py, networks.lora_sd3); diffusers runs it (StableDiffusion3Pipeline) and
ComfyUI. Our modules keep SAI's released names (joint_blocks.0.x_block.attn.qkv, context_block.mlp.fc1,
x_block.adaLN_modulation.1), which sd-scripts' kohya files use and ComfyUI reads as they are (its key map takes every
`lora_unet_` + model name). A LoRA in diffusers' names has FLUX.1's double-block names (transformer_blocks.0.attn.to_q,
ff_context.net.0.proj) and no single blocks: it is told by its width (2432 or 1536; FLUX.1's 3072: recognise).
"""

from library.models import spec as S
from library.models.flux1.spec import T5_XXL_TEXT

# -- LoRA targets and key names (networks/)
# sd-scripts' networks.lora_sd3 trains every Linear of the joint blocks by default (its SD3_TARGET_REPLACE_MODULE
# "SingleDiTBlock": attention, MLP and adaLN modulation of both streams, MMDiT-X's attn2): ours too
# (modulation_default). Its type ranks are context_/x_ attn / mlp / mod (x_attn covers attn2: its name test is "attn"
# in the module name); its emb_dims rank the embedders and the final layer (ours: their _dim). The patch embedding is
# a 2x2 convolution in the file (x_embedder.proj): sd-scripts gives it a LoRA only with conv_dim; ours none.
_BLOCK = r"joint_blocks\.(?P<joint>\d+)\."
LORA = S.LoRATargets(
    targets={
        "context_attn": _BLOCK + r"context_block\.attn\.(qkv|proj)",
        "context_mlp": _BLOCK + r"context_block\.mlp\.(fc1|fc2)",
        "context_mod": _BLOCK + r"context_block\.adaLN_modulation\.1",
        "x_attn": _BLOCK + r"x_block\.attn2?\.(qkv|proj)",
        "x_mlp": _BLOCK + r"x_block\.mlp\.(fc1|fc2)",
        "x_mod": _BLOCK + r"x_block\.adaLN_modulation\.1",
        "context_embedder": r"context_embedder",
        "t_embedder": r"t_embedder\.mlp\.(0|2)",
        "y_embedder": r"y_embedder\.mlp\.(0|2)",
        "final_layer": r"final_layer\.(linear|adaLN_modulation\.1)",
    },
    block_args={"train_block_indices": "joint"},
    kohya_prefix="lora_unet",  # sd-scripts' LORA_PREFIX_SD3: lora_unet_joint_blocks_0_x_block_attn_qkv
    modulation_types=("context_mod", "x_mod"),
    modulation_default=True,
    in_dim_types=("context_embedder", "t_embedder", "y_embedder", "final_layer"),
    type_groups={"attn": ("context_attn", "x_attn"), "mlp": ("context_mlp", "x_mlp"),
                 "mod": ("context_mod", "x_mod")},
    refused_args={
        "split_qkv": "sd-scripts saves split q/k/v adapters as one block-diagonal LoRA of rank 3r with the alpha "
                     "of rank r, so every loader applies 1/3 of the trained qkv delta; train the fused qkv LoRA "
                     "(the default) instead",
    },
    diffusers_module_map="library.models.sd3.lora_files:module_map_of_config",
    diffusers_blocks=("transformer_blocks.", "context_embedder", "time_text_embed.", "norm_out.", "proj_out"),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# Only SAI's names have joint_blocks with x_block / context_block; diffusers' names are FLUX.1's double blocks (told
# by the width: recognise, or the header, or --model_type).
LORA_FILES = S.LoRAFiles(
    markers=("joint_blocks_", "_x_block_", "_context_block_"),
    names_of="flux",
    recognise="library.models.sd3.lora_files:has_sd3_shapes",
    # ours and sd-scripts' modelspec stable-diffusion-3(.5)-* (sai_model_spec), ai-toolkit's sd3
    model_versions=("sd3", "stable-diffusion-3"),
    block_pattern=r"(joint_blocks|transformer_blocks)[._](\d+)[._]",
    module_paths="library.models.sd3.lora_files:module_paths",
    module_map="library.models.sd3.lora_files:module_map_of_lora",
    layouts=("kohya", "diffusers", "comfy"),
    # diffusers' names are FLUX.1's double blocks' (attn2, SD3.5-Medium's, is Anima's too): no naming of its own there
    info_markers=(("sai", r"joint_blocks_\d+_(x|context)_block_"),),
    info_blocks=(("joint", r"joint_blocks_(\d+)_"), ("joint", r"(?<!single_)transformer_blocks_(\d+)_")),
    width_modules=r"attn2?_qkv|attn2?_to_[qkv]|attn_add_[qkv]_proj|adaLN_modulation_1|norm1(_context)?_linear|mlp_fc1",
    releases=(S.Release("SD3.5-Large", 2432, {"joint": 38}),
              S.Release("SD3-Medium / SD3.5-Medium", 1536, {"joint": 24})),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (context, timestep, pooled text) and the final layer stay bf16, as FLUX.1's; x_embedder is a 2x2
# convolution (never quantized); the positional table is computed, not a weight (model.py). The per-block adaLN
# Linears (6 x width rows) are quantized while fp8.QUANTIZE_MODULATION says so, as every family's.
FP8 = S.FP8Rules(
    keep=(r"context_embedder", r"t_embedder\..*", r"y_embedder\..*", r"final_layer\..*"),
    modulation=(r".*\.adaLN_modulation\.1",),
    stored={"sai": S.STORED_FP8},
)


# -- GGUF (merge_lora --save_precision gguf_*): ComfyUI-GGUF's "sd3" (tools/convert.py ModelSD3 detects SAI's
# joint_blocks.0.x_block.attn.qkv.weight); its llama.cpp patch (tools/lcpp.patch, LLM_ARCH_SD3) leaves final_layer.,
# time_text_embed., context_embedder., t_embedder., y_embedder., x_embedder., proj_out.weight and pos_embed unquantized;
# no keys_hiprec
GGUF = S.GgufLayout("sd3", unquantized=("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.",
                                        "y_embedder.", "x_embedder.", "proj_out.weight", "pos_embed"))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# The released schedulers (FlowMatchEulerDiscreteScheduler, scheduler_config.json of SD3-Medium, SD3.5-Medium and
# -Large) shift every schedule by k = 3.0, no resolution shift. Training draws sigmoid(randn) shifted by the same k:
# diffusers' train_dreambooth_lora_sd3.py (logit-normal u indexing the shifted scheduler's sigmas) and the SD3
# paper's 1024 px shift. sd-scripts' default draw is uniform without a shift (its training_shift 1.0).
# StableDiffusion3Pipeline passes no sigmas: the scheduler spaces them, linspace(1, 3e-3 / 1.002, steps) shifted
# (scheduler_spacing; FLUX.1's pipelines pass linspace(1, 1 / steps, steps)).
# The loss: ours the velocity error (weighting_scheme "none"), the rectified-flow loss of the SD3 paper; sd-scripts'
# sd3_train_network.py and diffusers' train_dreambooth_lora_sd3.py (precondition_outputs 1) train the x0 error by
# default, the velocity error weighted by sigma^2: weighting_scheme = "sigma_sq" (flow_matching.loss_weighting).
SAMPLING = S.Sampling(method="sd3_shift", shift=3.0, scheduler_spacing=True)


# -- memory planner shapes and presets
# The context is CLIP's 77 tokens then T5's 256 (the pipeline's max_sequence_length; text_on_meta adds the 77).
# The text encoders as their loaders read them (library/models/sd3/text_encoder.py): CLIP-L and CLIP-G with their
# projections (bf16 under fp8; 123.7 M and 694.7 M on meta), T5-XXL's encoder.
_CLIP_L = S.TextWeights(123_650_304)
_CLIP_G = S.TextWeights(694_659_840)
_TEXT = {"clip_l": _CLIP_L, "clip_g": _CLIP_G, "t5xxl": T5_XXL_TEXT}  # T5-XXL as FLUX.1 reads it
_T5_256 = {"t5_max_length": 256}
PLANNER = S.Planner(
    transformer="library.models.sd3.model:SD3",
    text_tokens=256,
    presets={"sd3.5-large": S.PlannerPreset("sd3", "library.models.sd3.model:SD35_LARGE", _TEXT, _T5_256),
             "sd3.5-medium": S.PlannerPreset("sd3", "library.models.sd3.model:SD35_MEDIUM", _TEXT, _T5_256),
             "sd3-medium": S.PlannerPreset("sd3", "library.models.sd3.model:SD3_MEDIUM", _TEXT, _T5_256)},
)


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(
    writers=("library.models.sd3.tiny:write_sd3",
             "library.models.sd3.tiny_vae:write_sd3_vae",
             "library.models.sd3.tiny_text:write_sd3_text_encoders"),
    transformer="sd3",
    config_files={"ae": "sd3_vae", "clip_l": "sd3_clip_l", "clip_g": "sd3_clip_g", "t5xxl": "sd3_t5xxl"},
    config_values={"t5xxl_max_token_length": 32},
    sized="library.models.sd3.tiny:write_sized_sd3",
)


# -- the training config's keys of its text files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("clip_l", str, "CLIP-L (SAI's text_encoders/clip_l.safetensors, the diffusers repo's text_encoder/, "
                               "or the all-in-one checkpoint itself)"),
    S.ConfigKey("clip_g", str, "CLIP-G (SAI's text_encoders/clip_g.safetensors, the diffusers repo's "
                               "text_encoder_2/, or the all-in-one checkpoint itself)"),
    S.ConfigKey("t5xxl", str, "T5-XXL (SAI's text_encoders/t5xxl_fp16.safetensors, the diffusers repo's "
                              "text_encoder_3/, or the all-in-one checkpoint itself)"),
    S.ConfigKey("t5xxl_max_token_length", int, "T5 tokens per caption, at most 512 (default 256, as "
                                               "StableDiffusion3Pipeline and sd-scripts)", renders=True),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): sd-scripts' sai_model_spec (ARCH_SD3_M
# "stable-diffusion-3" + "-" + its MMDiT's model_type: "medium", "5-medium", "5-large"; IMPL_STABILITY_AI)
_SAI = "https://github.com/Stability-AI/generative-models"
MODELSPEC = {
    "sd3-medium": S.ModelSpecNames("stable-diffusion-3-medium", _SAI),
    "sd3.5-medium": S.ModelSpecNames("stable-diffusion-3-5-medium", _SAI),
    "sd3.5-large": S.ModelSpecNames("stable-diffusion-3-5-large", _SAI),
}


# -- sd-scripts' names (library/training/peers/sd_scripts.py, sd_scripts_script.py): sd3_train_network.py (its
# setup_parser: train_network's, add_dit_training_arguments and sd3_train_utils.add_sd3_training_arguments; sd-scripts
# 48d368f) with networks.lora_sd3. Its parser lacks the FLUX.1 script's --ae, guidance, ControlNet, model_type,
# split_mode and its draw arguments (timestep_sampling, sigmoid_scale, discrete_flow_shift, model_prediction_type); it
# has --clip_l, --t5xxl, --t5xxl_max_token_length (default 256, ours') and --apply_t5_attn_mask by the FLUX.1 script's
# names, its own --clip_g, and reads the VAE from --vae. Where --clip_l / --clip_g / --t5xxl / --vae are not given it
# reads them from the model file (an all-in-one checkpoint's text_encoders.* and first_stage_model.*: sd3_utils.load_*)
# and so does ours, given that file as each path (files_in_model). (Where the checkpoint holds CLIP-G or T5-XXL,
# sd3_utils.load_clip_g / load_t5xxl read its copy even where --clip_g / --t5xxl name another file; ours reads the
# file named.) Its draw and loss are weighting_scheme's and training_shift's (sd_scripts_draw.py); its LoRA module
# trains every joint-block Linear by default, ours' default (sd_scripts_lora.py says its emb_dims).
_ENCODER_MASK = ("the padding mask goes to the {which}'s own attention{effect}, and the transformer still attends to "
                 "every row unmasked (its TODO); ours encodes as StableDiffusion3Pipeline, which passes no mask")
_PER_ENCODER_DROPOUT = ("with this probability sd-scripts zeroes {what} of a sample (a per-encoder dropout to zeros); "
                        "ours drops whole captions to the empty caption's encoding (a subset's caption_dropout_rate)")
_NOT_WORKING = "sd-scripts' help: [DOES NOT WORK], its script reads nothing of it"
SD_SCRIPTS = S.SdScriptsModels(
    script="sd3_train_network.py", lora_module="networks.lora_sd3", models={}, model_type="sd3",
    sample_scale=7.5,  # sd3_train_utils.sample_image_inference: scale (--l) 7.5, no --g
    lacks=("model_type", "ae", "controlnet_model_name_or_path", "guidance_scale", "timestep_sampling", "sigmoid_scale",
           "model_prediction_type", "discrete_flow_shift", "split_mode"),
    files={"vae": "ae"},
    same_args=("clip_g",),
    files_in_model=("clip_l", "clip_g", "t5xxl", "vae"),
    defaults={"weighting_scheme": "uniform", "training_shift": 1.0},
    draw_args=("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "training_shift", "min_timestep",
               "max_timestep"),
    draw="library.models.sd3.sd_scripts_draw:sd3_draw",
    ignored_args={**dict.fromkeys(("save_clip", "save_t5xxl", "t5xxl_device", "t5xxl_dtype"), _NOT_WORKING),
                  # its get_noisy_model_input_and_timesteps has no input perturbation (FLUX's and Lumina's have)
                  **dict.fromkeys(("ip_noise_gamma", "ip_noise_gamma_random_strength"),
                                  "sd3_train_network perturbs no input: its script reads nothing of it")},
    # sd3_train_network: model_pred x (-sigma) + x_t against the latents (its x0 loss, ours' sigma_sq weighting)
    huber_not_ours="its loss is on the predicted clean latent: its huber is huber_c's of sigma x the velocity "
                   "error, ours' x0 weighting sigma^2 x huber of the error (the same only for errors far below c)",
    refused_args={
        # measured on the tiny CLIP and T5 (tests/test_sd3_convert_config.py): CLIP's rows up to the caption's end
        # and its pooled vector are the same with the mask (its attention is causal), T5's every row differs
        "apply_lg_attn_mask": _ENCODER_MASK.format(which="CLIP-L and CLIP-G", effect=" (causal: only the padding "
                                                   "rows after the caption change; the caption's rows and the pooled "
                                                   "vectors are the same)"),
        "apply_t5_attn_mask": _ENCODER_MASK.format(which="T5-XXL", effect=" (every row changes: T5 attends both ways)"),
        "clip_l_dropout_rate": _PER_ENCODER_DROPOUT.format(what="CLIP-L's states and pooled half"),
        "clip_g_dropout_rate": _PER_ENCODER_DROPOUT.format(what="CLIP-G's states and pooled half"),
        "t5_dropout_rate": _PER_ENCODER_DROPOUT.format(what="T5-XXL's states"),
        "pos_emb_random_crop_rate": "with this probability sd-scripts adds a randomly placed window of the position "
                                    "table (SD3.5-Medium's training); ours takes the centred window always, as "
                                    "StableDiffusion3Pipeline",
        "enable_scaled_pos_embed": "sd-scripts then adds sin-cos tables rescaled to each bucket's size (its "
                                   "get_scaled_2d_sincos_pos_embed) in place of the file's; ours takes the centred "
                                   "window of the file's table, as StableDiffusion3Pipeline",
    },
    # its create_network's kwargs (networks.lora_sd3 48d368f: no network_reg_dims / _lrs, ggpo or train_blocks)
    lora_module_args=("conv_dim", "conv_alpha", "context_attn_dim", "context_mlp_dim", "context_mod_dim", "x_attn_dim",
                      "x_mlp_dim", "x_mod_dim", "emb_dims", "train_block_indices", "rank_dropout", "module_dropout",
                      "split_qkv", "train_t5xxl", "verbose", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                      "loraplus_text_encoder_lr_ratio"),
    lora_args="library.models.sd3.sd_scripts_lora:network_args_of",
    # CLIP-L and CLIP-G LoRAs unless network_train_unet_only; with cached outputs it caches T5 alone and encodes
    # CLIP each step (is_partial): no stop
    text_lora_when_cached=True,
    one_block_kind=True,  # its joint blocks: its N swaps N of them, as ours
)


SPEC = S.ArchSpec(
    arch="sd3",
    title="SD3 / SD3.5",
    names=(r"sd[-_ ]?3(?![0-9])", r"stable[-_ ]?diffusion[-_ ]?3", r"mmdit"),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.sd3.checkpoint:load_sd3",
                                   random_inputs="library.models.sd3.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    default_config="sd3.toml",
    config_keys=CONFIG_KEYS,
    # the model cards' steps and guidance (diffusers' examples): SD3.5-Large 28 at 3.5, SD3.5-Medium 40 at 4.5,
    # SD3-Medium 28 at 7.0; the empty negative prompt (StableDiffusion3Pipeline's)
    sample_steps={"sd3.5-large": 28, "sd3.5-medium": 40, "sd3-medium": 28},
    sample_guidance={"sd3.5-large": 3.5, "sd3.5-medium": 4.5, "sd3-medium": 7.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch "sd3" (or its older is_v3: true); its bucket divisibility (get_bucket_divisibility:
    # 2^3 of the VAE's 4 levels, x 2 for the patch, x 2)
    peer_bucket_steps={"ai-toolkit": 32},
    # (its training scheduler there: toolkit/sampler.py's sd_flow_config, a fixed shift 3)
    peer_models={"ai-toolkit": {"sd3": {"model_type": "sd3", "fixed_shift": "3.0"}}, "sd-scripts": SD_SCRIPTS},
    learned="library.models.sd3.learned:LEARNED",  # the learned tiny base (learned.py; learned/sd3/)
)
