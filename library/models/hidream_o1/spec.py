"""HiDream-O1-Image (HiDream-ai, 2026: Full and Dev share one architecture): a pixel-space model whose denoiser is
Qwen3-VL-8B's language model (36 layers of width 4096) reading the prompt's token ids, a timestep token and 32 x 32
pixel patches (a bottleneck patch embedder in, one Linear out, no adaLN); the architecture's facts
(library/models/spec.py).

musubi-tuner trains it (hidream_o1_train_network.py, networks.lora_hidream_o1) and ai-toolkit (arch hidream_o1);
ComfyUI runs it. Our modules keep the Comfy-Org single file's names (model.language_model.layers.0.self_attn.q_proj,
model.x_embedder.proj1, model.final_layer2.linear), which are musubi-tuner's module paths: its kohya names are ours.
"""

from library.models import spec as S

# -- LoRA targets and key names (networks/)
# musubi-tuner's text-to-image default (lora_hidream_o1: the decoder layers' attention and MLP Linears, the patch
# embedder's two Linears and the final layer; 255 modules); the timestep MLP only with a rank of its own, as its load
# list has it; embed_tokens and the vision tower never (the tower runs only with reference images).
_LAYER = r"model\.language_model\.layers\.(?P<layer>\d+)\."
LORA = S.LoRATargets(
    targets={
        "attn": _LAYER + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)",
        "mlp": _LAYER + r"mlp\.(gate_proj|up_proj|down_proj)",
        "x_embedder": r"model\.x_embedder\.(proj1|proj2)",
        "final_layer": r"model\.final_layer2\.linear",
        "t_embedder": r"model\.t_embedder1\.mlp\.(0|2)",
    },
    block_args={"block_indices": "layer"},
    kohya_prefix="lora_unet",  # musubi-tuner's: lora_unet_model_language_model_layers_0_self_attn_q_proj
    in_dim_types=("t_embedder",),
    type_groups={"embedders": ("x_embedder", "final_layer")},
)


# -- LoRA files: converters' and inspectors' key tables (tools/)
# kohya lora_unet_model_* (musubi-tuner's, ours) and ai-toolkit's / ComfyUI's diffusion_model.* (ai-toolkit drops the
# root's `model.`: diffusion_model.language_model.layers.0.self_attn.q_proj): lora_files.py maps the prefix.
LORA_FILES = S.LoRAFiles(
    markers=("model_x_embedder_proj", "model_final_layer2_linear", "x_embedder_proj1", "final_layer2_linear",
             "model_language_model_layers_"),
    layouts=("kohya", "comfy"),
    model_versions=("hidream-o1", "hidream_o1"),
    block_pattern=r"language_model[._](layers)[._](\d+)[._]",
    module_paths="library.models.hidream_o1.lora_files:module_paths",
    comfy_map="library.models.hidream_o1.lora_files:comfy_module_map",  # ComfyUI's / ai-toolkit's names read as ours
    comfy_names="library.models.hidream_o1.lora_files:comfy_module",  # --to comfy writes them
    info_markers=(("released", r"language_model_layers_\d+_(self_attn|mlp)_"),),
    info_blocks=(("layer", r"language_model_layers_(\d+)_"),),
    width_modules=r"self_attn_[qo]_proj|mlp_(gate|up)_proj",
    releases=(S.Release("HiDream-O1-Image (Full / Dev)", 4096, {"layer": 36}),),
)


# -- fp8: modules kept in high precision (library/precision/fp8.py)
# The patch embedder, the timestep MLP and the final layer (the pixels' way in and out, the time) stay bf16, as every
# family's embedders; the decoder layers' Linears go to fp8 (embed_tokens is an Embedding: never quantized).
FP8 = S.FP8Rules(
    keep=(r"model\.x_embedder\..*", r"model\.t_embedder1\..*", r"model\.final_layer2\..*"),
    stored={"released": S.STORED_FP8},
)


# -- timestep sampling and shift defaults (library/models/flow_matching.py)
# Full's pipeline samples with a constant shift 3 (FlowUniPCMultistepScheduler(shift=3), use_dynamic_shifting off):
# HiDream-I1's constants, so its method name; training draws sigma uniformly by default (the family's
# default_timestep_sampling: musubi-tuner's recommended draw). Dev runs its own fixed timesteps (family.py).
SAMPLING = S.Sampling(method="hidream_shift", shift=3.0)


