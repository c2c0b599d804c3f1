"""Which keys a run reads: a key another model_type reads (an image run's batch_size is the LLM's),
or one another key's value makes do nothing (lr_scheduler_power without a polynomial schedule), is
refused in one line naming where it was set, not ignored. Called by config.validate; tools/generate.py
refuses the families' keys by the same lists."""

from __future__ import annotations

import argparse
from typing import Any

from library.errors import ConfigError, blame
from library.models.registry import FAMILIES, UNSHIFTED_DRAWS, arch_specs, spec_of

LLM_KEYS = ("train_data", "train_on_all_tokens", "attend_across_documents", "max_length", "stride", "packing",
            "val_fraction",
            "eval_every_n_steps", "sample_prompt", "sample_chat_template", "sample_max_new_tokens", "temperature",
            "top_k", "batch_size", "pretrain", "scaled_residual_init")
LORA_KEYS = ("network_module", "network_dim", "network_alpha", "network_args", "network_weights", "network_dropout",
             "dim_from_weights", "scale_weight_norms")
DIFFUSION_KEYS = ("ae", "dataset_config", "cache_latents_to_disk", "cache_text_encoder_outputs_to_disk",
                  "sample_prompts", "sample_bf16_reference", "vae_tiling", "timestep_sampling", "timestep_bias",
                  "min_timestep", "max_timestep", "preserve_distribution_shape", "num_timestep_buckets",
                  "logsnr_mean", "logsnr_std", "shifted_draw", "qinglong_logsnr_share", "qinglong_detail_share",
                  "qinglong_mid", "timestep_loss_weights",
                  "discrete_flow_shift", "sigmoid_scale", "sigmoid_mean", "mode_scale", "weighting_scheme", "loss_type",
                  "huber_c", "ip_noise_gamma",
                  "ip_noise_gamma_random_strength", "guidance_scale", "prior_loss_weight",
                  "vae_batch_size", "text_encoder_batch_size", "text_encoder_precision", "blocks_to_swap",
                  "validate_every_n_steps", "validate_every_n_epochs", "persistent_data_loader_workers",
                  "max_data_loader_n_workers",
                  "torch_compile", "keep_cache", "diff_output_preservation", "trigger_word", "diff_output_preservation_class",
                  "diff_output_preservation_multiplier", "blank_prompt_preservation", "blank_prompt_preservation_multiplier")


def validate_unread_keys(args: argparse.Namespace, origins: dict[str, str]) -> None:
    """A key the model_type never reads would be ignored without a word (batch_size on an image
    model's run is the llm's, not the images'; the dataset TOML sets those). Refused whenever it was given,
    whatever its value: at the other type's default (batch_size = 8) it was let through, and ignored."""
    if args.model_type == "llm":
        foreign = {k: "the diffusion models" for k in (*DIFFUSION_KEYS, *family_key_names())}
        if args.pretrain:  # the whole model trains: no LoRA is built, loaded or saved
            foreign.update({k: "LoRA training (pretrain = false)" for k in LORA_KEYS})
    else:
        foreign = {k: "model_type llm" for k in LLM_KEYS}
        foreign.update(unread_family_keys(args.model_type))
    for key in origins:
        if key in foreign:
            extra = " (the batch size of images is the dataset TOML's batch_size)" if key == "batch_size" else ""
            raise ConfigError(f"{origins[key]}: key '{key}' is read by {foreign[key]}, not by model_type "
                              f"{args.model_type}{extra}")


