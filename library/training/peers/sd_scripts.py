"""sd-scripts' LoRA training script for the models whose specs list it (peer_models["sd-scripts"]: the script,
its LoRA module and --model_type values; sd_scripts_models.py reads them) read key by key into ours.

RULES holds one rule per argument its parser takes (train_network.setup_parser and the add_* functions
of library/train_util.py, the model's *_train_utils.py, sai_model_spec.py, deepspeed_utils.py, config_util.py
and custom_train_functions.py that it calls, then the script's setup_parser's own); its dataset
(a dataset TOML, or DreamBooth folders) is sd_scripts_dataset.py's, its samples sd_scripts_samples.py's, its
optimizer, schedule, timestep draw and loss sd_scripts_training.py's (its parser's defaults: sd_scripts_defaults.py),
and the keys the kohya_ss GUI adds to the TOML it runs it with kohya_ss.py's. A "" or 0 where sd-scripts tests
`if args.key` is its "not given" (the GUI writes its empty fields so): dropped. Facts from its code that decide
many rules:

- the script draws its noise and timesteps itself (its *_train_utils.get_noisy_model_input_and_
  timesteps) and its post_process_loss returns the loss as it is: noise_offset, multires noise,
  min_snr_gamma, min/max_timestep, the v-prediction losses and the other Stable Diffusion keys do
  nothing there, so they are dropped (leaving them out changes nothing), not "not carried".
- Where its parser's default trains otherwise than ours (network_alpha 1, learning_rate 2e-6, timestep
  "sigma" with model_prediction_type "sigma_scaled", guidance 3.5, fp32 compute, a CLIP-L LoRA beside
  the transformer's, captions in .caption files), a key the config leaves out is translated at that
  default and reported as `key (default)`.
- Its timestep draw, prediction type and loss weighting read each other (`weighting_scheme` weighs the
  loss only with model_prediction_type sigma_scaled and shapes the draw only with timestep_sampling
  sigma): those rules read the other keys' values (Translation.given, through sd_scripts_defaults.their).

No torch here (rules.py).
"""

from __future__ import annotations

import os
from typing import Any

from library.models.registry import spec_of
from library.training.config_schema import SCHEMA
from library.training.peers import kohya_ss, sd_scripts_dataset as dataset_rules, sd_scripts_models as models
from library.training.peers import sd_scripts_samples, sd_scripts_script as script_rules
from library.training.peers import sd_scripts_training as training_rules
from library.training.peers.sd_scripts_defaults import note, script_of, text_encoder_lr_zero, their, their_default
from library.training.peers.rules import (
    DROPPED, KEPT, NOT_CARRIED, RENAMED, Line, Rule, Translation, apply_rule, custom, flatten_tables, ignored, implied,
    is_off, is_true, same, unless_off, unsupported,
)

# The keys whose default trains otherwise than ours: translated at sd-scripts' default where the config
# leaves them out (sd_scripts_dataset.py does caption_extension's).
DEFAULTS_CARRIED = ("model_type", "network_dim", "network_alpha", "learning_rate", "mixed_precision", "guidance_scale",
                    "timestep_sampling", "model_prediction_type", "network_train_unet_only", "output_name",
                    "validate_every_n_epochs")


def model_type(t: Translation) -> str:
    return t.config["model_type"]


def reads(t: Translation, key: str) -> bool:
    """Our model_type reads this family key (clip_l: a model without CLIP-L does not)."""
    return any(k.key == key for k in spec_of(model_type(t)).config_keys)


def clip_l_lr_zero(t: Translation) -> bool:
    """text_encoder_lr (its first: CLIP-L's) 0: its LoRA module skips a parameter group at lr 0, the CLIP-L LoRA's
    too."""
    return text_encoder_lr_zero(t)


def trains_clip_l(t: Translation) -> bool:
    """sd-scripts trains a CLIP-L LoRA beside the transformer's (of a model that has CLIP-L) unless
    network_train_unet_only or a CLIP-L rate of 0."""
    return reads(t, "clip_l") and not is_true(their(t, "network_train_unet_only")) and not clip_l_lr_zero(t)


def title(t: Translation) -> str:
    return spec_of(model_type(t)).title


# ----------------------------------------------------------------------------------------------
# The model


