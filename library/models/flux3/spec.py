"""FLUX.3 [klein] (base, step-distilled): the architecture's facts (library/models/spec.py).

No peer trainer (sd-scripts, musubi-tuner, ai-toolkit) trains FLUX.3 yet: the names below that the peers would
give (kohya prefix, ModelSpec strings, network_args) are ours in their style, each comment says so, and the spec
lists no peer_models.
"""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# Every Linear of the blocks, in BFL's single-file names (model.py): the per-mode blocks of the image tokens
# (content_mode_blocks.image.N), of the reference tokens (content_mode_blocks.image_cond.N, trained only where the
# data has references) and of the text (txt_mode_blocks.N), then the joint single blocks (single_blocks.N); each
# block has q_proj, k_proj, v_proj, attn_out, mlp_in (SwiGLU gate | up), mlp_out. The modulations are shared (one
# projection per mode feeds every block, as FLUX.2's) and, with the embedders and the final layer, left out as
# FLUX.2's. Kohya names as sd-scripts / musubi-tuner name FLUX's (lora_unet_single_blocks_0_q_proj: ours, no peer
# trains FLUX.3); a diffusers-named LoRA (mode_blocks.image.0.attn.to_q ...) is renamed through the module map.
_LINEARS = r"(q_proj|k_proj|v_proj|attn_out|mlp_in|mlp_out)"
_ATTN, _MLP = r"(q_proj|k_proj|v_proj|attn_out)", r"(mlp_in|mlp_out)"
LORA = S.LoRATargets(
    targets={
        "img_attn": rf"content_mode_blocks\.image\.(?P<mode>\d+)\.{_ATTN}",
        "img_mlp": rf"content_mode_blocks\.image\.(?P<mode>\d+)\.{_MLP}",
        "cond_attn": rf"content_mode_blocks\.image_cond\.(?P<mode>\d+)\.{_ATTN}",
        "cond_mlp": rf"content_mode_blocks\.image_cond\.(?P<mode>\d+)\.{_MLP}",
        "txt_attn": rf"txt_mode_blocks\.(?P<mode>\d+)\.{_ATTN}",
        "txt_mlp": rf"txt_mode_blocks\.(?P<mode>\d+)\.{_MLP}",
        "single_attn": rf"single_blocks\.(?P<single>\d+)\.{_ATTN}",
        "single_mlp": rf"single_blocks\.(?P<single>\d+)\.{_MLP}",
    },
    # ours, in sd-scripts' train_double_block_indices style: a mode index selects that block of every mode
    block_args={"train_mode_block_indices": "mode", "train_single_block_indices": "single"},
    # <group>_dim: a mode's blocks (img, cond, txt, single) or every block's attention / MLP; a type in two groups
    # takes its mode's rank (the groups are read in this order, the first one given sets it)
    type_groups={"img": ("img_attn", "img_mlp"), "cond": ("cond_attn", "cond_mlp"), "txt": ("txt_attn", "txt_mlp"),
                 "single": ("single_attn", "single_mlp"), "attn": ("img_attn", "cond_attn", "txt_attn", "single_attn"),
                 "mlp": ("img_mlp", "cond_mlp", "txt_mlp", "single_mlp")},
    diffusers_module_map="library.models.flux3.lora_files:module_map_of_config",
    diffusers_blocks=("mode_blocks.", "txt_mode_blocks.", "single_transformer_blocks."),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# FLUX.3 keeps FLUX.1's `single_blocks` (and txt_in, time_in, final_layer): a FLUX-named LoRA is FLUX.3's by its
# markers (names only FLUX.3 has, either naming), its header (ss_base_model_version flux3*, modelspec Flux.3/lora)
# or its single blocks' module names (lora_files.has_flux3_names: single_blocks.N.q_proj / .attn_out / .mlp_in
# ..., single_transformer_blocks.N.ff.linear_in). The diffusers names share FLUX.2's ff.linear_in and
# *_stream_modulation markers: FLUX.3 is registered before FLUX.2 so that its own checks decide first.
# ComfyUI / BFL layout: `diffusion_model.<BFL path>.lora_A/B`, what diffusers' Flux3LoraLoaderMixin converts
# (lora_conversion_utils._convert_non_diffusers_flux3_lora_to_diffusers).
LORA_FILES = S.LoRAFiles(
    markers=("mode_blocks_", "stream_modulations_", "emb_in_image", "x_embedders_", "ref_time_in_",
             "target_timestep_embedder_", "final_layer_image_"),
    names_of="flux",
    recognise="library.models.flux3.lora_files:has_flux3_names",
    model_versions=("flux3", "flux.3"),  # ours (flux3, flux3-distilled) and our modelspec Flux.3/lora
    block_pattern=r"(txt_mode_blocks|mode_blocks[._]image_cond|mode_blocks[._]image|single_transformer_blocks"
                  r"|single_blocks)[._](\d+)[._]",
    module_paths="library.models.flux3.lora_files:module_paths",
    module_map="library.models.flux3.lora_files:module_map_of_lora",
    layouts=("kohya", "diffusers", "comfy"),
    info_markers=(
        ("bfl", rf"(mode_blocks_(image_|image_cond_)?|single_blocks_)\d+_{_LINEARS}$|stream_modulations_\w+_lin$"),
        ("diffusers", r"mode_blocks_(image_|image_cond_)?\d+_(attn_to_[qkv]|attn_to_out_0|ff_linear_(in|out))$"
                      r"|single_transformer_blocks_\d+_ff_linear_(in|out)$|stream_modulations_\w+_linear$"),
    ),
    info_blocks=(("mode", r"mode_blocks_(?:image_cond_|image_)?(\d+)_"),
                 ("single", r"single_(?:transformer_)?blocks_(\d+)_")),
    width_modules=r"_(q_proj|k_proj|v_proj|attn_out|mlp_in|attn_to_[qkv]|attn_to_out_0|ff_linear_in)",
    releases=(S.Release("FLUX.3 [klein] (base / distilled)", 3072, {"mode": 5, "single": 28}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (image and reference tokens, text, the timestep and the flow map's target-timestep MLPs), the
# final layer and the shared stream modulations: each of those one projection feeds every block of its stream
# (as FLUX.2's SHARED_MODULATION), so an fp8 error in it would reach all blocks at once. The six modulation
# Linears [3h, h] are 18 h^2 weights, 3.1% of the released 5.54 B. Measured on a tiny FLUX.3 (width 256, 2 per-mode
# + 4 single blocks, weights N(0, 0.02), relative error of the blocks' residual update vs fp32, 3 seeds):
# fp8_scaled 5.18% with them quantized vs 4.49% kept (plain fp8: 6.89% vs 6.00%; with a reference image's
# tokens too: 5.17% vs 4.47%). Keeping them cuts the error by 13% for +2.9% memory, as FLUX.2's (13% for +3.4%).
# tests/test_flux3_fp8.py::test_fp8_keeping_shared_modulation_pays repeats it (1 per-mode + 2 single blocks, 1 seed).
SHARED_MODULATION = (r"early_stream_modulations\..*", r"single_stream_modulations\..*")
FP8 = S.FP8Rules(
    keep=(r"emb_in\..*", r"txt_in", r"time_in\..*", r"ref_time_in\..*", r"final_layer\..*", *SHARED_MODULATION),
    # both namings: diffusers renames every Linear one to one (nothing fused), so a stored scale stays its Linear's
    stored={"bfl": S.STORED_FP8, "diffusers": S.STORED_FP8},
)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# diffusers' modular FLUX.3 pipeline (Flux3SetTimestepsStep): FlowMatchEulerDiscreteScheduler with a constant shift
# 6.93 (no resolution shift) over sigmas linspace(1, 1/N, N): the time shift with mu = ln 6.93 at every size.
# Training draws the logit-normal sigma shifted by the same constant (no released training recipe; k = 6.93
# leans to high noise, as the sampler does). timestep_sampling = shift with discrete_flow_shift gives another k.
SAMPLING = S.Sampling(method="flux3_shift", shift=6.93)


# -- memory planner shapes and presets
# Each caption is its own window, padded to a multiple of 80 tokens (the transformer sees the pads: no mask); the
# plan sizes 320 tokens (captions up to ~300 tokens with the chat template). The text encoder as
# load_flux3_text_encoder reads Qwen3-VL-4B: the embeddings, the first 32 of 36 decoder layers (the deepest
# stacked hidden state, 32) and the final norm, no head, no vision (LLM(QWEN3_VL_4B) on meta, truncated to 32
# layers; fp8: its decoder Linears, one scale per 64 weights).
_QWEN3_VL_4B_32_LAYERS = S.TextWeights(3_618_744_832, fp8_weights=3_229_614_080, fp8_scales=50_462_720)
PLANNER = S.Planner(
    transformer="library.models.flux3.model:Flux3Transformer",
    text_tokens=320,
    presets={
        "flux3": S.PlannerPreset("flux3", "library.models.flux3.model:FLUX3_IMAGE",
                                 {"text_encoder": _QWEN3_VL_4B_32_LAYERS}),
        "flux3-distilled": S.PlannerPreset("flux3", "library.models.flux3.model:FLUX3_IMAGE_DISTILLED",
                                           {"text_encoder": _QWEN3_VL_4B_32_LAYERS}),
    },
)


# -- tiny models (tests, quickstart); FLUX.2's tiny VAE is the VAE (the same AutoencoderKLFlux2)
TINY = S.TinySpec(
    writers=("library.models.flux3.tiny:write_flux3", "library.models.flux3.tiny:write_flux3_text_encoder"),
    transformer="flux3_tiny",
    config_files={"ae": "flux2_vae", "text_encoder": "flux3_text_encoder"},
)


# -- the training config's keys of its text encoder files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen3-VL-4B (the repo's text_encoder/ folder with tokenizer/ beside it, or a "
                                     "single file with the tokenizer files beside it)"),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata), by release (the family's model_version: flux3,
# flux3-distilled): ours in musubi-tuner's style for FLUX.2 (Flux.2-klein-4b), none trains FLUX.3 yet; the
# implementation is BFL's reference code that diffusers' FLUX.3 blocks cite.
MODELSPEC = {"flux3": S.ModelSpecNames("Flux.3", "https://github.com/black-forest-labs/flux-3-image-klein")}


SPEC = S.ArchSpec(
    arch="flux3",
    title="FLUX.3",
    names=(r"flux[.-]?3",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.flux3.checkpoint:load_flux3",
                                   random_inputs="library.models.flux3.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.flux3.learned:LEARNED",
    default_config="flux3.toml",
    config_keys=CONFIG_KEYS,
    # the modular pipelines' defaults: Flux3SetTimestepsStep 50 steps (16 for the step-distilled model),
    # Flux3LoopDenoiser's ClassifierFreeGuidance at 3.5 with a negative prompt; the distilled model runs no CFG
    sample_steps={"base": 50, "distilled": 16},
    sample_guidance={"base": 3.5},
    modelspec=MODELSPEC,
)