# Each schedule key -> the lr_scheduler values that read it: ours, and sd-scripts' get_scheduler_fix's (musubi-tuner's
# copy adds its rex, whose alpha / beta it takes as lr_scheduler_args: REX_KEYS); transformers' two read
# lr_scheduler_num_cycles as half-waves.
SCHEDULE_KEY_READERS = {
    "lr_scheduler_num_cycles": ("cosine_with_restarts", "cosine_with_min_lr", "warmup_stable_decay"),
    "lr_scheduler_power": ("polynomial",),
    "lr_scheduler_min_lr_ratio": ("cosine_with_min_lr", "warmup_stable_decay", "rex"),
    "lr_scheduler_rex_alpha": ("rex",),
    "lr_scheduler_rex_beta": ("rex",),
    "lr_decay_steps": ("warmup_stable_decay",),
    "lr_scheduler_timescale": ("inverse_sqrt",),
}
REX_KEYS = ("lr_scheduler_rex_alpha", "lr_scheduler_rex_beta")
# A schedule -> the key it cannot run without, and why (sd-scripts: transformers stops on the first without it
# at the scheduler's build, after caching; the second's default 0 never decays, a constant_with_warmup).
SCHEDULE_NEEDS = {
    "cosine_with_min_lr": ("lr_scheduler_min_lr_ratio", "the lr it ends at, as a fraction of learning_rate, e.g. 0.1"),
    "warmup_stable_decay": ("lr_decay_steps", "its decay's steps at the run's end, or a fraction of the run, e.g. "
                                              "0.1; without it the lr never decays"),
}

# key -> (the key (or keys) whose values decide whether it is read, that test, what it needs): the
# schedulers and the loss read these only there (diffusers' get_scheduler drops num_cycles and
# power elsewhere, sd-scripts' get_scheduler_fix the min lr ratio, decay steps and timescale), as
# sd-scripts does; the DataLoader keeps no workers alive without workers, the EMA
# lives nowhere without ema_decay, log_prefix names only a tracker's run, and a run without
# intermediate saves has none to prune (its one Ctrl-C save is the newest).
def _read_by_schedules(readers: tuple[str, ...]) -> tuple:
    """IDLE_UNLESS' entry of a schedule key read by these lr_scheduler values: 'lr_scheduler = "a", "b" or "c"'."""
    said = [f'"{name}"' for name in readers]
    return "lr_scheduler", lambda v: v in readers, "lr_scheduler = " + " or ".join(
        [", ".join(said[:-1]), said[-1]] if len(said) > 1 else said)


IDLE_UNLESS = {
    **{key: _read_by_schedules(readers) for key, readers in SCHEDULE_KEY_READERS.items()},
    # (with qinglong, its mid draw's law reads them: _validate_draw_keys)
    "discrete_flow_shift": ("timestep_sampling", lambda v: v in ("shift", "qinglong"), 'timestep_sampling = "shift"'),
    **{key: ("timestep_sampling", lambda v: v not in ("uniform", "logsnr", "mode"),
             "a sigmoid draw (any timestep_sampling but uniform, logsnr and mode)")
       for key in ("sigmoid_scale", "sigmoid_mean")},
    "shifted_draw": ("timestep_sampling", lambda v: v not in UNSHIFTED_DRAWS,
                     "a shift (timestep_sampling \"shift\", a model's own, or unset)"),
    "mode_scale": (("timestep_sampling", "shifted_draw"),
                   lambda v, d: v in ("mode", "qinglong") or d == "mode" and v not in UNSHIFTED_DRAWS,
                   "a mode draw (timestep_sampling = \"mode\", or shifted_draw = \"mode\")"),
    **{key: ("timestep_sampling", lambda v: v in ("logsnr", "qinglong"), 'timestep_sampling = "logsnr" or "qinglong"')
       for key in ("logsnr_mean", "logsnr_std")},
    **{key: ("timestep_sampling", lambda v: v == "qinglong", 'timestep_sampling = "qinglong"')
       for key in ("qinglong_logsnr_share", "qinglong_detail_share", "qinglong_mid")},
    "huber_c": ("loss_type", lambda v: v == "huber", 'loss_type = "huber"'),
    "preserve_distribution_shape": (("min_timestep", "max_timestep"), lambda lo, hi: lo is not None or hi is not None,
                                    "min_timestep or max_timestep (the range it keeps the draw in)"),
    "ip_noise_gamma_random_strength": ("ip_noise_gamma", lambda v: v > 0, "ip_noise_gamma > 0 (e.g. 0.1)"),
    # (base_precision = "fp8" / "fp8_scaled" sets fp8_base first: config._validate_base_precision); musubi-tuner
    # refuses fp8_scaled without fp8_base too
    "fp8_scaled": ("fp8_base", bool, 'fp8_base = true (a base stored in fp8), or base_precision = "fp8"'),
    "block_swap_prefetch": ("blocks_to_swap", lambda v: v > 0, "blocks_to_swap >= 1 (a diffusion model's)"),
    "weight_decay_1d": ("pretrain", bool, "pretrain = true (a LoRA's parameters are all matrices)"),
    "persistent_data_loader_workers": ("max_data_loader_n_workers", lambda v: v > 0, "max_data_loader_n_workers >= 1"),
    "ema_device": ("ema_decay", lambda v: v > 0, "ema_decay > 0 (e.g. 0.999)"),
    "log_prefix": (("log_with", "logging_dir"), lambda w, d: bool(w or d), "a tracker (logging_dir, or log_with)"),
    "save_last_n_saves": (("save_every_n_steps", "save_every_n_epochs"), lambda n, e: bool(n or e),
                          "intermediate saves (save_every_n_steps or save_every_n_epochs)"),
    **{key: ("diff_output_preservation", bool, "diff_output_preservation = true")
       for key in ("trigger_word", "diff_output_preservation_class", "diff_output_preservation_multiplier")},
    "blank_prompt_preservation_multiplier": ("blank_prompt_preservation", bool, "blank_prompt_preservation = true"),
}
UNSET_MEANS = {"timestep_sampling": " (the model's own)"}  # an unset key's meaning, where an error line names it


