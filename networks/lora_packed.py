"""Packed weights as LoRA targets: W [E, K, N] of E experts used as x @ W[e] (library/precision/fp8_packed.py
PackedWeights, a mixture's routed experts), one low-rank delta per expert (networks/lora.py PackedLoRAModule).

Layout: PEFT's ParamWrapper's (peft/tuners/lora/layer.py, its target_parameters), which reads the weight as E
matrices [out, in] = [K, N] (in_features N, out_features K): lora_down = PEFT's lora_A [r E, N], lora_up = lora_B
[K, r E]; delta[e] = (alpha / r) * up_e @ down_e [K, N] with up_e = up.view(K, r, E)[:, :, e] and down_e =
down.view(E, r, N)[e] (networks/lora_files.py LoRAWeights.packed_factors); r is the rank of one expert. A kohya file
holds them under `<prefix>_<path of the weight>.lora_down.weight` / `.lora_up.weight` / `.alpha` in those shapes, so
PEFT's and ComfyUI-style dotted layouts are a key rename, and a header entry (lora_files.PACKED_EXPERTS_KEY) says E.

Hook: the base's packed_bmm (the one place a packed weight is applied) calls the module after its own bmm on the same
input: x @ W[e] + multiplier * (alpha / r) * (x @ up_e) @ down_e, two bmm's through the rank on each expert's tokens,
never a weight-sized delta. The base weight is read as stored, so fp8 / nf4 / int8 experts (fp8_packed) take a LoRA
unchanged.

Everything else is LoRAModule's (PackedLoRAModule subclasses it): float32 factors (lora_dtype), the branch in the
LoRA dtype or autocast's and cast back to the base output's, the multiplier, rank / alpha (the scale alpha / r, r per
expert), dropout (on each token's rank activations), rank_dropout (each token's rank channels), module_dropout,
saving and merging (LoRAWeights with experts). No DoRA: PEFT's ParamWrapper has none either.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from library.precision.fp8_packed import PackedWeights


class PackedTarget:
    """One packed weight of a PackedWeights module as a LoRA's base: `weight` is the stored tensor ([E, K, N], or
    the codes of a quantized one; a merge replaces the Parameter), in_features / out_features as PEFT's
    ParamWrapper counts them (N, K)."""

    def __init__(self, module: PackedWeights, name: str):
        self.module, self.name = module, name

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.module, self.name)

    @weight.setter
    def weight(self, value: nn.Parameter) -> None:
        if self.name in self.module.packed_modes:  # codes and scales: a merge never writes into them
            mode = self.module.packed_modes[self.name]
            raise ValueError(f"{type(self.module).__name__}.{self.name} is stored in {mode}: no merge writes into it")
        setattr(self.module, self.name, value)

    @property
    def experts(self) -> int:
        return self.module.packed_shape(self.name)[0]  # [E, K, N] as the weight reads, however stored (nf4: packed)

    @property
    def in_features(self) -> int:
        return self.module.packed_shape(self.name)[2]

    @property
    def out_features(self) -> int:
        return self.module.packed_shape(self.name)[1]

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [E, K, N] in `dtype` (dequantized where it is stored quantized)."""
        return self.module.packed_weight(self.name, dtype)


def packed_targets(model: nn.Module) -> list[tuple[str, PackedTarget]]:
    """(path of the weight, its PackedTarget) for every packed weight of `model`: `<module path>.<weight name>`,
    the name of the Parameter in the model's state dict (and PEFT's target_parameters)."""
    return [(f"{path}.{name}" if path else name, PackedTarget(module, name))
            for path, module in model.named_modules() if isinstance(module, PackedWeights)
            for name in module.packed_weights]
