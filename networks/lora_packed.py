"""Packed weights as LoRA targets: W [E, K, N] of E experts used as x @ W[e] (library/precision/fp8_packed.py
PackedWeights, a mixture's routed experts), one low-rank delta per expert (PackedLoRAModule, below).

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
import torch.nn.functional as F

from library.precision.autocast import autocast_dtype
from library.precision.fp8_packed import PackedWeights
from networks.lora_files import LoRAWeights
from networks.lora_module import LoRAModule


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


class PackedLoRAModule(LoRAModule):
    """A packed weight's LoRA (layout, hook: the module docstring): out = x @ W[e] + multiplier * (alpha / r) *
    (x @ up_e) @ down_e for the experts a call runs. rank: per expert; the factors hold E times its rows / columns."""

    def __init__(self, name, base: PackedTarget, rank, alpha=None, multiplier=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None, lora_dtype=torch.float32, dora: bool = False):
        if dora:
            raise ValueError(f"LoRA target '{name}' is a packed weight of {base.experts} experts: DoRA is not "
                             f"supported there (nor in PEFT's ParamWrapper); train it without dora")
        rank = int(rank)
        alpha = float(rank if alpha is None or alpha == 0 else alpha)
        # LoRAModule's factors at E times the rank: down [r E, N] (kaiming, as PEFT's lora_A), up [K, r E] (zeros)
        super().__init__(name, base, rank * base.experts, alpha, multiplier, dropout, rank_dropout, module_dropout,
                         lora_dtype)
        self.rank, self.experts, self.packed_applied = rank, base.experts, False
        self.set_alpha(alpha)  # the scale alpha / r of one expert's rank

    @property
    def applied(self) -> bool:
        return self.packed_applied

    def apply_to_base(self):
        """Add this module to its weight's adapters (PackedWeights.packed_adapters), the last one applied."""
        if not self.packed_applied:
            self.base.module.packed_adapters.setdefault(self.base.name, []).append(self)
            self.packed_applied = True

    def remove_from_base(self):
        if self.packed_applied:
            adapters = self.base.module.packed_adapters[self.base.name]
            adapters.pop(next(i for i, a in enumerate(adapters) if a is self))
            self.packed_applied = False

    def expert_factors(self, experts: slice | int = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(up [e, K, r], down [e, r, N]) of `experts`: down a view of its Parameter, up a dense copy of the
        permuted view (gradients flow to both Parameters). The view alone has stride 1 on neither matrix axis
        (strides (1, r E, E)), which CPU bmm runs without BLAS: at the released size (chunks of 12 experts of 128
        tokens, K 2048, r 16) 18 ms for x @ up, 3.3 ms with the copy (bench/bench_packed_experts.py)."""
        up = self.lora_up.weight.view(-1, self.rank, self.experts).permute(2, 0, 1)[experts].contiguous()
        return up, self.lora_down.weight.view(self.experts, self.rank, -1)[experts]

    def forward(self, x: torch.Tensor, out: torch.Tensor, experts: slice = slice(None)) -> torch.Tensor:
        """x [e, n, K] the experts' tokens, out [e, n, N] the base's x @ W[e] for the experts `experts` -> out plus
        this LoRA's delta, in out's dtype."""
        if self._dropped() or not self.enabled or self.multiplier == 0:
            return out
        autocast = autocast_dtype(x.device.type)
        if autocast is None:  # the branch in the LoRA dtype (float32) unless autocast picks it
            x = x.to(self.lora_down.weight.dtype)
        up, down = self.expert_factors(experts)
        lx = torch.bmm(x, up)  # [e, n, r]
        if self.training and self.dropout:
            lx = F.dropout(lx, p=self.dropout)
        factor = self.multiplier * self.scale
        if self.training and self.rank_dropout:  # each token's rank channels, the expected delta unchanged
            lx = lx * (torch.rand(lx.shape, device=lx.device) > self.rank_dropout).to(lx.dtype)
            factor = factor / (1.0 - self.rank_dropout)
        if factor != 1:  # on the rank side: r values a token instead of N
            lx = lx * factor
        return out + torch.bmm(lx, down).to(out.dtype)  # back to the base output dtype

    def weights(self) -> LoRAWeights:
        return LoRAWeights(self.lora_down.weight.detach(), self.lora_up.weight.detach(), float(self.alpha),
                           experts=self.experts)

    @torch.no_grad()
    def delta_norm(self) -> float:
        """||delta|| over every expert (Frobenius, float32) from the factors: ||B_e A_e||^2 = <B_e^T B_e, A_e A_e^T>,
        no [E, K, N] delta (1.4 GB in float32 for one released gate_up_proj)."""
        up, down = (f.float() for f in self.expert_factors())
        squared = ((up.transpose(1, 2) @ up) * (down @ down.transpose(1, 2))).sum().clamp(min=0)
        return self.scale * float(squared.sqrt())
