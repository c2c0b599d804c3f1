"""Ideogram 4: the architecture's facts (library/models/spec.py)."""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# diffusers' module names (model.py). ai-toolkit's Ideogram 4 LoRAs (the one peer layout diffusers reads,
# Ideogram4LoraLoaderMixin) train the blocks' attention (qkv fused, o), SwiGLU w1 / w2 / w3 and the
# per-block adaLN Linear; here the attention and MLP train by default and `adaln_modulation` with
# train_modulation / mod_dim (our default elsewhere, as musubi-tuner). Embedders and the final layer take
# a rank through in_dims: input_proj, llm_cond_proj, t_embedding (mlp_in, mlp_out), adaln_proj, final_layer.
LORA = S.LoRATargets(
    targets={
        "attn": r"layers\.(?P<block>\d+)\.attention\.(to_q|to_k|to_v|to_out\.0)",
        "mlp": r"layers\.(?P<block>\d+)\.feed_forward\.(w1|w2|w3)",
        "mod": r"layers\.(?P<block>\d+)\.adaln_modulation",
        "input_proj": r"input_proj",
        "llm_cond_proj": r"llm_cond_proj",
        "t_embedding": r"t_embedding\.(mlp_in|mlp_out)",
        "adaln_proj": r"adaln_proj",
        "final_layer": r"final_layer\.(linear|adaln_modulation)",
    },
    block_args={"block_indices": "block"},
    modulation_types=("mod",),
    in_dim_types=("input_proj", "llm_cond_proj", "t_embedding", "adaln_proj", "final_layer"),
    extra_args=("in_dims",),  # those types' ranks, in in_dim_types' order (as FLUX.1's in_dims)
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# diffusers module names in every layout: converting changes the prefix only. The blocks' names
# (layers.N.attention.to_q, feed_forward.w1..3) are Z-Image's too: names_of zimage, told apart by
# the modules only Ideogram 4 has (markers), else the header (model_versions); --model_type settles the rest.
# ai-toolkit's LoRAs (`diffusion_model.layers.N.attention.qkv` / `.o`, the original names) read as ours;
# `.o` is theirs only (Z-Image's original name is attention.out): its marker ends at the module name, as
# markers meet tensor keys (`..._attention_o_lora_down_weight`), so Z-Image's `_attention_out_` is no match.
LORA_FILES = S.LoRAFiles(
    # the blocks' adaLN by their layer (Anima's blocks.N.adaln_modulation_self_attn holds the rest)
    markers=("llm_cond_proj", "adaln_proj", "t_embedding_mlp_", *(f"layers_{n}_adaln_modulation" for n in range(64)),
             "_attention_o_"),
    names_of="zimage",
    model_versions=("ideogram4", "ideogram-4"),  # ours and ai-toolkit's ideogram4; musubi-tuner's modelspec Ideogram-4/lora
    block_pattern=r"(layers)[._](\d+)[._]",
    module_paths="library.models.ideogram4.lora_files:module_paths",
    comfy_map="library.models.ideogram4.lora_files:comfy_module_map",  # ai-toolkit's fused qkv / o read as ours
    # ComfyUI's model has the original fused names, which its key map takes alone: --to comfy writes them
    layouts=("kohya", "diffusers", "comfy"),
    comfy_fuse="library.models.ideogram4.lora_files:comfy_fused_map",
    info_markers=(("diffusers", r"llm_cond_proj|adaln_proj|t_embedding_mlp_|layers_\d+_adaln_modulation$"),
                  ("original", r"layers_\d+_attention_o$")),
    info_blocks=(("block", r"(?:^|_)layers_(\d+)_"),),
    width_modules=r"attention_(to_[qkv]|qkv|o)|feed_forward_w[13]",  # ai-toolkit's qkv and o: their down reads the width too
    releases=(S.Release("Ideogram 4", 4608, {"block": 34}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (patches, text features, time), the shared adaLN projection and the final layer; the
# blocks' Linears (attention, SwiGLU, adaLN) go to fp8, which are the ones the released BFL files store
# quantized (bfl_weights: the file decides for those).
FP8 = S.FP8Rules(
    keep=(r"input_proj", r"llm_cond_proj", r"t_embedding\..*", r"adaln_proj", r"final_layer\..*"),
    modulation=(r"layers\.\d+\.adaln_modulation",),
    # stored: none of these; the releases' own BFL fp8r / nvfp4 (precision/bfl_weights.py) are what its loader reads
)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# Ideogram4Pipeline: sigma = expit(mu + 1.5 z) quantiles with mu = 0.5 ln(H W / 512^2) (sampling.py); in
# tokens of 16 x 16 pixels, mu = 0.5 ln(tokens / 1024). The family draws training sigmas from that law
# (std 1.5) and samples with the pipeline's quantile schedule, unset or as timestep_sampling = "ideogram4_shift"
# (sigmoid_scale refused there: family.unread_training_keys); on other families that method's time shift
# by this mu of a sigmoid(randn) draw is the same law at std 1.
SAMPLING = S.Sampling(method="ideogram4_shift", mu="library.models.ideogram4.sampling:token_mu")


# -- memory planner shapes and presets
# Captions vary in length (we cache each one's real tokens; the pipeline pads to 2048): the plan sizes 512.
# The text encoder: Qwen3-VL-8B's language model, all 36 layers (the last tap is the last layer), no head.
# Qwen3-8B's dimensions (LLM(QWEN3_8B) on meta, lm_head aside; fp8 on every decoder Linear)
_QWEN3_VL_8B_LANGUAGE = S.TextWeights(7_568_405_504, fp8_weights=6_945_767_424, fp8_scales=108_527_616)
# Samples load the release's unconditional transformer beside the trained one: IDEOGRAM4's shapes in BFL fp8r
# (the blocks' Linears), the rest bf16, 8.93 GiB (tiny.quantized of the meta model's state dict).
_UNCONDITIONAL_FP8R = 9_583_360_256
PLANNER = S.Planner(
    transformer="library.models.ideogram4.model:Ideogram4",
    text_tokens=512,
    presets={"ideogram4": S.PlannerPreset("ideogram4", "library.models.ideogram4.model:IDEOGRAM4",
                                          {"text_encoder": _QWEN3_VL_8B_LANGUAGE},
                                          attributes={"unconditional_bytes": _UNCONDITIONAL_FP8R})},
)


# -- tiny models (tests, quickstart); FLUX.2's tiny VAE is the VAE (the same AutoencoderKLFlux2)
TINY = S.TinySpec(writers=(
    "library.models.ideogram4.tiny:write_ideogram4", "library.models.ideogram4.tiny:write_ideogram4_text_encoder",
), transformer="ideogram4", config_files={"ae": "flux2_vae", "text_encoder": "ideogram4_text_encoder"},
    sized="library.models.ideogram4.tiny:write_sized_ideogram4")


CONFIG_KEYS = (
    S.ConfigKey("text_encoder", str, "Qwen3-VL (the repo's text_encoder/ folder with tokenizer/ beside it)"),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): musubi-tuner's (ARCH_IDEOGRAM4, IMPL_IDEOGRAM4)
MODELSPEC = {"ideogram4": S.ModelSpecNames("Ideogram-4", "https://huggingface.co/Comfy-Org/Ideogram-4")}


# -- musubi-tuner's names (library/training/peers/musubi_tuner.py): its script draws ideogram4_shift by default
# (16 px per token-grid cell; another model's latents take none of it), without sigmoid_scale.
MUSUBI = S.MusubiModels(
    script="ideogram4_train_network.py",
    lora_module="networks.lora_ideogram4",
    model_type="ideogram4",
    token_grid=True,
    default_draw="ideogram4_shift",
    draws={"ideogram4_shift": S.PeerDraw("ideogram4_shift", elsewhere="Ideogram 4's law on another model's latents",
                                         reads_sigmoid_scale=False)},
    ignored_args=dict.fromkeys(("ideogram4_timestep_mu", "ideogram4_timestep_std"), "deprecated: musubi-tuner ignores it"),
)


SPEC = S.ArchSpec(
    arch="ideogram4",
    title="Ideogram 4",
    names=(r"ideogram[-_ ]?4",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.ideogram4.checkpoint:load_ideogram4",
                                   random_inputs="library.models.ideogram4.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    learned="library.models.ideogram4.learned:LEARNED",  # the learned tiny base (learned.py; learned/ideogram4/)
    default_config="ideogram4.toml",
    config_keys=CONFIG_KEYS,
    sample_steps={"ideogram4": 48},  # Ideogram4Pipeline
    sample_guidance={"ideogram4": 7.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch
    peer_bucket_steps={"ai-toolkit": 16},  # ai-toolkit's get_bucket_divisibility: 8 x 2
    # (ai-toolkit's training scheduler: CustomFlowMatchEulerDiscreteScheduler at shift 1.0, no dynamic shifting: its
    # shift timestep types pick uniformly among evenly spaced sigmas, unshifted)
    peer_models={"ai-toolkit": {"ideogram4": {"model_type": "ideogram4", "lokr_format": "peft", "fixed_shift": "1.0"}},
                 "musubi-tuner": MUSUBI},
)
