"""ai-toolkit's train section read into ours (library/training/peers/ai_toolkit.py names the keys and runs
the translation): the run length, optimizer and schedule, precision, timesteps and loss, EMA, output
preservation, and the training extras of ai-toolkit's that are not ours (each named with why)."""

from __future__ import annotations

from typing import Any

from library.training.peers.ai_toolkit_model import (Job, as_number, fixed_shift, one_of, our_key, read_as,
                                                     read_elsewhere, shift_method)
from library.training.peers.rules import KEPT, RENAMED, Line, Rule, custom, ignored, implied, unsupported


# ai-toolkit's optimizer names (toolkit/optimizer.py) -> ours, with the arguments it adds (eps=1e-6 where it passes it)
OPTIMIZERS = {
    "adamw": ("AdamW", {"eps": 1e-6}), "adam": ("Adam", {"eps": 1e-6}), "adamw8bit": ("AdamW8bit", {"eps": 1e-6}),
    "adam8bit": ("Adam8bit", {"eps": 1e-6}), "ademamix8bit": ("AdEMAMix8bit", {"eps": 1e-6}), "lion8bit": ("Lion8bit", {}),
    "prodigy": ("Prodigy", {"eps": 1e-6}), "dadaptation": ("DAdaptAdam", {"eps": 1e-6}), "adagrad": ("Adagrad", {}),
    "lion": ("lion_pytorch.Lion", {}),
    "adafactor": ("Adafactor", {"relative_step": False, "scale_parameter": False, "warmup_init": False}),
}
OWN_OPTIMIZERS = {"adam8": "ai-toolkit's own 8-bit Adam (nearest: AdamW8bit)", "adamw8": "ai-toolkit's own 8-bit "
                  "AdamW (nearest: AdamW8bit)", "prodigy8bit": "ai-toolkit's own 8-bit Prodigy (nearest: Prodigy)",
                  "dadaptationadam": "ai-toolkit builds DAdaptLion for it, with an eps it does not take",
                  "dadaptationlion": "ai-toolkit builds DAdaptLion with an eps it does not take"}
ADAPTIVE = ("Prodigy", "DAdaptAdam")  # ai-toolkit runs them at lr 1.0 where lr < 0.1


def _optimizer(t: Job, key: str, value: Any) -> None:
    name = str(value).lower()
    if name in OPTIMIZERS:
        ours, preset = OPTIMIZERS[name]
        t.set("optimizer_type", ours, key, value, RENAMED, "optimizer_type" + (
            f" (with ai-toolkit's {', '.join(f'{k}={v}' for k, v in preset.items())})" if preset else ""))
        t.optimizer_args = {**preset, **t.optimizer_args}
    else:
        t.refuse(key, value, OWN_OPTIMIZERS.get(name, "ai-toolkit's own optimizer: not ours"))


