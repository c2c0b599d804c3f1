"""Block swap on a full-size FLUX.1-dev / Qwen-Image transformer: peak device memory and step time
for blocks_to_swap = 0 / N1 / N2 ..., in one process on the same random weights.

Each setting runs LoRA training steps (rank 16, default targets, AdamW, gradient checkpointing,
batch 1, an MSE loss against a fixed random target) and reports: the median step time, the ratio to
blocks_to_swap = 0 (the swap overhead: 1.00 = copies fully hidden behind compute), the peak
torch.cuda.max_memory_allocated during the steps, and the bytes copied per step.

    python bench/bench_block_swap.py --family flux --base fp8_scaled --swaps 0,8,16,30 --res 1024
    python bench/bench_block_swap.py --family qwen_image --base fp8_scaled --swaps 0,20,40 --res 1024
    python bench/bench_block_swap.py --family flux --swaps 0,16 --compile [--fp8_compute]

--compile compiles every block (train_lora.py's torch_compile) once, before the first setting; the
swap settings then run the same compiled blocks. --fp8_compute runs the fp8 base's Linears as fp8
GEMMs (library/precision/fp8_compute.py; --base fp8 / fp8_scaled).

Weights are random (normal, std 0.02) and built straight on the device; swapped blocks go to
pinned CPU memory. Timings need CUDA; before spending device time, check a change here on the CPU at full
width and few blocks (nothing overlaps there, so only that it runs and counts):
    python bench/bench_block_swap.py --device cpu --blocks 1 --res 32 --text 4 --steps 1 --swaps 0,1
    python bench/bench_block_swap.py --device cpu --blocks 2 --res 32 --text 4 --steps 1 --swaps 0,1 --family qwen_image
(Qwen-Image swaps at most its blocks less one: 1 of 2.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from library.models.block_swap import enable_block_swap  # noqa: E402
from library.models.core import compile_block  # noqa: E402
from library.models.flux1.model import FLUX_DEV, Flux, make_img_ids, make_txt_ids  # noqa: E402
from library.models.qwen_image.model import QWEN_IMAGE, QwenImage  # noqa: E402
from library.precision.fp8 import FP8Linear, prepare_fp8, quantize_weight  # noqa: E402
from networks.lora import LoRANetwork  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402
from tools.devices import device_or_exit  # noqa: E402

GiB = 2**30


@torch.no_grad()
def random_model(family: str, base: str, device: torch.device, config=None) -> nn.Module:
    """Full-size model with random weights, bf16 compute, built on meta and filled on the device.
    config: the family's config to build instead of the released one (e.g. fewer blocks)."""
    with torch.device("meta"):
        model = Flux(config or FLUX_DEV) if family == "flux" else QwenImage(config or QWEN_IMAGE)
    if base != "bf16":
        prepare_fp8(model, base, arch_spec(family).fp8)
    model.to_empty(device=device)
    gen = torch.Generator(device).manual_seed(0)
    for module in model.modules():
        if isinstance(module, FP8Linear):
            w = torch.randn(module.out_features, module.in_features, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
            module.weight, module.weight_scale = quantize_weight(w, base)
        for name, p in module.named_parameters(recurse=False):
            if p.dtype != torch.bfloat16 and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
            if name == "weight" and p.dim() == 1:
                p.fill_(1.0)  # norms
            else:
                p.normal_(0, 0.02, generator=gen)
    model.compute_dtype = torch.bfloat16
    model.requires_grad_(False).eval()
    model.gradient_checkpointing = True
    return model


def inputs_for(family: str, res: int, device: torch.device, text_len: int = 512) -> tuple[dict, int]:
    h = w = res // 16  # 2x2 patches of the 8x-downsampled latent
    if family == "flux":
        cfg = FLUX_DEV
        return dict(img=torch.randn(1, h * w, cfg.in_channels, device=device), img_ids=make_img_ids(1, h, w, device),
                    txt=torch.randn(1, text_len, cfg.context_in_dim, device=device), txt_ids=make_txt_ids(1, text_len, device),
                    timesteps=torch.tensor([0.5], device=device), y=torch.randn(1, cfg.vec_in_dim, device=device),
                    guidance=torch.tensor([1.0], device=device)), h * w
    cfg = QWEN_IMAGE
    return dict(img=torch.randn(1, h * w, cfg.in_channels, device=device),
                txt=torch.randn(1, text_len, cfg.joint_attention_dim, device=device),
                txt_mask=torch.ones(1, text_len, dtype=torch.bool, device=device),
                timesteps=torch.tensor([0.5], device=device), img_shapes=[(1, h, w)]), h * w


def run_setting(model, net, optimizer, inputs, target, steps: int, device) -> tuple[list[float], int]:
    cuda = device.type == "cuda"
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = (model(**inputs).float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times, torch.cuda.max_memory_allocated(device) if cuda else 0


def profile_step(model, net, optimizer, inputs, target, device, trace: str | None = None) -> None:
    """One step under torch.profiler: where the host's time goes (self CPU: launches, copies' set-up,
    waits) and the device's (kernels and host-to-device copies), to tell a swap's host cost from its
    copies' bandwidth. With `trace` (a .json path) the step's timeline is also written there and read
    back by trace_overlap.py: the compute stream's idle time split into waiting on copies and on the host."""
    from torch.profiler import ProfilerActivity, profile

    from trace_overlap import overlap, report

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_setting(model, net, optimizer, inputs, target, 1, device)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48))
    if device.type == "cuda":
        print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=48))
        kernels = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
        copies = sum(e.self_device_time_total for e in events if "Memcpy HtoD" in e.key) / 1e6
        print(f"device time: all {kernels:.3f} s, of which host-to-device copies {copies:.3f} s (on the side stream)")
    if trace:
        prof.export_chrome_trace(trace)
        if device.type == "cuda":
            with open(trace) as f:
                print(report(overlap(json.load(f))))
        print(f"timeline: {trace} (chrome://tracing or ui.perfetto.dev)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--family", default="flux", choices=("flux", "qwen_image"))
    p.add_argument("--base", default="fp8_scaled", choices=("bf16", "fp8", "fp8_scaled"))
    p.add_argument("--swaps", default="0,8,16")
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--text", type=int, default=512, help="text tokens")
    p.add_argument("--steps", type=int, default=4, help="timed steps per setting (after 1 warmup)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prefetch", type=int, default=1, help="block_swap_prefetch: swapped blocks copied ahead of use")
    p.add_argument("--compile", action="store_true", help="torch.compile every block (as torch_compile = true)")
    p.add_argument("--fp8_compute", action="store_true", help="fp8 GEMMs for the fp8 base (as fp8_compute = true)")
    p.add_argument("--device", default="cuda", help="cuda (timings) or cpu (a smoke run with --blocks)")
    p.add_argument("--profile", action="store_true",
                   help="after each setting's timing, one step under torch.profiler: the host's and the device's top ops")
    p.add_argument("--trace", metavar="DIR",
                   help="profile as --profile and write each setting's profiled step as DIR/swap<N>.json (a chrome trace), "
                        "and report copy / compute overlap from it (bench/trace_overlap.py)")
    p.add_argument("--blocks", type=int, default=0,
                   help="build this many blocks of each kind at full width (0: the released depth)")
    args = p.parse_args(argv)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    device = device_or_exit(args.device)
    config = None
    if args.blocks:
        config = (dataclasses.replace(FLUX_DEV, depth=args.blocks, depth_single=args.blocks) if args.family == "flux"
                  else dataclasses.replace(QWEN_IMAGE, num_layers=args.blocks))
    model = random_model(args.family, args.base, device, config)
    if args.fp8_compute:
        from library.precision.fp8_compute import enable_fp8_compute

        print(f"fp8_compute: {enable_fp8_compute(model)} Linears")
    net = LoRANetwork(model, args.family, rank=args.rank, alpha=args.rank)
    net.apply()
    if args.compile:
        for block in model.swappable_blocks():
            compile_block(block)
    net.to(device).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-5)
    inputs, tokens = inputs_for(args.family, args.res, device, args.text)
    with torch.no_grad():
        target = torch.randn_like(model(**inputs).float())
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    print(f"{args.family} {args.base} base{' (fp8 compute)' if args.fp8_compute else ''}"
          f"{', compiled' if args.compile else ''}, prefetch {args.prefetch}: {weights / GiB:.2f} GiB of weights, {tokens} image tokens "
          f"({args.res}px), LoRA {sum(p.numel() for p in net.parameters()) / 1e6:.1f} M params, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    rows, reference = [], None
    for n in [int(s) for s in args.swaps.split(",")]:
        swap = enable_block_swap(model, n, device, args.prefetch)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # a block's home: a list of tensors, or one flat buffer (the block_swap_flat candidate, commit 272a36d,
        # dropped): never iterate a tensor here (its unbind into 330 M one-byte views stalled a 2026-11-28 run)
        block_bytes = {} if swap is None else {i: sum(h.numel() * h.element_size() for h in (v if isinstance(v, list) else [v]))
                                               for i, v in swap.homes.items()}
        run_setting(model, net, optimizer, inputs, target, 1, device)  # warmup
        if swap is not None:
            swap.log.clear()
        times, peak = run_setting(model, net, optimizer, inputs, target, args.steps, device)
        # the loads the steps made (the last blocks of a training forward stay for its backward: fewer than 2 each)
        moved = 0 if swap is None else sum(block_bytes[i] for op, i in swap.log if op == "load") / args.steps
        t = statistics.median(times)
        reference = reference or t
        rows.append((n, t, t / reference, peak / GiB, moved / GiB))
        print(f"blocks_to_swap {n:3d}: step {t:.3f} s (x{t / reference:.3f}), peak {peak / GiB:.2f} GiB, "
              f"copied {moved / GiB:.2f} GiB/step ({moved / GiB / t:.1f} GiB/s needed)", flush=True)
        if args.profile or args.trace:
            trace = os.path.join(args.trace, f"swap{n}.json") if args.trace else None
            profile_step(model, net, optimizer, inputs, target, device, trace)
    enable_block_swap(model, 0, device)
    print("\n| blocks_to_swap | step (s) | vs 0 | peak allocated (GiB) | copied per step (GiB) |")
    print("|---|---|---|---|---|")
    for n, t, ratio, peak, copied in rows:
        print(f"| {n} | {t:.3f} | x{ratio:.3f} | {peak:.2f} | {copied:.2f} |")


if __name__ == "__main__":
    main()