# sd-scripts' LoRA training scripts (tools/convert_config.py tells the peer of a --command by them); the others
# than the specs' train models we do not, and model_of refuses them in one line.
SCRIPTS = (*models.scripts(), "train_network.py", "sdxl_train_network.py")


def script_of_config(flat: dict, script: str | None, source: str) -> str:
    """The specs' script the config is for: a command line's (one of the specs'), else the script of the LoRA module
    its network_module names, else the one script whose parser alone takes a key it gives, else the first."""
    if script is not None:
        name = os.path.basename(script)
        if name in models.scripts():
            return name
        expected = " / ".join(f"{s}'s" for s in models.scripts())
        model = name[:-len("_train_network.py")] if name.endswith("_train_network.py") else "Stable Diffusion 1.x / 2.x"
        raise ValueError(f"{script}: sd-scripts' {name} trains {model}, which we do not train here ({expected} "
                         f"configs translate)" if name.endswith("train_network.py") else
                         f"{script}: not sd-scripts' LoRA training script ({expected} configs translate)")
    module = flat.get("network_module")
    if isinstance(module, str) and module in models.lora_modules():
        return models.lora_modules()[module]
    own = {s: set(flat) & (set(SCRIPT_RULES[s]) - {k for o in models.scripts() if o != s for k in SCRIPT_RULES[o]})
           for s in models.scripts()}
    told = [s for s, keys in own.items() if keys]
    if len(told) > 1:
        raise ValueError(f"{source}: " + ", ".join(f"{', '.join(sorted(own[s]))} ({s}'s)" for s in told)
                         + ": keys of more than one sd-scripts script; give the command line with its script")
    return told[0] if told else models.first_script()


def model_of(flat: dict, asked: str | None, script: str | None, source: str) -> str:
    """Our model_type: the script's (script_of_config); of a script with --model_type values, the config's
    model_type (one of them; else its default, ours too). --model_type must agree."""
    name = script_of_config(flat, script, source)
    known, default = models.model_types(name), models.default_model_type(name)
    if not known:  # a script of its own says the model (a model_type key is not its parser's: unknown)
        if asked is not None and asked != default:
            raise ValueError(f"{source}: sd-scripts' {name} trains model_type {default!r}, but --model_type {asked}")
        return default
    found = flat.get("model_type", default)
    if found not in list(known):  # (a list value is no name either)
        raise ValueError(f"{source}: model_type {found!r}: expected one of sd-scripts' {', '.join(known)}")
    if asked is not None and asked != known[found]:
        raise ValueError(f"{source}: model_type {found!r} (sd-scripts' default {default}), but "
                         f"--model_type {asked}")
    return known[found]


def _model_type(t: Translation, key: str, value: Any) -> None:
    t.lines.append(Line(key, value, KEPT, key))  # set by translate, from the config or the script


def _clip_l(t: Translation, key: str, value: Any) -> None:
    if reads(t, "clip_l"):
        t.set(key, value, key, value)
    else:
        t.drop(key, value, f"{title(t)} has no CLIP-L (sd-scripts does not load it either)")


def _apply_t5_attn_mask(t: Translation, key: str, value: Any) -> None:
    masks = spec_of(model_type(t)).masks_text_padding  # our release's pipeline's rule
    why = (f"ours masks T5's padding for {title(t)} always, as its pipeline" if masks else
           f"ours encodes T5 and attends without a padding mask for {title(t)}, as its pipeline")
    if is_true(value) == masks:
        t.drop(key, value, why)
    elif masks:  # a masking model without it: sd-scripts stops (its script asserts it)
        t.drop(key, value, f"sd-scripts refuses {title(t)} without it; {why}")
    else:
        t.refuse(key, value, why)


def _guidance_scale(t: Translation, key: str, value: Any) -> None:
    if spec_of(model_type(t)).sampling.guidance_scale is not None:  # a guidance-distilled model's embedding
        t.set(key, float(value), key, value)
    elif float(value) == 0:
        t.drop(key, value, f"ours trains {title(t)} at guidance 0 always, as it was distilled")
    else:
        t.refuse(key, value, f"ours trains {title(t)} at guidance 0 always, as it was distilled (sd-scripts' docs: 0.0)")


