"""The eager step's host (CPU-side) cost per block, ours against the peer's (issue 29).

At batch 1 on a GPU the eager step is bound by the CPU issuing work: Python, the dispatcher and
autograd per op, not FLOPs (the H100 run: a Qwen-Image block ~25 ms eager against ~5 ms of GEMMs).
This measures that host cost where it can be measured without a GPU: the same pair as bench_peers
(one random base, the same inputs, each side's LoRA and checkpointing) at toy widths ("narrow":
head_dim 32, `--blocks` blocks) and a few tokens on one CPU thread, where every op costs about its
fixed overhead. It prints the step time per block over two block counts (the slope: the fixed parts
cancel), ours / theirs (also per round: the four steps alternate), and with `--profile` cProfile's top
Python functions of one side's step. On the CPU the times are the thread's CPU time (time.thread_time: the
step runs in this one thread), which leaves out the time other processes hold the core on a shared
machine; `--clock wall` for wall time.

    python bench/host_overhead.py --musubi /tmp/musubi-tuner --families qwen_image --precisions bf16,fp8_scaled
    python bench/host_overhead.py --sd_scripts /tmp/sd-scripts --families flux --profile ours
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import bench_peers  # noqa: E402
import profile_peers  # noqa: E402
from bench_train_step import alternate, median  # noqa: E402


def build_steps(family: str, precision: str, blocks: int, args, peer) -> dict:
    """profile_peers' pair of steps at toy widths with `blocks` blocks (FLUX.1: a third of them double)."""
    args.double, args.single, args.qwen_blocks = blocks // 3, blocks - blocks // 3, blocks
    return profile_peers.build_steps(family, precision, args, peer, size="narrow")


def per_block(family: str, precision: str, args, peer) -> dict:
    """{side: (step ms at the small count, ms per block)} from the median steps at two block counts, and
    "ratio": (median, lower quartile, upper quartile) of ours / theirs per block over the rounds. The four
    steps (each side at each count) alternate in one loop, so each round's two slopes come from steps run
    back to back, under about the same load."""
    lo, hi = args.blocks
    steps = {(side, blocks): step for blocks in (lo, hi)
             for side, step in build_steps(family, precision, blocks, args, peer).items()}
    res = alternate(steps, args.warmup, args.reps, args.device,
                    time.thread_time if args.clock == "thread" else time.perf_counter)
    ms = {key: [t * 1e3 for t in r["times"]] for key, r in res.items()}
    slopes = {side: [(b - a) / (hi - lo) for a, b in zip(ms[side, lo], ms[side, hi])] for side in ("ours", "theirs")}
    ratios = sorted(o / t for o, t in zip(slopes["ours"], slopes["theirs"]))
    quartile = len(ratios) // 4
    out = {side: (median(ms[side, lo]), (median(ms[side, hi]) - median(ms[side, lo])) / (hi - lo))
           for side in ("ours", "theirs")}
    out["ratio"] = (median(ratios), ratios[quartile], ratios[-1 - quartile])
    return out


def profile(family: str, precision: str, side: str, args, peer) -> None:
    step = build_steps(family, precision, args.blocks[1], args, peer)[side]
    for _ in range(args.warmup):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reps):
        step()
    prof.disable()
    print(f"[{family} {precision} {side}] cProfile over {args.reps} steps, {args.blocks[1]} blocks")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_peers.add_pair_arguments(p, (1, 2, 3), (16, 8))  # blocks come from --blocks
    p.add_argument("--precisions", default="bf16")
    p.add_argument("--blocks", default="3,9", help="two block counts: the per-block cost is the slope")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--profile", choices=("ours", "theirs"), help="cProfile one side instead of timing")
    p.add_argument("--clock", choices=("thread", "wall"), default="thread",
                   help="thread: this thread's CPU time (CPU only; the default there), wall: wall time")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    args.blocks = tuple(int(b) for b in args.blocks.split(","))
    if args.device != "cpu":
        args.clock = "wall"  # the GPU's work runs outside this thread
    torch.set_num_threads(1)  # toy ops: more threads only add OpenMP sync
    families = args.families.split(",")
    peers = bench_peers.load_peers(args, families)
    lines = []
    for family in families:
        for precision in args.precisions.split(","):
            if not bench_peers.supported(family, precision):
                continue
            if args.profile:
                profile(family, precision, args.profile, args, peers[family])
                continue
            r = per_block(family, precision, args, peers[family])
            (o_fix, o_blk), (t_fix, t_blk), ratio = r["ours"], r["theirs"], r["ratio"]
            lines.append(f"{family} {precision}: per block ours {o_blk:.2f} ms theirs {t_blk:.2f} ms "
                         f"= {o_blk / t_blk:.2f} (per round: median {ratio[0]:.2f}, quartiles {ratio[1]:.2f}-"
                         f"{ratio[2]:.2f}); step at {args.blocks[0]} blocks ours {o_fix:.1f} ms "
                         f"theirs {t_fix:.1f} ms = {o_fix / t_fix:.2f}")
            print(lines[-1], flush=True)
    if lines:
        print("SUMMARY: " + "; ".join(lines) + f" ({args.clock} time)")


if __name__ == "__main__":
    main()