def _shown(key: str, value: Any) -> str:
    """`key = value` as an error line says it."""
    if value is None:
        return f"{key} unset{UNSET_MEANS.get(key, '')}"
    if isinstance(value, bool):
        return f"{key} = {str(value).lower()}"  # as TOML writes it
    return f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}"


def validate_idle_keys(args: argparse.Namespace, origins: dict[str, str], where: str, schema: dict) -> None:
    """Keys set where another key's value makes them do nothing, or pass over data (schema:
    config_schema.SCHEMA, for the defaults)."""
    if args.model_type == "llm" and not args.sample_prompt:  # an empty prompt has no token to sample from
        raise ConfigError(f"{blame(origins, where, 'sample_prompt')}: key 'sample_prompt' must not be empty "
                          f"(the LLM's sample at each eval continues it)")
    if args.model_type == "llm" and args.stride is not None and args.stride > args.max_length:  # (taken silently)
        raise ConfigError(f"{blame(origins, where, 'stride', 'max_length')}: key 'stride' ({args.stride}) must be <= "
                          f"max_length ({args.max_length}): each window would skip the {args.stride - args.max_length} "
                          f"tokens after it, never trained on or evaluated; for longer windows raise max_length")
    if args.model_type == "llm" and args.packing == "best_fit":  # windows of whole documents: no stride, no stream
        for key, idle in (("attend_across_documents", args.attend_across_documents),
                          ("stride", args.stride not in (None, args.max_length))):
            if idle:
                raise ConfigError(f"{blame(origins, where, 'packing', key)}: packing = \"best_fit\" puts whole "
                                  f"documents into windows, which '{key}' = {getattr(args, key)} would cut as a "
                                  f"stream; unset one of them (packing = \"stream\" is the stream's windows)")
    if args.lr_warmup_steps and args.lr_scheduler == "constant":  # diffusers' constant ignores it (sd-scripts refuses)
        raise ConfigError(f"{blame(origins, where, 'lr_warmup_steps', 'lr_scheduler')}: key 'lr_warmup_steps' does "
                          f"nothing with lr_scheduler = \"constant\"; use \"constant_with_warmup\" (or another schedule)")
    if args.lr_scheduler in SCHEDULE_NEEDS and getattr(args, SCHEDULE_NEEDS[args.lr_scheduler][0]) is None:
        key, what = SCHEDULE_NEEDS[args.lr_scheduler]
        raise ConfigError(f"{blame(origins, where, 'lr_scheduler', key)}: lr_scheduler = \"{args.lr_scheduler}\" needs "
                          f"key '{key}' ({what})")
    _validate_draw_keys(args, origins, where, schema)
    for key, (others, used, needs) in IDLE_UNLESS.items():  # set off its default where nothing reads it
        others = (others,) if isinstance(others, str) else others
        values = [getattr(args, other) for other in others]
        if _set_off_default(args, origins, key, schema) and not used(*values):
            shown = " and ".join(_shown(other, value) for other, value in zip(others, values))
            raise ConfigError(f"{blame(origins, where, key, *others)}: key '{key}' does nothing with {shown}; "
                              f"it needs {needs}")
    sampling = [k for k in ("sample_every_n_steps", "sample_every_n_epochs", "sample_at_first") if getattr(args, k)]
    if args.model_type != "llm" and sampling and args.sample_prompts is None:  # "" is an explicit "no samples"
        raise ConfigError(f"{blame(origins, where, sampling[0])}: key '{sampling[0]}' renders the prompts of "
                          f"sample_prompts, which is not set (a prompt file, or \"\" for no samples)")


