"""Qwen-Image, Qwen-Image-Edit (2509, 2511) and Qwen-Image-Layered: the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# The blocks' attention and MLP Linears; the modulation only with train_modulation or mod_dim. musubi-tuner
# means the same (its exclude `.*(_mod_).*`) but matches it against dotted names (`img_mod.1`), where it
# excludes nothing: its files carry the modulation, which train_modulation = true matches.
LORA = S.LoRATargets(
    targets={
        "attn": r"transformer_blocks\.(?P<block>\d+)\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)",
        "mlp": r"transformer_blocks\.(?P<block>\d+)\.(img|txt)_mlp\.net\.(0\.proj|2)",
        "mod": r"transformer_blocks\.(?P<block>\d+)\.(img|txt)_mod\.1",
    },
    block_args={"block_indices": "block"},
    modulation_types=("mod",),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# diffusers module names in every layout: converting changes the prefix only.
LORA_FILES = S.LoRAFiles(
    # BFL-named models have img_mlp_0, img_mod_lin. Nucleus-Image's blocks hold img_mod.1 (all 32) and, in its dense
    # blocks 0-2, img_mlp.net: the image stream's markers carry the block index (an index ending in 3-9 for the MLP,
    # blocks 32-59 for the modulation); a Qwen-Image LoRA's default types hold the text stream's names too.
    markers=("_txt_mlp_net_", "_txt_mod_1", *(f"{d}_img_mlp_net_" for d in range(3, 10)),
             *(f"blocks_{i}_img_mod_1" for i in range(32, 60))),
    block_pattern=r"(transformer_blocks)[._](\d+)[._]",
    module_paths="library.models.qwen_image.lora_files:module_paths",
    # attention projections alone (attn.to_q, add_q_proj) other architectures have too: lora_info tells by shapes
    info_markers=(("diffusers", r"_(img|txt)_mlp_net_|_(img|txt)_mod_1"),),
    info_blocks=(("block", r"(?<!single_)transformer_blocks_(\d+)_"),),
    width_modules=r"attn_to_[qkv]|attn_add_[qkv]_proj|_mod_1|mlp_net_0_proj",
    releases=(S.Release("Qwen-Image", 3072, {"block": 60}),),
    # ours (qwen-image, qwen-image-edit-*) and musubi-tuner's modelspec Qwen-Image(-Edit...)/lora
    model_versions=("qwen-image", "qwen_image"),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
FP8 = S.FP8Rules(
    keep=(r"img_in", r"txt_in", r"time_text_embed\..*", r"norm_out\..*", r"proj_out"),
    modulation=(r".*\.(img|txt)_mod\.1",),
    stored={"diffusers": S.STORED_FP8},  # a folder or a single file in the folder's names (ComfyUI's)
)


# -- GGUF: ComfyUI-GGUF's layout (library/precision/gguf_writer.py)
# city96's auto_convert branch: convert.py detects the diffusers keys as "qwen_image" (ModelQwenImage,
# tools/convert.py:73-81, no keys_hiprec) and its llama.cpp patch leaves these unquantized for it
# (tools/lcpp.patch:487-494, the fp8 keep list's names); the per-block modulation is quantized, and the
# ffn rule (:206-207) takes img_mlp.net.2 / txt_mlp.net.2 one step up (Q4_1 / Q5_1 at Q4_0 / Q5_0). Its
# first / last block rule (:234-253) changes only K-quant file types, which gguf cannot write.
GGUF = S.GgufLayout("qwen_image", unquantized=("img_in.", "txt_in.", "time_text_embed.", "norm_out.", "proj_out."))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# Qwen/Qwen-Image scheduler/scheduler_config.json (pipeline_qwenimage.py reads these keys from the
# scheduler config; its own calculate_shift defaults are FLUX.1's and do not apply): base_image_seq_len
# 256, max_image_seq_len 8192, base_shift 0.5, max_shift 0.9, shift_terminal 0.02 (the inference
# schedule only), time_shift_type "exponential". No guidance embedding: samples use true CFG.
SAMPLING = S.Sampling(method="qwen_shift", mu=S.MuLine(256, 8192, 0.5, 0.9), shift_terminal=0.02)


# -- memory planner shapes and presets
# Captions vary in length (a mask pads them): the plan sizes a long one, 512 tokens.
# Qwen2.5-VL-7B's language model as load_llm keeps it (LLM(QWEN2_5_7B) on meta: fp8 on every decoder Linear).
_QWEN2_5_VL_7B_LANGUAGE = S.TextWeights(7_615_616_512, fp8_weights=6_525_288_448, fp8_scales=101_957_632)
PLANNER = S.Planner(
    transformer="library.models.qwen_image.model:QwenImage",
    text_tokens=512,
    presets={
        "qwen-image": S.PlannerPreset("qwen_image", "library.models.qwen_image.model:QWEN_IMAGE",
                                      {"text_encoder": _QWEN2_5_VL_7B_LANGUAGE}),
        # Edit(-2509/-2511): Qwen-Image's transformer, one reference's tokens; Qwen2.5-VL-7B with its vision
        # tower (0.68 B) as the text encoder. No config.json to read the version from: 2509 (2511 plans the
        # same: its text sees the references alike).
        "qwen-image-edit": S.PlannerPreset("qwen_image_edit", "library.models.qwen_image.model:QWEN_IMAGE",
                                           {"text_encoder": S.TextWeights(8_292_166_656, fp8_weights=6_525_288_448,
                                                                          fp8_scales=101_957_632)},
                                           attributes={"version": "qwen-image-edit-2509"}),
        # Layered: Qwen-Image's transformer (the flags add no weight) on the composite + 4 layers + the
        # condition image: six frames' tokens; Qwen2.5-VL-7B's language model (the text sees no image).
        "qwen-image-layered": S.PlannerPreset("qwen_image_layered", "library.models.qwen_image.layered:QWEN_IMAGE_LAYERED",
                                              {"text_encoder": _QWEN2_5_VL_7B_LANGUAGE}, attributes={"layers": 4}),
    },
)


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(writers=(
    "library.models.qwen_image.tiny:write_qwen_image", "library.models.qwen_image.tiny:write_qwen_vae",
    "library.models.qwen_image.tiny:write_qwen_text_encoder", "library.models.qwen_image.tiny:write_qwen_image_edit",
    "library.models.qwen_image.tiny:write_qwen_vl_text_encoder", "library.models.qwen_image.tiny:write_qwen_image_layered",
), transformer="qwen_image", config_files={"ae": "qwen_image_vae", "text_encoder": "qwen_image_text_encoder"},
    sized="library.models.qwen_image.tiny:write_sized_qwen_image")


# -- the training config's keys of its text encoder files and edit version (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen2.5-VL (the repo's text_encoder/ folder; an edit model's with its "
                                     "vision tower, processor/ beside it)"),
    S.ConfigKey("model_version", str, "qwen_image_edit: qwen-image-edit, qwen-image-edit-2509 or qwen-image-edit-2511 "
                                      "(default: the transformer config.json's flags, 2509 without zero_cond_t; "
                                      "needed for a single transformer file)", model_types=("qwen_image_edit",)),
    S.ConfigKey("layers", int, "qwen_image_layered: layers a sample (--ci image) is decomposed into (the pipeline's "
                               "`layers`, default 4; training takes each image's own layer files)", model_types=("qwen_image_layered",)),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata), by release (the families' model_version):
# musubi-tuner's (ARCH_QWEN_IMAGE, _EDIT, _EDIT_PLUS for 2509, _EDIT_2511, _LAYERED, with their IMPL_ URLs).
_QWEN = "https://github.com/QwenLM/Qwen-Image"
MODELSPEC = {
    "qwen-image": S.ModelSpecNames("Qwen-Image", _QWEN),
    "qwen-image-edit": S.ModelSpecNames("Qwen-Image-Edit", _QWEN),
    "qwen-image-edit-2509": S.ModelSpecNames("Qwen-Image-Edit-Plus", _QWEN),
    "qwen-image-edit-2511": S.ModelSpecNames("Qwen-Image-Edit-2511", _QWEN),
    "qwen-image-layered": S.ModelSpecNames("Qwen-Image-Layered", "https://github.com/QwenLM/Qwen-Image-Layered"),
}


# -- musubi-tuner's names (library/training/peers/musubi_tuner.py): one script and LoRA module; its
# model_version (or the edit / edit_plus switches, edit_plus read first) picks the variant, "original" by default.
# Its Edit fits each control image to its target's size, ours encodes it at the resolution's area ("area").
_EDIT = {"model_type": "qwen_image_edit"}
MUSUBI = S.MusubiModels(
    script="qwen_image_train_network.py",
    lora_module="networks.lora_qwen_image",
    model_type="qwen_image",
    versions={"original": {"model_type": "qwen_image"}, "layered": {"model_type": "qwen_image_layered"},
              "edit": {**_EDIT, "model_version": "qwen-image-edit"},
              "edit-2509": {**_EDIT, "model_version": "qwen-image-edit-2509"},
              "edit-2511": {**_EDIT, "model_version": "qwen-image-edit-2511"}},
    version_switches={"edit_plus": "edit-2509", "edit": "edit"},
    references={"qwen_image_edit": "area"},
    layered={"qwen_image_layered": "Qwen-Image-Layered"},
    dataset_renames={"qwen_image_edit_no_resize_control": "no_resize_control",
                     "qwen_image_edit_control_resolution": "control_resolution"},
    draws={"qwen_shift": S.PeerDraw("qwen_shift")},
    # its hybrid sampler's qinglong_qwen: 95% qwen_shift, no logsnr, 5% log-SNR 5.36 / 1
    mixtures={"qinglong_qwen": S.PeerMixture("qwen_shift", 0.0, 0.05)},
    lora_args=(S.PeerLoRAArg("train_modulation=true", "its exclude '.*(_mod_).*' matches no dotted module name: "
                                                      "it trains img_mod / txt_mod"),),
)


SPEC = S.ArchSpec(
    arch="qwen_image",
    title="Qwen-Image",
    names=(r"qwen[-_ ]?image",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.qwen_image.model:load_qwen_image",
                                   random_inputs="library.models.qwen_image.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.qwen_image.learned:LEARNED",
    default_config="qwen_image.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"qwen-image": 50, "edit": 50, "layered": 50},  # QwenImage(Edit(Plus)|Layered)Pipeline
    sample_guidance={"qwen-image": 4.0, "edit": 4.0, "layered": 4.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch: its qwen_image_edit is the first Edit, qwen_image_edit_plus 2509 / 2511 (ours reads
    # which from the folder's config, 2509 when it cannot tell)
    peer_bucket_steps={"ai-toolkit": 32},  # ai-toolkit's get_bucket_divisibility (16 x 2, for Edit too)
    peer_models={"ai-toolkit": {"qwen_image": {"model_type": "qwen_image"},
                                "qwen_image_edit": {"model_type": "qwen_image_edit", "model_version": "qwen-image-edit"},
                                "qwen_image_edit_plus": {"model_type": "qwen_image_edit"}},
                 "musubi-tuner": MUSUBI},
)