def _fp8_base(t: Translation, key: str, value: Any) -> None:
    """fp8_base / fp8_base_unet: the transformer cast to float8_e4m3fn (the text encoder as its file stores it)."""
    if not is_true(value):
        t.drop(key, value, "off")
        return
    t.set("base_precision", "fp8", key, value, RENAMED)
    note(t, 'base_precision = "fp8" (the plain cast, as sd-scripts; "fp8_scaled" is ours with per-block scales)')


def _blocks_to_swap(t: Translation, key: str, value: Any) -> None:
    """sd-scripts swaps N // 2 double blocks and twice the rest in single blocks; ours the last N blocks in
    order (single blocks first), each counting one: the same number of blocks, fewer bytes."""
    count = 0 if is_off(value) else int(value)  # "": sd-scripts' `if args.blocks_to_swap` too
    if count <= 0:
        t.drop(key, value, "off")
    else:
        script_rules.swap_two_kinds(t, key, value, count)


def _split_mode(t: Translation, key: str, value: Any) -> None:
    if is_true(value) and "blocks_to_swap" not in t.given:  # sd-scripts sets blocks_to_swap 18 for it
        _blocks_to_swap(t, key, 18)
        t.lines[-1].value = value
    else:
        t.drop(key, value, "off" if not is_true(value) else "deprecated; blocks_to_swap is set (sd-scripts ignores it too)")


# ----------------------------------------------------------------------------------------------
# The network


LORA_MODULE = models.lora_module(models.first_script())  # the first script's LoRA of its models' blocks (the specs')
# The network_args its create_network reads (others are ignored there; a script of its own: its spec's).
LORA_ARGS = {
    "conv_dim", "conv_alpha", "img_attn_dim", "txt_attn_dim", "img_mlp_dim", "txt_mlp_dim", "img_mod_dim", "txt_mod_dim",
    "single_dim", "single_mod_dim", "in_dims", "train_double_block_indices", "train_single_block_indices",
    "rank_dropout", "module_dropout", "train_blocks", "split_qkv", "ggpo_beta", "ggpo_sigma", "train_t5xxl", "verbose",
    "network_reg_lrs", "network_reg_dims", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
    "loraplus_text_encoder_lr_ratio",
}
LORA_ARGS_REFUSED = {
    "split_qkv": "ours trains the fused qkv LoRA (sd-scripts saves split q/k/v as one rank-3r block that loaders "
                 "apply at 1/3)",
    "train_t5xxl": "ours caches T5's outputs before training: no T5-XXL LoRA",
    "ggpo_beta": "GGPO's weight perturbation: ours perturbs nothing",
    "ggpo_sigma": "GGPO's weight perturbation: ours perturbs nothing",
}


def lora_module_of(t: Translation) -> str:
    """sd-scripts' LoRA module of the translation's script (the specs'): ours networks.lora."""
    return models.lora_module(script_of(t))


def _network_module(t: Translation, key: str, value: Any) -> None:
    if value == lora_module_of(t):
        t.set(key, "networks.lora", key, value, RENAMED)
        note(t, 'network_module = "networks.lora" (the same LoRA of the same Linears)')
    elif value == "lycoris.kohya":
        t.set(key, value, key, value)
    else:  # (networks.lora on a DiT script wraps its CLIP text encoders alone: no block of the transformer)
        what = ("sd-scripts' SD / SDXL LoRA, which finds no layer of this script's transformer to wrap"
                if value == "networks.lora" else "another network")
        t.refuse(key, value, f"{what}; ours trains {lora_module_of(t)}'s LoRA (networks.lora) or lycoris.kohya")


