"""Nucleus-Image (NucleusAI's 17 B sparse mixture-of-experts DiT, ~2 B active): the architecture's facts
(library/models/spec.py).

ai-toolkit trains it (extensions_built_in/diffusion_models/nucleus_image, model.arch "nucleus_image"); musubi-tuner
and sd-scripts do not. Where a name below is ai-toolkit's, the comment says so; the kohya prefix and the ModelSpec
strings are ours in sd-scripts' / musubi-tuner's style.

The released transformer (NucleusAI/Nucleus-Image transformer/config.json; diffusers'
NucleusMoEImageTransformer2DModel): 32 single-stream blocks of width 2048 (16 heads x 128, 4 key-value heads), the
image tokens the only queries, each block projecting the text itself (encoder_proj) into its keys and values; blocks
0-2 have a dense SwiGLU MLP (`img_mlp.net`), blocks 3-31 a mixture of 64 experts with expert-choice routing (the
router `img_mlp.gate`, a shared expert `img_mlp.shared_expert.net`, the experts packed as two Parameters
`img_mlp.experts.gate_up_proj` / `down_proj`). Of its 16.92 B parameters 15.33 B are the packed experts, 1.60 B
Linear weights (on meta).
"""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# Default: every Linear under transformer_blocks, what ai-toolkit's LoRA wraps there (transformer_only: the Linears
# under its get_transformer_block_names ["transformer_blocks"]), in diffusers' module names (the model's own):
#   attn     the image side of the attention: attn.to_q / to_k / to_v / to_out.0
#   context  the text side of each block: encoder_proj (text 4096 -> 2048) and attn.add_k_proj / add_v_proj
#   mod      the block's modulation img_mod.1 (trained by default, as ai-toolkit does; train_modulation=false
#            leaves it out)
#   mlp      the dense blocks' img_mlp.net.0.proj / net.2 and the MoE blocks' shared expert's (same names under
#            img_mlp.shared_expert)
#   router   the MoE router img_mlp.gate (Linear [64, 2 x 2048] over the timestep embedding and the unmodulated
#            tokens). On by default, as ai-toolkit's LoRA module trains it where a config names no
#            network_kwargs.ignore_if_contains (so a translated ai-toolkit config trains the modules ai-toolkit
#            trained; 7.6 M weights, 0.5% of the Linears). A LoRA here moves the expert-choice routing: each expert
#            takes its top-k tokens by the router's softmax, so a router delta changes which tokens every expert
#            (and the unadapted expert weights) sees, a discrete change the gradient only reaches through the
#            picked tokens' gating weights. ai-toolkit's UI preset for Nucleus-Image ignores img_mlp.gate (and
#            img_mlp.experts): `router_dim=0` trains as that preset does.
#   experts  the routed experts' packed weights img_mlp.experts.gate_up_proj [E, 2048, 2688] and down_proj
#            [E, 1344, 2048] (Parameters used as x @ W[e]: networks/lora_packed.py, one rank-r delta per expert in
#            PEFT's ParamWrapper layout; fp8-stored experts too). OFF by default, on with experts_dim (block_indices
#            apply): the 64 experts of a weight each get their own factors, so a rank-r LoRA of the 29 MoE blocks
#            holds 29 x 64 x r x (2688 + 2048 + 2048 + 1344) = 15,085,568 r weights: at rank 16 241 M, a 483 MB
#            file in bf16 (30.2 MB per rank), where the default targets (every block Linear) at rank 16 are
#            24.5 M, 49 MB. It does not touch the routing: the router img_mlp.gate is its own type and reads the
#            block's input, so an experts LoRA changes what each expert computes on the tokens it is given, never
#            which tokens (later blocks' routers see the changed residual stream, as after any LoRA).
# The embedders and the final layer take a rank through in_dims, in this order: img_in, time_embedding
# (time_text_embed.timestep_embedder.linear_1 / _2), final_layer (norm_out.linear, proj_out).
LORA = S.LoRATargets(
    targets={
        "attn": r"transformer_blocks\.(?P<block>\d+)\.attn\.(to_q|to_k|to_v|to_out\.0)",
        "context": r"transformer_blocks\.(?P<block>\d+)\.(encoder_proj|attn\.add_k_proj|attn\.add_v_proj)",
        "mod": r"transformer_blocks\.(?P<block>\d+)\.img_mod\.1",
        "mlp": r"transformer_blocks\.(?P<block>\d+)\.img_mlp\.(shared_expert\.)?net\.(0\.proj|2)",
        "router": r"transformer_blocks\.(?P<block>\d+)\.img_mlp\.gate",
        "experts": r"transformer_blocks\.(?P<block>\d+)\.img_mlp\.experts\.(gate_up_proj|down_proj)",
        "img_in": r"img_in",
        "time_embedding": r"time_text_embed\.timestep_embedder\.linear_[12]",
        "final_layer": r"norm_out\.linear|proj_out",
    },
    block_args={"block_indices": "block"},
    kohya_prefix="lora_unet",  # ours, as for the other diffusers-named models: lora_unet_transformer_blocks_0_attn_to_q
    modulation_types=("mod",),
    modulation_default=True,  # ai-toolkit trains img_mod.1 with the rest of the blocks' Linears
    in_dim_types=("img_in", "time_embedding", "final_layer"),
    packed_types=("experts",),  # experts_dim turns them on
    extra_args=("in_dims",),  # those types' ranks, in in_dim_types' order (as FLUX.1's in_dims)
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# diffusers' module names in every layout: kohya lora_unet_*, PEFT transformer.* (diffusers has no Nucleus-Image
# LoRA loader mixin: NucleusMoEImageTransformer2DModel.load_lora_adapter, PeftAdapterMixin, reads it) and
# ai-toolkit's `diffusion_model.<diffusers name>.lora_A/B` (its convert_lora_weights_before_save; what a ComfyUI
# loader would read: our ComfyUI snapshot has no Nucleus-Image model, unverified): converting changes the prefix
# only. Markers are names only Nucleus-Image has ('_'-flattened): the per-block text projection `encoder_proj`, the
# shared expert and the packed experts (an experts LoRA's modules: the weights' paths, img_mlp.experts.gate_up_proj;
# its header says their expert count, networks/lora_files.py PACKED_EXPERTS_KEY). Its attention, img_mod.1 and the
# dense blocks' img_mlp.net are Qwen-Image's names too: Qwen-Image's markers leave those blocks out
# (qwen_image/spec.py), and Nucleus-Image is registered before Qwen-Image (registry.py: lora_info tries its names
# first). The router's `img_mlp_gate` begins Qwen-Image-2.1's
# `img_mlp_gate_layer` / `gate_up`: lora_info's regex anchors it, the substring markers leave it out.
LORA_FILES = S.LoRAFiles(
    markers=("_encoder_proj", "_img_mlp_shared_expert_", "_img_mlp_experts_"),
    # ours (nucleus-image) and ai-toolkit's nucleus_image (separators aside); our modelspec nucleus-image/lora
    model_versions=("nucleus-image",),
    block_pattern=r"(transformer_blocks)[._](\d+)[._]",
    module_paths="library.models.nucleus_image.lora_files:module_paths",
    layouts=("kohya", "diffusers", "comfy"),
    info_markers=(("diffusers", r"transformer_blocks_\d+_(encoder_proj|img_mlp_gate|img_mlp_shared_expert_net_"
                                r"(0_proj|2)|img_mlp_experts_(gate_up|down)_proj)$"),),
    info_blocks=(("block", r"(?<!single_)transformer_blocks_(\d+)_"),),
    width_modules=r"attn_to_[qkv]|attn_add_[kv]_proj|img_mod_1|img_mlp_(shared_expert_)?net_0_proj",
    releases=(S.Release("Nucleus-Image", 2048, {"block": 32}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# As Qwen-Image's: the embedders (img_in, the timestep MLP), the final layer (norm_out's modulation, proj_out) stay
# bf16; txt_norm (an RMSNorm) and the q/k norms are no Linears, never fp8. Kept too: each MoE block's router
# img_mlp.gate (7.6 M weights in all, 0.5% of the Linears): its softmax picks which tokens each expert takes (a
# top-k), so an fp8 error there changes the routing itself. The per-block modulation img_mod.1 (537 M weights, a
# third of the Linears) follows fp8.QUANTIZE_MODULATION as every family's. The packed experts (no Linears: a
# PackedWeights, precision/fp8_packed.py) are stored in fp8 too, each expert as FP8Linear's weight: fp8_scaled holds
# their 15.3 B weights in 15.8 GB (1.03 bytes a weight) where bf16 takes 30.7 GB.
# An fp8 base moves the routing itself: the rounding upstream of the router flips which tokens an expert's top-k
# takes. On the tiny model against the float32 one (tests/test_nucleus_image_model.py) fp8_scaled is 0.192 off
# (its experts alone 0.119, its Linears alone 0.167; bf16 0.093; all dense 0.055); a LoRA's effect on an fp8 base
# differs from the bf16 base's by 0.35 (fp8) / 0.37 (fp8_scaled) relative in fp32 compute, 0.31-0.39 over five random
# LoRAs (0.36 both with the experts bf16), where the same model all dense differs by 0.07
# (tests/test_precision_matrix.py).
FP8 = S.FP8Rules(
    keep=(r"img_in", r"time_text_embed\..*", r"norm_out\..*", r"proj_out", r".*\.img_mlp\.gate"),
    modulation=(r".*\.img_mod\.1",),
    stored={"diffusers": S.STORED_FP8},  # a folder or a single file in the folder's names, nothing fused
)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# NucleusMoEImagePipeline: sigmas linspace(1, 1/N, N) through FlowMatchEulerDiscreteScheduler, whose released config
# has shift 1.0 and use_dynamic_shifting false (the mu the pipeline computes is not read): no shift at any size,
# mu = ln 1 = 0. ai-toolkit's scheduler_config for it is the same (shift 1.0, no dynamic shifting), so training
# draws the logit-normal sigma unshifted: the same draw as ai-toolkit's generic default timestep_type "sigmoid"
# (TrainConfig). Its UI's preset for Nucleus-Image sets timestep_type "linear", uniform sigmas: timestep_sampling =
# "uniform" draws those.
SAMPLING = S.Sampling(method="nucleus_shift", shift=1.0)


# -- memory planner shapes and presets
# The preset plans 16.9 B parameters, 15.3 B of them the packed experts: bf16 does not fit a 24 GB card without block
# swap; fp8 / fp8_scaled store the experts in fp8 as the Linears (fp8_packed), nf4 / nf4_dq / int8 in their format
# (bnb_weights.packed_shapes): the base 8.93 / 8.20 / 15.84 GiB (29.45 / 30.08 GiB while they stayed bf16); nf4 fits
# a 16 GB card with checkpointing and no swap (planned peak 10.5 GiB).
# tools/plan_memory.py --preset nucleus-image at 1024 px, batch 1, rank 16: the base 31.5 GiB in bf16, 16.3 GiB in
# fp8_scaled (15.8 in fp8); the training step 33.1 / 17.8 GiB with checkpointing; on 24 GB fp8_scaled with
# checkpointing and no swap (peak 17.8 GiB; samples 17.6 with the VAE decoding in tiles), bf16 with checkpointing and
# blocks_to_swap 13 (peak 21.3 GiB, 13.9 GiB of host memory); on 16 GB fp8_scaled with checkpointing and 8 (peak
# 14.5 GiB) and vae_batch_size 3; on 48 GB none (bf16 with checkpointing 33.1 GiB). Caching: Qwen3-VL-8B's 29 layers
# 11.6 GiB in bf16, the VAE's encode (batch 4) 15.6 GiB.
# Captions vary in length (each caption's chat text, a batch padded with a mask): the plan sizes 512 tokens.
# The text encoder as load_nucleus_text_encoder reads Qwen3-VL-8B: the embeddings, the first 29 of 36 decoder
# layers (hidden_states[-8]) and the final norm, no head, no vision (fp8: its decoder Linears, one scale per 64
# weights): 29 x 192,946,432 + 622,329,856 + 4,096.
_QWEN3_VL_8B_29_LAYERS = S.TextWeights(6_217_780_480, fp8_weights=5_595_201_536, fp8_scales=87_425_024)
PLANNER = S.Planner(
    transformer="library.models.nucleus_image.model:NucleusImage",
    text_tokens=512,
    presets={"nucleus-image": S.PlannerPreset("nucleus_image", "library.models.nucleus_image.model:NUCLEUS_IMAGE",
                                              {"text_encoder": _QWEN3_VL_8B_29_LAYERS})},
)


# -- tiny models (tests, quickstart); Qwen-Image's tiny VAE is the VAE (the same AutoencoderKLQwenImage)
TINY = S.TinySpec(
    writers=("library.models.nucleus_image.tiny:write_nucleus_image",
             "library.models.nucleus_image.tiny:write_nucleus_image_text_encoder"),
    transformer="nucleus_image",
    config_files={"ae": "qwen_image_vae", "text_encoder": "nucleus_image_text_encoder"},
)


# -- the training config's keys of its text encoder files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen3-VL-8B (the repo's text_encoder/ folder with processor/ beside it)"),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): ours in sd-scripts' style (its sai_model_spec
# ARCH_ names are lowercase and hyphenated, "hunyuan-image-2.1", "lumina-2"; its IMPL_ a URL, the model card's where
# no code base is the reference, IMPL_CHROMA): none of the peers that write modelspec trains Nucleus-Image, and
# ai-toolkit writes ss_base_model_version "nucleus_image".
MODELSPEC = {"nucleus-image": S.ModelSpecNames("nucleus-image", "https://huggingface.co/NucleusAI/Nucleus-Image")}


SPEC = S.ArchSpec(
    arch="nucleus_image",
    title="Nucleus-Image",
    names=(r"nucleus[-_ ]?(moe[-_ ]?)?image",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.nucleus_image.checkpoint:load_nucleus_image",
                                   random_inputs="library.models.nucleus_image.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.nucleus_image.learned:LEARNED",
    default_config="nucleus_image.toml",
    config_keys=CONFIG_KEYS,
    # NucleusMoEImagePipeline.__call__'s defaults: 50 steps, CFG guidance_scale 4.0 (above 1) with the negative
    # prompt "", the guided prediction rescaled per token to the conditional one's norm
    sample_steps={"nucleus-image": 50},
    sample_guidance={"nucleus-image": 4.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch; its get_bucket_divisibility: "16 for the VAE, 2 for patch size" (32)
    peer_bucket_steps={"ai-toolkit": 32},
    # (ai-toolkit's training scheduler: CustomFlowMatchEulerDiscreteScheduler at shift 1.0, no dynamic shifting: its
    # shift timestep types pick uniformly among evenly spaced sigmas, unshifted)
    peer_models={"ai-toolkit": {"nucleus_image": {"model_type": "nucleus_image", "fixed_shift": "1.0"}}},
    masks_text_padding=True,  # the pipeline passes the prompt's attention mask to the transformer
)
