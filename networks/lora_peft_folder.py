"""PEFT adapter folders (LLMs) written: adapter_config.json + adapter_model.safetensors, what
PeftModel.from_pretrained, vLLM and llama.cpp's converter read. lora_B is written unscaled: the config holds r /
lora_alpha and rank_pattern / alpha_pattern for the modules that differ (PEFT's scale is alpha / r per module).

Finding and reading one (peft_folder_of, read_adapter_config, lora_reader): networks/lora_files.py.
"""

from __future__ import annotations

import json
import os

import torch

from library.io import CheckpointError, atomic_folder, write_text
from networks.lora_files import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, LoRAWeights, write_lora_tensors

CAUSAL_LM_PREFIX = "base_model.model."  # PeftModelForCausalLM wraps LoraModel wraps the *ForCausalLM


def _most_common(values):
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: (counts[v], -list(counts).index(v)))  # ties: the first seen


def _pattern_key(path: str) -> str:
    """rank_pattern / alpha_pattern key for a module: its path without the leading `model.`, as
    PEFT users write them (`layers.0.mlp.down_proj`); PEFT matches `(.*\\.)?(key)$` (older
    releases `.*\\.key$`, which needs the dot before it), so it names this module only."""
    return path.removeprefix("model.")


def peft_target_modules(paths, all_paths=None) -> list[str]:
    """target_modules for adapter_config.json: the module names (`q_proj`, ...) when the LoRA
    covers every module of the model with those names (all_paths: the model's Linear paths),
    else the full module paths, which PEFT matches exactly."""
    paths = sorted(paths)
    names = sorted({p.rsplit(".", 1)[-1] for p in paths})
    if all_paths is not None and {p for p in all_paths if p.rsplit(".", 1)[-1] in names} == set(paths):
        return names
    return paths


def _json_number(value: float):
    return int(value) if float(value).is_integer() else float(value)


def peft_adapter_config(weights: dict[str, LoRAWeights], base_model: str | None = None, target_modules=None,
                        lora_dropout: float = 0.0) -> dict:
    """adapter_config.json for a causal-LM LoRA: r and lora_alpha are the most common rank and
    alpha, modules that differ go to rank_pattern / alpha_pattern (PEFT's scale is alpha / r per
    module, so lora_B is written unscaled). DoRA sets use_dora; plain and DoRA modules cannot mix.
    lora_dropout: the LoRA's trained `dropout` (network_dropout), the probability PEFT's own training reads on."""
    if packed := next((p for p, w in weights.items() if w.experts), None):
        raise CheckpointError(f"module '{packed}' is a packed weight's LoRA: a PEFT adapter folder of those (PEFT's "
                              f"target_parameters) is not written; save the kohya layout")
    dora = {w.magnitude is not None for w in weights.values()}
    if len(dora) > 1:
        raise CheckpointError("a PEFT adapter is all DoRA or all plain LoRA; this LoRA mixes both")
    r = _most_common(w.rank for w in weights.values())
    alpha = _most_common(w.alpha for w in weights.values())
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": _json_number(alpha),
        "target_modules": list(target_modules or peft_target_modules(weights)),
        "rank_pattern": {_pattern_key(p): w.rank for p, w in sorted(weights.items()) if w.rank != r},
        "alpha_pattern": {_pattern_key(p): _json_number(w.alpha)
                          for p, w in sorted(weights.items()) if w.alpha != alpha},
        "use_dora": dora == {True},
        "use_rslora": False,
        "lora_dropout": float(lora_dropout),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "revision": None,
    }


def peft_folder_state_dict(weights: dict[str, LoRAWeights], dtype=torch.float32) -> dict[str, torch.Tensor]:
    """PEFT causal-LM tensors: lora_A = down, lora_B = up (not scaled: alpha is in the config),
    lora_magnitude_vector [out] for DoRA."""
    out = {}
    for path, w in weights.items():
        head = f"{CAUSAL_LM_PREFIX}{path}"
        out[f"{head}.lora_A.weight"] = w.down.detach().to(dtype)
        out[f"{head}.lora_B.weight"] = w.up.detach().to(dtype)
        if w.magnitude is not None:
            out[f"{head}.lora_magnitude_vector"] = w.magnitude.detach().reshape(-1).to(dtype)
    return out


def write_peft_folder(weights: dict[str, LoRAWeights], folder: str, dtype=torch.float32, metadata=None,
                      base_model: str | None = None, target_modules=None, lora_dropout: float = 0.0) -> None:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, our training
    metadata in its header), built beside `folder` and swapped in whole (library.io.atomic_folder)."""
    config = peft_adapter_config(weights, base_model, target_modules, lora_dropout)
    with atomic_folder(folder) as tmp:
        write_lora_tensors(peft_folder_state_dict(weights, dtype), os.path.join(tmp, PEFT_WEIGHTS_FILE),
                           {"format": "pt", **(metadata or {})})
        write_text(os.path.join(tmp, PEFT_CONFIG_FILE), json.dumps(config, indent=2, sort_keys=True) + "\n")

