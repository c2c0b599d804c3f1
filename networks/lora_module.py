"""One LoRA adapter: a low-rank delta on one Linear-like base module, applied unmerged.

A `LoRAModule` wraps one Linear-like base module (nn.Linear, library.precision.fp8.FP8Linear, anything with
in_features/out_features) by patching `base.forward`; the base stays in the model, untouched, so
the same base can run with the LoRA on, off (`enabled`, multiplier 0) or without it (`remove_from_base()`). A
packed weight's (a mixture's experts) is its subclass PackedLoRAModule (networks/lora_packed.py), inside the
weight's packed_bmm. Which modules get one: networks/lora.py LoRANetwork.

Precision: LoRA parameters are float32 by default (`lora_dtype`). The branch casts its input to
the LoRA weight dtype, or leaves it to autocast when autocast is on, and casts its result to the
base output's dtype before adding it. Merging computes the delta in float32.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models import core
from library.precision.autocast import autocast_dtype
from networks.lora_files import LoRAWeights

# Device types where the LoRA's up GEMM takes the base output as its sum (torch.addmm). On the CPU the
# add runs in the GEMM's epilogue; on CUDA addmm copies the base output into its result and runs a
# beta = 1 GEMM, and the plain `out + up` was the faster on an H200 (bench_core_levers' lora_addmm, the
# two mid models at 1024 px, per-round medians of addmm against it: eager x1.018 / x1.031, compiled
# x1.033 / x0.998, where inductor fuses the add into the next pointwise kernel; bench/RESULTS.md).
ADDMM_SUM_DEVICES = ("cpu",)


class LoRAModule(nn.Module):
    """out = base(x) + multiplier * (alpha / rank) * up(down(x)), with sd-scripts' dropouts.

    Training-only regularisers, active while this LoRA module is in train mode (the trainer puts
    the network in train mode for steps and eval mode for samples; the frozen base stays in eval):
    - dropout: F.dropout on down(x) (sd-scripts `network_dropout`);
    - rank_dropout: zero each rank channel per sample with probability p, the scale multiplied by
      1 / (1 - p) so the expected delta is unchanged;
    - module_dropout: skip the whole LoRA branch with probability p per forward.

    DoRA (dora=True; Liu et al. 2024, as PEFT implements it): W' = m * (W + s*BA) / ||W + s*BA||,
    the norm over the input dim for each output row, m a trained magnitude per output row
    (initialised to ||W||; kept as `dora_scale` [out, 1], the key ComfyUI reads). The norm is
    detached (the paper's section 4.3), so
        out = base(x) + multiplier * ((g - 1) * (base(x) - bias) + g * s * B(A(x))),  g = m / ||W + s*BA||
    which at multiplier 1 equals PEFT's DoRA and interpolates the merged weight otherwise (ComfyUI's
    strength). W is the base weight dequantized to float32 (FP8Linear), read under no_grad, plus the
    deltas of the adapters applied to the base before this module (generate.py --lora a dora): the
    weight their forward computes, as ComfyUI patches in sequence and a base_loras run trains on.
    """

    def __init__(self, name, base: nn.Module, rank, alpha=None, multiplier=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None, lora_dtype=torch.float32, dora: bool = False):
        super().__init__()
        if not (hasattr(base, "in_features") and hasattr(base, "out_features")):
            raise ValueError(f"LoRA target '{name}' ({type(base).__name__}) has no in_features/out_features")
        self.name, self.rank = name, int(rank)
        self._base = [base]  # a list, so the base is not registered as a submodule (no base keys)
        weight = getattr(base, "weight", None)
        device = weight.device if weight is not None and weight.device.type != "meta" else None
        self.lora_down = nn.Linear(base.in_features, self.rank, bias=False, device=device, dtype=lora_dtype)
        self.lora_up = nn.Linear(self.rank, base.out_features, bias=False, device=device, dtype=lora_dtype)
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))  # as sd-scripts
        nn.init.zeros_(self.lora_up.weight)  # zero delta at step 0
        alpha = float(self.rank if alpha is None or alpha == 0 else alpha)
        self.register_buffer("alpha", torch.tensor(alpha, dtype=torch.float32, device=device))
        self.scale = alpha / self.rank  # a Python float: reading the buffer each forward syncs the device
        self.multiplier, self.enabled = multiplier, True
        self.dropout, self.rank_dropout, self.module_dropout = dropout, rank_dropout, module_dropout
        self.dora_scale = None
        if dora:  # m = ||W|| per output row: the adapted weight starts equal to W
            norm = torch.ones(base.out_features, device=device) if device is None else self.base_weight().norm(dim=1)
            self.dora_scale = nn.Parameter(norm.reshape(-1, 1).to(lora_dtype))
        self._original_forward = None  # the base's forward while patched
        self._had_instance_forward = False  # base.forward was already an instance attribute

    @property
    def base(self) -> nn.Module:
        return self._base[0]

    @torch.no_grad()
    def base_weight(self) -> torch.Tensor:
        """The base weight [out, in] in float32 (dequantized for FP8Linear)."""
        if hasattr(self.base, "dequantized_weight"):
            return self.base.dequantized_weight(torch.float32)
        return self.base.weight.detach().float()

    @torch.no_grad()
    def input_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] of the forward this module wraps: the base weight, plus the deltas of
        the adapters applied to the base before this one, each at its multiplier."""
        return forward_weight(self._original_forward, self.base_weight)

    @torch.no_grad()
    def adapted_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The float32 weight this module's forward computes (no dropouts) on a wrapped forward of `weight`."""
        if not self.enabled or self.multiplier == 0:
            return weight.float()
        return self.weights().merged(weight, self.multiplier)

    def set_alpha(self, alpha: float):
        self.alpha.fill_(alpha)
        self.scale = float(alpha) / self.rank

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.scale = float(self.alpha) / self.rank  # once per load, not per forward

    @property
    def applied(self) -> bool:
        return self._original_forward is not None

    def apply_to_base(self):
        """Route base calls through this module; the original forward is kept for remove()."""
        if self.applied:
            return
        original = self.base.__dict__.get("forward", None) or type(self.base).forward.__get__(self.base)
        if self.dora_scale is not None:  # its norm reads the adapters under it: one it cannot read is named now
            for adapter in adapters_under(original):
                if not isinstance(adapter, LoRAModule):
                    from networks.lycoris_views import check_lycoris_weight

                    check_lycoris_weight(adapter, f"DoRA module '{self.name}'")
        self._original_forward = original
        self._had_instance_forward = "forward" in self.base.__dict__
        self.base.forward = self.forward
        self.base.forward_with_base_output = self.forward_with_base_output

    def remove_from_base(self):
        if not self.applied:
            return
        if self._had_instance_forward:
            self.base.forward = self._original_forward
        else:
            del self.base.forward
        self.base.__dict__.pop("forward_with_base_output", None)  # (another network may have taken it)
        self._original_forward = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._dropped():
            return self._original_forward(x)
        return self._adapted(x, self._original_forward(x))

    def forward_with_base_output(self, x: torch.Tensor, base_call) -> torch.Tensor:
        """core.residual_projection's call in checkpointing: this module's path in full on the base output
        that base_call(original forward, x) gives (the base on one token, or kept from the forward). A
        module dropped this call (module_dropout; the recompute draws the same) returns the base's own
        output, in both passes: a kept output stands in for the value, not for its autograd history."""
        if self.dora_scale is not None or self._had_instance_forward or not core.saves_only_weights(self.base):
            return self.forward(x)  # DoRA's delta reads the base output; an unknown base may save x
        if self._dropped():
            return self._original_forward(x)
        return self._adapted(x, base_call(self._original_forward, x))

    def _dropped(self) -> bool:
        """module_dropout's draw for this call: skip the whole branch (training only). Under
        torch_compile the bool() is a graph break per module call: correct, and kept, because a draw
        inside the graph (a 0/1 factor) would come from inductor's RNG, not eager's (another run for
        one seed), would compute every dropped branch, and a dropped module must return the base's
        own output (forward_with_base_output: a kept output has no autograd path to x)."""
        return bool(self.training and self.module_dropout and self.enabled and self.multiplier != 0
                    and torch.rand(()) < self.module_dropout)

    def _adapted(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        training = self.training
        if not self.enabled or self.multiplier == 0:
            return out
        # Branch dtype: x -> LoRA weight dtype (float32 by default) unless autocast picks it.
        autocast = autocast_dtype(x.device.type)
        if autocast is None:
            x = x.to(self.lora_down.weight.dtype)
        dtype = autocast or self.lora_up.weight.dtype
        if x.dim() != 2 and self._up_takes_rows(out, autocast or x.dtype, dtype):
            # _add_up's GEMM takes [tokens, rank] rows: down runs on the rows as well (the same GEMM that
            # F.linear folds a [..., tokens, in] input into), no reshape of lx back and forth; 2 ops fewer
            # per module in the forward and the recompute each, 2 in backward
            x = x.reshape(-1, x.shape[-1])
        lx = self.lora_down(x)
        if training and self.dropout:
            lx = F.dropout(lx, p=self.dropout)
        scale = self.scale
        if training and self.rank_dropout:
            mask_shape = (lx.shape[0],) + (1,) * (lx.dim() - 2) + (self.rank,)
            lx = lx * (torch.rand(mask_shape, device=lx.device) > self.rank_dropout).to(lx.dtype)
            scale = scale / (1.0 - self.rank_dropout)
        if self.dora_scale is not None:
            return out + self._dora_delta(out, self.lora_up(lx), scale)
        return self._add_up(out, lx, self.multiplier * scale, dtype)

    def _up_takes_rows(self, out: torch.Tensor, lx_dtype: torch.dtype, dtype: torch.dtype) -> bool:
        """Whether this call's _add_up runs the up GEMM on [tokens, rank] rows (no DoRA, no rank dropout,
        dtypes meeting): summing into the base output on ADDMM_SUM_DEVICES, adding after it elsewhere."""
        return (self.dora_scale is None and not (self.training and self.rank_dropout)
                and out.dtype == dtype and lx_dtype == dtype)

    def _add_up(self, out: torch.Tensor, lx: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor:
        """out + factor * lora_up(lx), in the base output's dtype. Where out, lx and the up weight meet in
        `dtype` (autocast's, or no autocast and all float32), the factor goes on the rank-r side, and on
        ADDMM_SUM_DEVICES the sum goes into the up GEMM (torch.addmm): one pass over the [tokens, out]
        output instead of four (GEMM, scale, cast, add) with their temporaries, and no [tokens, out]
        multiply in backward; elsewhere the GEMM, then one add."""
        # factor 1 (alpha = rank, the default, at multiplier 1): no multiply, x * 1.0 is x bit for bit; 3
        # ops fewer per module and step (forward, recompute, backward), 36 per block of 12 LoRA modules
        if out.dtype != dtype or lx.dtype != dtype:
            up = self.lora_up(lx)
            return out + (up if factor == 1 else up * factor).to(out.dtype)  # back to the base output dtype
        rows = lx if factor == 1 else lx * factor
        rows = rows if rows.dim() == 2 else rows.reshape(-1, rows.shape[-1])  # [tokens, rank]
        if out.device.type not in ADDMM_SUM_DEVICES:
            return out + self.lora_up(rows).view(out.shape)
        return torch.addmm(out.reshape(-1, out.shape[-1]), rows, self.lora_up.weight.t()).view(out.shape)

    def _dora_delta(self, out: torch.Tensor, lx: torch.Tensor, scale: float) -> torch.Tensor:
        """multiplier * ((g - 1) * W x + g * s * BAx), g = m / ||W + s*BA|| per output row, the
        norm detached and computed in float32 (the training scale s, without rank dropout)."""
        with torch.no_grad():
            adapted = self.input_weight() + self.scale * (self.lora_up.weight.float() @ self.lora_down.weight.float())
            norm = adapted.norm(dim=1)
        g = self.dora_scale.reshape(-1) / norm  # [out], float32 (grad to the magnitude only)
        bias = getattr(self.base, "bias", None)
        wx = out if bias is None else out - bias.to(out.dtype)
        delta = (g - 1) * wx.to(g.dtype) + g * (lx * scale).to(g.dtype)
        return (self.multiplier * delta).to(out.dtype)  # back to the base output dtype

    def weights(self) -> LoRAWeights:
        magnitude = None if self.dora_scale is None else self.dora_scale.detach().reshape(-1)
        return LoRAWeights(self.lora_down.weight.detach(), self.lora_up.weight.detach(), float(self.alpha), magnitude)

    def parameters_to_train(self) -> list[nn.Parameter]:
        return [self.lora_down.weight, self.lora_up.weight] + ([self.dora_scale] if self.dora_scale is not None else [])

    @torch.no_grad()
    def delta_norm(self) -> float:
        """||(alpha / rank) * up @ down|| (Frobenius, float32): the update scale_weight_norms bounds."""
        return (self.scale * (self.lora_up.weight.float() @ self.lora_down.weight.float())).norm().item()

    @torch.no_grad()
    def merge_into_base(self, weight_dtype: torch.dtype | None = None):
        """W += multiplier * (alpha / rank) * up @ down, computed in float32, stored in
        `weight_dtype` (default: the base weight's dtype); then the forward patch is removed."""
        weight = self.base.weight
        if weight.dtype.itemsize == 1 and weight.is_floating_point():
            raise ValueError(
                f"LoRA '{self.name}': the base weight is {weight.dtype}; merging into fp8 loses the delta. "
                "Merge into a high-precision copy of the checkpoint and quantize afterwards."
            )
        if not weight.is_floating_point():  # nf4 / int8 / GGUF codes (a Linear's or the experts'): nothing to add to
            raise ValueError(f"LoRA '{self.name}': the base weight is stored as {weight.dtype} codes (nf4 / int8 / "
                             f"GGUF); a merge cannot write into them. Merge into a high-precision copy of the "
                             f"checkpoint and quantize afterwards.")
        merged = self.weights().merged(weight, self.multiplier).to(weight_dtype or weight.dtype)  # float32 math
        self.base.weight = nn.Parameter(merged, requires_grad=weight.requires_grad)
        self.remove_from_base()


def adapters_under(forward) -> list:
    """The adapters (LoRAModule, LyCORIS module) that a base Linear's `forward` runs, the first applied first:
    each patched forward wraps the one before it, down to the base's own."""
    adapters = []
    while (owner := getattr(forward, "__self__", None)) is not None:
        if isinstance(owner, LoRAModule):
            forward = owner._original_forward
        elif type(owner).__module__.startswith("lycoris."):
            from networks.lycoris_views import lycoris_wrapped

            forward = lycoris_wrapped(owner)
        else:  # the base's own forward (or a wrapper of it that adds no delta)
            break
        adapters.append(owner)
    return adapters[::-1]


@torch.no_grad()
def forward_weight(forward, base_weight) -> torch.Tensor:
    """The float32 weight [out, in] that a base Linear's `forward` computes: base_weight() (the base's, float32)
    with each adapter under `forward` applied in turn at its multiplier."""
    weight = base_weight()
    for adapter in adapters_under(forward):
        if isinstance(adapter, LoRAModule):
            weight = adapter.adapted_weight(weight)
        else:
            from networks.lycoris_views import lycoris_delta

            weight = weight + lycoris_delta(adapter)
    return weight
