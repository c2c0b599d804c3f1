"""The training config's keys: each declared once with its type, default, one-line help and choices.

Names follow kohya sd-scripts / musubi-tuner where one exists; each family adds the keys of its own
files (its spec's config_keys). config.py reads a TOML file and the command line against this table
and checks the values; the web UI, the peer converters and --help read it too. No torch here: the
parser loads before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from library.models.registry import (BASE_PRECISIONS, FAMILIES, MODE_SCALE, SAMPLING_METHODS, SHIFTED_DRAWS,
                                     TIMESTEP_BIASES, arch_specs)

PRECISION_NAMES = ("fp32", "bf16", "fp16")  # save / compute dtypes (config.PRECISION_DTYPES)


@dataclass(frozen=True)
class Arg:
    type: type  # str, int, float, bool, list (of str)
    default: Any
    help: str
    choices: tuple | None = None


A = Arg


def family_keys() -> dict[str, Arg]:
    """Every family's own config keys (its spec's config_keys, in registration order). A key that
    several families read (one file role, e.g. their one text encoder) must have one type; the
    helps are joined, each after its family's title."""
    keys: dict[str, Arg] = {}
    for spec in arch_specs().values():
        for k in spec.config_keys:
            help = f"{spec.title}: {k.help}"
            if k.key in keys:
                if keys[k.key].type is not k.type or keys[k.key].default != k.default:
                    raise TypeError(f"config key {k.key!r}: {spec.arch} declares it with another type or default")
                help = f"{keys[k.key].help}; {help}"
            keys[k.key] = Arg(k.type, k.default, help)
    return keys


