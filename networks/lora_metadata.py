"""A LoRA file's safetensors header: the training facts as sd-scripts' `ss_*` keys (and ours where sd-scripts
has none), Stability's ModelSpec keys as sd-scripts and musubi-tuner write them, the rank / alpha a header
states, and the expert counts of packed weights' modules (ours). networks/lora_files.py writes the tensors and the
hashes over them."""

from __future__ import annotations

import datetime
import json
import os

import torch

from library.io import CheckpointError

# ModelSpec's "0x" + sha256 of the bytes after the header (sshs_model_hash with "0x"): metadata editors (SwarmUI's)
# write it into a header, and SwarmUI shows and records it as the model's hash. sd-scripts / musubi-tuner write none;
# write_lora_tensors (networks/lora_files.py) sets it over the tensors it writes.
MODELSPEC_HASH = "modelspec.hash_sha256"

MODELSPEC_TEXTS = ("author", "description", "license", "tags", "usage_hint", "trigger_phrase")  # metadata_<name>

# build_metadata field -> safetensors header key (sd-scripts names where sd-scripts has one).
METADATA_KEYS = {
    "network_module": "ss_network_module",
    "network_dim": "ss_network_dim",
    "network_alpha": "ss_network_alpha",
    "network_args": "ss_network_args",
    "network_dropout": "ss_network_dropout",  # sd-scripts' key beside its `dropout` in ss_network_args
    "base_model_version": "ss_base_model_version",
    "base_model": "ss_sd_model_name",
    "base_precision": "ss_base_precision",
    "fp8_compute": "ss_fp8_compute",  # the base's Linears ran as fp8 GEMMs (library/precision/fp8_compute.py)
    "base_loras": "ss_base_loras",  # LoRAs merged into the frozen base while training (not in this file)
    "scale_weight_norms": "ss_scale_weight_norms",  # sd-scripts' max-norm regularization's bound
    "ip_noise_gamma": "ss_ip_noise_gamma",  # sd-scripts' input perturbation (written where it is on)
    "output_preservation": "ss_output_preservation",  # diff_output_preservation / blank_prompt_preservation's prompt
    "trained_keys": "ss_trained_keys",  # the family's keys it renders right only with (ConfigKey.renders), as set
    "mixed_precision": "ss_mixed_precision",
    "resolution": "ss_resolution",
    "steps": "ss_steps",  # optimizer steps trained (fewer than max_steps after a Ctrl-C)
    "max_steps": "ss_max_train_steps",  # as configured
    "epochs": "ss_num_epochs",  # the run's epochs as planned (sd-scripts' num_train_epochs)
    "epoch": "ss_epoch",  # the epoch the save falls in, from 1 (the last one for the final file)
    "batch_size": "ss_total_batch_size",
    "optimizer": "ss_optimizer",
    "lr": "ss_learning_rate",
    "lr_scheduler": "ss_lr_scheduler",
    "lr_warmup_steps": "ss_lr_warmup_steps",  # as configured: steps, or a fraction of the run's below 1
    "gradient_accumulation_steps": "ss_gradient_accumulation_steps",
    "max_grad_norm": "ss_max_grad_norm",  # 0: no clipping
    "timestep_sampling": "ss_timestep_sampling",
    "timestep_bias": "ss_timestep_bias",  # high_noise / low_noise (written where it is not none)
    "min_timestep": "ss_min_timestep",  # the sigmas trained, in thousandths (written where set)
    "max_timestep": "ss_max_timestep",
    "preserve_distribution_shape": "ss_preserve_distribution_shape",  # written where true
    "num_timestep_buckets": "ss_num_timestep_buckets",  # written where > 1 (stratified sigmas)
    "logsnr": "ss_logsnr_mean_std",  # [mean, std] of timestep_sampling = "logsnr" or "qinglong" (written with them)
    "shifted_draw": "ss_shifted_draw",  # "uniform" / "mode" where the shift moves that draw (written then only)
    "sigmoid_mean": "ss_sigmoid_mean",  # the sigmoid draw's centre (written where it is not 0)
    "mode_scale": "ss_mode_scale",  # the mode law's scale (written where a mode draw is drawn)
    # timestep_loss_weights' table: {file (its name), count, mean} (written where set)
    "timestep_loss_weights": "ss_timestep_loss_weights",
    "qinglong": "ss_qinglong",  # {logsnr_share, detail_share, mid} of timestep_sampling = "qinglong" (with it only)
    "shift": "ss_discrete_flow_shift",
    "guidance": "ss_guidance_scale",
    "seed": "ss_seed",
    "dataset": "ss_datasets",
    "dataset_dirs": "ss_dataset_dirs",  # sd-scripts': {folder: {"n_repeats", "img_count"}}, training folders
    "tag_frequency": "ss_tag_frequency",  # sd-scripts': {folder: {tag: count}}, what A1111 / Civitai show
    "num_train_images": "ss_num_train_images",  # images x num_repeats (sd-scripts' count)
    "num_reg_images": "ss_num_reg_images",
    "num_batches_per_epoch": "ss_num_batches_per_epoch",  # this process's batches per epoch
    "training_started_at": "ss_training_started_at",
    "training_finished_at": "ss_training_finished_at",
    "training_seconds": "ss_training_seconds",
    "output_name": "ss_output_name",
    "training_comment": "ss_training_comment",  # the config's note (sd-scripts' key)
    # Stability's ModelSpec (sd-scripts' / musubi-tuner's sai_model_spec.build_metadata; modelspec_fields)
    "modelspec_version": "modelspec.sai_model_spec",
    "modelspec_architecture": "modelspec.architecture",  # the release's (its spec's modelspec) + "/lora"
    "modelspec_implementation": "modelspec.implementation",
    "modelspec_title": "modelspec.title",
    "modelspec_resolution": "modelspec.resolution",  # "WxH"
    "modelspec_date": "modelspec.date",
    "modelspec_hash": MODELSPEC_HASH,  # write_lora_tensors sets it to the written tensors'
    # the config's metadata_* (sd-scripts' add_model_spec_arguments): written where set
    **{f"modelspec_{name}": f"modelspec.{name}" for name in MODELSPEC_TEXTS},
}

