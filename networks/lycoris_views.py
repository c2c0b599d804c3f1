"""The pieces of LyCORIS handling that networks/lora_module.py needs too (a DoRA stacked on a LyCORIS module reads
its delta), kept apart from networks/lycoris_network.py, which builds on networks/lora.py: the nn.Linear face
of a quantized Linear, and an applied LoKr / LoHa / LoCon module's wrapped forward and weight delta."""

from __future__ import annotations

import torch
import torch.nn as nn

# What LycorisDelta merges and lycoris_delta reads: LyCORIS' own get_merged_weight / get_weight agree with the
# forward for these (networks/lycoris_network.LycorisDelta).
MERGEABLE = ("LokrModule", "LohaModule", "LoConModule")


class FP8LinearView(nn.Linear):
    """An nn.Linear face of a quantized Linear (FP8Linear, ...) for LyCORIS: no parameters of its
    own, `weight` is the dequantized float32 weight (no grad), forward is the layer's (its stored
    codes, no base grad)."""

    def __init__(self, layer: nn.Module):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a weight
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self._layer = [layer]  # a list: not a submodule
        self._patched = None  # the layer's instance forward before this network's (an earlier network's LoRA)

    @property
    def weight(self) -> torch.Tensor:
        return self._layer[0].dequantized_weight(torch.float32)

    @property
    def bias(self):
        return self._layer[0].bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._patched is not None:  # networks applied before this one keep their deltas (generate's --lora a b)
            return self._patched(x)
        return type(self._layer[0]).forward(self._layer[0], x)  # the class forward: the instance one is patched


def is_quantized_linear(module: nn.Module) -> bool:
    """A Linear whose weight is stored quantized (FP8Linear, GGUFLinear, NF4Linear, Int8Linear): it
    computes like a Linear and gives its weight through dequantized_weight(dtype), but is no nn.Linear."""
    return not isinstance(module, nn.Linear) and callable(getattr(module, "dequantized_weight", None))


def dora_at_comfyui_strength(module) -> None:
    """A dora_wd module (`wd`) at a ratio s applies W + s * (DoRA(W + dW) - W), as ComfyUI applies the file
    (comfy/weight_adapter/base.py weight_decompose) and networks/lora_module.py's DoRA: ratio 0 is the base. LyCORIS'
    apply_weight_decompose blends the magnitude alone, (W + dW) * (s * (m / ||W + dW|| - 1) + 1), which keeps
    the whole dW at every ratio: until 2026-11-30 merge_lora and generate at 0.5 were 1.5-2x the update off
    ComfyUI's, and at 0 not the base. Its forward and its merged weight both call this, so both change."""
    if not getattr(module, "wd", False) or "apply_weight_decompose" in module.__dict__:
        return
    decompose = module.apply_weight_decompose  # the class's, bound

    def at_strength(weight: torch.Tensor, multiplier=1) -> torch.Tensor:
        full = decompose(weight, 1)
        if multiplier == 1:
            return full
        base = module.org_module[0].weight.detach().to(full)  # an FP8LinearView's: the dequantized weight
        return base + multiplier * (full - base)

    module.apply_weight_decompose = at_strength


def merged_weight(module, w: torch.Tensor) -> torch.Tensor:
    """What an applied LoKr / LoHa / LoCon `module` makes of the weight w (float32 math; LycorisDelta's notes).
    w is only read. A LoKr / LoHa's w + dW * scalar, then w + multiplier * (that - w), run in place in the one
    weight-sized buffer dW is built in, with the roundings of those expressions: each made a full-size temporary (3
    fp32 copies of a 21504 x 3072 linear1 beside w; bench/RESULTS.md, LoKr merge memory)."""
    from lycoris.modules import LoConModule

    if isinstance(module, LoConModule):
        return module.get_merged_weight(module.multiplier, shape=tuple(w.shape), device=w.device)[0]
    adapted = _owned(weight_delta(module, tuple(w.shape)).to(w.dtype), module).mul_(module.scalar).add_(w)
    if module.wd:
        return module.apply_weight_decompose(adapted, module.multiplier)
    return adapted.sub_(w).mul_(module.multiplier).add_(w)


def weight_delta(module, shape: tuple) -> torch.Tensor:
    """A LoKr / LoHa module's get_weight(shape). A LoKr's Kronecker product on the CPU is scaled in place: LyCORIS'
    own kron(w1, w2) * scale holds two full-size tensors at once (the host memory of a merge). The same product
    and multiply, so the same bits; on a GPU its fused kernels may scale inside the product, so it is left to them."""
    from lycoris.functional.lokr import kron_weight
    from lycoris.modules import LokrModule

    dropping = module.training and getattr(module, "rank_dropout", 0)  # get_weight drops rows at random: its own
    if not isinstance(module, LokrModule) or module.alpha.device.type != "cpu" or dropping:
        return module.get_weight(shape)
    low_rank_w2 = not module.use_w2
    delta = kron_weight(module.lokr_w1 if module.use_w1 else None,
                        None if module.use_w1 else module.lokr_w1_a, None if module.use_w1 else module.lokr_w1_b,
                        None if low_rank_w2 else module.lokr_w2,
                        module.lokr_w2_a if low_rank_w2 else None, module.lokr_w2_b if low_rank_w2 else None,
                        module.lokr_t2 if module.tucker and low_rank_w2 else None, scale=1.0).view(shape)
    return delta.mul_(module.scale) if module.scale != 1 else delta  # LyCORIS' make_kron skips a scale of 1 too


def _owned(delta: torch.Tensor, module) -> torch.Tensor:
    """delta, or a copy of it where it shares memory with one of `module`'s tensors: merged_weight writes into it."""
    held = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    return delta.clone() if delta.untyped_storage().data_ptr() in held else delta


def lycoris_wrapped(module):
    """The forward an applied LyCORIS module wraps: an earlier network's, or the base's own (None where its
    FP8LinearView calls the quantized layer's class forward)."""
    view = getattr(module.org_forward, "__self__", None)
    return view._patched if isinstance(view, FP8LinearView) else module.org_forward


def check_lycoris_weight(module, reader: str) -> None:
    """A ValueError unless lycoris_delta can give `module`'s weight delta to `reader` (what needs it)."""
    if type(module).__name__ not in MERGEABLE:
        raise ValueError(f"{reader} is applied after the LyCORIS {type(module).__name__} '{module.lora_name}': its norm "
                         f"needs that module's weight, which only LoKr, LoHa and LoCon give; give the DoRA file first")


@torch.no_grad()
def lycoris_delta(module) -> torch.Tensor:
    """The float32 weight delta [out, in] an applied LoKr / LoHa / LoCon module's forward adds at its multiplier.
    LyCORIS computes it from the base weight, not from the networks applied before it (its dora_wd norm too)."""
    base = module.org_module[0].weight.detach().float()  # an FP8LinearView's: the dequantized weight
    return merged_weight(module, base).float() - base
