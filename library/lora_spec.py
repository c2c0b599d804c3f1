"""The one parser of `path[:ratio]` LoRA arguments: the tools' --lora (generate, merge_lora,
combine_loras, precision_doctor) and the training config's base_loras. Torch-free, at the bottom of
the layers, so the command lines and the config check read it before torch loads."""

from __future__ import annotations

import os
from dataclasses import dataclass

# A LoRA's strength: 1 applies it as trained. Far beyond this bound the delta swamps the base weights
# (1e30 renders a black image), so a larger value is taken for a typo.
MAX_LORA_RATIO = 100.0


@dataclass
class LoRASpec:
    path: str
    ratio: float


def parse_lora_spec(spec: str, option: str = "--lora") -> LoRASpec:
    """'a.safetensors:0.8' -> (a.safetensors, 0.8); no ':ratio' (or a path that exists with its
    colon) means 1.0. The ratio must be a finite number with |ratio| <= MAX_LORA_RATIO. `option`
    names the argument in the error."""
    path, sep, ratio = spec.rpartition(":")
    if not sep or os.path.exists(spec):
        return LoRASpec(spec, 1.0)
    try:
        value = float(ratio)
    except ValueError:
        raise ValueError(f"{option} {spec!r}: ratio {ratio!r} is not a number (expected path[:ratio], e.g. a.safetensors:0.8)") from None
    if not abs(value) <= MAX_LORA_RATIO:  # also false for nan
        raise ValueError(f"{option} {spec!r}: ratio {ratio!r} is not a finite number in [-{MAX_LORA_RATIO:g}, "
                         f"{MAX_LORA_RATIO:g}] (1 applies the LoRA as trained)")
    return LoRASpec(path, value)
