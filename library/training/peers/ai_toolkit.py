"""ai-toolkit's (ostris) LoRA training YAML read into our training config, dataset TOML and sample prompts.

The YAML is `job` / `config: {name, process: [{type, training_folder, trigger_word, network, save,
datasets, train, model, sample, logging}]}`; one process (a LoRA trainer: sd_trainer, diffusion_trainer,
ui_trainer) is translated. Keys are named by their dotted path in the process: "train.lr",
"train.ema_config.ema_decay", "network.network_kwargs.only_if_contains", "trigger_word"; the job's own
as "job", "config.name", "meta"; a dataset's keys as "datasets[].folder_path" in RULES and
"datasets[0].folder_path" in the report; the older model switches (model.is_xl, ...) share the rule
"model.is_*", model.use_<arch>_cfg the rule "model.use_*_cfg". A key left out whose ai-toolkit default
differs from ours (train.lr 1e-6, train.steps 1000, network.linear 4 ...: DEFAULTS) is read at that
default and reported as "<key> (ai-toolkit's default)", so the run is ai-toolkit's, not ours.

This module names the keys (RULES) and runs the translation; the sections' rules are in
ai_toolkit_model.py (model, network, save), ai_toolkit_train.py (train) and ai_toolkit_data.py (datasets
and samples). The model: model.arch (or model.is_<arch>) names it, the family specs' peer_models say
which of ours it is (library/models/<family>/spec.py), and an arch none lists is one ValueError.
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any

from library.training.peers.ai_toolkit_data import DATASET_RULES, SAMPLE_RULES, sample_prompts, to_dataset_toml
from library.training.peers.ai_toolkit_model import (MODEL_RULES, NETWORK_RULES, PEER, SAVE_RULES, Job, entry_config,
                                                    entry_of, model_keys, read_elsewhere, unset_model_options)
from library.training.peers.ai_toolkit_train import ADAPTIVE, TRAIN_RULES, clipping
from library.training.peers.rules import (NOT_CARRIED, RENAMED, Line, Rule, Translation, apply_rule, custom, ignored,
                                          implied, renamed, unsupported)

LORA_TRAINERS = ("sd_trainer", "diffusion_trainer", "ui_trainer")  # extensions_built_in/sd_trainer's process types
# Dicts read as one value (their keys are the optimizer's, the scheduler's, the model's), not flattened.
LEAF_DICTS = ("train.optimizer_params", "train.lr_scheduler_params", "train.validation_config", "model.model_kwargs",
              "model.quantize_kwargs", "model.model_paths", "network.lorm")
# ai-toolkit's defaults where they differ from ours (toolkit/config_modules.py): read when the key is left out.
DEFAULTS = {"train.steps": 1000, "train.lr": 1e-6, "train.optimizer": "adamw", "train.dtype": "fp32",
            "train.gradient_checkpointing": True, "train.timestep_type": "sigmoid", "save.dtype": "float16",
            "save.save_every": 1000, "save.max_step_saves_to_keep": 5}


# ----------------------------------------------------------------------------------------------
# The job, the process, logging


def _output_dir(t: Job, key: str, value: Any) -> None:
    """ai-toolkit writes into training_folder/<name>/ (the LoRA as <name>.safetensors, and its steps)."""
    name = t.config.get("output_name", "lora")
    t.set("output_dir", os.path.join(str(value), name), key, value, RENAMED, f"output_dir ({value}/{name}, as ai-toolkit's)")


PROCESS_RULES: dict[str, Rule] = {
    "job": implied(lambda v: v == "extension", "ai-toolkit's job that runs its trainers"),
    "config.name": renamed("output_name"),
    "meta": ignored("ai-toolkit's extra header fields: ours writes its own metadata"),
    "type": implied(lambda v: v in LORA_TRAINERS, "ai-toolkit's LoRA trainer"),
    "training_folder": custom(_output_dir),
    "device": ignored("accelerate chooses the device (CUDA_VISIBLE_DEVICES, accelerate config)"),
    "trigger_word": custom(read_elsewhere),  # the datasets' captions (ai_toolkit_data.add_trigger), the prompts, DOP
    "training_seed": renamed("seed"),
    "log_dir": renamed("logging_dir"),
    "performance_log_every": ignored("ai-toolkit's timing printout"),
    "sqlite_db_path": ignored("ai-toolkit's web UI's job database"),
    "first_sample": ignored("ai-toolkit's own settings for the first samples: ours renders the sample section's"),
    "logging.use_wandb": custom(lambda t, key, value: t.set("log_with", "wandb", key, value, RENAMED, "log_with = wandb")
                                if value else t.drop(key, value, "off")),
    "logging.project_name": ignored("wandb's project name (ours: log_prefix, default output_name)"),
    "logging.run_name": ignored("wandb's run name"),
    "logging.log_every": ignored("ours logs every step"),
    "logging.verbose": ignored("ai-toolkit's printout"),
    "logging.use_ui_logger": ignored("ai-toolkit's web UI"),
    **{k: unsupported("trains something else than a LoRA: not ours") for k in (
        "adapter", "embedding", "decorator", "slider", "guidance")},
}


RULES: dict[str, Rule] = {**PROCESS_RULES, **MODEL_RULES, **NETWORK_RULES, **SAVE_RULES, **TRAIN_RULES,
                          **DATASET_RULES, **SAMPLE_RULES}


def rule_for(key: str) -> Rule | None:
    """The rule of a key as the report names it ("train.lr", "train.steps (ai-toolkit's default)", model.is_xl)."""
    key = key.split(" (")[0]
    return RULES.get(key) or next((RULES[k] for k in RULES if "*" in k and fnmatch.fnmatchcase(key, k)), None)


# ----------------------------------------------------------------------------------------------
# The translation


def translate(config: dict, source: str, *, model_type=None, dataset=None, dataset_source=None, script=None) -> Translation:
    """ai-toolkit's whole YAML document (dataset and script: other peers' inputs, unused) into ours."""
    process = _the_process(config, source)
    t = Job(PEER, source, process=process)
    keys = model_keys(t, source, model_type)
    t.model_type = keys["model_type"]
    t.config.update(entry_config(keys))  # (its network args: _modulation)
    if not t.section("model").get("name_or_path"):
        raise ValueError(f"{source}: model.name_or_path is required (the model to train: a diffusers folder, a file "
                         f"or a Hub id)")
    if not isinstance(process.get("network"), dict):
        trains = (f"its {process['adapter'].get('type', 'adapter')} adapter" if isinstance(process.get("adapter"), dict)
                  else "the whole model (a fine-tune)")
        raise ValueError(f"{source}: the process has no network: ai-toolkit then trains {trains}; ours trains LoRAs")
    for key, value in _flat_keys(config, process).items():
        apply_rule(t, key, value, rule_for(key))
    train = t.section("train")
    trigger = process.get("trigger_word")
    for where, word in [("trigger_word", trigger)] + [(f"datasets[{i}].trigger_word", d.get("trigger_word"))
                                                      for i, d in enumerate(process.get("datasets") or [])
                                                      if isinstance(d, dict)]:
        if word is not None and not isinstance(word, str):  # ai-toolkit fails on it too (str methods)
            raise ValueError(f"{source}: {where} must be text (quote it: \"{word}\"), got {word!r}")
    t.dataset = to_dataset_toml(t, process.get("datasets"), train, trigger)
    text = sample_prompts(t, t.section("sample"), train, trigger) if "sample" in process else None
    if text:
        t.files["sample_prompts"] = ("_prompts.txt", text)
    for key in ("skip_first_sample", "force_first_sample", "disable_sampling"):
        if key in train and (not text or key == "disable_sampling"):
            t.drop(f"train.{key}", train[key], "off" if text else "no samples")
    unset_model_options(t)
    _modulation(t)
    _finish(t)
    return t


def _the_process(config: dict, source: str) -> dict:
    """The one LoRA process of ai-toolkit's job, with the job-level keys its processes fall back to."""
    job = config.get("config")
    if not isinstance(job, dict) or not isinstance(job.get("process"), list) or not job["process"]:
        raise ValueError(f"{source}: expected ai-toolkit's job (config: {{name, process: [...]}}), got keys "
                         f"{', '.join(map(str, config)) or 'none'}")
    kinds = {p.get("type") for p in job["process"] if isinstance(p, dict)}
    if len(job["process"]) > 1 and kinds & set(LORA_TRAINERS):  # (other processes: the job's kind is said below)
        raise ValueError(f"{source}: {len(job['process'])} processes; ours translates one (a file per process)")
    process = job["process"][0]
    if not isinstance(process, dict):
        raise ValueError(f"{source}: config.process[0] must be a mapping, got {process!r}")
    if process.get("type") not in LORA_TRAINERS:
        raise ValueError(f"{source}: process type {process.get('type')!r}: ours translates ai-toolkit's LoRA "
                         f"trainers ({', '.join(LORA_TRAINERS)})")
    return {**{k: job[k] for k in ("training_folder", "log_dir", "training_seed", "device") if k in job}, **process}