def network_arg_verdict(t: Translation, name: str, text: str) -> tuple[str, str]:
    """(verdict, why) of one argument `name=text` of its LoRA module: KEPT, or DROPPED / NOT_CARRIED with why."""
    from networks.lora_args import check_lora_args

    module_args = models.entry(script_of(t)).lora_module_args or LORA_ARGS
    if name not in module_args:
        return DROPPED, f"{lora_module_of(t)} does not read it"
    own = script_rules.lora_arg_verdict(t, name, text) if module_args is not LORA_ARGS else None
    if own is not None:
        return own
    if name in ("verbose", "conv_dim", "conv_alpha"):
        return DROPPED, "a log switch" if name == "verbose" else "the model has no convolutions"
    if name in ("split_qkv", "train_t5xxl") and text != "True":  # sd-scripts' test: the string "True" only
        return DROPPED, "off (sd-scripts turns it on only with the string True)"
    if name in LORA_ARGS_REFUSED:
        return NOT_CARRIED, LORA_ARGS_REFUSED[name]
    if is_true(their(t, "dim_from_weights")) and (name.endswith(("_dim", "_dims", "_indices")) or name == "train_blocks"):
        return DROPPED, "dim_from_weights: the network is network_weights' modules (create_network_from_weights)"
    if name == "loraplus_text_encoder_lr_ratio":
        return (NOT_CARRIED, "the CLIP-L LoRA's: not trained here") if trains_clip_l(t) else (
            DROPPED, "no text encoder LoRA is trained")
    ours = "loraplus_lr_ratio" if name == "loraplus_unet_lr_ratio" else name
    if name == "loraplus_lr_ratio" and "loraplus_unet_lr_ratio" in network_args_of(their(t, "network_args")):
        return DROPPED, "loraplus_unet_lr_ratio sets the transformer's"
    arch = spec_of(model_type(t)).arch
    try:
        check_lora_args(arch, {ours: text})
    except ValueError as e:  # ours' line, without its list of the keys it knows
        return NOT_CARRIED, f"ours: {str(e).split(' (known: ')[0]}"
    return (KEPT, "") if ours == name else (RENAMED, ours)


def network_args_of(value: Any, source: str = "network_args") -> dict[str, str]:
    """sd-scripts' network_args ("key=value" strings; one string from a command line) as a dict."""
    items = value if isinstance(value, list) else [] if value is None else [value]
    pairs = {}
    for item in items:
        name, sep, text = str(item).partition("=")
        if not sep:
            raise ValueError(f"{source}: network_args entry {item!r}: expected key=value")
        pairs[name.strip()] = text.strip()
    return pairs


def _network_args(t: Translation, key: str, value: Any) -> None:
    """Its LoRA module's arguments one by one, or (a script's spec with lora_args) its module's selection as ours'
    items, given or not (its default may train other modules than ours')."""
    module = their(t, "network_module")
    theirs = module in (None, lora_module_of(t))
    given = {} if is_off(value) or not theirs else network_args_of(value, t.source)
    own = script_rules.own_lora_args(t, given) if theirs else None
    if is_off(value) and not (own and own[0]):  # the kohya_ss GUI's [] (sd-scripts reads "" as none too)
        t.drop(key, value, "empty")
        return
    if module == "lycoris.kohya":  # LyCORIS' own arguments: ours passes them on (docs/configuration.md)
        t.set(key, [str(v) for v in (value if isinstance(value, list) else [value])], key, value)
        return
    if not theirs:
        t.drop(key, value, f"goes with network_module {module!r}, not carried")
        return
    kept, read = (list(own[0]), own[1]) if own else ([], {})
    for name, (verdict, why) in read.items():
        t.lines.append(Line(f"{key} {name}", given[name], verdict, why))
    for name, text in ((n, v) for n, v in given.items() if n not in read):
        verdict, why = network_arg_verdict(t, name, text)
        if verdict in (KEPT, RENAMED):
            kept.append(why if "=" in why else f"{why or name}={text}")  # a switch's: ours' whole item
        else:
            t.lines.append(Line(f"{key} {name}", text, verdict, why))
    if kept:
        same_list = kept == [str(v) for v in (value if isinstance(value, list) else [value])]
        t.set(key, kept, key, value, KEPT if same_list else RENAMED)
        if not same_list:
            note(t, f"network_args = {kept}")
    else:
        t.drop(key, value, "none of its arguments is carried (each said above)")


def _network_train_unet_only(t: Translation, key: str, value: Any) -> None:
    if not reads(t, "clip_l"):
        t.drop(key, value, f"{title(t)} has no CLIP-L: sd-scripts trains the transformer only too")
    elif is_true(value):
        t.drop(key, value, "ours trains the transformer's LoRA only")
    elif clip_l_lr_zero(t):
        t.drop(key, value, "text_encoder_lr 0: sd-scripts trains the transformer's LoRA only too (a CLIP-L one at lr 0 "
                           "stays as made)")
    else:
        t.refuse(key, value, "sd-scripts then trains a CLIP-L LoRA too; ours trains the transformer's only")


