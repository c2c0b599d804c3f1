"""Z-Image (Turbo, Base): the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# The main blocks' (`layers`) attention and SwiGLU Linears: what ai-toolkit trains and what the Z-Image
# LoRAs diffusers converts name (`layers.N.attention.to_q ... to_out.0`, `layers.N.feed_forward.w1/w2/w3`).
# The refiners (two image `noise_refiner` and two caption `context_refiner` blocks before the stack)
# are the same block kind: they train only when given a rank (`refiner_dim`, or the types' own _dim).
# The per-block adaLN modulation (one Linear reading the 256-wide timestep embedding) is off by default,
# as musubi-tuner leaves modulation out (train_modulation or mod_dim turn it on).
_ATTN = r"attention\.(to_q|to_k|to_v|to_out\.0)"
_FF = r"feed_forward\.(w1|w2|w3)"
_REFINER = r"(noise_refiner\.(?P<noise_refiner>\d+)|context_refiner\.(?P<context_refiner>\d+))"
LORA = S.LoRATargets(
    targets={
        "attn": rf"layers\.(?P<layer>\d+)\.{_ATTN}",
        "ff": rf"layers\.(?P<layer>\d+)\.{_FF}",
        "mod": r"layers\.(?P<layer>\d+)\.adaLN_modulation\.0",
        "refiner_attn": rf"{_REFINER}\.{_ATTN}",
        "refiner_ff": rf"{_REFINER}\.{_FF}",
        "refiner_mod": r"noise_refiner\.(?P<noise_refiner>\d+)\.adaLN_modulation\.0",
    },
    block_args={"block_indices": "layer"},
    kohya_prefix="lora_unet",  # musubi-tuner's Z-Image LoRAs: lora_unet_layers_0_attention_to_q
    modulation_types=("mod", "refiner_mod"),
    in_dim_types=("refiner_attn", "refiner_ff", "refiner_mod"),  # only with a rank (no in_dims key: by _dim)
    type_groups={"refiner": ("refiner_attn", "refiner_ff")},
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# diffusers module names in every layout we write (kohya lora_unet_*, PEFT transformer.*, ComfyUI /
# ai-toolkit diffusion_model.*, which ComfyUI maps onto its fused qkv through its z_image_to_diffusers
# table; it takes lora_unet_ names only in its own module names): converting changes the prefix only.
# LoRAs in ComfyUI's own names (fused attention.qkv ...) read through comfy_map (lora_files.py).
LORA_FILES = S.LoRAFiles(
    # the attention's with the block index before it: ERNIE-Image's `layers.N.self_attention.to_q` holds the rest
    markers=(*(f"{i}_attention_to_" for i in range(10)), "_feed_forward_w", "noise_refiner_", "context_refiner_",
             "_attention_qkv"),
    layouts=("kohya", "diffusers", "comfy"),
    # ours (zimage-turbo, zimage-base, zimage-omni) and ai-toolkit's zimage; musubi-tuner's modelspec Z-Image/lora
    model_versions=("zimage", "z-image", "z_image"),
    comfy_map="library.models.zimage.lora_files:comfy_module_map",
    block_pattern=r"(noise_refiner|context_refiner|layers)[._](\d+)[._]",
    module_paths="library.models.zimage.lora_files:module_paths",
    diffusers_lokr="Z-Image",  # diffusers' ZImageLoraLoaderMixin converts LoKr files too
    # the single file's (ComfyUI's) names where no diffusers attention name is there: its fused qkv, out and the
    # feed-forward's w1-w3, which both namings have
    info_markers=(("diffusers", r"_attention_to_(q|k|v|out_0)"),
                  ("single_file", r"_attention_(qkv|out)|_feed_forward_w[123]")),
    info_blocks=(("layer", r"(?:^|_)layers_(\d+)_"), ("noise_refiner", r"noise_refiner_(\d+)_"),
                 ("context_refiner", r"context_refiner_(\d+)_")),
    width_modules=r"attention_to_[qkv]|attention_to_out_0|feed_forward_w[13]",
    releases=(S.Release("Z-Image (Turbo / Base)", 3840, {"layer": 30, "noise_refiner": 2, "context_refiner": 2}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (patches, caption, timestep) and the final layer stay bf16, as for every family; so
# does Omni's siglip_embedder (RMSNorm + Linear 1152 -> 3840): it is the SigLIP features' input
# projection, the caption embedder's counterpart (one Linear of 4.4 M weights that every SigLIP token
# passes, ahead of every block). The blocks' adaLN Linears are the per-block modulation (quantized while
# fp8.QUANTIZE_MODULATION, as FLUX.1's: measured there).
FP8 = S.FP8Rules(
    keep=(r"all_x_embedder\..*", r"cap_embedder\..*", r"t_embedder\..*", r"all_final_layer\..*",
          r"siglip_embedder\..*"),
    modulation=(r".*\.adaLN_modulation\.0",),
    stored={"single_file": S.STORED_FP8, "diffusers": S.STORED_FP8},  # a fused qkv splits by rows, scales too
)


# -- GGUF: ComfyUI-GGUF's layout (library/precision/gguf_writer.py), in the single-file names (x_embedder,
# fused attention.qkv ...; checkpoint.py's map): convert.py detects cap_embedder.1.weight with
# context_refiner.0.attention.qkv.weight as "lumina2" (ModelLumina2; loader.py's IMG_ARCH_LIST has no
# other name for Z-Image), and its llama.cpp patch leaves these unquantized for "lumina2" (tools/lcpp.patch,
# LLM_ARCH_LUMINA2): the embedders, the final layer and the refiner blocks. The pad tokens are F32, as
# ModelLumina2's keys_hiprec on city96's auto_convert branch (a0a0d2e "Z-Image conversion support",
# tools/convert.py:152-156) keeps them: ComfyUI-GGUF's loader turns BF16 into floats only for 1-D tensors
# (main branch loader.py:122-123), so a BF16 [1, 3840] pad token would load as raw bytes and fail ComfyUI's load.
GGUF = S.GgufLayout("lumina2", unquantized=("t_embedder.", "x_embedder.", "final_layer.", "cap_embedder.",
                                            "context_refiner.", "noise_refiner."),
                    hiprec=("x_pad_token", "cap_pad_token"))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: FlowMatchEulerDiscreteScheduler with
# use_dynamic_shifting false and shift 3.0 (Base's: 6.0, the family's inference_sampling): a constant
# shift, the same at every resolution. Training draws as musubi-tuner's Z-Image guide trains it
# (timestep_sampling shift, discrete_flow_shift 2.0, weighting none): the logit-normal draw shifted by
# k = 2, a little less noise-heavy than the sampler's k = 3 (ai-toolkit's default for it is a
# weighted draw of the scheduler's own sigmas). timestep_sampling = shift with discrete_flow_shift
# gives any other k.
SAMPLING = S.Sampling(method="zimage_shift", shift=3.0, train_shift=2.0)


# -- memory planner shapes and presets
# Captions vary in length (a mask; the pipeline keeps at most 512 tokens): the plan sizes 512.
# The text encoder as load_zimage_text_encoder reads Qwen3-4B: the embeddings, 35 of 36 decoder
# layers (hidden_states[-2]) and the final norm, no head (tied embeddings: none in the files); fp8: its Linears.
_QWEN3_4B_35_LAYERS = S.TextWeights(3_921_537_280, fp8_weights=3_532_390_400, fp8_scales=55_193_600)
# Omni's SigLIP2 so400m vision model (Siglip2VisionModel: hidden 1152, 27 layers, 4304 MLP, patch 16,
# 256 positions, its pooling head included as from_pretrained builds it), counted on meta.
_SIGLIP2_SO400M = S.TextWeights(427_888_064)  # never fp8 (bf16 under fp8)
PLANNER = S.Planner(
    transformer="library.models.zimage.omni:zimage_transformer",  # ZImage, or ZImageOmni with the SigLIP branch
    text_tokens=512,
    presets={
        "zimage-turbo": S.PlannerPreset("zimage", "library.models.zimage.model:ZIMAGE_TURBO",
                                        {"text_encoder": _QWEN3_4B_35_LAYERS}, attributes={"version": "zimage-turbo"}),
        "zimage-base": S.PlannerPreset("zimage", "library.models.zimage.model:ZIMAGE_BASE",
                                       {"text_encoder": _QWEN3_4B_35_LAYERS}, attributes={"version": "zimage-base"}),
        # one reference per image unless --references says otherwise (each: its latents + 256 SigLIP tokens)
        "zimage-omni": S.PlannerPreset("zimage_omni", "library.models.zimage.omni:ZIMAGE_OMNI",
                                       {"text_encoder": _QWEN3_4B_35_LAYERS, "siglip": _SIGLIP2_SO400M}),
    },
)


# -- tiny models (tests, quickstart); FLUX.1's tiny VAE is the VAE (the same AutoencoderKL)
TINY = S.TinySpec(writers=(
    "library.models.zimage.tiny:write_zimage", "library.models.zimage.tiny:write_zimage_text_encoder",
    "library.models.zimage.tiny:write_zimage_omni",
), transformer="zimage", config_files={"ae": "flux_vae_single", "text_encoder": "zimage_text_encoder"},
    sized="library.models.zimage.tiny:write_sized_zimage")


# -- the training config's keys of its text encoder files and version (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen3-4B (the repo's text_encoder/ folder or a single file, tokenizer/ beside it)"),
    S.ConfigKey("model_version", str, "zimage: zimage-turbo or zimage-base (default: the pipeline folder's "
                                      "scheduler shift, 3.0 Turbo / 6.0 Base; Turbo for a single file)"),
    S.ConfigKey("siglip", str, "zimage_omni: the SigLIP2 vision model folder with its preprocessor_config.json "
                               "(default: the Omni repo's siglip/ and siglip_processor/)", model_types=("zimage_omni",)),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata), by release (the families' model_version):
# musubi-tuner's (ARCH_Z_IMAGE, IMPL_Z_IMAGE) for Turbo and Base, which it names alike; Omni (no peer trains it,
# and it runs with other inputs) ours in that style.
_ZIMAGE = "https://github.com/Tongyi-MAI/Z-Image"
MODELSPEC = {
    "zimage": S.ModelSpecNames("Z-Image", _ZIMAGE),
    "zimage-omni": S.ModelSpecNames("Z-Image-Omni", _ZIMAGE),
}


SPEC = S.ArchSpec(
    arch="zimage",
    title="Z-Image",
    names=(r"z[-_ ]?image",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.zimage.checkpoint:load_zimage",
                                   random_inputs="library.models.zimage.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.zimage.learned:LEARNED",  # the learned tiny base (learned.py; learned/zimage/)
    default_config="zimage.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"turbo": 8, "base": 50, "omni": 50},  # ZImagePipeline / ZImageOmniPipeline; Turbo's card: 8 steps
    sample_guidance={"turbo": 0.0, "base": 5.0, "omni": 5.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch: Turbo and Base (told apart by the folder's scheduler)
    peer_bucket_steps={"ai-toolkit": 16},  # ai-toolkit's get_bucket_divisibility: 8 x 2
    # (ai-toolkit's training scheduler: CustomFlowMatchEulerDiscreteScheduler at shift 3.0, no dynamic shifting: its
    # shift timestep types pick uniformly among evenly spaced sigmas shifted by 3)
    peer_models={"ai-toolkit": {"zimage": {"model_type": "zimage", "fixed_shift": "3.0"}},
                 # zimage_train_network.py's do_inference: CFG pos + l (pos - neg) above l = 1 (4.0 unset), where ours
                 # (and diffusers' ZImagePipeline) runs it above 0 (the release's Turbo: 0 unset)
                 # its handle_model_specific_args: the DiT float32 unless --mixed_precision bf16 / fp16
                 "musubi-tuner": S.MusubiModels("zimage_train_network.py", "networks.lora_zimage", "zimage",
                                                sample_cfg=S.PeerSampleCfg(default=4.0),
                                                float32_dit_without_mixed_precision=True)},
)