def _flat_keys(config: dict, process: dict) -> dict[str, Any]:
    """Every key but datasets and samples (ai_toolkit_data reads those), by its dotted path, then ai-toolkit's
    defaults for those left out ("<key> (ai-toolkit's default)")."""
    flat = {"job": config.get("job"), "config.name": config["config"].get("name")}
    flat = {k: v for k, v in flat.items() if v is not None}
    flat.update({k: v for k, v in config.items() if k not in ("job", "config")})
    flat.update({f"config.{k}": v for k, v in config["config"].items()
                 if k not in ("name", "process", "training_folder", "log_dir", "training_seed", "device")})
    flat.update(_flatten({k: v for k, v in process.items() if k not in ("datasets", "sample")}))
    network, model = process.get("network") or {}, process.get("model") or {}
    defaults = dict(DEFAULTS)
    if str(network.get("type", "lora")).lower() == "lora":  # the rank and alpha ai-toolkit gives a LoRA
        defaults.update({k: v for k, v, given in (("network.linear", 4, ("linear", "rank")),
                                                  ("network.linear_alpha", 1.0, ("linear_alpha", "alpha")))
                         if not any(g in network for g in given)})
    if "quantize" in model:  # quantize_te follows quantize
        defaults["model.quantize_te"] = model["quantize"]
    if (process.get("train") or {}).get("lr_scheduler_params"):  # read with its schedule, ai-toolkit's default one
        defaults["train.lr_scheduler"] = "constant"
    for key, value in defaults.items():
        if key not in flat:
            flat[f"{key} (ai-toolkit's default)"] = value
    return flat


