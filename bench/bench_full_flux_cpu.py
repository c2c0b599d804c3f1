"""One LoRA training step of a full-size FLUX.1-dev (19 double + 38 single blocks, width 3072) on CPU,
with the base in fp8_scaled, never holding the model in bf16.

The model is built on `meta`, prepare_fp8 swaps its Linears for FP8Linear, then it is materialised
module by module: each FP8Linear gets a random float32 weight N(0, 0.02) of its shape, quantized at
once by library.precision.fp8.quantize_weight (only one layer is ever in high precision); every other tensor
(norms = 1, embedders / final layer / biases N(0, 0.02)) is bf16. Then one step as train_lora.py
takes it: LoRA rank 16 on the default TARGETS (float32), gradient checkpointing on, compute dtype
bf16 (or fp32, --compute), FluxFamily.predict, MSE against a random target, backward, AdamW.

Memory: VmHWM (peak RSS) from /proc/self/status, reset before each phase through
/proc/self/clear_refs, so each phase's own peak is reported: build, forward, backward, optimizer.
Forward and backward progress is printed per block (with checkpointing the blocks run again during
backward), so a slow run can be extrapolated from its log.

    timeout 1500 python bench/bench_full_flux_cpu.py > /tmp/full_flux.log 2>&1 &
    python bench/bench_full_flux_cpu.py --double 2 --single 4   # a quick partial-depth check
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_step import GiB, machine_summary, pin_malloc_threshold, reset_peak, status_bytes  # noqa: E402

from library.models.core import checkpointing  # noqa: E402
from library.models.flux1.family import FluxFamily  # noqa: E402
from library.models.flux1.model import FLUX_DEV, Flux  # noqa: E402
from library.precision.fp8 import FP8Linear, bytes_per_parameter, prepare_fp8, quantize_weight  # noqa: E402
from networks.lora import LoRANetwork  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402

START = time.perf_counter()


def log(msg: str):
    print(f"[{time.perf_counter() - START:7.1f} s | RSS {status_bytes('VmRSS') / GiB:5.2f} GiB] {msg}", flush=True)


def peak() -> float:
    return status_bytes("VmHWM") / GiB


# ----------------------------------------------------------------------------------------------
# Building straight into fp8


@torch.no_grad()
def materialize(model: nn.Module, mode: str, dtype: torch.dtype, seed: int) -> int:
    """Fill a meta model prepared by prepare_fp8: FP8Linear weights from float32 N(0, 0.02), one
    layer at a time; every other parameter in `dtype`. Returns the number of quantized layers."""
    g = torch.Generator().manual_seed(seed)
    quantized = 0
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            w = torch.empty(module.out_features, module.in_features, dtype=torch.float32).normal_(0, 0.02, generator=g)
            module.weight, module.weight_scale = quantize_weight(w, mode)  # fp8 codes + bf16 scales
            del w
            quantized += 1
        for pname, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                continue
            if pname == "scale" or (pname == "weight" and p.dim() == 1):  # RMSNorm weights
                value = torch.ones(p.shape, dtype=dtype)
            else:
                value = torch.empty(p.shape, dtype=torch.float32).normal_(0, 0.02, generator=g).to(dtype)
            setattr(module, pname, nn.Parameter(value, requires_grad=False))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"still on meta after materialize: {left[:3]}")
    return quantized


def build(args) -> Flux:
    cfg = dataclasses.replace(FLUX_DEV, depth=args.double, depth_single=args.single)
    with torch.device("meta"):
        model = Flux(cfg)
    prepare_fp8(model, args.mode, arch_spec("flux").fp8)
    count = materialize(model, args.mode, torch.bfloat16, args.seed)
    model.compute_dtype = DTYPES[args.compute]
    model.gradient_checkpointing = checkpointing(True, args.save_projections)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, FP8Linear))
    log(f"built {cfg.depth}+{cfg.depth_single} blocks: {count} FP8Linear ({args.mode}) holding {weights / 1e9:.2f} B weights; "
        f"checkpointing {model.gradient_checkpointing}")
    return model


# ----------------------------------------------------------------------------------------------
# Per-block progress


def watch_blocks(model: Flux) -> tuple[dict[str, list[float]], dict]:
    """Print block times as they run. Returns ({phase: [seconds per block]}, state): set
    state["phase"] = "backward" before backward. Forward: each block's own time. Backward: the time
    between successive blocks' recomputations starting (checkpointing reruns each block's forward
    just before its backward, and stops that rerun early, so only pre-hooks fire there): one
    block's recompute + backward, for all blocks but the first one."""
    times = {"forward": [], "backward": []}
    state = {"phase": "forward", "t": 0.0, "last": None}
    blocks = [(f"double {i}", b) for i, b in enumerate(model.double_blocks)] + \
             [(f"single {i}", b) for i, b in enumerate(model.single_blocks)]
    every = max(1, len(blocks) // 12)

    def pre(label, index):
        def hook(module, args):
            now = state["t"] = time.perf_counter()
            if state["phase"] == "backward":
                if state["last"] is not None:
                    times["backward"].append(now - state["last"][1])
                    if index % every == 0:
                        log(f"  backward {state['last'][0]:9s} {times['backward'][-1]:6.2f} s")
                state["last"] = (label, now)
        return hook

    def post(label, index):
        def hook(module, args, output):
            if state["phase"] == "forward":
                times["forward"].append(time.perf_counter() - state["t"])
                if index % every == 0 or index == len(blocks) - 1:
                    log(f"  forward  {label:9s} {times['forward'][-1]:6.2f} s")
        return hook

    for index, (label, block) in enumerate(blocks):
        block.register_forward_pre_hook(pre(label, index))
        block.register_forward_hook(post(label, index))
    return times, state


# ----------------------------------------------------------------------------------------------
# The step


def mean(values) -> float:
    return sum(values) / len(values) if values else float("nan")


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def matmul_gflops(dtype: torch.dtype, tokens: int = 320) -> float:
    """One FLUX MLP matmul ([tokens, 3072] x [3072, 12288]) in `dtype`: GFLOP/s on this machine."""
    a, b = torch.randn(tokens, 3072, dtype=dtype), torch.randn(12288, 3072, dtype=dtype)
    F.linear(a, b)
    start = time.perf_counter()
    for _ in range(3):
        F.linear(a, b)
    return 3 * 2 * tokens * 3072 * 12288 / (time.perf_counter() - start) / 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--double", type=int, default=19)
    p.add_argument("--single", type=int, default=38)
    p.add_argument("--mode", choices=("fp8", "fp8_scaled"), default="fp8_scaled")
    p.add_argument("--compute", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--image-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-projections", action="store_true", help="checkpoint_saves_projections (the trained gates' "
                                                                      "projections kept from the forward)")
    args = p.parse_args(argv)
    pin_malloc_threshold()
    log(f"machine: {machine_summary()}")
    log(f"matmul probe [320x3072]x[3072x12288]: bf16 {matmul_gflops(torch.bfloat16):.0f} GFLOP/s, "
        f"fp32 {matmul_gflops(torch.float32):.0f} GFLOP/s; compute dtype {args.compute}")
    can_reset = reset_peak()
    phases = {}

    t0 = time.perf_counter()
    model = build(args)
    phases["build"] = (time.perf_counter() - t0, peak(), status_bytes("VmRSS") / GiB)
    log(f"bytes per base parameter {bytes_per_parameter(model):.4f}; "
        f"base {sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) / GiB:.2f} GiB")

    torch.manual_seed(args.seed)  # the LoRA's init: runs with other settings get the same LoRA
    network = LoRANetwork(model, "flux", args.rank, alpha=args.rank)
    network.apply()
    params = network.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    model.train()
    log(f"LoRA: {len(network.lora_modules())} modules, {sum(p.numel() for p in params) / 1e6:.1f} M float32 params")

    side = int(args.image_tokens**0.5)
    g = torch.Generator().manual_seed(1)
    x_t = torch.randn(1, side * side, 64, generator=g)  # float32 packed latents; the model casts at entry
    text = {"t5": torch.randn(1, args.text_tokens, 4096, generator=g), "clip_pooled": torch.randn(1, 768, generator=g)}
    sigmas, target = torch.rand(1, generator=g), torch.randn(1, side * side, 64, generator=g)
    block_times, watch = watch_blocks(model)

    def phase(name, fn):
        reset_peak()
        start = time.perf_counter()
        out = fn()
        phases[name] = (time.perf_counter() - start, peak(), status_bytes("VmRSS") / GiB)
        log(f"{name} done in {phases[name][0]:.1f} s, peak RSS in phase {phases[name][1]:.2f} GiB")
        return out

    loss = phase("forward", lambda: F.mse_loss(FluxFamily("unused").predict(model, x_t, sigmas, text, side, side, 1.0).float(), target))
    watch["phase"] = "backward"
    phase("backward", loss.backward)
    phase("optimizer", optimizer.step)
    grad_norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in params if p.grad is not None)).item()

    step_s = sum(phases[k][0] for k in ("forward", "backward", "optimizer"))
    overall = max(v[1] for v in phases.values())
    print()
    print(f"compute {args.compute}, base {args.mode}, {args.double}+{args.single} blocks, rank {args.rank}, "
          f"{args.image_tokens}+{args.text_tokens} tokens, batch 1, gradient checkpointing on; loss {loss.item():.4f}, "
          f"LoRA grad norm {grad_norm:.9e}; VmHWM reset per phase: {can_reset}")
    print(f"{'phase':10s} {'seconds':>8s} {'peak RSS GiB':>13s} {'RSS after GiB':>14s}")
    for name, (sec, pk, rss) in phases.items():
        print(f"{name:10s} {sec:8.1f} {pk:13.2f} {rss:14.2f}")
    fwd, bwd = block_times["forward"], block_times["backward"]
    if fwd:
        d, n = args.double, len(fwd)
        print(f"per block forward: double {mean(fwd[:d]):.2f} s, single {mean(fwd[d:]):.2f} s; "
              f"backward incl. recompute: single {mean(bwd[:n - d]):.2f} s, double {mean(bwd[n - d:]):.2f} s "
              f"({len(bwd)} of {n} blocks timed)")
    print(f"SUMMARY: full FLUX.1-dev {args.mode} LoRA step on CPU ({args.compute} compute): peak RSS {overall:.2f} GiB "
          f"({'<=' if overall <= 15 else '>'} 15 GiB), {bytes_per_parameter(model):.4f} bytes/base param, "
          f"step {step_s:.0f} s (forward {phases['forward'][0]:.0f}, backward {phases['backward'][0]:.0f}, "
          f"optimizer {phases['optimizer'][0]:.1f}), build {phases['build'][0]:.0f} s")


if __name__ == "__main__":
    main()