def _text_encoder_lr(t: Translation, key: str, value: Any) -> None:
    if trains_clip_l(t):
        t.refuse(key, value, "the CLIP-L LoRA's rate: ours trains no text encoder LoRA")
    else:
        t.drop(key, value, "0: sd-scripts does not train the CLIP-L LoRA at it, as ours" if clip_l_lr_zero(t) else
               "no text encoder LoRA is trained (network_train_unet_only)")


def _learning_rate(t: Translation, key: str, value: Any) -> None:
    """unet_lr is the transformer's rate where given (train_network: prepare_optimizer_params); learning_rate
    else (and the text encoders', which are not trained here)."""
    if key == "learning_rate" and their(t, "unet_lr") is not None:
        t.drop(key, value, "unet_lr sets the transformer's rate")
    else:
        t.set("learning_rate", float(value), key, value, KEPT if key == "learning_rate" else RENAMED)


def _base_weights(t: Translation, key: str, value: Any) -> None:
    """base_weights (+ base_weights_multiplier, 1.0 where missing): LoRAs merged into the base before training."""
    if key == "base_weights_multiplier":
        t.drop(key, value, "in base_loras' ratios" if their(t, "base_weights") else "no base_weights")
        return
    if is_off(value):
        t.drop(key, value, "empty: nothing merged")
        return
    paths = value if isinstance(value, list) else [value]
    ratios = their(t, "base_weights_multiplier")
    ratios = ratios if isinstance(ratios, list) else [] if ratios is None else [ratios]
    entries = [f"{path}:{float(ratios[i]) if i < len(ratios) else 1.0:g}" for i, path in enumerate(paths)]
    t.set("base_loras", entries, key, value, RENAMED)
    note(t, f"base_loras = {entries} (merged into the frozen base before training, as sd-scripts)")


# ----------------------------------------------------------------------------------------------
# Saves, samples, logs


def _save_last_n(t: Translation, key: str, value: Any) -> None:
    """save_last_n_epochs (epoch saves kept), save_last_n_steps (a window of steps: N // save_every_n_steps + 1
    saves kept, train_util.get_remove_step_no): ours keeps one count of the newest saves."""
    every = their(t, "save_every_n_epochs" if key == "save_last_n_epochs" else "save_every_n_steps")
    if is_off(value) or not every:
        t.drop(key, value, "off" if is_off(value) else f"no {key.replace('last_n', 'every_n')}: nothing to prune")
        return
    keep = int(value) if key == "save_last_n_epochs" else int(value) // int(every) + 1
    if t.config.get("save_last_n_saves", keep) != keep:
        t.refuse(key, value, f"ours keeps one count of saves: save_last_n_saves = {t.config['save_last_n_saves']} "
                             f"already")
        return
    t.set("save_last_n_saves", keep, key, value, RENAMED)
    note(t, f"save_last_n_saves = {keep}")


def _log_prefix(t: Translation, key: str, value: Any) -> None:
    if is_off(value):
        t.drop(key, value, "empty: ours' default (output_name)")
    elif their(t, "logging_dir") or their(t, "log_with"):
        t.set(key, str(value), key, value)
    else:
        t.drop(key, value, "no logging_dir or log_with: nothing is logged")


def _persistent_workers(t: Translation, key: str, value: Any) -> None:
    on = not is_off(value)  # true, or the kohya_ss GUI's 1 (sd-scripts passes it on as it is: truthy)
    if on and not t.given.get("max_data_loader_n_workers"):
        t.drop(key, value, "ours loads cached latents without workers unless max_data_loader_n_workers "
                           "is set (sd-scripts' default 8)")
    else:
        t.set(key, on, key, value)


def _validate_every_n_steps(t: Translation, key: str, value: Any) -> None:
    if dataset_rules.holds_out_images(t):
        t.set(key, value, key, value)
    else:
        t.drop(key, value, "no validation_split: sd-scripts validates nothing")


def _validate_every_n_epochs(t: Translation, key: str, value: Any) -> None:
    """Unset, sd-scripts validates at every epoch's end where it holds images out: ours 1."""
    if dataset_rules.holds_out_images(t):
        t.set(key, 1 if value is None else int(value), key, value, note="" if value else "every epoch, as sd-scripts")
    else:
        t.drop(key, value, "no validation_split: sd-scripts validates nothing")


