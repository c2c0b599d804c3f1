"""ERNIE-Image (Baidu's 8 B single-stream DiT): the architecture's facts (library/models/spec.py).

ai-toolkit trains it (extensions_built_in/diffusion_models/ernie_image, model.arch "ernie_image"); musubi-tuner and
sd-scripts do not. Where a name below is ai-toolkit's, the comment says so; the kohya prefix and the ModelSpec
strings are ours in sd-scripts' / musubi-tuner's style.
"""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# The 36 blocks' attention (to_q, to_k, to_v, to_out.0) and MLP (gate_proj, up_proj, linear_fc2) Linears in
# diffusers' module names (which the single file shares): every Linear of the blocks, what ai-toolkit's LoRA trains
# there (transformer_only: the Linears under `layers`, its get_transformer_block_names). The blocks hold no
# modulation of their own (one shared adaLN projection feeds every block). The embedders, the shared modulation
# and the final layer take a rank through in_dims, in this order: text_proj, time_embedding (linear_1, linear_2),
# adaln (adaLN_modulation.1), final_layer (final_norm.linear, final_linear); x_embedder is a Conv2d, not trained.
LORA = S.LoRATargets(
    targets={
        "attn": r"layers\.(?P<block>\d+)\.self_attention\.(to_q|to_k|to_v|to_out\.0)",
        "mlp": r"layers\.(?P<block>\d+)\.mlp\.(gate_proj|up_proj|linear_fc2)",
        "text_proj": r"text_proj",
        "time_embedding": r"time_embedding\.linear_[12]",
        "adaln": r"adaLN_modulation\.1",
        "final_layer": r"final_norm\.linear|final_linear",
    },
    block_args={"block_indices": "block"},  # as Z-Image's / Ideogram 4's (one block kind)
    kohya_prefix="lora_unet",  # ours, as musubi-tuner names diffusers-named models: lora_unet_layers_0_mlp_gate_proj
    in_dim_types=("text_proj", "time_embedding", "adaln", "final_layer"),
    extra_args=("in_dims",),  # those types' ranks, in in_dim_types' order (as FLUX.1's in_dims)
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# diffusers' module names in every layout: kohya lora_unet_*, PEFT transformer.* (ErnieImageLoraLoaderMixin) and
# ai-toolkit's `diffusion_model.<diffusers name>.lora_A/B` (its convert_lora_weights_before_save; the mixin swaps
# the prefix to transformer.): converting changes the prefix only. Markers are names only ERNIE-Image has
# ('_'-flattened): `_self_attention_` (Z-Image / Ideogram 4 name it `layers.N.attention`), `_mlp_linear_fc2`
# (an LLM's MLP ends in down_proj) and the modules outside the blocks. Its `layers.N.mlp.gate_proj / up_proj` are an
# LLM's names too, and `_attention_to_q` Z-Image's markers: the LLM and Z-Image markers say so (llm_spec.py,
# zimage/spec.py), and ERNIE-Image is registered before Z-Image (registry.py: lora_info tries it first).
# The shared adaLN projection is top-level (`adaLN_modulation.1`, behind a prefix only): Z-Image's final layer holds
# an `all_final_layer.2-1.adaLN_modulation.1` (its marker named Z-Image's transformer as ERNIE-Image's).
_ADALN = ("unet_adaLN_modulation_1", "transformer_adaLN_modulation_1", "model_adaLN_modulation_1")
LORA_FILES = S.LoRAFiles(
    markers=("_self_attention_to_", "_mlp_linear_fc2", *_ADALN, "final_norm_linear", "final_linear",
             "time_embedding_linear_"),
    model_versions=("ernie-image",),  # ours (ernie-image) and ai-toolkit's ernie_image; our modelspec ERNIE-Image/lora
    block_pattern=r"(layers)[._](\d+)[._]",
    module_paths="library.models.ernie_image.lora_files:module_paths",
    layouts=("kohya", "diffusers", "comfy"),
    info_markers=(("diffusers", r"layers_\d+_(self_attention_to_(q|k|v|out_0)|mlp_linear_fc2)$"
                                r"|(^|unet_|transformer_|model_)adaLN_modulation_1$|final_norm_linear|final_linear"),),
    info_blocks=(("block", r"(?:^|_)layers_(\d+)_"),),
    width_modules=r"self_attention_to_[qkv]|mlp_(gate|up)_proj",
    releases=(S.Release("ERNIE-Image", 4096, {"block": 36}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# As FLUX.2's / FLUX.3's: the embedders (text_proj, the timestep MLP; x_embedder is a Conv2d, never fp8), the shared
# adaLN projection (one Linear [6h, h] whose output modulates all 36 blocks: an fp8 error there reaches every block
# at once; 6 h^2 = 101 M weights, 1.2% of the 8.0 B) and the final layer. The blocks' Linears go to fp8.
FP8 = S.FP8Rules(
    keep=(r"text_proj", r"time_embedding\..*", r"adaLN_modulation\..*", r"final_norm\..*", r"final_linear"),
    # one naming (the single file's and the folder's: diffusers'), nothing fused: a stored scale stays its Linear's
    stored={"diffusers": S.STORED_FP8},
)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# ErnieImagePipeline: sigmas linspace(1, 0, N + 1)[:-1] through FlowMatchEulerDiscreteScheduler, whose released
# config (baidu/ERNIE-Image scheduler/scheduler_config.json) has use_dynamic_shifting false and shift 4.0: a
# constant shift k = 4 at every size (mu = ln 4), which samples use. ai-toolkit's scheduler_config for it is the same
# but for shift 3.0, with which its `shift` draw trains and its samples run: training draws the logit-normal sigma
# shifted by that k = 3 (train_shift; timestep_sampling = shift with discrete_flow_shift gives another k).
SAMPLING = S.Sampling(method="ernie_shift", shift=4.0, train_shift=3.0)


# -- memory planner shapes and presets
# Captions vary in length (each caption's own tokens, no template; a batch pads with a mask): the plan sizes 512.
# The text encoder as load_ernie_text_encoder reads Ministral 3 3B (Mistral3Model's language model, width 3072):
# the embeddings, decoder layers 1..25 (hidden_states[-2]) and the final norm, no head, no vision tower
# (text_encoder.ernie_text_weights on meta; fp8: the decoder Linears, one scale per 64 weights).
_MINISTRAL3_3B_25_LAYERS = S.TextWeights(3_312_608_256, fp8_weights=2_909_798_400, fp8_scales=45_465_600)
PLANNER = S.Planner(
    transformer="library.models.ernie_image.model:ErnieImage",
    text_tokens=512,
    presets={"ernie-image": S.PlannerPreset("ernie_image", "library.models.ernie_image.model:ERNIE_IMAGE",
                                            {"text_encoder": _MINISTRAL3_3B_25_LAYERS})},
)


# -- tiny models (tests, quickstart); FLUX.2's tiny VAE is the VAE (the same AutoencoderKLFlux2)
TINY = S.TinySpec(
    writers=("library.models.ernie_image.tiny:write_ernie_image",
             "library.models.ernie_image.tiny:write_ernie_image_text_encoder"),
    transformer="ernie_image",
    config_files={"ae": "flux2_vae", "text_encoder": "ernie_image_text_encoder"},
)


# -- the training config's keys of its text encoder files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Ministral 3 (the repo's text_encoder/ folder with tokenizer/ beside it)"),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): ours in musubi-tuner's style (none of the peers
# that write modelspec trains ERNIE-Image; ai-toolkit writes ss_base_model_version "ernie_image").
MODELSPEC = {"ernie-image": S.ModelSpecNames("ERNIE-Image", "https://huggingface.co/baidu/ERNIE-Image")}


SPEC = S.ArchSpec(
    arch="ernie_image",
    title="ERNIE-Image",
    names=(r"ernie[-_ ]?image",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.ernie_image.checkpoint:load_ernie_image",
                                   random_inputs="library.models.ernie_image.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.ernie_image.learned:LEARNED",
    default_config="ernie_image.toml",
    config_keys=CONFIG_KEYS,
    # ErnieImagePipeline.__call__'s defaults: 50 steps, CFG guidance_scale 4.0 with the negative prompt "" (above 1)
    sample_steps={"ernie-image": 50},
    sample_guidance={"ernie-image": 4.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch; its get_bucket_divisibility: "16 for the VAE, 2 for patch size" (the pipeline's
    # vae_scale_factor 16, the VAE's 8 x its 2 x 2 patchify, times 2)
    peer_bucket_steps={"ai-toolkit": 32},
    # (ai-toolkit's training scheduler: CustomFlowMatchEulerDiscreteScheduler at shift 3.0, no dynamic shifting: its
    # shift timestep types pick uniformly among evenly spaced sigmas shifted by 3)
    peer_models={"ai-toolkit": {"ernie_image": {"model_type": "ernie_image", "fixed_shift": "3.0"}}},
)