def _optimizer_params(t: Job, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{t.source}: train.optimizer_params must be a mapping (name: value), got {value!r}")
    t.optimizer_args.update(value)
    t.lines.append(Line(key, value, RENAMED, "optimizer_args"))


def _scheduler(t: Job, key: str, value: Any) -> None:
    """torch's schedulers over train.steps, as ai-toolkit builds them (toolkit/scheduler.py)."""
    params = dict(t.section("train").get("lr_scheduler_params") or {})
    params.pop("total_iters", None)
    name = str(value)
    if name == "constant" and params.get("factor", 1.0) == 1.0 and set(params) <= {"factor"}:
        t.set("lr_scheduler", "constant", key, value, KEPT, "lr_scheduler")
    elif name in ("cosine", "cosine_with_restarts") and not set(params) - {"T_max", "T_0"}:
        t.set("lr_scheduler", "cosine", key, value, RENAMED, "lr_scheduler = cosine (one cosine over the run, as torch's "
              "over train.steps)")
    elif name == "constant_with_warmup" and set(params) <= {"num_warmup_steps"}:
        t.set("lr_scheduler", name, key, value, KEPT, "lr_scheduler")
        t.set("lr_warmup_steps", params.get("num_warmup_steps", 1000), key, value, RENAMED, "lr_warmup_steps")
    elif name == "linear":
        t.refuse(key, value, "torch's LinearLR: the lr rises from lr/3 to lr over the run (ours decays to 0)")
    else:
        t.refuse(key, value, f"{name} with {params or 'no'} parameters: not a schedule of ours")


def _scheduler_params(t: Job, key: str, value: Any) -> None:
    t.drop(key, value, "read with train.lr_scheduler") if value else t.drop(key, value, "off")


def _accumulation(t: Job, key: str, value: Any) -> None:
    """gradient_accumulation: micro-batches per step, their gradients summed (SDTrainer.hook_train_loop runs their
    backwards without dividing), where ours averages them: the same step for Adam's kind but for the clip, so ours
    clips at max_grad_norm / it (_finish). The older gradient_accumulation_steps: its steps, saves, samples and lr
    schedule count micro-batches, and hook_train_loop zeroes the gradients as each begins, so an optimizer step
    trains on the last micro-batch alone: ours trains one per step, its counts divided by it (_finish)."""
    if value == -1:
        t.refuse(key, value, "a whole epoch per optimizer step: ours takes a number of micro-batches")
    elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{t.source}: {key.split(' (')[0]} must be a whole number >= 1, got {value!r}")
    elif value == 1:
        t.drop(key, value, "one micro-batch per step (ours too)")
    elif key.startswith("train.gradient_accumulation_steps"):
        t.micro_steps = value
        t.lines.append(Line(key, value, RENAMED, f"one micro-batch per step, train.steps, save_every, sample_every and "
                            f"the warmup / {value}", "ai-toolkit counts micro-batches with this key and zeroes the "
                            "gradients as each begins: each optimizer step trained on its last micro-batch alone"))
    else:
        t.summed_micro_batches = value
        t.set("gradient_accumulation_steps", value, key, value, RENAMED, "gradient_accumulation_steps")


def clipping(t: Job) -> None:
    """ai-toolkit's gradient clip as ours runs it (after every key is read): none for `adafactor` (hook_train_loop
    skips the clip for that name, as written); with gradient_accumulation N, the sum of N micro-batches' gradients
    clipped at max_grad_norm, which is their mean (ours' gradient) clipped at max_grad_norm / N."""
    given = t.section("train").get("optimizer", "adamw")
    norm = t.config.get("max_grad_norm", 1.0)  # ai-toolkit's default is ours
    if given == "adafactor":
        t.lines.append(Line("train.optimizer", given, RENAMED, "max_grad_norm = 0 (off: ai-toolkit clips no "
                            "adafactor gradients)"))
        t.config["max_grad_norm"] = 0.0
    elif t.summed_micro_batches > 1 and norm:
        n = t.summed_micro_batches
        t.lines.append(Line("train.gradient_accumulation", n, RENAMED, f"max_grad_norm = {norm} / {n} (ai-toolkit "
                            f"clips the sum of the {n} micro-batches' gradients, ours their mean)"))
        t.config["max_grad_norm"] = norm / n


def _ema(t: Job, key: str, value: Any) -> None:
    """ai-toolkit samples and saves the EMA of the weights; ours saves it beside as <output_name>_ema.safetensors."""
    if not value:
        t.drop(key, value, "off")
        return
    decay = (t.section("train").get("ema_config") or {}).get("ema_decay", 0.999)
    t.set("ema_decay", as_number(decay), key, value, RENAMED, "ema_decay and sample_with_ema (ai-toolkit saves the EMA "
          "as the LoRA: ours saves it beside, <output_name>_ema.safetensors)")
    t.config["sample_with_ema"] = True


def _ema_part(t: Job, key: str, value: Any) -> None:
    on = (t.section("train").get("ema_config") or {}).get("use_ema", False)
    t.drop(key, value, "read with train.ema_config.use_ema" if on else "use_ema is off")


def _preservation(t: Job, key: str, value: Any) -> None:
    """diff_output_preservation reads the trigger word (the process's, else its first dataset's)."""
    name = key.split(" (")[0].split(".")[-1]
    if not value:
        t.drop(key, value, "off")
        return
    t.set(name, True, key, value, KEPT, name)
    if name == "diff_output_preservation":
        datasets = [d for d in t.process.get("datasets") or [] if isinstance(d, dict)]
        trigger = t.process.get("trigger_word") or next((d["trigger_word"] for d in datasets if d.get("trigger_word")), None)
        if trigger:
            t.set("trigger_word", trigger, "trigger_word", trigger, KEPT, "trigger_word")


def _bias(t: Job, key: str, value: Any) -> None:
    """content_or_style (its UI's Timestep Bias): content = High Noise, style = Low Noise: ours' timestep_bias."""
    ours = {"content": "high_noise", "style": "low_noise"}.get(str(value))
    if ours:
        t.set("timestep_bias", ours, key, value, RENAMED, f"timestep_bias = {ours}")
    elif value == "balanced":
        t.drop(key, value, "ours draws timesteps the same way for every image (timestep_bias = \"none\")")
    else:
        t.refuse(key, value, "expected balanced, content or style")


# timestep_type "weighted": its table of 1000 loss weights over its timesteps (measured on Flex.1-alpha, its comment
# says), in its checkout: read from there into a file beside ours (AI_TOOLKIT_CHECKOUT, or a folder above the config)
WEIGHTED_TABLE = "toolkit/timestep_weighing/default_weighing_scheme.py"


def checkout_table(source: str) -> str | None:
    """The weighted table's file in the ai-toolkit checkout AI_TOOLKIT_CHECKOUT names, or in a folder above the
    config (its UI writes jobs under the checkout's output/); None where neither holds it."""
    import os

    folders = [os.environ["AI_TOOLKIT_CHECKOUT"]] if os.environ.get("AI_TOOLKIT_CHECKOUT") else []
    folder = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None
    while folder and folder != os.path.dirname(folder):
        folders.append(folder)
        folder = os.path.dirname(folder)
    return next((p for f in folders if os.path.isfile(p := os.path.join(f, WEIGHTED_TABLE))), None)


def bell_weights(half: bool) -> list[float]:
    """ai-toolkit's loss weights of train.linear_timesteps (its CustomFlowMatchEulerDiscreteScheduler, restated in
    float32): y = exp(-2 ((i - 500) / 1000)^2) over its 1000 timestep indices, less its least, scaled to mean 1;
    linear_timesteps2 (half) holds the second half at the largest (the low-noise half flat)."""
    import torch

    x = torch.arange(1000, dtype=torch.float32)
    y = torch.exp(-2 * ((x - 1000 / 2) / 1000) ** 2)
    shifted = y - y.min()
    weights = shifted * (1000 / shifted.sum())
    if half:
        weights[500:] = weights[500:].max()
    return weights.tolist()


def _loss_table(t: Job, weights: list[float], what: str) -> None:
    """timestep_loss_weights: the table, written beside our config (`_timestep_weights.json`)."""
    import json

    t.config["timestep_loss_weights"] = "_timestep_weights.json"  # (the converter writes the file and its path)
    t.files["timestep_loss_weights"] = ("_timestep_weights.json", json.dumps(weights) + "\n")
    t.lines[-1].note = f"its loss weights ({what}) in the file timestep_loss_weights names, beside this config"


def _timesteps(t: Job, key: str, value: Any) -> None:
    """ai-toolkit's flow-matching draws: sigmoid (sigmoid of a normal draw, unshifted) and linear (uniform) are ours;
    linear_timesteps / linear_timesteps2 and weighted weigh each timestep's loss as well (its SDTrainer's
    do_weighted_timesteps): ours by the same table (timestep_loss_weights)."""
    train = t.section("train")
    bell = train.get("linear_timesteps") or train.get("linear_timesteps2")
    kind = "linear" if bell else str(value)
    if kind in ("sigmoid", "linear"):
        ours = "sigmoid" if kind == "sigmoid" else "uniform"
        t.set("timestep_sampling", ours, key, value, RENAMED, f"timestep_sampling = {ours}"
              + (" (train.linear_timesteps)" if kind != str(value) else ""))
        if bell:
            half = bool(train.get("linear_timesteps2"))
            _loss_table(t, bell_weights(half), f"linear_timesteps{'2' if half else ''}'s bell curve")
    elif kind == "weighted" and (table := checkout_table(t.source)):
        from library.text_files import read_number_list

        t.set("timestep_sampling", "uniform", key, value, RENAMED, "timestep_sampling = uniform")
        _loss_table(t, read_number_list(table, "ai-toolkit's weighted table"), f"its table, {table}")
    elif kind == "weighted":
        t.refuse(key, value, f"uniform draws weighted by ai-toolkit's own table of loss weights ({WEIGHTED_TABLE}): "
                             f"no ai-toolkit checkout above the config holds it; set AI_TOOLKIT_CHECKOUT to yours and "
                             f"convert again (ours reads it as timestep_loss_weights)")
    elif kind.endswith("shift") and (k := fixed_shift(t)) == 1:  # (its three *shift types: one branch there)
        t.set("timestep_sampling", "uniform", key, value, RENAMED, "timestep_sampling = \"uniform\" (its model's "
              "scheduler's evenly spaced sigmas, unshifted, picked uniformly; ours continuous)")
    elif kind.endswith("shift") and k:
        t.set("timestep_sampling", "shift", key, value, RENAMED, f"timestep_sampling = \"shift\", shifted_draw = "
              f"\"uniform\", discrete_flow_shift = {k:g} (its model's scheduler's fixed shift of evenly spaced "
              f"sigmas, picked uniformly; ours continuous)")
        t.config.update(shifted_draw="uniform", discrete_flow_shift=k)
    elif kind.endswith("shift") and (method := shift_method(t)):
        t.set("timestep_sampling", method, key, value, RENAMED, f"timestep_sampling = \"{method}\", shifted_draw = "
              f"\"uniform\" (its model's scheduler's resolution shift of evenly spaced sigmas, picked uniformly: "
              f"ours' of a uniform draw, continuous)")
        t.config.update(shifted_draw="uniform")
    elif kind.endswith("shift"):
        t.refuse(key, value, "ai-toolkit shifts evenly spaced sigmas by the image size where its model's scheduler "
                             "shifts dynamically (its own constants); ours shifts a uniform draw so only by a fixed "
                             "shift (shifted_draw), or shifts logit-normal draws (each model's default)")
    else:
        t.refuse(key, value, "ai-toolkit's own timestep draw: not ours")


LOSSES = {"mse": "l2"}
OTHER_LOSSES = {"mae": "L1 loss: not ours (l2, huber)", "pseudo_huber": "ai-toolkit's pseudo-Huber at c = 0.01 "
                "without sd-scripts' 2c scale: ours is huber with huber_c (2c x it)", "wavelet": "wavelet loss: not ours",
                "stepped": "stepped loss: not ours", "mean_flow": "mean-flow loss: not ours",
                "pixelspace": "pixel-space loss: not ours"}


def _loss(t: Job, key: str, value: Any) -> None:
    if value in LOSSES:
        t.set("loss_type", LOSSES[value], key, value, RENAMED, "loss_type")
    else:
        t.refuse(key, value, OTHER_LOSSES.get(value, "not a loss of ours"))


MIXED = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "no", "float32": "no", "float": "no"}


