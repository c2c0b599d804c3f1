"""The step-time cost of the LoRA EMA (library/training/ema.py): one training step (forward +
backward + AdamW, as bench_train_step.py) against the same step followed by TrainableEMA.update,
on the same model, network and optimizer, alternated after warmup; the EMA in float32 beside the
weights (`ema_device = "same"`) and, on CUDA, in CPU memory (`"cpu"`). The cost reported is
1 + (the update alone, averaged over many calls) / (the median plain step): the update runs after
the step, so it adds; the alternated whole-step ratio is printed beside it (noisier).

    python bench/bench_ema.py                          # tiny and mid FLUX, CPU fp32
    python bench/bench_ema.py --device cuda --dtype bf16 --sizes mid --double 4 --single 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench_train_step import (DTYPES, add_our_lora, alternate, build_ours, machine_summary, make_inputs,  # noqa: E402
                              make_step, median, our_forward, synchronize)
from library.training.ema import TrainableEMA  # noqa: E402
from tools.devices import device_or_exit  # noqa: E402


def bench_size(family: str, size: str, args, dtype, device) -> dict:
    model = build_ours(family, size, args, dtype, device).train()
    x = make_inputs(family, model.config, args.image_tokens, args.text_tokens, args.batch, device)
    network, params = add_our_lora(model, family, args.rank)
    named = {n: p for n, p in network.named_parameters() if p.requires_grad}
    step = make_step(lambda: our_forward(family, model, x), params, x["target"])
    emas = {"same": TrainableEMA(named, 0.999, warmup=True)}
    if device.type == "cuda":
        emas["cpu"] = TrainableEMA(named, 0.999, warmup=True, device="cpu")
    counter = [0]

    def with_ema(ema):
        def run() -> float:
            loss = step()
            counter[0] += 1
            ema.update(counter[0])
            return loss
        return run

    steps = {"plain": step, **{f"ema_{k}": with_ema(e) for k, e in emas.items()}}
    res = alternate(steps, args.warmup, args.reps, device)
    update_times = {}
    for name, ema in emas.items():  # the update alone, many times
        synchronize(device)
        start = time.perf_counter()
        for i in range(args.update_reps):
            ema.update(1000 + i)
        synchronize(device)
        update_times[name] = (time.perf_counter() - start) / args.update_reps
    base = median(res["plain"]["times"])
    n = sum(p.numel() for p in named.values())
    print(f"[{family} {size} {args.dtype} {device}] LoRA {n:,} params in {len(named)} tensors (rank {args.rank}); "
          f"plain step {base * 1e3:.1f} ms")
    out = {}
    for name in emas:
        # The update runs after the step, alone on the device: its cost adds to the step. The
        # alternated whole-step ratio is printed too, but on a shared machine its noise is larger.
        t, cost = median(res[f"ema_{name}"]["times"]), 1 + update_times[name] / base
        out[name] = cost
        print(f"  ema_device={name:4s} update {update_times[name] * 1e3:.3f} ms = step time x{cost:.4f}; "
              f"alternated steps {t * 1e3:.1f} ms vs {base * 1e3:.1f} ms (x{t / base:.3f}, noisy)")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--families", default="flux")
    p.add_argument("--sizes", default="tiny,mid")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=2)
    p.add_argument("--qwen-blocks", type=int, default=2)
    p.add_argument("--image-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tiny-reps", type=int, default=30)
    p.add_argument("--update-reps", type=int, default=50)
    args = p.parse_args(argv)
    device, dtype = device_or_exit(args.device), DTYPES[args.dtype]
    print(f"machine: {machine_summary()}; device {device}")
    summary, start, mid_reps = [], time.time(), args.reps
    for size in args.sizes.split(","):
        args.reps = args.tiny_reps if size == "tiny" else mid_reps
        for family in args.families.split(","):
            r = bench_size(family, size, args, dtype, device)
            summary += [f"{family}/{size} ema_{k} x{v:.4f}" for k, v in r.items()]
    print(f"SUMMARY ({args.dtype}, {device}, {time.time() - start:.0f} s): " + "; ".join(summary))


if __name__ == "__main__":
    main()
