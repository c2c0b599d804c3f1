"""The step-time cost of quantized base Linears on the CPU: forward + input-gradient backward (what a
frozen base layer under a LoRA does each step) of one FLUX-width Linear stored as fp8_scaled, nf4,
nf4_dq, int8, GGUF Q8_0 and GGUF Q4_K, against the same Linear in bf16 (and fp32) in the same process.

    python bench/bench_lowbit_linear.py [--reps 7] [--tokens 256] [--shapes 3072x3072,12288x3072] [--dtype bf16]

Each quantized layer dequantizes its weight in forward and again in backward (the scheme of every
stored format here), so the cost over bf16 is two dequantizations per step, whatever the token count;
the matmuls are the same. Runs alternate (each round times every layer once), medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train_step import machine_summary  # noqa: E402
from library.precision import bnb_weights as bnb  # noqa: E402
from library.precision.fp8 import FP8Linear  # noqa: E402
from library.precision.gguf_weights import GGUF_TYPES, GGUFLinear  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def gguf_layer(linear: nn.Linear, qtype: str) -> GGUFLinear:
    """A GGUFLinear of `qtype`: gguf's own quantization where it has one (Q8_0), else valid random
    blocks (every code byte random, the fp16 scales of the weight's size): dequantization costs the same."""
    import gguf

    layer = GGUFLinear.from_meta_linear(nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta"), qtype)
    w = linear.weight.detach().float()
    if qtype == "Q8_0":
        blocks = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0))
    else:
        kind, g = GGUF_TYPES[qtype], torch.Generator().manual_seed(0)
        b = torch.randint(0, 256, (w.numel() // kind.block, kind.block_bytes), dtype=torch.uint8, generator=g)
        for offset in (0, 2):  # Q4_K: d, dmin
            b[:, offset : offset + 2] = (torch.randn(b.shape[0], 1, generator=g) * 1e-3).half().view(torch.uint8)
        blocks = b.reshape(w.shape[0], -1)
    layer.weight = blocks
    return layer


def layers_for(out_features: int, in_features: int, dtype: torch.dtype) -> dict[str, nn.Module]:
    linear = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(linear.weight, std=0.02)
    found = {"bf16" if dtype == torch.bfloat16 else "fp32": nn.Linear(in_features, out_features, bias=False)}
    found[next(iter(found))].weight.data = linear.weight.detach().to(dtype)
    found["fp8_scaled"] = FP8Linear.from_linear(linear, "fp8_scaled")
    for mode in bnb.MODES:
        found[mode] = bnb.from_linear(linear, mode)
    for qtype in ("Q8_0", "Q4_K"):
        found[f"GGUF {qtype}"] = gguf_layer(linear, qtype)
    return {name: layer.requires_grad_(False) for name, layer in found.items()}


def step_of(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        xi = x.detach().requires_grad_(True)
        layer(xi).backward(grad)
        return xi.grad
    return step


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--shapes", default="3072x3072,12288x3072", help="out x in of each Linear")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(machine_summary())
    print(f"forward + input-grad backward, {args.tokens} tokens, {args.dtype} compute, medians of {args.reps} alternating rounds")
    summary = []
    for shape in args.shapes.split(","):
        out_features, in_features = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        layers = layers_for(out_features, in_features, dtype)
        x, grad = torch.randn(args.tokens, in_features, dtype=dtype), torch.randn(args.tokens, out_features, dtype=dtype)
        steps = {name: step_of(layer, x, grad) for name, layer in layers.items()}
        reference = next(iter(steps))
        expected = steps[reference]()
        times = {name: [] for name in steps}
        for name, step in steps.items():  # warm-up; every layer's input grad is finite and near the reference
            got = step()
            assert torch.isfinite(got).all()
            if not name.startswith("GGUF Q4_K"):  # random blocks: another weight
                rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
                assert rel < 0.2, (name, rel)
        for _ in range(args.reps):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        ref = statistics.median(times[reference])
        print(f"Linear [{out_features}, {in_features}]:")
        for name, layer in layers.items():
            t = statistics.median(times[name])
            stored = sum(b.numel() * b.element_size() for b in [*layer.buffers(), *layer.parameters()])
            print(f"  {name:11s} {t * 1e3:8.1f} ms  x{t / ref:5.2f} of {reference}   {stored / (out_features * in_features):.4f} bytes/weight")
            summary.append(f"{name}@{out_features}x{in_features} x{t / ref:.2f}")
    print("SUMMARY: " + ", ".join(summary))


if __name__ == "__main__":
    main()
