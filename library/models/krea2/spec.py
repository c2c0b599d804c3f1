"""Krea 2 (Raw, Turbo): the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# The released single file's module names (model.py), which musubi-tuner's kohya files use
# (lora_unet_blocks_0_attn_wq). The model authors' recommended default, musubi-tuner's, is every Linear
# (264 at rank 32): here the block Linears train by default (the 28 main blocks' attention wq / wk / wv
# / wo / gate and SwiGLU gate / up / down, the 4 text-fusion blocks' alike: 256 Linears), the other 8
# (patch embedder, time and text MLPs, the shared modulation projection, the layer projector, the
# final projection) with a rank through in_dims, so `in_dims = [32, 32, 32, 32, 32, 32]` gives the
# authors' 264. Modulation is no Linear here (each block adds a learned vector to one shared
# projection, tproj), so train_modulation has nothing to switch. `text_dim = 0` drops the text fusion
# (towards the authors' attention-only "long run" setting with `mlp_dim = 0`). A diffusers-named LoRA
# (transformer_blocks.N.attn.to_q ...) is renamed to ours through the module map.
_ATTN = r"attn\.(wq|wk|wv|wo|gate)"
_MLP = r"mlp\.(gate|up|down)"
_TEXT = r"txtfusion\.(layerwise_blocks\.(?P<layerwise>\d+)|refiner_blocks\.(?P<refiner>\d+))"
LORA = S.LoRATargets(
    targets={
        "attn": rf"blocks\.(?P<block>\d+)\.{_ATTN}",
        "mlp": rf"blocks\.(?P<block>\d+)\.{_MLP}",
        "text_attn": rf"{_TEXT}\.{_ATTN}",
        "text_mlp": rf"{_TEXT}\.{_MLP}",
        "first": r"first",
        "tmlp": r"tmlp\.(0|2)",
        "tproj": r"tproj\.1",
        "txtmlp": r"txtmlp\.(1|3)",
        "projector": r"txtfusion\.projector",
        "last": r"last\.linear",
    },
    block_args={"block_indices": "block"},
    kohya_prefix="lora_unet",  # musubi-tuner's Krea 2 LoRAs
    in_dim_types=("first", "tmlp", "tproj", "txtmlp", "projector", "last"),
    extra_args=("in_dims",),  # those types' ranks, in in_dim_types' order (as FLUX.1's in_dims)
    type_groups={"text": ("text_attn", "text_mlp")},
    diffusers_module_map="library.models.krea2.lora_files:module_map_of_config",
    diffusers_blocks=("transformer_blocks.", "text_fusion.", "img_in", "time_embed.", "time_mod_proj", "txt_in.",
                      "final_layer."),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# Names only Krea 2 has, in ours (kohya, diffusion_model.*) and diffusers' naming ('_'-flattened; the
# MLP ones end in `_lora` so that an LLM's mlp_up_proj does not match, and the gate's carry the block index before
# it: Nucleus-Image's router `img_mlp.gate` holds the rest).
LORA_FILES = S.LoRAFiles(
    markers=("_attn_wq", "_attn_wk", "_attn_wv", "_attn_wo", "_attn_gate", "txtfusion_", "tproj_", "txtmlp_",
             *(f"{d}_mlp_gate_lora" for d in range(10)), "_mlp_up_lora", "_mlp_down_lora", "_attn_to_gate",
             "text_fusion_", "time_mod_proj",
             "_ff_gate_lora", "_ff_up_lora", "_ff_down_lora"),
    model_versions=("krea2", "krea-2"),  # ours (krea2-raw, krea2-turbo), ai-toolkit's krea2; musubi-tuner's Krea-2/lora
    block_pattern=r"(layerwise_blocks|refiner_blocks|transformer_blocks|blocks)[._](\d+)[._]",
    module_paths="library.models.krea2.lora_files:module_paths",
    module_map="library.models.krea2.lora_files:module_map_of_lora",
    info_markers=(("krea2", r"(^|_)blocks_\d+_(attn_(wq|wk|wv|wo|gate)|mlp_(gate|up|down))$|txtfusion_|tproj_1|txtmlp_"),
                  ("diffusers", r"transformer_blocks_\d+_(attn_to_gate|ff_(gate|up|down))$|text_fusion_|time_mod_proj")),
    info_blocks=(("block", r"(?:^|_unet_|model_|^transformer_)(?:transformer_)?blocks_(\d+)_"),
                 ("layerwise", r"layerwise_blocks_(\d+)_"), ("refiner", r"refiner_blocks_(\d+)_")),
    width_modules=r"(?<!layerwise_)(?<!refiner_)blocks_\d+_(attn_(wq|wk|wv|gate|to_q|to_k|to_v|to_gate)|mlp_(gate|up)|ff_(gate|up))",
    releases=(S.Release("Krea 2 (Raw / Turbo)", 6144, {"block": 28, "layerwise": 2, "refiner": 2}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (patches, time, text), the shared modulation projection (tproj: one output carries
# every block's modulation, as Chroma's approximator), the final projection and the whole text-fusion
# transformer (343 M of the 12.8 B weights, 2.7%: musubi-tuner quantizes the 28 main blocks only and
# keeps it bf16) stay in high precision; the main blocks' Linears go to fp8.
# stored: none yet (load_krea2 quantizes a bf16 file while loading; a pre-quantized one is refused)
FP8 = S.FP8Rules(keep=(r"first", r"tmlp\..*", r"tproj\..*", r"txtmlp\..*", r"txtfusion\..*", r"last\..*"))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# Krea2Pipeline: mu on the line through (256 tokens, 0.5) and (6400 tokens, 1.15) (its scheduler config's
# base_image_seq_len / max_image_seq_len / base_shift / max_shift, the pipeline's fallbacks too: 256 px
# to 1280 px images), exponential time shift. Turbo (is_distilled) samples with a fixed mu 1.15 instead
# (family.inference_sampling). Training draws a logit-normal sigma shifted with the same resolution mu:
# ai-toolkit's Krea 2 training scheduler is this dynamic shift (its scheduler_config mirrors these four
# constants "for the training timestep distribution"), and musubi-tuner's `krea2_shift` is the same
# (its guide's fixed `shift` 2.5 is this mu at 1024 px: e^0.906 = 2.47). No released training recipe.
SAMPLING = S.Sampling(method="krea2_shift", mu=S.MuLine(256, 6400, 0.5, 1.15))


# -- memory planner shapes and presets
# Captions vary in length (we cache each one's real tokens; the pipeline pads to 512): the plan sizes
# 512, the most the pipeline keeps. The text encoder as load_krea2_text_encoder reads Qwen3-VL-4B:
# the embeddings, 35 of 36 decoder layers (the deepest tap, 35) and the final norm, no head, no vision.
_QWEN3_VL_4B_35_LAYERS = S.TextWeights(3_921_537_280, fp8_weights=3_532_390_400, fp8_scales=55_193_600)  # fp8: its Linears
PLANNER = S.Planner(
    transformer="library.models.krea2.model:Krea2",
    text_tokens=512,
    presets={
        "krea2-raw": S.PlannerPreset("krea2", "library.models.krea2.model:KREA2_RAW",
                                     {"text_encoder": _QWEN3_VL_4B_35_LAYERS}, attributes={"version": "krea2-raw"}),
        "krea2-turbo": S.PlannerPreset("krea2", "library.models.krea2.model:KREA2_TURBO",
                                       {"text_encoder": _QWEN3_VL_4B_35_LAYERS}, attributes={"version": "krea2-turbo"}),
        # ai-toolkit's edit scheme on Raw: one reference at the target's size (plan_controls)
        "krea2-edit": S.PlannerPreset("krea2_edit", "library.models.krea2.model:KREA2_RAW",
                                      {"text_encoder": _QWEN3_VL_4B_35_LAYERS}, attributes={"version": "krea2-raw"}),
    },
)


# -- tiny models (tests, quickstart); Qwen-Image's tiny VAE is the VAE (the same AutoencoderKLQwenImage)
TINY = S.TinySpec(writers=(
    "library.models.krea2.tiny:write_krea2", "library.models.krea2.tiny:write_krea2_text_encoder",
), transformer="krea2", config_files={"ae": "qwen_image_vae", "text_encoder": "krea2_text_encoder"},
    sized="library.models.krea2.tiny:write_sized_krea2")


# -- the training config's keys of its text encoder files and version (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen3-VL-4B (the repo's text_encoder/ folder, or a single file such as "
                                     "ComfyUI's qwen3vl_4b_bf16.safetensors with the tokenizer files beside it)"),
    S.ConfigKey("model_version", str, "krea2: krea2-raw or krea2-turbo (default: the pipeline folder's "
                                      "model_index.json is_distilled, else turbo when the file name says so)"),
    S.ConfigKey("reference_resolution", int, "krea2_edit: reference images (control_directory, --ci) keep their "
                "aspect and are scaled down to at most this^2 pixels, sides multiples of 16 (default 1024: "
                "ai-toolkit's control_image_max_pixels)", model_types=("krea2_edit",)),
    S.ConfigKey("reference_kv_cache", bool, "krea2_edit: reference tokens attend only to each other (ai-toolkit's "
                "model_kwargs kv_cache), for kv-cached inference in ComfyUI; recorded in the LoRA's metadata",
                default=False, model_types=("krea2_edit",)),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata), by release (the families' model_version):
# musubi-tuner's (ARCH_KREA2, IMPL_KREA2) for Raw and Turbo; the edit variant (no peer trains it) ours in that
# style, as musubi-tuner names Qwen-Image's edit model.
_KREA = "https://github.com/krea-ai/krea-2"
MODELSPEC = {
    "krea2": S.ModelSpecNames("Krea-2", _KREA),
    "krea2-raw-edit": S.ModelSpecNames("Krea-2-Edit", _KREA),
    "krea2-turbo-edit": S.ModelSpecNames("Krea-2-Edit", _KREA),
}


# -- musubi-tuner's names (library/training/peers/musubi_tuner.py): its LoRA module wraps every Linear, the
# embedders and the last layer too (ours: in_dims at the rank).
MUSUBI = S.MusubiModels(
    script="krea2_train_network.py",
    lora_module="networks.lora_krea2",
    model_type="krea2",
    draws={"krea2_shift": S.PeerDraw("krea2_shift")},
    lora_args=(S.PeerLoRAArg("in_dims=network_dim", "it wraps every Linear: the embedders and the last layer too",
                             unless="lora"),),
    # krea2_train_network.py's do_inference: standard CFG at --l (5.5 unset: the release's guidance 4.5 + 1), only
    # with a --n and above 1; ours (and diffusers' Krea2Pipeline) reads --l as that guidance, the empty negative
    sample_cfg=S.PeerSampleCfg(default=5.5, offset=1.0, needs_negative=True),
)


SPEC = S.ArchSpec(
    arch="krea2",
    title="Krea 2",
    names=(r"krea[-_ ]?2",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.krea2.checkpoint:load_krea2",
                                   random_inputs="library.models.krea2.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.krea2.learned:LEARNED",  # the learned tiny base (learned.py; learned/krea2/)
    default_config="krea2.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"raw": 28, "turbo": 8},  # Krea2Pipeline (turbo: is_distilled); the edit variant: its release's
    sample_guidance={"raw": 4.5, "turbo": 0.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch (its edit mode, model_kwargs edit: true, is our krea2_edit: not read from there)
    peer_bucket_steps={"ai-toolkit": 16},  # ai-toolkit's get_bucket_divisibility: 8 x 2
    peer_models={"ai-toolkit": {"krea2": {"model_type": "krea2", "lokr_format": "peft"}}, "musubi-tuner": MUSUBI},
)
