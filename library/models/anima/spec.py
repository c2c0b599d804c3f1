"""Anima (CircleStone Labs' 2 B anime model: NVIDIA's Cosmos-Predict2 MiniTrainDIT with an LLM adapter from
Qwen3-0.6B onto T5-token queries, the Qwen-Image VAE): the architecture's facts (library/models/spec.py).

sd-scripts trains it (anima_train_network.py, networks.lora_anima), and ai-toolkit (model.arch "anima", on
diffusers' CosmosTransformer3DModel + AnimaTextConditioner); musubi-tuner does not. Our modules keep the released
single file's names (`net.` stripped: blocks.0.self_attn.q_proj, llm_adapter.blocks.0.cross_attn.k_proj), which
sd-scripts' kohya files and ComfyUI's `diffusion_model.` files use; diffusers renames them (lora_files.py).
"""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# sd-scripts' default: every Linear of the 28 blocks but the adaLN modulation (its exclude pattern
# `.*(_modulation|_norm|_embedder|final_layer).*`): self-attention, cross-attention and the MLP. The modulation
# (blocks.N.adaln_modulation_*.1 / .2: the adaLN-LoRA's 2048 -> 256 -> 6144 pair per sub-layer) trains with
# train_modulation. The LLM adapter (6 blocks that turn Qwen3's states into the cross-attention's 512 tokens)
# trains only when given a rank (`adapter_dim`, as sd-scripts' train_llm_adapter=true): it is the text side, which a
# style or character LoRA rarely needs, and ComfyUI loads its LoRA keys (`diffusion_model.llm_adapter.*`). The
# embedders and the final layer take a rank through in_dims (x_embedder, t_embedder, final_layer).
_ATTN = r"(q_proj|k_proj|v_proj|output_proj)"
LORA = S.LoRATargets(
    targets={
        "attn": rf"blocks\.(?P<block>\d+)\.self_attn\.{_ATTN}",
        "cross_attn": rf"blocks\.(?P<block>\d+)\.cross_attn\.{_ATTN}",
        "mlp": r"blocks\.(?P<block>\d+)\.mlp\.(layer1|layer2)",
        "mod": r"blocks\.(?P<block>\d+)\.adaln_modulation_(self_attn|cross_attn|mlp)\.(1|2)",
        "adapter": r"llm_adapter\.blocks\.\d+\.((self_attn|cross_attn)\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(0|2))",
        "x_embedder": r"x_embedder\.proj\.1",
        "t_embedder": r"t_embedder\.1\.linear_[12]",
        "final_layer": r"final_layer\.(adaln_modulation\.(1|2)|linear)",
    },
    block_args={"block_indices": "block"},
    kohya_prefix="lora_unet",  # sd-scripts' LORA_PREFIX_ANIMA: lora_unet_blocks_0_self_attn_q_proj
    modulation_types=("mod",),
    in_dim_types=("adapter", "x_embedder", "t_embedder", "final_layer"),
    extra_args=("in_dims",),  # those types' ranks, in in_dim_types' order (as FLUX.1's in_dims)
    diffusers_module_map="library.models.anima.lora_files:module_map_of_config",
    diffusers_blocks=("transformer_blocks.", "text_conditioner.", "patch_embed.", "time_embed.", "norm_out.",
                      "proj_out"),
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# Names only Anima has, ours ('_'-flattened: the Cosmos names) and diffusers' (attn1 / attn2 of
# transformer_blocks, the adaLN as norm1-3.linear_1/2, ff.net; the adapter as text_conditioner).
LORA_FILES = S.LoRAFiles(
    markers=("_self_attn_output_proj", "_cross_attn_output_proj", "_mlp_layer1", "_mlp_layer2",
             "adaln_modulation_self_attn", "adaln_modulation_cross_attn", "adaln_modulation_mlp", "llm_adapter_",
             "_attn1_to_", "_attn2_to_", "text_conditioner_", "t_embedder_1_linear_"),
    model_versions=("anima",),  # ours (anima) and ai-toolkit's anima; sd-scripts' modelspec anima-preview/lora
    block_pattern=r"(transformer_blocks|blocks)[._](\d+)[._]",
    module_paths="library.models.anima.lora_files:module_paths",
    module_map="library.models.anima.lora_files:module_map_of_lora",
    diffusers_refuses="library.models.anima.lora_files:diffusers_refuses",  # the adapter: text_conditioner there
    layouts=("kohya", "diffusers", "comfy"),
    info_markers=(("anima", r"(^|_)blocks_\d+_((self|cross)_attn_(q|k|v|output)_proj|mlp_layer[12])$|llm_adapter_"),
                  ("diffusers", r"transformer_blocks_\d+_attn[12]_to_(q|k|v|out_0)$|text_conditioner_")),
    info_blocks=(("block", r"(?:^|_)(?:transformer_)?blocks_(\d+)_"),),
    width_modules=r"(?<!adapter_)blocks_\d+_(self_attn_[qkv]_proj|cross_attn_q_proj|mlp_layer1|attn1_to_[qkv]"
                  r"|attn2_to_q|ff_net_0_proj)",
    releases=(S.Release("Anima", 2048, {"block": 28}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (x_embedder, t_embedder), the final layer and the whole LLM adapter stay bf16: the adapter's output
# is every block's cross-attention context (an fp8 error there reaches all 28 blocks at once), and it is small
# (about 6% of the 2 B weights). sd-scripts' fp8_scaled keeps the embedders, norms, adaLN and final layer. The
# blocks' attention and MLP Linears go to fp8; their adaLN-LoRA pairs are the per-block modulation.
FP8 = S.FP8Rules(
    keep=(r"x_embedder\..*", r"t_embedder\..*", r"final_layer\..*", r"llm_adapter\..*"),
    modulation=(r"blocks\.\d+\.adaln_modulation_(self_attn|cross_attn|mlp)\.(1|2)",),
    # one naming (the single file's), nothing fused: a stored scale stays its Linear's (checkpoint.load_anima)
    stored={"anima": S.STORED_FP8},
)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# The release's FlowMatchEulerDiscreteScheduler (ai-toolkit's copy of its scheduler_config: shift 3.0,
# use_dynamic_shifting false) over sigmas linspace(1, 1/N, N) (AnimaSetTimestepsStep): a constant shift k = 3 at
# every size, which samples use and ai-toolkit trains with. sd-scripts' Anima default draws `sigmoid` with
# discrete_flow_shift 1.0 (timestep_sampling = "sigmoid" here).
SAMPLING = S.Sampling(method="anima_shift", shift=3.0)


# -- memory planner shapes and presets
# The transformer's cross-attention always reads 512 tokens (the adapter's output padded to min_sequence_length);
# the cached Qwen3 states are each caption's own tokens (at most 512). Qwen3-0.6B as load_anima_text_encoder reads
# it: the embeddings, 28 decoder layers and the final norm (last_hidden_state), no head (its Qwen3Config on meta:
# 155.6 M embeddings, 440.4 M decoder Linears; fp8: those Linears, one scale per 64 weights).
_QWEN3_06B = S.TextWeights(596_049_920, fp8_weights=440_401_920, fp8_scales=6_881_280)
PLANNER = S.Planner(
    transformer="library.models.anima.model:Anima",
    text_tokens=512,
    presets={"anima": S.PlannerPreset("anima", "library.models.anima.model:ANIMA",
                                      {"text_encoder": _QWEN3_06B})},
)


# -- tiny models (tests, quickstart); Qwen-Image's tiny VAE is the VAE (the same AutoencoderKLQwenImage)
TINY = S.TinySpec(
    writers=("library.models.anima.tiny:write_anima", "library.models.anima.tiny_text:write_anima_text_encoder"),
    transformer="anima",
    config_files={"ae": "qwen_image_vae", "text_encoder": "anima_text_encoder"},
    sized="library.models.anima.tiny:write_sized_anima",
)


# -- the training config's keys of its text files (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen3-0.6B (the repo's text_encoder/ folder with tokenizer/ and t5_tokenizer/ "
                                     "beside it, or a single file such as ComfyUI's qwen_3_06b_base.safetensors)"),
    S.ConfigKey("t5_tokenizer", str, "anima: the T5 tokenizer folder (google/t5-v1_1-xxl's vocabulary; sd-scripts' "
                                     "--t5_tokenizer_path); default: t5_tokenizer/ beside the text encoder",
                model_types=("anima",)),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): sd-scripts' (ARCH_ANIMA_PREVIEW, IMPL_ANIMA)
MODELSPEC = {"anima": S.ModelSpecNames("anima-preview", "https://huggingface.co/circlestone-labs/Anima")}


# -- sd-scripts' names (library/training/peers/sd_scripts.py, sd_scripts_script.py): anima_train_network.py (its
# setup_parser: train_network's, add_dit_training_arguments, anima_train_utils.add_anima_training_arguments and
# --unsloth_offload_checkpointing; sd-scripts 48d368f) with networks.lora_anima. Its parser lacks the FLUX.1 script's
# model arguments (add_flux_train_arguments) and its weighting_scheme weighs the raw loss
# (compute_loss_weighting_for_anima: no model_prediction_type); it draws timesteps by `sigmoid` at scale 1.0, and
# discrete_flow_shift 1.0 where `shift` / `sigma` reads it.
_MEMORY = "memory and speed only: ours runs PyTorch's SDPA on whole batches and encodes latents once, before training"
SD_SCRIPTS = S.SdScriptsModels(
    script="anima_train_network.py", lora_module="networks.lora_anima", models={}, model_type="anima",
    sample_scale=7.5, sample_flags=("fs",),  # anima_train_utils: scale (--l) 7.5, no --g; flow_shift (--fs) 3.0
    lacks=("model_type", "clip_l", "t5xxl", "ae", "t5xxl_max_token_length", "apply_t5_attn_mask", "guidance_scale",
           "controlnet_model_name_or_path", "model_prediction_type", "split_mode"),
    files={"qwen3": "text_encoder", "vae": "ae", "t5_tokenizer_path": "t5_tokenizer"},
    defaults={"timestep_sampling": "sigmoid", "discrete_flow_shift": 1.0},  # (sigmoid_scale 1.0, as THEIR_DEFAULTS)
    # AnimaTokenizeStrategy's max lengths (default 512 each); ours: Qwen3 up to 512 tokens and 512 T5 ids, as the
    # pipeline (the adapter's 512 cross-attention tokens)
    token_lengths={"qwen3_max_token_length": 512, "t5_max_token_length": 512},
    ignored_args={
        **dict.fromkeys(("attn_mode", "split_attn", "vae_chunk_size", "vae_disable_cache",
                         "unsloth_offload_checkpointing"), _MEMORY),
        # get_anima_param_groups: anima_train.py's (full fine-tuning); the LoRA script reads none of them (its docs:
        # network_reg_lrs instead)
        **dict.fromkeys(("self_attn_lr", "cross_attn_lr", "mlp_lr", "mod_lr", "llm_adapter_lr"),
                        "its full fine-tuning's rates (anima_train.py): its LoRA training does not read it either"),
    },
    # documented as a separate adapter file; its load_anima_model (48d368f) reads the adapter from the DiT file
    # whatever it says, as ours does
    refused_args={"llm_adapter_path": "ours reads the LLM adapter from the DiT file (pretrained_model_name_or_path), "
                                      "as sd-scripts' loader does too; merge a separate adapter into that file"},
    lora_module_args=("train_llm_adapter", "exclude_patterns", "include_patterns", "rank_dropout", "module_dropout",
                      "verbose", "network_reg_lrs", "network_reg_dims", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
                      "loraplus_text_encoder_lr_ratio"),
    # LLMAdapterTransformerBlock's Linears at network_dim: ours' adapter type at that rank
    lora_switches={"train_llm_adapter": "adapter_dim={network_dim}"},
    fp8_base_off="sd-scripts turns fp8_base off for Anima (a warning; its docs: not supported) and trains in "
                 "mixed_precision",
    one_block_kind=True,  # 28 blocks of one kind: its N swaps N of them, as ours
)


SPEC = S.ArchSpec(
    arch="anima",
    title="Anima",
    names=(r"anima(?![a-z])",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.anima.checkpoint:load_anima",
                                   random_inputs="library.models.anima.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.anima.learned:LEARNED",
    default_config="anima.toml",
    config_keys=CONFIG_KEYS,
    # the modular pipeline's defaults: 50 steps (num_inference_steps), ClassifierFreeGuidance 4.0 with the
    # negative prompt "" (applied above 1)
    sample_steps={"anima": 50},
    sample_guidance={"anima": 4.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch; its get_bucket_divisibility 16 * 2 (the VAE's 8 x the 2 x 2 patch, times 2)
    peer_bucket_steps={"ai-toolkit": 32},
    # (ai-toolkit's training scheduler: CustomFlowMatchEulerDiscreteScheduler at shift 3.0, no dynamic shifting: its
    # shift timestep types pick uniformly among evenly spaced sigmas shifted by 3)
    peer_models={"ai-toolkit": {"anima": {"model_type": "anima", "lokr_format": "peft", "fixed_shift": "3.0"}},
                 "sd-scripts": SD_SCRIPTS},
)
