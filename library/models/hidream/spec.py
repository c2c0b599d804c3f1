"""HiDream-I1 (HiDream-ai's 17 B sparse DiT, April 2025: Full, Dev and Fast share it; 16 double-stream and 32
single-stream blocks of width 2560 whose image feed-forwards are mixtures of 4 experts (top 2) and a shared expert;
patch 2 on FLUX.1's VAE; text: T5-XXL's 128 tokens and Llama-3.1-8B-Instruct's states of every layer, each projected
per block; CLIP-L's and CLIP-G's pooled outputs): the architecture's facts (library/models/spec.py).

ai-toolkit trains it (arch "hidream"), SimpleTuner too; diffusers runs it (HiDreamImagePipeline) and ComfyUI. Our
modules keep the released names, which are diffusers' and ComfyUI's (double_stream_blocks.0.block.attn1.to_q,
single_stream_blocks.3.block.ff_i.experts.1.w2): every LoRA layout we write differs only by its prefix.
"""

from library.models import spec as S
from library.models.flux1.spec import T5_XXL_TEXT

# -- LoRA targets and key names (networks/)
# ai-toolkit's default (transformer_only: every Linear inside double_stream_blocks / single_stream_blocks): both
# streams' attention, the image stream's experts (routed and shared; the gate is a bare parameter, no Linear), the
# text stream's feed-forward and each block's adaLN modulation. Ours the same (modulation_default); the embedders,
# the caption projections and the final layer only with a rank of their own (in_dims types).
_DOUBLE = r"double_stream_blocks\.(?P<double>\d+)\.block\."
_SINGLE = r"single_stream_blocks\.(?P<single>\d+)\.block\."
_EXPERTS = r"ff_i\.(shared_experts|experts\.\d+)\.(w1|w2|w3)"
LORA = S.LoRATargets(
    targets={
        "img_attn": _DOUBLE + r"attn1\.(to_q|to_k|to_v|to_out)",
        "txt_attn": _DOUBLE + r"attn1\.(to_q_t|to_k_t|to_v_t|to_out_t)",
        "img_ff": _DOUBLE + _EXPERTS,
        "txt_ff": _DOUBLE + r"ff_t\.(w1|w2|w3)",
        "double_mod": _DOUBLE + r"adaLN_modulation\.1",
        "single_attn": _SINGLE + r"attn1\.(to_q|to_k|to_v|to_out)",
        "single_ff": _SINGLE + _EXPERTS,
        "single_mod": _SINGLE + r"adaLN_modulation\.1",
        "x_embedder": r"x_embedder\.proj",
        "t_embedder": r"t_embedder\.timestep_embedder\.(linear_1|linear_2)",
        "p_embedder": r"p_embedder\.pooled_embedder\.(linear_1|linear_2)",
        "caption_projection": r"caption_projection\.\d+\.linear",
        "final_layer": r"final_layer\.(linear|adaLN_modulation\.1)",
    },
    block_args={"train_double_block_indices": "double", "train_single_block_indices": "single"},
    kohya_prefix="lora_unet",  # lora_unet_double_stream_blocks_0_block_attn1_to_q: ComfyUI maps any lora_unet_ + key
    modulation_types=("double_mod", "single_mod"),
    modulation_default=True,
    in_dim_types=("x_embedder", "t_embedder", "p_embedder", "caption_projection", "final_layer"),
    type_groups={"attn": ("img_attn", "txt_attn", "single_attn"), "ff": ("img_ff", "txt_ff", "single_ff"),
                 "mod": ("double_mod", "single_mod"), "experts": ("img_ff", "single_ff")},
    extra_args=("train_blocks",),  # "all", "double" or "single"
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# One naming: kohya lora_unet_*, PEFT transformer.* (diffusers' HiDreamImageLoraLoaderMixin), ai-toolkit's and
# ComfyUI's diffusion_model.* (diffusers strips that prefix: _convert_non_diffusers_hidream_lora_to_diffusers).
LORA_FILES = S.LoRAFiles(
    markers=("double_stream_blocks_", "single_stream_blocks_", "_ff_i_experts_", "_ff_i_shared_experts_"),
    layouts=("kohya", "diffusers", "comfy"),
    # ours (hidream-i1-full / -dev / -fast) and ai-toolkit's get_base_model_version "hidream_i1"
    model_versions=("hidream",),
    block_pattern=r"(double_stream_blocks|single_stream_blocks)[._](\d+)[._]",
    module_paths="library.models.hidream.lora_files:module_paths",
    info_markers=(("released", r"(double|single)_stream_blocks_\d+_block_"),),
    info_blocks=(("double", r"double_stream_blocks_(\d+)_"), ("single", r"single_stream_blocks_(\d+)_")),
    width_modules=r"attn1_to_[qkv](_t)?|adaLN_modulation_1|ff_[it]_w[13]|experts_w[13]|experts_\d+_w[13]",
    releases=(S.Release("HiDream-I1 (Full / Dev / Fast)", 2560, {"double": 16, "single": 32}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The embedders (patches, timestep, pooled text), the 49 caption projections (each text token's way in, as other
# families' context embedders) and the final layer stay bf16; the MoE gate is a bare parameter (never quantized: a
# rounded gate would pick other experts). The per-block adaLN Linears follow fp8.QUANTIZE_MODULATION.
FP8 = S.FP8Rules(
    keep=(r"x_embedder\..*", r"t_embedder\..*", r"p_embedder\..*", r"caption_projection\..*", r"final_layer\..*"),
    modulation=(r".*\.adaLN_modulation\.1",),
    stored={"released": S.STORED_FP8},
)


# -- GGUF: ComfyUI-GGUF's "hidream" (tools/convert.py ModelHiDream detects caption_projection.0.linear.weight with
# double_stream_blocks.0.block.ff_i.shared_experts.w3.weight; keys_hiprec .ff_i.gate.weight, a Parameter its loader
# cannot read from BF16); its llama.cpp patch (tools/lcpp.patch, LLM_ARCH_HIDREAM) leaves p_embedder., t_embedder.,
# x_embedder., final_layer., .ff_i.gate.weight and caption_projection. unquantized
GGUF = S.GgufLayout("hidream", unquantized=("p_embedder.", "t_embedder.", "x_embedder.", "final_layer.",
                                            ".ff_i.gate.weight", "caption_projection."),
                    hiprec=(".ff_i.gate.weight",))


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# The releases' schedulers shift by a constant, no resolution shift (HiDreamImagePipeline computes a mu and passes
# it to none of them): Full's UniPCMultistepScheduler flow_shift 3.0, Fast's FlashFlowMatchEulerDiscreteScheduler
# shift 3.0, Dev's 6.0 (the family's inference_sampling). Training draws sigmoid(randn) shifted by k = 3, ai-toolkit's
# scheduler shift for it (its hidream_model.py scheduler_config), whichever release trains. The pipeline passes no
# sigmas: the scheduler spaces them (scheduler_spacing), as StableDiffusion3Pipeline's. Dev and Fast step with the
# flash scheduler on those sigmas (family.py integrate); Full with Euler, where its UniPC spaces its 50 sigmas up to
# 0.05 apart and ends at 0.06 (ours 0.009): a second-order solver ours has not.
SAMPLING = S.Sampling(method="hidream_shift", shift=3.0, scheduler_spacing=True)


# -- memory planner shapes and presets
# T5-XXL and Llama each pad to 128 tokens (the pipeline's max_sequence_length, ComfyUI's min_length); a caption's
# context in the transformer is 128 T5 + 128 x 2 Llama tokens (the last layer's, carried, and the block's own).
# Llama-3.1-8B-Instruct as the text encoder reads it: every layer, no LM head.
# CLIP-L and CLIP-G as Long-CLIP towers of 248 positions with their projections (bf16 under fp8), T5-XXL's encoder as
# load_t5 keeps it (FLUX.1's numbers), all counted on meta (text_encoder.hidream_text_weights).
_CLIP_L = S.TextWeights(123_781_632)
_CLIP_G = S.TextWeights(694_878_720)
_LLAMA_31_8B = S.TextWeights(7_504_924_672, fp8_weights=6_979_321_856, fp8_scales=109_051_904)
_TEXT = {"clip_l": _CLIP_L, "clip_g": _CLIP_G, "t5xxl": T5_XXL_TEXT, "llama": _LLAMA_31_8B}
PLANNER = S.Planner(
    transformer="library.models.hidream.model:HiDream",
    text_tokens=128,
    presets={"hidream-i1": S.PlannerPreset("hidream", "library.models.hidream.model:HIDREAM_I1", _TEXT)},
)


# -- tiny models (tests, quickstart); FLUX.1's tiny VAE is the VAE (the same AutoencoderKL)
TINY = S.TinySpec(
    writers=("library.models.hidream.tiny:write_hidream",
             "library.models.hidream.tiny_text:write_hidream_text_encoders"),
    transformer="hidream",
    config_files={"ae": "flux_vae_single", "clip_l": "hidream_clip_l", "clip_g": "hidream_clip_g",
                  "t5xxl": "hidream_t5xxl", "llama": "hidream_llama"},
    sized="library.models.hidream.tiny:write_sized_hidream",
)


# -- the training config's keys of its text files and release (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("clip_l", str, "CLIP-L (ComfyUI's clip_l_hidream.safetensors or the diffusers repo's text_encoder/)"),
    S.ConfigKey("clip_g", str, "CLIP-G (ComfyUI's clip_g_hidream.safetensors or the diffusers repo's "
                               "text_encoder_2/)"),
    S.ConfigKey("t5xxl", str, "T5-XXL (ComfyUI's t5xxl_*.safetensors or the diffusers repo's text_encoder_3/)"),
    S.ConfigKey("llama", str, "Llama-3.1-8B-Instruct (a transformers folder, or ComfyUI's "
                              "llama_3.1_8b_instruct_*.safetensors with the tokenizer beside)"),
    S.ConfigKey("model_version", str, "hidream: hidream-i1-full, hidream-i1-dev or hidream-i1-fast (default: the "
                                      "file or folder name's full / dev / fast, else full)"),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): no peer writes one (ai-toolkit's header has
# its base model version hidream_i1): ours in sd-scripts' style, one architecture for the three releases
MODELSPEC = {"hidream-i1": S.ModelSpecNames("hidream-i1", "https://github.com/HiDream-ai/HiDream-I1")}


SPEC = S.ArchSpec(
    arch="hidream",
    title="HiDream-I1",
    names=(r"hi[-_ ]?dream",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    gguf=GGUF,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.hidream.checkpoint:load_hidream",
                                   random_inputs="library.models.hidream.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    default_config="hidream.toml",
    config_keys=CONFIG_KEYS,
    # HiDreamImagePipeline's call per release (the model cards): Full 50 steps at CFG 5.0 with the empty negative
    # prompt; Dev 28 and Fast 16 steps without guidance (0: no negative prompt run)
    sample_steps={"hidream-i1-full": 50, "hidream-i1-dev": 28, "hidream-i1-fast": 16},
    sample_guidance={"hidream-i1-full": 5.0, "hidream-i1-dev": 0.0, "hidream-i1-fast": 0.0},
    modelspec=MODELSPEC,
    # ai-toolkit's model.arch "hidream" (its hidream_e1, the edit model, is not trained here) with its Llama:
    # model_kwargs.llama_model_path, else its LLAMA_MODEL_PATH unsloth/Meta-Llama-3.1-8B-Instruct (downloaded to
    # models/); its bucket divisibility
    peer_bucket_steps={"ai-toolkit": 16},
    # (its LoRA names the diffusers modules, ours: its example's ignore_if_contains ff_i.experts carries)
    # (ai-toolkit's training scheduler: CustomFlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    # no dynamic shifting: its shift timestep types pick uniformly among evenly spaced sigmas shifted by 3)
    peer_models={"ai-toolkit": {"hidream": {"model_type": "hidream", "llama": "unsloth/Meta-Llama-3.1-8B-Instruct",
                                            "same_module_names": "yes", "fixed_shift": "3.0"}}},
    learned="library.models.hidream.learned:LEARNED",  # the learned tiny base (learned.py; learned/hidream/)
)
