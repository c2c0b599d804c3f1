"""Where one LoRA step's time goes, ours against the peer's, under torch.profiler (issue 29).

bench_peers.py times the two steps; this says why one is slower. The same pair (bench_peers.build_pair:
one random base, the same inputs, each side's LoRA, each trainer's precision and compile) runs a few
timed steps without the profiler, then `--steps` under it. Per side it prints:
  wall        the median step without the profiler;
  device      on CUDA, the step's kernel time (sum of kernel and copy durations) and its share of the
              wall time: far below 100% at batch 1 means the GPU waits for the CPU to launch work;
  launches    kernels launched per step on CUDA (on the CPU: aten ops per step): the eager step's CPU
              cost grows with this count, not with FLOPs;
  top ops     the names with the most self time on the device (CUDA) or the CPU, per step.
The profiler's own overhead inflates the profiled steps; shares and counts are what to compare.

    python bench/profile_peers.py --device cuda --musubi DIR --families qwen_image --precision bf16
    python bench/profile_peers.py --device cuda --sd_scripts DIR --families flux --precision fp8 --compile
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import bench_peers  # noqa: E402
from bench_train_step import add_our_lora, our_forward, synchronize  # noqa: E402


def build_steps(family: str, precision: str, args, peer, size: str = "mid") -> dict:
    """{"ours": step, "theirs": step} as bench_peers.compare builds them (without its step-0 check);
    size: bench_train_step's ("mid": full-width blocks, "narrow": toy widths)."""
    ours, theirs = bench_peers.build_pair(family, size, precision, args, peer)
    x = bench_peers.inputs(family, ours.config, args)
    _, our_params = add_our_lora(ours, family, args.rank)
    _, their_params = bench_peers.add_their_lora(family, theirs, args.rank, peer)
    if args.compile:
        theirs = bench_peers.compile_both(family, ours, theirs, peer, args.our_compile_mode)
    return {"ours": bench_peers.make_step(lambda: our_forward(family, ours, x), our_params, x["target"], precision, args.device),
            "theirs": bench_peers.make_step(lambda: bench_peers.their_forward(family, theirs, x, precision), their_params,
                                            x["target"], precision, args.device)}


def wall_times(step, reps: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def profile(step, steps: int, device: torch.device) -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    return list(prof.events())


def summarize(events: list, steps: int, wall: float, device: torch.device, top: int) -> list[str]:
    """The lines for one side: device time and share, launches, the top names by self time."""
    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    lines = []
    if device.type == "cuda":
        busy = sum(e.time_range.elapsed_us() for e in on_device) / 1e6 / steps
        lines.append(f"  device {busy * 1e3:.1f} ms/step ({busy / wall:.0%} of the wall time); "
                     f"{len(on_device) / steps:.0f} kernel launches/step")
        chosen, attr, unit = on_device, "time_range", "device"
    else:
        ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        lines.append(f"  {len(ops) / steps:.0f} aten ops/step (nested calls included)")
        chosen, attr, unit = ops, "self_cpu_time_total", "CPU self"
    totals, counts = defaultdict(float), defaultdict(int)
    for e in chosen:
        totals[e.name] += e.time_range.elapsed_us() if attr == "time_range" else e.self_cpu_time_total
        counts[e.name] += 1
    lines.append(f"  top {top} by {unit} time per step:")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {us / steps / 1e3:8.2f} ms  x{counts[name] / steps:<5.0f} {name[:100]}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    bench_peers.add_pair_arguments(p, blocks=(2, 4, 4), tokens=(4096, 512))
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp8_scaled"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=5, help="steps timed without the profiler")
    p.add_argument("--steps", type=int, default=3, help="steps under the profiler")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if bench_peers.supported(f, args.precision)]
    for family in set(args.families.split(",")) - set(families):
        print(f"[{family} {args.precision}] no peer row (sd-scripts has no scaled fp8 for FLUX.1)")
    peers = bench_peers.load_peers(args, families)
    mode = "compiled" if args.compile else "eager"
    for family in families:
        steps = build_steps(family, args.precision, args, peers[family])
        for name, step in steps.items():
            for _ in range(args.warmup):  # compiles here when --compile
                step()
            wall = statistics.median(wall_times(step, args.reps, args.device))
            events = profile(step, args.steps, args.device)
            who = "ours" if name == "ours" else bench_peers.PEER[family]
            print(f"[{family} mid {args.precision} {mode}] {who}: wall {wall * 1e3:.1f} ms/step (median of {args.reps})")
            print("\n".join(summarize(events, args.steps, wall, args.device, args.top)), flush=True)
        del steps


if __name__ == "__main__":
    main()
