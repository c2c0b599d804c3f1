"""Memory of FLUX.1-dev's transformer weights in bf16, plain fp8 and block-scaled fp8.

Builds every distinct full-size Linear of a FLUX.1-dev block (hidden 3072), one bf16 layer at a
time, quantizes it with library.precision.fp8, counts the bytes of the real tensors, and extrapolates to
19 double + 38 single blocks. The layers outside the blocks (embedders, final layer: ~0.4% of the
weights) stay bf16 in every mode (the spec's fp8 keep rules) and are counted from their shapes. If
library/models/flux1/model.py is present, the whole FLUX_DEV model is also built on `meta` and counted exactly.

    python bench/bench_fp8_memory.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from library.precision.fp8 import QUANTIZE_MODULATION, FP8Linear, bytes_per_parameter, prepare_fp8  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402

HIDDEN, MLP, DOUBLE, SINGLE = 3072, 12288, 19, 38
MODES = ("bf16", "fp8", "fp8_scaled")

# (name, in, out, count per block); a double block has the same layers for img and txt.
DOUBLE_LAYERS = [
    ("attn.qkv", HIDDEN, 3 * HIDDEN, 2),
    ("attn.proj", HIDDEN, HIDDEN, 2),
    ("mlp.0", HIDDEN, MLP, 2),
    ("mlp.2", MLP, HIDDEN, 2),
    ("mod.lin", HIDDEN, 6 * HIDDEN, 2),
]
SINGLE_LAYERS = [
    ("linear1", HIDDEN, 3 * HIDDEN + MLP, 1),
    ("linear2", HIDDEN + MLP, HIDDEN, 1),
    ("modulation.lin", HIDDEN, 3 * HIDDEN, 1),
]
# Outside the blocks, always bf16: img_in, txt_in, time/vector/guidance_in (2 layers each), final_layer.
OTHER_LAYERS = [(64, HIDDEN), (4096, HIDDEN), (256, HIDDEN), (HIDDEN, HIDDEN), (768, HIDDEN), (HIDDEN, HIDDEN),
                (256, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 64), (HIDDEN, 2 * HIDDEN)]


def tensor_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of all parameters and buffers, number of base weight elements without scales)."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    return total, sum(t.numel() for name, t in tensors if not name.endswith("weight_scale"))


def layer_bytes(in_features: int, out_features: int, mode: str) -> tuple[int, int]:
    """Bytes of one real bf16 Linear N(0, 0.02), quantized to `mode`; freed before returning."""
    linear = nn.Linear(in_features, out_features, dtype=torch.bfloat16)
    nn.init.normal_(linear.weight, std=0.02)
    layer = linear if mode == "bf16" else FP8Linear.from_linear(linear, mode)
    counted = tensor_bytes(layer)
    if mode != "bf16":
        assert torch.isfinite(layer.dequantized_weight(torch.float32)).all()
    return counted


def extrapolate() -> dict[str, tuple[int, int]]:
    """Total (bytes, base elements) per mode for 19 double + 38 single blocks + the bf16 rest."""
    totals = {}
    for mode in MODES:
        total_bytes = total_params = 0
        for layers, blocks in ((DOUBLE_LAYERS, DOUBLE), (SINGLE_LAYERS, SINGLE)):
            for name, fan_in, fan_out, count in layers:
                kept = "mod" in name and not QUANTIZE_MODULATION
                b, n = layer_bytes(fan_in, fan_out, "bf16" if kept else mode)
                total_bytes, total_params = total_bytes + b * count * blocks, total_params + n * count * blocks
        for fan_in, fan_out in OTHER_LAYERS:  # bf16 in every mode: count from shapes
            n = fan_in * fan_out + fan_out
            total_bytes, total_params = total_bytes + 2 * n, total_params + n
        totals[mode] = (total_bytes, total_params)
        print(f"{mode:10s} {total_bytes / 2**30:6.2f} GiB  {total_bytes / total_params:.4f} bytes/param "
              f"({total_params / 1e9:.3f} B params, extrapolated from one layer of each shape)")
    return totals


def exact_from_meta_model() -> dict[str, tuple[int, int]] | None:
    """The whole FLUX_DEV transformer on `meta` per mode (norm scales included), or None without flux.py."""
    try:
        from library.models.flux1.model import FLUX_DEV, Flux
    except ImportError as e:
        print(f"(library.models.flux1.model not importable, exact count skipped: {e})")
        return None
    totals = {}
    for mode in MODES:
        with torch.device("meta"):
            model = Flux(FLUX_DEV)
        if mode != "bf16":
            prepare_fp8(model, mode, arch_spec("flux").fp8)
        model.to(torch.bfloat16)  # high-precision tensors as loaded in bf16; fp8 weights and scales stay
        totals[mode] = tensor_bytes(model)
        b, n = totals[mode]
        print(f"{mode:10s} {b / 2**30:6.2f} GiB  {bytes_per_parameter(model):.4f} bytes/param "
              f"({n:,} params, exact, FLUX_DEV on meta)")
    return totals


def main():
    torch.manual_seed(0)
    print(f"FLUX.1-dev transformer weights; modulation {'quantized' if QUANTIZE_MODULATION else 'kept in bf16'}")
    start = time.time()
    totals = extrapolate()
    print(f"(quantized one layer of each shape in {time.time() - start:.1f} s)")
    exact = exact_from_meta_model()
    if exact:
        totals = exact
    bf16 = totals["bf16"][0]
    summary = ", ".join(f"{m} {b / n:.3f} B/param ({b / bf16:.1%} of bf16)" for m, (b, n) in totals.items())
    print(f"SUMMARY: {summary}")


if __name__ == "__main__":
    main()
