"""bf16 compute on a CPU without native bf16 GEMMs: the frozen low-bit Linears' products with and without
layout_matmul's column-major copy (library/precision/dequantized_linear.py), in one process, alternating.

PyTorch runs a bf16 GEMM in oneDNN only where the CPU has AVX-512 (torch.ops.mkldnn._is_mkldnn_bf16_supported);
elsewhere its fallback runs a row-major A @ row-major B (a Linear's input gradient, grad_out @ W) at 0.2-0.3
GFLOPS. An AVX2-only CPU is reproduced on any x86 one with oneDNN held to AVX2:

    ONEDNN_MAX_CPU_ISA=AVX2 python bench/bench_cpu_gemm_layout.py            # what an AVX2-only CPU runs
    python bench/bench_cpu_gemm_layout.py                                    # this CPU as it is
    ONEDNN_MAX_CPU_ISA=AVX2 python bench/bench_cpu_gemm_layout.py --parts step --image-tokens 64

gemm: one fp8_scaled Linear of a released width, forward + backward (x needs a gradient), bf16 compute, with
the copy (layout_matmul's column-major A: what the trainer runs where the CPU is not native) and plain (the
product as autograd would run it: what it runs where the CPU is native), and the same Linear in float32
compute. step: a FLUX.1 training step on an fp8_scaled base (full width, --double / --single blocks, LoRA rank 16,
AdamW) in bf16 with and without the copy, and in float32. Times are thread CPU seconds of one torch thread
(bench_train_step.alternate), medians.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_train_step import add_our_lora, alternate, build_ours, fp8_twin, machine_summary, make_inputs, \
    make_step, median, our_forward  # noqa: E402
from library.precision import dequantized_linear as dq, fp8  # noqa: E402

SHAPES = {  # (tokens, in, out): released widths
    "FLUX.1 attention proj, 320 tokens": (320, 3072, 3072),
    "FLUX.1 MLP down, 320 tokens": (320, 12288, 3072),
    "HiDream-O1 q_proj, 94 tokens": (94, 4096, 4096),
}


def layout(step, copy: bool):
    """The step with layout_matmul's column-major copy (copy) or the plain product, whatever this CPU is."""
    def call():
        dq.NATIVE_CPU_GEMMS[torch.bfloat16] = not copy
        return step()
    return call


def linear_step(tokens: int, fan_in: int, fan_out: int, dtype: torch.dtype):
    torch.manual_seed(0)
    layer = fp8.FP8Linear.from_linear(nn.Linear(fan_in, fan_out), "fp8_scaled")
    x = torch.randn(tokens, fan_in, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, fan_out, dtype=dtype)

    def step() -> float:
        x.grad = None
        layer(x).backward(grad)
        return 0.0

    return step


def bench_gemms(args):
    for name, (tokens, fan_in, fan_out) in SHAPES.items():
        bf16 = linear_step(tokens, fan_in, fan_out, torch.bfloat16)
        steps = {"bf16 copy": layout(bf16, True), "bf16 plain": layout(bf16, False),
                 "fp32": linear_step(tokens, fan_in, fan_out, torch.float32)}
        res = alternate(steps, 1, args.reps, torch.device("cpu"), clock=args.clock)
        flops = 4 * tokens * fan_in * fan_out  # forward and the input gradient
        t = {k: median(v["times"]) for k, v in res.items()}
        print(f"[{name}: [{tokens}, {fan_in}] -> {fan_out}, forward + input gradient]")
        for k, s in t.items():
            print(f"  {k:12s} {s * 1e3:9.1f} ms  {flops / s / 1e9:6.2f} GFLOPS  "
                  f"(x{s / t['bf16 copy']:.2f} of bf16 copy)")


def bench_step(args):
    cpu = torch.device("cpu")
    steps = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        base = build_ours("flux", "mid", args, dtype, cpu)
        model = fp8_twin(base, "flux", "fp8_scaled")
        model.train()
        x = make_inputs("flux", model.config, args.image_tokens, args.text_tokens, 1, cpu)
        _, params = add_our_lora(model, "flux", 16)
        step = make_step(lambda m=model, x=x: our_forward("flux", m, x), params, x["target"])
        if dtype == torch.bfloat16:
            steps["bf16 copy"], steps["bf16 plain"] = layout(step, True), layout(step, False)
        else:
            steps["fp32"] = step
    res = alternate(steps, 1, args.reps, cpu, clock=args.clock)
    t = {k: median(v["times"]) for k, v in res.items()}
    print(f"[FLUX.1 fp8_scaled step: {args.double} double + {args.single} single blocks at width 3072, "
          f"{args.image_tokens} image + {args.text_tokens} text tokens, LoRA rank 16]")
    for k, s in t.items():
        print(f"  {k:12s} {s:8.2f} s  (x{s / t['bf16 copy']:.2f} of bf16 copy)  first loss {res[k]['loss']:.6f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="gemm,step")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--double", type=int, default=1)
    p.add_argument("--single", type=int, default=1)
    p.add_argument("--image-tokens", type=int, default=64)
    p.add_argument("--text-tokens", type=int, default=16)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.clock = time.thread_time
    native = dq.native_cpu_matmul(torch.bfloat16)
    print(f"{machine_summary()}; ONEDNN_MAX_CPU_ISA="
          f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}; native bf16 GEMMs: {native}"
          + f" (the trainer runs bf16 {'plain' if native else 'copy'} here)")
    if "gemm" in args.parts:
        bench_gemms(args)
    if "step" in args.parts:
        bench_step(args)


if __name__ == "__main__":
    main()