def _flatten(section: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in section.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in LEAF_DICTS:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _modulation(t: Job) -> None:
    """ai-toolkit's LoRA wraps every Linear inside the transformer blocks (lora_special.py, transformer_only), the
    blocks' modulation too; where ours leaves the modulation out by default, train_modulation=true trains it."""
    from library.models.registry import spec_of
    from library.training.config_schema import SCHEMA

    lora = spec_of(t.model_type).lora
    if lora.modulation_types and not lora.modulation_default:
        t.network_args.append("train_modulation=true")
        t.lines.append(Line("network_args (added)", "train_modulation=true", RENAMED, "network_args",
                            "ai-toolkit's LoRA wraps every Linear of the blocks, their modulation too"))
    # where the Linears its LoRA wraps are others than ours' default trains: the model's peer entry names the args
    # (the ranks of modules ours trains only with their own, a 0 for one ours trains and it does not), for its
    # transformer_only LoRA (its default) and its whole-model one
    rank = t.config.get("network_dim", SCHEMA["network_dim"].default)
    entry = entry_of(t.model_type)
    which = "network_args" if t.section("network").get("transformer_only", True) else "whole_network_args"
    added = [arg.format(network_dim=rank) for arg in entry.get(which, "").split()]  # items, space-separated
    if added and t.config.get("network_module") == "lycoris.kohya":
        t.lines.append(Line("network_args (added)", added, NOT_CARRIED, f"ai-toolkit's LoKr wraps these blocks too; "
                                                                         f"ours' LyCORIS takes no rank args"))
    elif added:
        t.network_args += added
        t.lines.append(Line("network_args (added)", ", ".join(added), RENAMED, "network_args",
                            "the Linears ai-toolkit's LoRA wraps (those of the "
                            + ("transformer blocks" if which == "network_args" else "whole model") + "), at its rank"))


def _finish(t: Job) -> None:
    """What several keys give together: network_args, optimizer_args, the adaptive optimizers' lr, the step
    counts of the older gradient_accumulation_steps, and the gradient clip."""
    if t.network_args:
        t.config["network_args"] = t.network_args
    if t.optimizer_args and "optimizer_type" in t.config:
        t.config["optimizer_args"] = [f"{k}={_literal(v)}" for k, v in t.optimizer_args.items()]
    if t.config.get("optimizer_type") in ADAPTIVE and t.config.get("learning_rate", 1.0) < 0.1:
        t.lines.append(Line("train.lr", t.config["learning_rate"], RENAMED, "learning_rate = 1.0 (ai-toolkit runs "
                            f"{t.config['optimizer_type']} at 1.0 below 0.1)"))
        t.config["learning_rate"] = 1.0
    if t.micro_steps > 1:  # the older gradient_accumulation_steps: counts of micro-batches
        for key in ("max_train_steps", "save_every_n_steps", "sample_every_n_steps", "lr_warmup_steps"):
            if isinstance(t.config.get(key), int) and t.config[key]:
                t.config[key] = max(1, t.config[key] // t.micro_steps)
    clipping(t)


def _literal(value: Any) -> str:
    """optimizer_args' Python literal for a YAML value (lists as tuples: betas)."""
    return repr(tuple(value)) if isinstance(value, list) else repr(value)