FAMILY_KEYS = family_keys()
SCHEMA: dict[str, Arg] = {
    # what to train
    "model_type": A(str, None, "model family", (*FAMILIES, "llm")),
    "pretrained_model_name_or_path": A(str, None, "base checkpoint: BFL/diffusers file or folder, HF LLM folder"),
    "ae": A(str, None, "VAE: the family's single file (e.g. ae.safetensors) or a diffusers vae folder; none "
                       "for a model that takes the pixels (refused there)"),
    **FAMILY_KEYS,  # each family's text encoder files and options (its spec's config_keys)
    "dataset_config": A(str, None, "dataset TOML (kohya schema)"),
    # output
    "output_dir": A(str, "output", "where the LoRA, logs, samples and states go"),
    "output_name": A(str, "lora", "file stem of the saved LoRA"),
    # what the LoRA's header says of it (sd-scripts' keys): ss_training_comment and ModelSpec's fields
    "training_comment": A(str, None, "a note in the LoRA's header (ss_training_comment)"),
    **{f"metadata_{name}": A(str, None, f"ModelSpec's {what} in the LoRA's header (modelspec.{name})")
       for name, what in (("title", "title (default: output_name)"), ("author", "author"),
                          ("description", "description"), ("license", "license"),
                          ("tags", "tags, comma-separated"), ("usage_hint", "usage hint"),
                          ("trigger_phrase", "trigger phrase"))},
    "save_precision": A(str, "fp32", "dtype of the saved LoRA tensors (float: sd-scripts' fp32)", (*PRECISION_NAMES, "float")),
    "save_format": A(str, "auto", "LoRA layout: auto (llm: peft, diffusion families: kohya), kohya (one .safetensors), "
                                  "peft (llm: PEFT adapter folder <output_name>/), peft+kohya (both)",
                     ("auto", "kohya", "peft", "peft+kohya")),
    "save_every_n_steps": A(int, 0, "save the LoRA every N optimizer steps (0 = off)"),
    "save_every_n_epochs": A(int, 0, "save the LoRA every N epochs (0 = off)"),
    "save_last_n_saves": A(int, 0, "keep only the newest N intermediate saves (0 = keep all)"),
    "save_state": A(bool, False, "also save optimizer/scheduler/RNG state with each save"),
    "save_state_on_train_end": A(bool, False, "save the state with the final LoRA only (sd-scripts' key; "
                                              "save_state saves it with every save)"),
    "resume": A(str, None, "state folder to resume from"),
    # network
    "network_module": A(str, "networks.lora", "network type: networks.lora (LoRA, DoRA) or lycoris.kohya (LoKr, LoHa, ... via lycoris-lora)"),
    "network_dim": A(int, 16, "LoRA rank"),
    "network_alpha": A(float, 16.0, "LoRA alpha; scale = alpha / rank (0 means alpha = rank)"),
    "network_args": A(list, [], "extra network options as 'key=value' strings"),
    "network_weights": A(str, None, "initial LoRA weights: a .safetensors LoRA, or (llm) a PEFT adapter folder"),
    "dim_from_weights": A(bool, False, "the network takes network_weights' modules, ranks and alphas (sd-scripts' key; "
                                       "networks.lora): no others, network_dim / network_alpha unused"),
    "base_loras": A(list, [], "LoRAs merged into the frozen base before training, 'path[:ratio]' (e.g. a distilled "
                             "model's de-distillation adapter): not trained, not saved, recorded in the LoRA's metadata"),
    "network_dropout": A(float, 0.0, "dropout on the LoRA down projection"),
    "scale_weight_norms": A(float, None, "after each optimizer step, scale each LoRA module so ||(alpha/rank) up @ down|| "
                                         "<= this (sd-scripts' max-norm regularization; 1 is its suggested start)"),
    "pretrain": A(bool, False, "llm only: train the whole model instead of a LoRA"),
    "scaled_residual_init": A(bool, True, "llm pretraining from a config.json: o_proj / down_proj start at std "
                                          "0.02 / sqrt(2 * num_layers) as in GPT-2 (false: 0.02 like the other matrices)"),
    # optimisation
    "optimizer_type": A(str, "AdamW", "AdamW, AdamW8bit, Prodigy, Adafactor, SGDNesterov, DAdaptAdam, any torch.optim or "
                                      "bitsandbytes optimizer, AdamWScheduleFree / RAdamScheduleFree / SGDScheduleFree "
                                      "(schedulefree's), or module.Class"),
    "optimizer_args": A(list, [], "optimizer options as 'key=value' strings (values are Python literals)"),
    "learning_rate": A(float, 1e-4, "base learning rate (for Prodigy: 1.0, the step is d * lr)"),
    "lr_scheduler": A(str, "constant", "diffusers' schedules, transformers' three that sd-scripts and musubi-tuner "
                                       "offer (cosine_with_min_lr, warmup_stable_decay, inverse_sqrt) and musubi-"
                                       "tuner's rex",
                      ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                       "cosine_with_min_lr", "warmup_stable_decay", "inverse_sqrt", "rex")),
    "lr_warmup_steps": A(float, 0, "warmup: steps if >= 1, a fraction of max_train_steps if < 1 (or '10%')"),
    "lr_scheduler_num_cycles": A(int, 1, "cycles for cosine_with_restarts; half-waves of the cosine for "
                                         "cosine_with_min_lr and warmup_stable_decay's decay (1: down once)"),
    "lr_scheduler_power": A(float, 1.0, "power for polynomial"),
    "lr_scheduler_min_lr_ratio": A(float, None, "cosine_with_min_lr (needed), warmup_stable_decay (default 0) and "
                                                "rex (default 0.01): the lr the decay ends at, as a fraction of "
                                                "learning_rate"),
    "lr_scheduler_rex_alpha": A(float, 0.1, "rex: lr = learning_rate x (r + (1 - r) z / (alpha + beta z)), z the "
                                            "share of the decay left (musubi-tuner's rex_alpha)"),
    "lr_scheduler_rex_beta": A(float, 0.9, "rex: beta of that curve (musubi-tuner's rex_beta; alpha + beta = 1 "
                                           "starts the decay at learning_rate)"),
    "lr_decay_steps": A(float, None, "warmup_stable_decay (needed): the decay's steps if >= 1, a fraction of "
                                     "max_train_steps if < 1; the run's last steps"),
    "lr_scheduler_timescale": A(int, None, "inverse_sqrt: lr = learning_rate x sqrt(timescale / (step - warmup + "
                                           "timescale)) after the warmup (default: the warmup's steps, or 10000)"),
    "max_train_steps": A(int, 1600, "optimizer steps"),
    "max_train_epochs": A(int, None, "if set, overrides max_train_steps"),
    "gradient_accumulation_steps": A(int, 1, "micro-batches per optimizer step"),
    "max_grad_norm": A(float, 1.0, "gradient clipping (0 = off)"),
    "weight_decay_1d": A(bool, False, "also apply weight decay to 1-D parameters (biases, norms)"),
    # precision and speed
    "mixed_precision": A(str, "bf16", "compute dtype", ("no", "fp16", "bf16")),
    "base_precision": A(str, None, "how the frozen base's Linears are stored: bf16 (the compute dtype), fp8, fp8_scaled, "
                                   "nf4 / nf4_dq (4-bit NormalFloat, dq: double-quantized statistics), int8 (row-wise); "
                                   "unset: from fp8_base / fp8_scaled", BASE_PRECISIONS),
    "fp8_base": A(bool, False, "store base Linear weights in float8_e4m3fn (base_precision says it too)"),
    "fp8_scaled": A(bool, True, "with fp8_base: per-block absmax scales (False = plain cast, as sd-scripts); "
                                "a pre-quantized scaled file (ours, ComfyUI's per-tensor scaled) needs True"),
    "fp8_compute": A(bool, False, "run the fp8 base's Linears as fp8 GEMMs (torch._scaled_mm, per-row scales; "
                                  "GPUs of compute capability >= 8.9, or the CPU); needs an fp8 base and bf16"),
    "gradient_checkpointing": A(bool, False, "per-block activation checkpointing"),
    "checkpoint_saves_projections": A(bool, None, "with gradient_checkpointing: keep each block's last projection "
                                                   "into the residual from the forward where a trained gate needs "
                                                   "it (modulation among the LoRA targets) instead of recomputing "
                                                   "it: step FLOPs x0.88-0.90 there for one [tokens, width] activation "
                                                   "per stream and block (the planner counts it); eager or torch_compile. "
                                                   "Unset: on a CUDA card, on where the planned step fits with it"),
    "checkpoint_saves_attention": A(bool, None, "with gradient_checkpointing: keep each attention kernel's output "
                                                 "(and its log-sum-exp) from the forward, so the recompute runs no "
                                                 "attention: one [tokens, width] activation per attention call and "
                                                 "block (the planner counts it); eager or torch_compile. Unset: on a "
                                                 "CUDA card, on where the planned step fits with it"),
    "checkpoint_saves_dequantized": A(bool, False, "with gradient_checkpointing and a low-bit base (fp8, nf4, int8, "
                                                   "GGUF, ...), eager: the recompute keeps each base Linear's "
                                                   "dequantized weight for its backward instead of dequantizing it a "
                                                   "third time: one block's base weights in the compute dtype held "
                                                   "through its backward (the planner counts it); no effect compiled"),
    "blocks_to_swap": A(int, 0, "keep the last N transformer blocks' frozen weights in CPU memory, copied in per use "
                                "(each block counts one, unlike sd-scripts' count for double-stream models: docs/configuration.md)"),
    "block_swap_prefetch": A(int, 1, "swapped blocks copied ahead of their use (each one more block of device memory; "
                                     "deeper hides large blocks' copies behind more compute)"),
    "allow_tf32": A(bool, True, "TF32 matmuls on CUDA"),
    "torch_compile": A(bool, None, "torch.compile each transformer block; unset: on where it was measured faster (a CUDA "
                               "card with Triton, a model of 1 B parameters or more, networks.lora without DoRA, a bf16 / "
                               "fp8 / fp8_scaled base, one process), else off"),
    "seed": A(int, 42, "random seed"),
    "max_data_loader_n_workers": A(int, 0, "DataLoader workers"),
    "persistent_data_loader_workers": A(bool, False, "keep the DataLoader workers alive from epoch to epoch instead "
                                                     "of starting them anew (with max_data_loader_n_workers > 0)"),
    # caching: latents and caption embeddings are always computed once before training (the VAE
    # and text encoders are then freed); these keep them on disk, reused while unchanged.
    "cache_latents_to_disk": A(bool, False, "keep latent caches as safetensors beside the images"),
    "cache_text_encoder_outputs_to_disk": A(bool, False, "keep text caches on disk"),
    "keep_cache": A(bool, False, "keep the cache files of this model no entry uses (an old setting's, a removed "
                                 "image's) instead of deleting them after caching (musubi-tuner's --keep_cache)"),
    "text_encoder_precision": A(str, "bf16", "caption encoders' weights (fp8: T5-XXL / Qwen2.5-VL / Qwen3 Linears in e4m3, CLIP-L bf16)",
                                ("fp32", "fp16", "bf16", "fp8", "fp8_scaled")),
    "text_encoder_batch_size": A(int, 8, "captions per encoder batch while caching"),
    "vae_batch_size": A(int, 4, "images per VAE encode while caching latents (float32: the caching phase's peak "
                                "grows with it; tools/plan_memory.py)"),
    # flow matching
    "prior_loss_weight": A(float, 1.0, "loss weight of regularization images (dataset subsets with is_reg = true)"),
    "timestep_sampling": A(str, None, "sigma sampling; default per model", SAMPLING_METHODS),
    "discrete_flow_shift": A(float, 3.0, "k for timestep_sampling = shift"),
    "timestep_bias": A(str, "none", "lean the sigma draw to high or low noise (ai-toolkit's Timestep Bias, "
                                    "content_or_style content / style): its quantile 1 - u^3 or u^3", TIMESTEP_BIASES),
    "sigmoid_scale": A(float, 1.0, "scale of randn inside the sigmoid"),
    "sigmoid_mean": A(float, 0.0, "the sigmoid draw's centre: sigma = sigmoid(sigmoid_mean + sigmoid_scale randn), > 0 "
                                  "more noise (sd-scripts' / musubi-tuner's logit_mean of their sigma draw, negated; "
                                  "of a draw that takes sigma as u, as it is)"),
    "shifted_draw": A(str, "sigmoid", "the draw a shift moves (timestep_sampling shift or a model's own): "
                                      "sigmoid(sigmoid_scale randn), uniform (sd-scripts' sigma draw on its shifted "
                                      "scheduler, its nextdit_shift) or mode (mode_scale's law)", SHIFTED_DRAWS),
    "mode_scale": A(float, MODE_SCALE, "timestep_sampling = \"mode\" (or shifted_draw = \"mode\"): the mode law's "
                                       "s, sigma = (1 + s) u - s sin^2(pi u / 2) of a uniform u (the peers' "
                                       "weighting_scheme mode and mode_scale; 0: uniform, > 0: more mid sigmas), in "
                                       "(-1, 1.75]"),
    "logsnr_mean": A(float, -6.0, "timestep_sampling = \"logsnr\": the log-SNR's mean (musubi-tuner's logit_mean "
                                  "there; -6: the Style-Friendly paper's, mostly high noise)"),
    "logsnr_std": A(float, 2.0, "timestep_sampling = \"logsnr\": the log-SNR's standard deviation (musubi-tuner's "
                                "logit_std there; the paper's 2 or 3)"),
    "qinglong_logsnr_share": A(float, 0.11, "timestep_sampling = \"qinglong\": the share of sigmas from the logsnr "
                                            "draw (logsnr_mean / logsnr_std; 0.11 as musubi-tuner's first qinglong "
                                            "draw, its other's 0)"),
    "qinglong_detail_share": A(float, 0.10, "timestep_sampling = \"qinglong\": the share from the detail draw, log-SNR "
                                            "normal at 5.36 / 1 (low noise; musubi-tuner's 0.10, its other's 0.05); "
                                            "the rest from the mid draw"),
    "qinglong_mid": A(str, None, "timestep_sampling = \"qinglong\": its mid draw (unset: the model's own)",
                      tuple(m for m in SAMPLING_METHODS if m != "qinglong")),
    "timestep_loss_weights": A(str, None, "a table of loss weights over sigma (a JSON list, numbers, or a Python file "
                                          "holding one list literal), N weights from sigma 1 down, each sigma's "
                                          "nearest taken: ai-toolkit's timestep_type weighted (its table file, with a "
                                          "uniform draw)"),
    "min_timestep": A(int, None, "train sigmas from min_timestep / 1000 up (musubi-tuner's, 0-999; unset: 0)"),
    "max_timestep": A(int, None, "train sigmas up to max_timestep / 1000 (musubi-tuner's, 1-1000; unset: 1000)"),
    "preserve_distribution_shape": A(bool, False, "min_timestep / max_timestep cut the sigma law to their range (draws "
                                                  "outside it redrawn) instead of scaling it into it (musubi-tuner's)"),
    "num_timestep_buckets": A(int, None, "stratified sigmas (musubi-tuner's): each epoch deals its samples this "
                                         "many equal slices of the sigma law's quantiles evenly; unset or 1: each "
                                         "sample's own draw"),
    "weighting_scheme": A(str, "none", "loss weighting (sigma_sq: the x0 error, as preconditioned outputs train)",
                          ("none", "sigma_sqrt", "cosmap", "sigma_sq")),
    "loss_type": A(str, "l2", "loss", ("l2", "huber")),
    "huber_c": A(float, 0.1, "huber threshold"),
    "ip_noise_gamma": A(float, 0.0, "input perturbation (sd-scripts'): the model sees (1 - s) x0 + s (noise + "
                                    "gamma xi), xi a second draw, and still learns noise - x0; 0 = off"),
    "ip_noise_gamma_random_strength": A(bool, False, "each sample's gamma drawn uniform in [0, ip_noise_gamma)"),
    "guidance_scale": A(float, 1.0, "guidance fed to a guidance-distilled model's embedding during training"),
    # output preservation (ai-toolkit's; library/training/preservation.py): a second prompt's prediction held to the base's
    "diff_output_preservation": A(bool, False, "hold the prediction for each caption with trigger_word replaced by "
                                               "diff_output_preservation_class to the base's (the class keeps its look)"),
    "trigger_word": A(str, None, "the word the captions use for the trained concept (read by diff_output_preservation)"),
    "diff_output_preservation_class": A(str, None, "what replaces trigger_word in the second prompt, e.g. \"woman\""),
    "diff_output_preservation_multiplier": A(float, 1.0, "weight of the diff_output_preservation term"),
    "blank_prompt_preservation": A(bool, False, "hold the prediction for the empty prompt to the base's"),
    "blank_prompt_preservation_multiplier": A(float, 1.0, "weight of the blank_prompt_preservation term"),
    # samples and logging
    "sample_prompts": A(str, None, "prompt file (sd-scripts syntax: prompt --w --h --s --d --g --n)"),
    "sample_every_n_steps": A(int, 0, "render samples every N steps (0 = off)"),
    "sample_every_n_epochs": A(int, 0, "render samples every N epochs (0 = off)"),
    "sample_at_first": A(bool, False, "render samples before training"),
    "sample_bf16_reference": A(bool, None, "on an fp8 / nf4 / int8 base: also render each sample on a bf16 base, side by side "
                                           "(unset: on, unless the memory plan says that copy does not fit the card; never "
                                           "on a pre-quantized checkpoint, which has no bf16 base)"),
    "vae_tiling": A(bool, None, "decode samples in tiles (diffusers' tiled decode, as ComfyUI's tiled VAE decode; the "
                                "decode's peak memory 3-8x lower at 1024 px; unset: on where the memory plan says a "
                                "sample decoded whole does not fit the card)"),
    "logging_dir": A(str, None, "TensorBoard log folder, a timestamped subfolder per run (CSV is always written)"),
    # validation (diffusion; the held-out images are chosen in the dataset TOML)
    "validate_every_n_steps": A(int, 0, "val_loss on the held-out images every N steps; always at the end (0 = end only)"),
    "validate_every_n_epochs": A(int, 0, "val_loss on the held-out images at the end of every N epochs too "
                                         "(sd-scripts' and its default 1 where it holds images out; 0 = off)"),
    # EMA of the trained weights (library/training/ema.py), saved beside the LoRA as <name>_ema.safetensors
    "ema_decay": A(float, 0.0, "EMA decay per optimizer step, e.g. 0.999 (0 = off)"),
    "ema_warmup": A(bool, False, "diffusers' EMAModel warmup: decay min(ema_decay, 1 - (1 + t / ema_inv_gamma) ** "
                                 "-ema_power) at the t-th EMA update (0 at t = 0: the first update copies)"),
    "ema_inv_gamma": A(float, 1.0, "ema_warmup: diffusers' inv_gamma (the warmup's time scale, in steps)"),
    "ema_power": A(float, 2 / 3, "ema_warmup: diffusers' power (2/3: 0.999 after ~31600 updates, 3/4: after ~10000)"),
    "ema_start_step": A(int, 0, "the EMA equals the raw weights up to this optimizer step, averages after it"),
    "ema_device": A(str, "same", "where the float32 EMA lives: beside the weights, or in CPU memory", ("same", "cpu")),
    "sample_with_ema": A(bool, False, "render samples with the EMA weights (swapped in, then back)"),
    "log_prefix": A(str, None, "each run's TensorBoard folder in logging_dir is log_prefix + its start time "
                               "(YYYYmmddHHMMSS, as sd-scripts; default: '<output_name>_'; a resume continues its "
                               "state's); the wandb project (default: output_name)"),
    "log_with": A(str, None, "trackers: tensorboard (default with logging_dir), wandb, all", ("tensorboard", "wandb", "all")),
    # llm data
    "train_data": A(list, [], "llm: .txt files (a document each) and .jsonl files (a {\"text\": ...} or {\"messages\": [...]} "
                              "record a line), or folders whose .txt / .jsonl files (any case, subfolders too) are read"),
    "train_on_all_tokens": A(bool, False, "llm: .jsonl \"messages\" records: the loss on every token of the conversation "
                                          "(system, user, the template's), not only the assistant messages'; plain-text "
                                          "\"prompt\" / \"completion\" records: on the prompt's too"),
    "attend_across_documents": A(bool, False, "llm: false (default): in a window that packs several documents / "
                                              "conversations, each attends only to itself, its positions restart "
                                              "at 0 and the target after its end (the next one's first token) is "
                                              "not trained; true: the window is one sequence (as before the key)"),
    "max_length": A(int, 256, "llm: tokens per window"),
    "stride": A(int, None, "llm: window stride, <= max_length (unset: max_length, windows that neither overlap nor skip text)"),
    "packing": A(str, None, "llm: how windows hold the documents: best_fit puts each whole document (conversation, "
                            "record, .txt file) into a window, longest first, none cut unless longer than a window "
                            "(TRL's default packing); stream cuts the token stream every stride tokens, wherever a "
                            "conversation is (before 2026-12-04); unset: best_fit, stream with stride or "
                            "attend_across_documents", ("best_fit", "stream")),
    "val_fraction": A(float, 0.1, "llm: share of tokens held out (0: evals give the sample alone, no val loss)"),
    "eval_every_n_steps": A(int, 50, "llm: val loss / perplexity / sample interval"),
    "sample_prompt": A(str, "The", "llm: prompt for the sample at each eval"),
    "sample_chat_template": A(bool, None, "llm: sample_prompt as one user turn of the tokenizer's chat template with "
                                          "its generation prompt, the sample its reply alone (unset: on when train_data "
                                          "holds \"messages\" records; false: the prompt as raw text, continued)"),
    "sample_max_new_tokens": A(int, 40, "llm: sample length"),
    "temperature": A(float, 0.8, "llm: sampling temperature (0 = greedy)"),
    "top_k": A(int, 40, "llm: top-k sampling"),
    "batch_size": A(int, 8, "llm: windows per micro-batch"),
}

