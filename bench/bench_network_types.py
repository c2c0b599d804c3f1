"""Step time of the network types on one FLUX base: LoRA vs DoRA vs LyCORIS LoKr (vs LoHa).

One frozen base (bf16/fp32, or fp8_scaled), one network of each type on it (default targets:
sd-scripts' block Linears), each attached only for its own step (apply, step, remove), so all share
the same weights and inputs. A step = forward through FluxFamily.predict + MSE + backward + AdamW on
the network's parameters. Runs alternate (lora, dora, lokr, ...) after warmup; the median time
ratio against LoRA is printed, with the trainable parameter counts.

    python bench/bench_network_types.py                      # tiny and mid (width 3072, 1+1 blocks), fp32
    python bench/bench_network_types.py --sizes mid --base fp8_scaled --reps 3
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_train_step import (  # noqa: E402
    DTYPES, alternate, build_ours, fp8_twin, machine_summary, make_inputs, make_step, median, our_forward,
)
from networks.factory import build_network  # noqa: E402
from tools.devices import device_or_exit  # noqa: E402

NETWORKS = {  # name -> (network_module, network_args)
    "lora": ("networks.lora", {}),
    "dora": ("networks.lora", {"dora": True}),
    "lokr": ("lycoris.kohya", {"algo": "lokr", "factor": 16}),
    "loha": ("lycoris.kohya", {"algo": "loha"}),
}


def attached_step(network, family, model, x):
    """The training step with `network` patched in for its duration only."""
    params = network.trainable_parameters()
    inner = make_step(lambda: our_forward(family, model, x), params, x["target"])

    def step():
        network.apply()
        network.train()
        try:
            return inner()
        finally:
            network.remove()

    return step, sum(p.numel() for p in params)


def run(size: str, args) -> dict[str, float]:
    dtype, device = DTYPES[args.dtype], device_or_exit(args.device)
    base = build_ours("flux", size, args, dtype, device)
    if args.base != "hp":
        base = fp8_twin(base, "flux", args.base)
    base.train()
    x = make_inputs("flux", base.config, args.image_tokens, args.text_tokens, args.batch, device)
    steps, counts = {}, {}
    for name in args.networks.split(","):
        module, net_args = NETWORKS[name]
        network = build_network(module, base, "flux", args.rank, args.rank, network_args=net_args).to(device)
        steps[name], counts[name] = attached_step(network, "flux", base, x)
    res = alternate(steps, args.warmup, args.reps, device)
    ref = median(res["lora"]["times"])
    print(f"[flux {size}, base {args.base} {args.dtype}, rank {args.rank}, {args.image_tokens} image tokens]")
    out = {}
    for name in steps:
        t = median(res[name]["times"])
        out[name] = t / ref
        print(f"  {name:5s} {counts[name]:>10,d} params  step {t:.3f} s  x{t / ref:.2f} of LoRA  "
              f"first loss {res[name]['loss']:.6f}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--sizes", default="tiny,mid")
    p.add_argument("--networks", default="lora,dora,lokr,loha", help="first must be lora (the reference)")
    p.add_argument("--base", choices=["hp", "fp8_scaled", "fp8"], default="hp", help="hp = the --dtype base")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--double", type=int, default=1)
    p.add_argument("--single", type=int, default=1)
    p.add_argument("--qwen-blocks", type=int, default=1)
    p.add_argument("--image-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    print(machine_summary())
    for size in args.sizes.split(","):
        run(size, args)


if __name__ == "__main__":
    main()
