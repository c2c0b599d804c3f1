"""base_loras: LoRAs merged into the frozen base before training (any diffusion family), e.g. the
de-distillation "training adapter" a step-distilled model is trained with. They are
not trained and not saved: the saved LoRA holds the trained network alone, and its metadata names
the merged files and ratios (ss_base_loras), so inference can rebuild the base it was trained on.

Precision: each LoRA reaches its Linear through the same reader as network_weights (any layout the
network loads: kohya, PEFT/diffusers, ComfyUI; a BFL-named model's diffusers-named LoRAs converted)
and is merged with tools/merge_lora.py's math (networks/lora_files.merge_into_weight, float32). An
fp8 base is loaded in the compute dtype, merged, and only then quantized: a delta merged into fp8
weights would mostly round away (shared/DESIGN.md). For that load the whole base is briefly in the
compute dtype (about twice the fp8 base's memory, CPU side); the merged weights of the Linears that
become fp8 stay float32 until quantized, so they are rounded once, as a base merged beforehand in
float32 and quantized while loading.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn as nn

from library.lora_spec import LoRASpec, parse_lora_spec
from library.models.registry import LOWBIT_PRECISIONS, arch_spec


def base_lora_specs(entries: list[str]) -> list[LoRASpec]:
    return [parse_lora_spec(e, "base_loras") for e in entries]


def base_loras_metadata(entries: list[str] | None) -> list[dict] | None:
    """What the saved LoRA's header and a training state record of base_loras: each file's name and ratio,
    in merge order (None: no LoRA merged into the base)."""
    return [{"file": os.path.basename(s.path), "ratio": s.ratio} for s in base_lora_specs(entries)] if entries else None


@torch.no_grad()
def merge_base_loras(model: nn.Module, arch: str, specs: list[LoRASpec], keep_float32=lambda name: False) -> int:
    """Merge each LoRA (file, ratio) into `model`'s Linear weights in place, and its `.diff` / `.diff_b` tensors into
    the weights and biases they name (networks/lora_reader.merge_whole_deltas); returns the number of merged modules
    and tensors. A weight is stored back in its own dtype, or in float32 where keep_float32(module
    name) (the Linears an fp8 conversion quantizes next)."""
    from networks.factory import network_module_of_file
    from networks.lora import LoRANetwork
    from networks.lora_files import merge_into_weight
    from networks.lora_reader import WholeDeltasLeftOut, merge_whole_deltas, whole_deltas_only

    merged = 0
    for spec in specs:
        if whole_deltas_only(spec.path):  # ComfyUI's full_diff, LyCORIS' full type: the deltas alone, no network
            merged += merge_whole_deltas(model, arch, spec.path, spec.ratio, keep_float32)
            continue
        if network_module_of_file(spec.path) != "networks.lora":
            raise ValueError(f"base_loras {spec.path}: a LyCORIS file; merge it into the checkpoint with "
                             f"tools/merge_lora.py and train on the merged checkpoint")
        # The reader resolves names and layouts. Building its modules draws their initial weights from
        # the global generator (overwritten by the file's): the trained network's own draws must not
        # depend on base_loras, so the generator's state is put back.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", WholeDeltasLeftOut)  # added below
            network = LoRANetwork.from_weights(model, arch, spec.path)
        for lora in network.lora_modules():
            linear = lora.base
            dtype = torch.float32 if keep_float32(lora.name) else linear.weight.dtype
            weight = merge_into_weight(linear.weight, [(spec.ratio, lora.weights())]).to(dtype)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            merged += 1
        # its `.diff` / `.diff_b` tensors (ComfyUI's extraction), as ComfyUI patches them
        merged += merge_whole_deltas(model, arch, spec.path, spec.ratio, keep_float32)
    return merged


def load_merged_base(family, compute_dtype: torch.dtype, precision: str, specs: list[LoRASpec]) -> nn.Module:
    """The frozen transformer with `specs` merged, stored as `precision` (a BASE_PRECISIONS name: bf16,
    fp8 / fp8_scaled, or bitsandbytes' nf4 / nf4_dq / int8)."""
    from library.precision.fp8 import is_high_precision, quantize_module

    model = family.load_transformer(compute_dtype, "bf16")
    rules = arch_spec(family.arch).fp8
    quantized = precision != "bf16"
    merge_base_loras(model, family.arch, specs, keep_float32=lambda name: quantized and not is_high_precision(name, rules))
    if precision in LOWBIT_PRECISIONS:  # every non-bf16 precision was sent to fp8's quantizer, which refused nf4
        from library.precision.bnb_weights import prepare_bnb

        prepare_bnb(model, precision, rules)
    elif quantized:
        quantize_module(model, precision, rules)
    return model