# The gradient-checkpointing keys that keep tensors from the forward for less recompute (each needs
# gradient_checkpointing), in the order train_lora.py plans the unset ones against the card
# (memory_plan.settle_keeping_keys: attention keeps tensors in every family, projections only where a
# gate trains; dequantized defaults to false: an eager low-bit lever, x0.93-0.95 of the H200's eager fp8 step
# for one block's dequantized weights, where compiled steps, the CUDA default, do better), each with
# what it buys (tools/plan_memory.py says it).
KEEPING_KEYS = {"checkpoint_saves_attention": "no attention in the recompute",
                "checkpoint_saves_projections": "less recompute",
                "checkpoint_saves_dequantized": "no dequantization in backward"}


# Keys that name files or folders (base_loras: 'path[:ratio]'; train_data: a list): a leading ~ is the home folder,
# as the shell would read it, in a TOML too (load_config expands them; a folder named "~" was made before).
PATH_KEYS = frozenset({"pretrained_model_name_or_path", "ae", "clip_l", "t5xxl", "text_encoder", "siglip",
                       "t5_tokenizer", "byt5", "clip_g", "llama", "tokenizer", "dataset_config", "output_dir",
                       "resume", "network_weights", "sample_prompts", "logging_dir", "base_loras", "train_data",
                       "timestep_loss_weights"})