# -- memory planner shapes and presets
# A caption is its template + prompt + boi + tms ids (the prompt + 10 tokens); 128 plans a long caption. No text
# encoder: the ids enter the transformer (its embed_tokens).
PLANNER = S.Planner(
    transformer="library.models.hidream_o1.model:HiDreamO1",
    text_tokens=128,
    presets={"hidream-o1": S.PlannerPreset("hidream_o1", "library.models.hidream_o1.model:HIDREAM_O1", {},
                                           attributes={"version": "hidream-o1-full"})},
)


# -- tiny models (tests, quickstart)
TINY = S.TinySpec(
    writers=("library.models.hidream_o1.tiny:write_hidream_o1",),
    transformer="hidream_o1",
    config_files={"tokenizer": "hidream_o1_tokenizer"},
)


# -- the training config's keys of its files and release (library/training/config.py)
CONFIG_KEYS = (
    S.ConfigKey("tokenizer", str, "hidream_o1: the HiDream-O1 processor's tokenizer folder (default: the model's HF "
                                  "repo folder, or a tokenizer/ folder beside ComfyUI's single file)"),
    S.ConfigKey("model_version", str, "hidream_o1: hidream-o1-full or hidream-o1-dev (default: the file or folder "
                                      "name's dev, else full)"),
    # musubi-tuner's options of the same names; the model learns the noise it is trained on, so a LoRA trained at
    # another scale renders right at that scale only (renders: its header records them)
    S.ConfigKey("noise_scale_start", float, "hidream_o1: the noise's scale at sigma 1, in training and samples (x_t = "
                                            "(1 - sigma) x0 + sigma s n; default: the release's, Full 8.0, Dev 7.5)",
                renders=True),
    S.ConfigKey("noise_scale_end", float, "hidream_o1: the noise's scale at sigma 0 (linear between; default: "
                                          "noise_scale_start's where it is set, else the release's)", renders=True),
    S.ConfigKey("noise_clip_std", float, "hidream_o1: the noise clamped to +- this many of its stds, 0 none (default: "
                                         "the release's, Full 0, Dev 2.5)", renders=True),
)


# -- ModelSpec names of its LoRAs (training/saves.py lora_metadata): musubi-tuner's ARCH_HIDREAM_O1 / IMPL_HIDREAM_O1
MODELSPEC = {"hidream-o1": S.ModelSpecNames("HiDream-O1-Image", "https://github.com/HiDream-ai/HiDream-O1-Image")}