NOT_OURS = "changes the training; not ours"
TRAIN_RULES: dict[str, Rule] = {f"train.{k}": r for k, r in {
    "steps": our_key("max_train_steps", convert=int),
    "lr": our_key("learning_rate", convert=as_number),
    "unet_lr": ignored("unread by its LoRA trainer, which gives the network train.lr (BaseSDTrainProcess)"),
    "text_encoder_lr": ignored("a text encoder's lr: ours trains none"),
    "refiner_lr": ignored("a refiner's lr: ours trains none"),
    "embedding_lr": ignored("an embedding's lr: ours trains a LoRA"),
    "adapter_lr": ignored("an adapter's lr: ours trains a LoRA"),
    "optimizer": custom(_optimizer),
    "optimizer_params": custom(_optimizer_params),
    "lr_scheduler": custom(_scheduler),
    "lr_scheduler_params": custom(_scheduler_params),
    "batch_size": read_as("batch_size of each [[datasets]]"),
    "gradient_accumulation": custom(_accumulation),
    "gradient_accumulation_steps": custom(_accumulation),
    "gradient_checkpointing": our_key("gradient_checkpointing"),
    "max_grad_norm": our_key("max_grad_norm", convert=as_number),
    "dtype": our_key("mixed_precision", convert=one_of(MIXED, "ours computes in bf16, fp16 or fp32")),
    "timestep_type": custom(_timesteps),
    **dict.fromkeys(("linear_timesteps", "linear_timesteps2"), ignored(
        "carried on timestep_type's line: a uniform draw, each loss weighted by its bell curve (timestep_loss_weights)")),
    "content_or_style": custom(_bias),
    "noise_scheduler": implied(lambda v: v == "flowmatch", "ours trains flow matching"),
    "loss_type": custom(_loss),
    "reg_weight": our_key("prior_loss_weight", convert=as_number),
    "train_unet": implied(bool, "ours trains a LoRA on the transformer"),
    "train_text_encoder": implied(lambda v: not v, "ours trains no text encoder"),
    "train_refiner": ignored("refiner models only"),
    "cache_text_embeddings": ignored("ours always caches the caption embeddings before training"),
    "unload_text_encoder": unsupported("ai-toolkit then trains every image on the trigger word (or an empty prompt) "
                                       "instead of its caption; ours trains the captions"),
    "skip_first_sample": custom(read_elsewhere),  # sample_at_first (ai_toolkit_data)
    "force_first_sample": custom(read_elsewhere),
    "disable_sampling": custom(read_elsewhere),
    "ema_config": implied(lambda v: not v, "no EMA (off)"),  # given as a mapping: its keys below
    "ema_config.use_ema": custom(_ema),
    "ema_config.ema_decay": custom(_ema_part),
    "ema_config.use_feedback": unsupported("ai-toolkit's EMA feedback into the weights: not ours"),
    "ema_config.param_multiplier": implied(lambda v: v == 1.0, "ours scales no weight per step"),
    "diff_output_preservation": custom(_preservation),
    "diff_output_preservation_multiplier": our_key("diff_output_preservation_multiplier", "diff_output_preservation",
                                                   as_number),
    "diff_output_preservation_class": our_key("diff_output_preservation_class", "diff_output_preservation"),
    "blank_prompt_preservation": custom(_preservation),
    "blank_prompt_preservation_multiplier": our_key("blank_prompt_preservation_multiplier", "blank_prompt_preservation",
                                                  as_number),
    "xformers": ignored("attention kernel only: ours runs torch's SDPA"),
    "sdp": ignored("attention kernel only: ours runs torch's SDPA"),
    "attention_backend": ignored("attention kernel only: ours runs torch's SDPA"),
    "start_step": ignored("ai-toolkit's step counter on resuming: ours resumes a state folder (resume)"),
    "num_train_timesteps": implied(lambda v: v == 1000, "ours scales sigmas to the model's 1000 timesteps"),
    "min_denoising_steps": implied(lambda v: v == 0, "ours draws from every timestep"),
    "max_denoising_steps": implied(lambda v: v == 999, "ours draws from every timestep"),
    "next_sample_timesteps": ignored("read with timestep_type next_sample"),
    "validation_config": unsupported("ai-toolkit's validation images: ours holds images out by validation_split in "
                                     "the dataset TOML"),
    "max_negative_prompts": ignored("read with negative_prompt"),
    "switch_boundary_every": ignored("two-stage video models only"),
    "audio_loss_multiplier": ignored("audio models only"),
    "max_loss_debug": ignored("ai-toolkit's debugging output"),
    "show_turbo_outputs": ignored("ai-toolkit's debugging output"),
    "merge_network_on_save_strength": ignored("read with merge_network_on_save"),
    "batch_noise_correction_scale": ignored("read with do_batch_noise_correction"),
    "signal_amplification_strength": ignored("read with do_signal_amplification"),
    "signal_correction_noise_scale": ignored("read with do_signal_correction_noise"),
    "inverted_mask_prior_multiplier": ignored("read with inverted_mask_prior"),
    "correct_pred_norm_multiplier": ignored("read with correct_pred_norm"),
    "target_norm_std_value": ignored("read with target_norm_std"),
    "paramiter_swapping_factor": ignored("read with do_paramiter_swapping"),
    "latent_feature_loss_weight": ignored("read with latent_feature_extractor_path"),
    "diffusion_feature_extractor_weight": ignored("read with diffusion_feature_extractor_path"),
    "differential_guidance_scale": ignored("read with do_differential_guidance"),
    "short_and_long_captions_encoder_split": ignored("read with short_and_long_captions"),
    "max_cfg_scale": ignored("read with do_random_cfg"),
    "cfg_rescale": ignored("read with do_cfg"),
    "adapter_assist_type": ignored("read with adapter_assist_name_or_path"),
    **{k: ignored("read with do_guidance_loss") for k in ("guidance_loss_target", "do_guidance_loss_cfg_zero",
                                                          "guidance_loss_schedule", "unconditional_prompt")},
    **{k: implied(lambda v: v == 1.0, "ours scales nothing there (1)") for k in (
        "noise_multiplier", "target_noise_multiplier", "img_multiplier", "noisy_latent_multiplier", "latent_multiplier",
        "pred_scaler", "cfg_scale")},
    "loss_target": implied(lambda v: v == "noise", "ours trains flow matching's velocity target"),
    "optimal_noise_pairing_samples": implied(lambda v: v == 1, "ours draws one noise per image"),
    **{k: unsupported(why) for k, why in {
        "noise_offset": "noise offset: ours adds none", "min_snr_gamma": "min-SNR loss weights: not ours",
        "snr_gamma": "SNR loss weights: not ours", "learnable_snr_gos": "learned SNR weights: not ours",
        "weight_jitter": "weight jitter: not ours", "random_noise_multiplier": NOT_OURS, "random_noise_shift": NOT_OURS,
        "do_signal_correction_noise": NOT_OURS, "do_batch_noise_correction": NOT_OURS, "do_signal_amplification": NOT_OURS,
        "negative_prompt": "training against a negative prompt: not ours", "adaptive_scaling_factor": NOT_OURS,
        "prompt_dropout_prob": "dropout of each text encoder's prompt: ours drops whole captions (caption_dropout_rate)",
        "match_noise_norm": NOT_OURS, "short_and_long_captions": "two captions per image from a JSON file: not ours",
        "single_item_batching": NOT_OURS, "match_adapter_assist": NOT_OURS, "match_adapter_chance": NOT_OURS,
        "inverted_mask_prior": "the base's prediction as the target outside the mask: not ours",
        "standardize_images": NOT_OURS, "standardize_latents": NOT_OURS, "dynamic_noise_offset": NOT_OURS,
        "do_cfg": "training with classifier-free guidance: not ours", "do_random_cfg": NOT_OURS,
        "correct_pred_norm": NOT_OURS, "t0_loss_target": NOT_OURS, "t0_velocity_equiv_weight": NOT_OURS,
        "do_fft_loss": NOT_OURS, "do_fft_velocity_equiv_weight": NOT_OURS, "prompt_saturation_chance": NOT_OURS,
        "do_prior_divergence": NOT_OURS, "target_norm_std": NOT_OURS,
        "do_paramiter_swapping": "training a share of the parameters at a time: not ours",
        "bypass_guidance_embedding": "training past the guidance embedding: not ours",
        "latent_feature_extractor_path": "a feature-extractor loss: not ours",
        "diffusion_feature_extractor_path": "a feature-extractor loss: not ours", "force_consistent_noise": NOT_OURS,
        "blended_blur_noise": NOT_OURS, "do_guidance_loss": "ai-toolkit's guidance loss: not ours",
        "do_differential_guidance": "ai-toolkit's differential guidance: not ours",
        "do_blank_stabilization": NOT_OURS, "max_loss": "a loss clip: not ours", "free_u": "FreeU: not ours",
        "train_turbo": "turbo training: not ours", "merge_network_on_save": "a LoRA merged into the base on save: not ours "
        "(tools/merge_lora.py merges)", "adapter_assist_name_or_path": "an assisting adapter: not ours"}.items()},
}.items()}