# The ModelSpec version the keys follow: the spec's own (Stability-AI/ModelSpec README), musubi-tuner's; sd-scripts
# writes 1.0.1 over the same keys.
MODELSPEC_VERSION = "1.0.0"


def modelspec_fields(names, title: str, resolution: str, timestamp: float) -> dict[str, str]:
    """build_metadata's ModelSpec fields of a trained LoRA of the release `names` (an ArchSpec.modelspec entry) as
    sd-scripts' and musubi-tuner's sai_model_spec.build_metadata write them: "<architecture>/lora", the
    implementation, the title (their default: output_name), the resolution "WxH" (width x height: sd-scripts' of
    its resolution, ours of the first dataset's), the save's date in ISO 8601 local time to the second
    (datetime.fromtimestamp(int(t)).isoformat()); and modelspec.hash_sha256, which neither writes (the spec's
    SHOULD: write_lora_tensors fills it in)."""
    return {"modelspec_version": MODELSPEC_VERSION, "modelspec_architecture": f"{names.architecture}/lora",
            "modelspec_implementation": names.implementation, "modelspec_title": title,
            "modelspec_resolution": resolution,
            "modelspec_date": datetime.datetime.fromtimestamp(int(timestamp)).isoformat(), "modelspec_hash": "0x"}


def dim_and_alpha(ranks, alphas) -> tuple[str, str]:
    """(ss_network_dim, ss_network_alpha) of modules of these ranks and alphas: the value they all share,
    else "Dynamic"; both "Dynamic" where the ranks differ, as sd-scripts' resize_lora.py writes for a
    file of per-module ranks (--dynamic_method)."""
    ranks, alphas = set(ranks), {float(a) for a in alphas}
    if len(ranks) != 1:
        return "Dynamic", "Dynamic"
    return str(ranks.pop()), f"{alphas.pop():g}" if len(alphas) == 1 else "Dynamic"


def _strip_paths(value):
    """Paths -> basenames (a LoRA header must not leak the trainer's file system): absolute ones, and
    relative ones that exist (sd-scripts' ss_sd_model_name); a hub id ('org/model') is no path here."""
    if isinstance(value, str):
        is_path = os.path.isabs(value) or (("/" in value or os.sep in value) and os.path.exists(value))
        return os.path.basename(value.rstrip("/\\")) if is_path else value
    if isinstance(value, dict):
        return {k: _strip_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strip_paths(v) for v in value]
    return value


def build_metadata(**fields) -> dict[str, str]:
    """Training facts -> safetensors header (all strings; dicts/lists as json; None dropped;
    paths reduced to basenames: _strip_paths). Fields are the keys of METADATA_KEYS; `sshs_model_hash`
    is added by the writers, over the tensors actually written."""
    unknown = [k for k in fields if k not in METADATA_KEYS]
    if unknown:
        raise ValueError(f"build_metadata: unknown field '{unknown[0]}' (known: {', '.join(METADATA_KEYS)})")
    out = {}
    for field, value in fields.items():
        if value is None:
            continue
        value = _strip_paths(value)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        out[METADATA_KEYS[field]] = str(value)
    return out


# Header entry of a LoRA with packed weights' modules (LoRAWeights.experts), ours in every layout: json {dotted
# module path: E}. The shapes [r E, N] / [K, r E] do not tell r from E, and alpha / r needs r.
PACKED_EXPERTS_KEY = "lora_packed_experts"


def packed_experts_header(weights: dict) -> dict[str, str]:
    """The PACKED_EXPERTS_KEY header entry of `weights` ({path: lora_files.LoRAWeights}; {} where no module is a
    packed weight's)."""
    experts = {path: w.experts for path, w in sorted(weights.items()) if w.experts}
    return {PACKED_EXPERTS_KEY: json.dumps(experts)} if experts else {}


def packed_experts(metadata: dict[str, str], source: str = "LoRA",
                   known: dict[str, int] | None = None) -> dict[str, int]:
    """{module path: E} of a LoRA's packed weights: the header's (PACKED_EXPERTS_KEY) and `known` (the target's, by
    the model or checkpoint it is applied to); one that both name with another E is a CheckpointError."""
    try:
        said = json.loads(metadata.get(PACKED_EXPERTS_KEY) or "{}")
        ok = isinstance(said, dict) and all(type(e) is int and e > 0 for e in said.values())
    except ValueError:
        ok = False
    if not ok:
        raise CheckpointError(f"{source}: header entry {PACKED_EXPERTS_KEY} = {metadata[PACKED_EXPERTS_KEY]!r}: "
                              f"expected a JSON object of module path -> expert count")
    for path, e in (known or {}).items():
        if said.get(path, e) != e:
            raise CheckpointError(f"{source}: module '{path}' is a LoRA of {said[path]} experts (its header "
                                  f"{PACKED_EXPERTS_KEY}), the weight it applies to has {e}")
    return {**said, **(known or {})}