def _dataset_config(t: Translation, key: str, value: Any) -> None:
    if is_off(value):
        t.drop(key, value, "empty: no dataset TOML")
    elif t.dataset is None:
        t.drop(key, value, "its dataset has nothing ours can train (said above)")
    else:
        t.lines.append(Line(key, value, RENAMED, "dataset_config: ours, written beside (OUT_dataset.toml)"))


# ----------------------------------------------------------------------------------------------
# The rules: every argument of its script's parser


IGNORED = models.ignored_text(models.first_script())  # a key of its parser its training of these models does not read
HEADER_TEXT = "text for the LoRA's header: ours writes none (the training is the same)"
# the header's note and ModelSpec text: the same keys in ours (its other metadata_* are ignored below)
HEADER_KEYS = ("training_comment", *(key for key in SCHEMA if key.startswith("metadata_")))
UPLOAD = "a Hugging Face upload: ours uploads nothing (upload the LoRA yourself)"
DEEPSPEED = "DeepSpeed: ours runs DDP or FSDP through accelerate launch (configs/accelerate/)"


def _network_weights(t: Translation, key: str, value: Any) -> None:
    """The LoRA file training starts from. sd-scripts builds the network at network_alpha / network_dim and then
    loads the file (train_network.py, its "FIXME consider alpha of weights"): the file's alpha is loaded, unread,
    unless dim_from_weights builds the network from the file. Ours trains at the file's alpha: the note says so."""
    if is_off(value):
        t.drop(key, value, "empty: the LoRA starts new")
        return
    t.set(key, value, key, value, KEPT, note="" if is_true(their(t, "dim_from_weights")) else (
        f"sd-scripts trains it at network_alpha / network_dim ({their(t, 'network_alpha')} / "
        f"{their(t, 'network_dim')}) whatever alpha the file holds; ours at the file's alpha (set dim_from_weights, "
        f"or a network_alpha equal to the file's, for the same scale in both)"))