def _set_off_default(args: argparse.Namespace, origins: dict[str, str], key: str, schema: dict) -> bool:
    """`key` given (a file or the command line) at another value than its default."""
    return key in origins and getattr(args, key) != schema[key].default


def _validate_draw_keys(args: argparse.Namespace, origins: dict[str, str], where: str, schema: dict) -> None:
    """The draw keys whose reader another key than timestep_sampling names (IDLE_UNLESS takes them with the laws
    that may read them): sigmoid_scale / sigmoid_mean with shifted_draw = "uniform" or "mode" (the shift moves that
    draw), and discrete_flow_shift / sigmoid_scale / sigmoid_mean / mode_scale with qinglong, whose mid draw
    (qinglong_mid) reads them as its law does."""
    shifted = args.shifted_draw
    for key in ("sigmoid_scale", "sigmoid_mean"):
        if (shifted != "sigmoid" and args.timestep_sampling != "sigmoid"
                and _set_off_default(args, origins, key, schema)):
            raise ConfigError(f"{blame(origins, where, key, 'shifted_draw')}: key '{key}' does nothing with "
                              f"shifted_draw = \"{shifted}\" (the shift moves a {shifted} draw); it needs a sigmoid "
                              f"draw")
    if args.timestep_sampling != "qinglong":
        return
    mid = args.qinglong_mid
    moved = mid if mid in UNSHIFTED_DRAWS else shifted  # the draw its mid law (a shift, or unset: the own) moves
    sigmoid = (moved == "sigmoid", "a sigmoid mid draw")
    for key, reads, needs in (("discrete_flow_shift", mid == "shift", 'qinglong_mid = "shift"'),
                              ("sigmoid_scale", *sigmoid), ("sigmoid_mean", *sigmoid),
                              ("mode_scale", moved == "mode", "a mode mid draw"),
                              ("shifted_draw", mid not in UNSHIFTED_DRAWS, "a shifting mid draw (a shift, or unset)")):
        if _set_off_default(args, origins, key, schema) and not reads:
            raise ConfigError(f"{blame(origins, where, key, 'qinglong_mid')}: key '{key}' does nothing with "
                              f"timestep_sampling = \"qinglong\" and qinglong_mid = {mid or 'unset'}; it needs {needs}")


def unread_family_keys(model_type: str) -> dict[str, str]:
    """The families' keys (config_schema.FAMILY_KEYS) that a diffusion model_type never reads -> the model_types
    that do, for an error line (tools/generate.py refuses them as flags too)."""
    own = {k.key for k in spec_of(model_type).config_keys if not k.model_types or model_type in k.model_types}
    return {k: _readers(k) for k in family_key_names() if k not in own}


def family_key_bounds(model_type: str) -> dict[str, int]:
    """The model_type's own int keys that its family takes only up to a value (ConfigKey.most) -> that value."""
    return {k.key: k.most for k in spec_of(model_type).config_keys
            if k.most is not None and (not k.model_types or model_type in k.model_types)}


def _readers(key: str) -> str:
    """The model_types whose families declare `key`, for an error line."""
    return "model_type " + ", ".join(t for t in FAMILIES if any(k.key == key and (not k.model_types or t in k.model_types)
                                                                for k in spec_of(t).config_keys))


def family_key_names() -> list[str]:
    """Every family's own config keys (config_schema.FAMILY_KEYS' names), in registration order."""
    return list(dict.fromkeys(k.key for spec in arch_specs().values() for k in spec.config_keys))
