"""fp8 -> bf16/fp32 on the CPU: PyTorch's native cast against fp8.fp8_to's pair table, per weight
and in a whole LoRA training step (issue 16's target: the fp8_scaled step at most 1.5x the bf16 step
on the mid FLUX config).

    python bench/bench_fp8_dequant.py [--reps 5] [--dtype bf16] [--checkpointing]

Per weight: best of 7 for each FLUX width shape, ratio native / table (bit-identity checked).
Step: the same mid FLUX (width 3072, 2 double + 2 single blocks, 256 image + 64 text tokens, rank 16)
on a bf16 base and quantized (fp8_scaled, fp8), the fp8 ones once with the table and once with the
native cast (fp8.CPU_TABLE), alternating in one process (bench_train_step.alternate), medians.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train_step import (DTYPES, add_our_lora, alternate, build_ours, fp8_twin, machine_summary,  # noqa: E402
                              make_inputs, make_step, median, our_forward)
from library.precision import fp8  # noqa: E402


def best_of(fn, n: int = 7) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def per_weight():
    g = torch.Generator().manual_seed(0)
    for shape in ((3072, 3072), (9216, 3072), (3072, 12288)):
        q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(fp8.FP8_DTYPE)
        for dtype in (torch.bfloat16, torch.float32):
            view = torch.int16 if dtype.itemsize == 2 else torch.int32
            assert torch.equal(fp8.fp8_to(q, dtype).view(view), q.to(dtype).view(view))
            native, table = best_of(lambda: q.to(dtype)), best_of(lambda: fp8.fp8_to(q, dtype))
            print(f"  {str(list(shape)):14s} -> {str(dtype)[6:]:8s} native {native * 1e3:6.1f} ms  table "
                  f"{table * 1e3:6.1f} ms  ({native / q.numel() * 1e9:.2f} vs {table / q.numel() * 1e9:.2f} ns/weight)  "
                  f"x{native / table:.2f}")


def with_table(step, enabled: bool):
    def run():
        fp8.CPU_TABLE = enabled
        try:
            return step()
        finally:
            fp8.CPU_TABLE = True
    return run


def step_ratios(args):
    dtype, device = DTYPES[args.dtype], torch.device("cpu")
    args.double, args.single = 2, 2
    base = build_ours("flux", "mid", args, dtype, device)
    x = make_inputs("flux", base.config, 256, 64, 1, device)
    steps = {}
    for name, model in (("bf16", base), ("fp8_scaled", fp8_twin(base, "flux", "fp8_scaled")), ("fp8", fp8_twin(base, "flux", "fp8"))):
        model.train()
        model.gradient_checkpointing = args.checkpointing
        _, params = add_our_lora(model, "flux", 16)
        step = make_step(lambda m=model: our_forward("flux", m, x), params, x["target"])
        if name == "bf16":
            steps[args.dtype] = step
        else:
            steps[f"{name} table"], steps[f"{name} native"] = with_table(step, True), with_table(step, False)
    res = alternate(steps, 1, args.reps, device)
    ref = median(res[args.dtype]["times"])
    for name in steps:
        t = median(res[name]["times"])
        print(f"  {name:18s} step {t:.3f} s  x{t / ref:.2f} of the {args.dtype} step   first loss {res[name]['loss']:.6f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--skip-step", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_summary())
    print("per weight, best of 7:")
    per_weight()
    if not args.skip_step:
        print(f"mid FLUX step ({args.dtype} compute, checkpointing {args.checkpointing}), medians of {args.reps}:")
        step_ratios(args)


if __name__ == "__main__":
    main()