RULES: dict[str, Rule] = {
    # the model and its files
    "model_type": custom(_model_type),
    "pretrained_model_name_or_path": same(),
    "clip_l": custom(_clip_l),
    "t5xxl": same(),
    "ae": same(),
    "t5xxl_max_token_length": same(),
    "apply_t5_attn_mask": custom(_apply_t5_attn_mask),
    "guidance_scale": custom(_guidance_scale),
    "controlnet_model_name_or_path": ignored(IGNORED + " (its ControlNet training script does)"),
    **{key: ignored(IGNORED + " (Stable Diffusion's)")
       for key in ("v2", "v_parameterization", "clip_skip", "max_token_length", "vae")},
    "no_half_vae": ignored("ours encodes latents in float32 always"),
    "tokenizer_cache_dir": ignored("a tokenizer download cache: ours downloads nothing"),
    "disable_mmap_load_safetensors": ignored("a file-loading switch"),
    # precision and memory
    "mixed_precision": same(),
    **{key: unsupported("ours keeps the LoRA weights and their gradients in float32 (mixed_precision is the compute "
                        "dtype)") for key in ("full_fp16", "full_bf16")},
    "fp8_base": custom(_fp8_base),
    "fp8_base_unet": custom(_fp8_base),
    "gradient_checkpointing": same(),
    "cpu_offload_checkpointing": ignored("memory only: ours offloads no activations; blocks_to_swap frees memory instead"),
    "blocks_to_swap": custom(_blocks_to_swap),
    "split_mode": custom(_split_mode),
    **{key: ignored("memory machinery") for key in ("highvram", "lowram")},
    **{key: ignored("the attention kernel: ours runs PyTorch's SDPA (the same attention)")
       for key in ("sdpa", "xformers", "mem_eff_attn")},
    "torch_compile": same(),
    "dynamo_backend": ignored("ours compiles with inductor"),
    **{key: ignored("DDP machinery (accelerate launch runs ours)")
       for key in ("ddp_timeout", "ddp_gradient_as_bucket_view", "ddp_static_graph")},
    **{key: ignored(DEEPSPEED) for key in (
        "deepspeed", "zero_stage", "offload_optimizer_device", "offload_optimizer_nvme_path", "offload_param_device",
        "offload_param_nvme_path", "zero3_init_flag", "zero3_save_16bit_model", "fp16_master_weights_and_gradients")},
    "max_data_loader_n_workers": same(),
    "persistent_data_loader_workers": custom(_persistent_workers),
    "seed": same(),
    # caching
    "cache_latents": ignored("ours always caches the latents before training"),
    "cache_text_encoder_outputs": ignored("ours always caches the text encoders' outputs before training"),
    "cache_latents_to_disk": same(),
    "cache_text_encoder_outputs_to_disk": same(),
    "vae_batch_size": unless_off("0: sd-scripts then encodes one image at a time; how many changes memory only"),
    "text_encoder_batch_size": same(),
    "skip_cache_check": ignored("ours checks its caches by content hash"),
    # the network
    "network_module": custom(_network_module),
    "network_dim": same(),
    "network_alpha": same(),
    "network_args": custom(_network_args),
    "network_weights": custom(_network_weights),
    "network_dropout": same(),
    "dim_from_weights": same(),
    "scale_weight_norms": unless_off("0: off (sd-scripts scales nothing)"),
    "network_train_unet_only": custom(_network_train_unet_only),
    "network_train_text_encoder_only": unsupported("ours trains the transformer's LoRA"),
    "text_encoder_lr": custom(_text_encoder_lr),
    "unet_lr": custom(_learning_rate),
    "base_weights": custom(_base_weights),
    "base_weights_multiplier": custom(_base_weights),
    "no_metadata": unsupported("ours always writes the training metadata (folder names, tag counts) into the LoRA"),
    **{key: same() for key in HEADER_KEYS},  # the header's note and ModelSpec text, the same keys
    **{key: ignored(HEADER_TEXT) for key in (
        "metadata_thumbnail", "metadata_merged_from", "metadata_preprocessor", "metadata_is_negative_embedding")},
    # the optimizer, its schedule, the timestep draw, the prediction and the loss (sd_scripts_training.py)
    **training_rules.RULES,
    "learning_rate": custom(_learning_rate),  # unet_lr's too (the network's)
    # saves
    "output_dir": same(),
    "output_name": same(),
    "save_model_as": implied(lambda v: v in ("safetensors", None, "None"), "ours saves .safetensors"),
    "save_precision": unless_off("empty: sd-scripts saves the float32 weights, as ours"),
    "save_every_n_epochs": same(),
    "save_every_n_steps": same(),
    "save_n_epoch_ratio": unsupported("ours saves every save_every_n_epochs / save_every_n_steps"),
    "save_last_n_epochs": custom(_save_last_n),
    "save_last_n_steps": custom(_save_last_n),
    **{key: unsupported("ours keeps one state, the newest (<output_name>-state), replaced at each save")
       for key in ("save_last_n_epochs_state", "save_last_n_steps_state")},
    "save_state": same(),
    "save_state_on_train_end": same(),
    "resume": unsupported("an sd-scripts state folder: ours resumes only its own states"),
    **{key: unsupported("ours starts at step 0, or where a state of its own left off")
       for key in ("initial_epoch", "initial_step", "skip_until_initial_step")},
    **{key: ignored(UPLOAD) for key in (
        "huggingface_repo_id", "huggingface_repo_type", "huggingface_path_in_repo", "huggingface_token",
        "huggingface_repo_visibility", "save_state_to_huggingface", "async_upload")},
    "resume_from_huggingface": unsupported("resumes a state from the Hub: ours resumes only its own local states"),
    # samples, validation and logs
    **sd_scripts_samples.RULES,  # sample_prompts, sample_every_n_steps / _epochs, sample_at_first, sample_sampler
    "validate_every_n_steps": custom(_validate_every_n_steps),
    "validate_every_n_epochs": custom(_validate_every_n_epochs),
    "max_validation_steps": unsupported("ours validates on every held-out image"),
    "logging_dir": unless_off("empty: no TensorBoard log"),
    "log_with": unless_off("empty: sd-scripts' default (TensorBoard with logging_dir), as ours"),
    "log_prefix": custom(_log_prefix),
    "log_tracker_name": ignored("the tracker's project: ours names it log_prefix (default output_name)"),
    "wandb_run_name": ignored("ours names each run by its start time"),
    "wandb_api_key": ignored("log in with `wandb login`"),
    "log_tracker_config": ignored("a tracker config file: ours has none"),
    "log_config": ignored("the config logged to the tracker: ours logs none"),
    **{key: ignored("console logging") for key in ("console_log_level", "console_log_file", "console_log_simple")},
    # the dataset (sd_scripts_dataset.py)
    "dataset_config": custom(_dataset_config),
    **dataset_rules.ARG_RULES,
    "dataset_class": unsupported("a dataset class of its own: ours reads image folders"),
    "debug_dataset": unsupported("shows the dataset without training: tools/check_dataset.py checks ours"),
    "config_file": ignored("its keys are read into this translation"),
    "output_config": ignored("writes the config and trains nothing"),
}