# -- the peers' names and options (tools/convert_config.py, library/training/peers/)
FULL, DEV = "hidream-o1-full", "hidream-o1-dev"  # family.py's releases (model_version)
# each release's training / sampling noise: (scale at sigma 1, scale at sigma 0, clip in noise stds or 0: none)
NOISE = {FULL: (8.0, 8.0, 0.0), DEV: (7.5, 7.5, 2.5)}
NOISE_KEYS = ("noise_scale_start", "noise_scale_end", "noise_clip_std")  # the config's, each None: the release's
# musubi-tuner's hidream_o1_train_network.py: --model_type full / dev (default full) is the release; its loss is the
# MSE of the predicted x0 and it takes weighting_scheme none only; its resolution shifts (flux_shift ...) read the
# pixel-patch cache [B, H/32, W/32, 3072] as latents whose height and width are its last two sides; its pixel buckets
# step 32 (BucketSelector's RESOLUTION_STEPS_HIDREAM_O1).
MUSUBI = S.MusubiModels(
    script="hidream_o1_train_network.py",
    lora_module="networks.lora_hidream_o1",
    model_type="hidream_o1",
    versions={"full": {"model_type": "hidream_o1", "model_version": FULL},
              "dev": {"model_type": "hidream_o1", "model_version": DEV}},
    version_key="model_type",
    default_version="full",
    weighting={"none": "sigma_sq"},
    weighting_note="its loss is the MSE of the predicted x0: ours' velocity loss x sigma^2 (sigma_sq)",
    same_args=("noise_scale_start", "noise_scale_end", "noise_clip_std"),  # each unset: the release's, as ours
    other_draws="its resolution shifts read this model's pixel-patch cache (the width in 32 px patches and a patch's "
                "3072 values) as the latents' height and width: a shift no image size gives, which ours has not",
    ignored_args={"skip_t2i_visual_dummy": "a dummy vision-tower pass for FSDP's gradients: ours runs no vision tower "
                                           "for text-to-image",
                  **dict.fromkeys(("dino_loss_backend", "dino_loss_model_type", "dino_loss_layer",
                                   "dino_loss_feature_mode", "dino_loss_resize", "dino_loss_use_gram",
                                   "dino_loss_no_norm", "dino_loss_every_n_steps"),
                                  "read with dino_loss_weight only (its line says what became of it)")},
)
PEER_OPTIONS = {
    "musubi-tuner": {
        "task": S.PeerFixed("ours trains text-to-image: its i2i (reference images through the vision tower, their "
                            "modules in the LoRA) is not ours", ours="t2i"),
        "dino_loss_weight": S.PeerFixed("SenseCraft's DINOv3 perceptual loss on the predicted pixels: ours has none",
                                        ours=0.0),
    },
    # ai-toolkit's HidreamO1Model: model_kwargs.noise_scale (8.0 unset) scales the noise of either release, never
    # clipped (its HidreamO1FlowmatchScheduler.add_noise; Dev's too, whose release clips); noise_scale_inference its
    # samples'; is_comfy_weight how a full fine-tune is saved
    "ai-toolkit": {
        "model.model_kwargs.noise_scale": S.PeerAsKeys(
            "ai-toolkit scales the noise of either release by it, unclipped", key="noise_scale_start",
            with_keys={"noise_clip_std": 0.0}, peer_default=8.0,
            released={release: {"noise_scale_start": start, "noise_clip_std": clip}
                      for release, (start, _, clip) in NOISE.items()}),
        "model.model_kwargs.noise_scale_inference": S.PeerFixed("its samples' starting noise: ours' samples start "
                                                                "from the training noise's (noise_scale_start)"),
        "model.model_kwargs.is_comfy_weight": S.PeerFixed("how its full fine-tune saves the model: ours trains a "
                                                          "LoRA"),
    },
}


SPEC = S.ArchSpec(
    arch="hidream_o1",
    title="HiDream-O1-Image",
    names=(r"hi[-_ ]?dream[-_ ]?o1",),
    lora=LORA,
    lora_files=LORA_FILES,
    fp8=FP8,
    sampling=SAMPLING,
    transformer=S.TransformerHooks(load="library.models.hidream_o1.checkpoint:load_hidream_o1",
                                   random_inputs="library.models.hidream_o1.model:random_inputs"),
    planner=PLANNER,
    tiny=TINY,
    default_config="hidream_o1.toml",
    config_keys=CONFIG_KEYS,
    # the pipelines' defaults (musubi-tuner's hidream_o1_utils, the official inference.py): Full 50 steps at CFG 5.0
    # against " "; Dev 28 steps on its fixed timesteps without guidance
    sample_steps={"hidream-o1-full": 50, "hidream-o1-dev": 28},
    sample_guidance={"hidream-o1-full": 5.0, "hidream-o1-dev": 0.0},
    modelspec=MODELSPEC,
    peer_bucket_steps={"ai-toolkit": 32, "musubi-tuner": 32},  # both step 32 px: the patch
    # ai-toolkit's LoRA (transformer_only, its default) wraps the decoder layers' Linears only (its
    # get_transformer_block_names: model.language_model.layers), so ours leaves the patch embedder and final layer
    # out; off (its UI's job for this model), every Linear of Qwen3VLForConditionalGeneration: the timestep MLP too,
    # and the vision tower's and lm_head, which a text-to-image step never runs (its UI leaves them out by name)
    peer_models={"ai-toolkit": {"hidream_o1": {"model_type": "hidream_o1", "network_args": "embedders_dim=0",
                                               "whole_network_args": "t_embedder_dim={network_dim}",
                                               "idle_modules": "visual patch_embed lm_head", "lokr_format": "peft"}},
                 "musubi-tuner": MUSUBI},
    peer_options=PEER_OPTIONS,
)
