"""Qwen-Image-2.1: the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# diffusers' module names are the model's (model.py), and the kohya names follow them
# (lora_unet_transformer_blocks_0_attn_to_q), as for Qwen-Image, whose kohya names musubi-tuner and
# DiffSynth-Studio's converters take from the same diffusers paths; no released Qwen-Image-2.1 kohya
# LoRA was available offline to check against. Default: each block's attention (to_q / to_k / to_v /
# to_out.0) and SwiGLU (proj / gate_layer / out): 7 x 32 = 224 Linears. The shared modulation Linear
# (one for every block, `modulation.1`: no per-block modulation exists) trains with train_modulation;
# the embedders and the output projection only with a rank through in_dims.
LORA = S.LoRATargets(
    targets={
        "attn": r"transformer_blocks\.(?P<block>\d+)\.attn\.(to_q|to_k|to_v|to_out\.0)",
        "mlp": r"transformer_blocks\.(?P<block>\d+)\.img_mlp\.(proj|gate_layer|out)",
        "mod": r"modulation\.1",
        "img_in": r"img_in",
        "txt_in": r"txt_in\.(in_layer|out_layer)",
        "time": r"time_text_embed\.timestep_embedder\.linear_(1|2)",
        "norm_out": r"norm_out\.linear",
        "proj_out": r"proj_out",
    },
    block_args={"block_indices": "block"},
    modulation_types=("mod",),
    in_dim_types=("img_in", "txt_in", "time", "norm_out", "proj_out"),
    extra_args=("in_dims",),  # those types' ranks, in in_dim_types' order (as FLUX.1's in_dims)
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# diffusers module names in every layout: converting changes the prefix only. The SwiGLU and text
# projection names are Qwen-Image-2.1's alone (Qwen-Image has img_mlp.net.0.proj / net.2, txt_in a Linear).
LORA_FILES = S.LoRAFiles(
    markers=("_img_mlp_gate_layer", "_img_mlp_proj", "_img_mlp_out", "_img_mlp_gate_up", "txt_in_in_layer",
             "txt_in_out_layer"),
    block_pattern=r"(transformer_blocks)[._](\d+)[._]",
    module_paths="library.models.qwen_image21.lora_files:module_paths",
    comfy_map="library.models.qwen_image21.lora_files:comfy_module_map",  # ComfyUI's fused gate_up read as ours
    info_markers=(("diffusers", r"_img_mlp_(gate_layer|proj|out|gate_up)$|txt_in_(in|out)_layer"),),
    info_blocks=(("block", r"transformer_blocks_(\d+)_"),),
    width_modules=r"attn_to_[qkv]|img_mlp_(proj|gate_layer)",
    releases=(S.Release("Qwen-Image-2.1", 4096, {"block": 32}),),
    # ours: qwen-image-2.1 (longer than Qwen-Image's prefix: lora_arch.header_arch); not "qwen-image-2", which
    # also begins Qwen-Image-2512 (Qwen-Image's blocks) in any spelling (lora_arch.begins_release)
    model_versions=("qwen-image-2.1",),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (latents, text, time), the output norm's scale and the output projection stay bf16;
# the shared modulation Linear (every block's scales and gates, as Krea 2's tproj) is kept too: one
# 67 M-parameter matrix whose error would reach all 32 blocks. The blocks' Linears go to fp8.
FP8 = S.FP8Rules(keep=(r"img_in", r"txt_in\..*", r"time_text_embed\..*", r"modulation\..*", r"norm_out\..*",
                       r"proj_out"),
                 stored={"diffusers": S.STORED_FP8})  # a folder or a single file in the folder's names (ComfyUI's)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# QwenImage21Pipeline: mu = calculate_shift(image tokens, base_image_seq_len, max_image_seq_len, base_shift,
# max_shift) read from the scheduler config with the fallbacks 256, 4096, 0.5, 1.15 (FLUX.1's constants:
# its method, as Chroma), exponential time shift (FlowMatchEulerDiscreteScheduler's default). The released
# scheduler_config.json could not be read offline: samples read a pipeline folder's own (family.py
# inference_sampling) and its model_index.json `sample_sigmas`, the grid the Turbo checkpoint ships (diffusers'
# modular QwenImage21 blocks), which the pipeline samples on in place of the linspace; training draws on this
# line. Tokens are latent pixels of the 16x VAE: 1024 px = 4096 tokens, so mu 1.15 (shift e^1.15 = 3.16) there.
SAMPLING = S.Sampling(method="flux_shift", mu=S.MuLine(256, 4096, 0.5, 1.15))


# -- memory planner shapes and presets
# Captions vary in length (we cache each one's real tokens; the pipeline has no limit): the plan sizes 512.
# The text encoder: Qwen3-VL-8B's language model without head or vision tower (as Qwen3-8B's layers:
# 36 x 4096, 8 key-value heads, MLP 12288, vocabulary 151936): 7,568,405,504 parameters.
_QWEN3_VL_8B_LANGUAGE_MODEL = S.TextWeights(7_568_405_504, fp8_weights=6_945_767_424, fp8_scales=108_527_616)
PLANNER = S.Planner(
    transformer="library.models.qwen_image21.model:QwenImage21",
    text_tokens=512,
    presets={
        "qwen-image-2.1": S.PlannerPreset("qwen_image21", "library.models.qwen_image21.model:QWEN_IMAGE21",
                                          {"text_encoder": _QWEN3_VL_8B_LANGUAGE_MODEL}),
    },
)


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(writers=(
    "library.models.qwen_image21.tiny:write_qwen_image21", "library.models.qwen_image21.tiny:write_qwen_image21_vae",
    "library.models.qwen_image21.tiny:write_qwen_image21_text_encoder",
), transformer="qwen_image21", config_files={"ae": "qwen_image21_vae", "text_encoder": "qwen_image21_text_encoder"})


# -- the training config's keys of its text encoder files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen3-VL-8B (the repo's text_encoder/ folder, processor/ beside it)"),
    S.ConfigKey("reference_resolution", int, "qwen_image21: reference images (control_directory, --ci) are resized "
                                             "to this square's area at their own ratio, for the VAE and the text "
                                             "encoder alike (QwenImage21Pipeline's output_resolution, default 1024)"),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): no peer trains it, so ours in musubi-tuner's style
# for the Qwen-Image line (the release's name); the implementation is the release's weights page (as sd-scripts
# names Chroma's).
MODELSPEC = {"qwen-image-2.1": S.ModelSpecNames("Qwen-Image-2.1", "https://huggingface.co/Qwen/Qwen-Image-2.1")}


SPEC = S.ArchSpec(
    arch="qwen_image21",
    title="Qwen-Image-2.1",
    names=(r"qwen[-_ ]?image[-_ ]?2[._]?1",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.qwen_image21.checkpoint:load_qwen_image21",
                                   random_inputs="library.models.qwen_image21.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    default_config="qwen_image21.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"qwen-image-2.1": 40},  # QwenImage21Pipeline
    sample_guidance={"qwen-image-2.1": 1.0},  # QwenImage21Pipeline: "meant to be sampled without guidance"
    modelspec=MODELSPEC,
    learned="library.models.qwen_image21.learned:LEARNED",  # the learned tiny base (learned.py; learned/qwen_image21/)
)