# ----------------------------------------------------------------------------------------------
# The translation


# Each of the specs' scripts' rules: the first's RULES, a script of its own's from them (sd_scripts_script.py).
SCRIPT_RULES = {script: RULES if script == models.first_script() else script_rules.rules_of(script, RULES)
                for script in models.scripts()}


def translate(config: dict, source: str, *, model_type=None, dataset=None, dataset_source=None, script=None) -> Translation:
    """sd-scripts' config (its TOML, or a command line's keys) and its dataset TOML as ours."""
    flat = flatten_tables(config)
    t = Translation("sd-scripts", source, given=flat)
    t.config["model_type"] = model_of(flat, model_type, script, source)
    rules = SCRIPT_RULES[script_of(t)]
    t.dataset = dataset_rules.dataset_of(t, flat, dataset, dataset_source)
    for key, value in flat.items():
        try:
            apply_rule(t, key, value, kohya_ss.KEYS.get(key, rules.get(key)))
        except (TypeError, ValueError) as e:  # a value of another type (float("")): one line naming the key
            raise ValueError(str(e) if str(e).startswith(source) else f"{source}: {key} = {value!r}: {e}") from None
    carry_defaults(t, flat, rules)
    dataset_rules.finish(t)
    fit_schema(t)
    return t


def carry_defaults(t: Translation, flat: dict, rules: dict[str, Rule]) -> None:
    """The keys the config leaves out whose sd-scripts default trains otherwise than ours (and those its script's
    parser defaults otherwise: its spec's defaults): translated at that default, each line marked `(default)` (a
    default that asks for what we do is left out). A key its script's parser lacks has none."""
    script = script_of(t)
    for key in dict.fromkeys((*DEFAULTS_CARRIED, *models.entry(script).defaults)):
        if key in flat or key not in rules or (key == "learning_rate" and "unet_lr" in flat):
            continue
        _apply_default(t, key, their_default(key, script), rules[key])
    model = flat.get("pretrained_model_name_or_path")
    for key in models.entry(script).files_in_model:  # read from an all-in-one checkpoint where not given
        if key not in flat and isinstance(model, str) and model:
            _apply_default(t, key, model, rules[key], "the model file itself: sd-scripts reads this part of an "
                                                       "all-in-one checkpoint where it is not given; ours' loader "
                                                       "takes the checkpoint as its path too")


def _apply_default(t: Translation, key: str, value: Any, rule: Rule, why: str = "") -> None:
    """One left-out key translated at the value sd-scripts runs with, its lines marked `(default)` (a default that
    asks for what we do is left out); why: a note on each line kept."""
    first = len(t.lines)
    apply_rule(t, key, value, rule)
    for line in t.lines[first:]:
        line.key = f"{line.key} (default)"
        line.note = line.note or why
    t.lines[first:] = [line for line in t.lines[first:] if line.verdict != DROPPED]


def fit_schema(t: Translation) -> None:
    """Values as our schema types them, where a command line could not tell (an output_name of digits read
    as a number, a list given as one word)."""
    for key, value in t.config.items():
        kind = SCHEMA[key].type if key in SCHEMA else None
        if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            t.config[key] = str(value)
        elif kind is list and not isinstance(value, list):
            t.config[key] = [str(value)]
        elif kind is list:
            t.config[key] = [str(v) for v in value]
        elif kind is float and isinstance(value, int) and not isinstance(value, bool):
            t.config[key] = float(value)
