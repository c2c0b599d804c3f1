"""What one training forward saves for backward, eager against torch_compile: full-width FLUX.1-dev /
Qwen-Image with a few blocks, random weights, on this machine's device (CPU by default).

bench_block_swap's model (random_model: bf16 compute, fp8 base, .eval(), requires_grad_(False)), rank-16
LoRA (float32), gradient checkpointing, called as bench_block_swap calls it (no autocast: inputs cast at
model entry) or under bf16 autocast (--autocast, as train_lora's mixed_precision = "bf16"). The bytes are
those torch.autograd.graph.saved_tensors_hooks sees, the model's and the LoRA's own tensors left out; the
largest saved tensors are listed (a [out, in] one is a dequantized weight).

    python bench/bench_compiled_saved.py --family flux --double 1 --single 1 --compile inductor
    python bench/bench_compiled_saved.py --family qwen_image --blocks 1 --compile inductor --autocast
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_block_swap import inputs_for, random_model  # noqa: E402
from library.models.core import compile_block  # noqa: E402
from library.models.flux1.model import FLUX_DEV  # noqa: E402
from library.models.qwen_image.model import QWEN_IMAGE  # noqa: E402
from library.precision.fp8_compute import enable_fp8_compute  # noqa: E402
from networks.lora import LoRANetwork  # noqa: E402
from tools.devices import device_or_exit  # noqa: E402

MiB = 2**20


def saved_for_backward(model, net, inputs: dict, autocast: bool) -> list[tuple[tuple, torch.dtype, int]]:
    """(shape, dtype, bytes) of each tensor one forward saves, weights and buffers left out; runs backward."""
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *net.parameters()]}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in resident:
            saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    device = next(net.parameters()).device.type
    cast = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        out = model(**inputs)
    out.float().square().mean().backward()
    return saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--family", default="flux", choices=("flux", "qwen_image"))
    p.add_argument("--base", default="fp8_scaled", choices=("bf16", "fp8", "fp8_scaled"))
    p.add_argument("--double", type=int, default=1, help="FLUX.1 double blocks")
    p.add_argument("--single", type=int, default=1, help="FLUX.1 single blocks")
    p.add_argument("--blocks", type=int, default=1, help="Qwen-Image blocks")
    p.add_argument("--res", type=int, default=256, help="image side in pixels (256: 256 image tokens)")
    p.add_argument("--text", type=int, default=64, help="text tokens")
    p.add_argument("--compile", default="none", help="none (eager) or a torch.compile backend (inductor)")
    p.add_argument("--autocast", action="store_true", help="the forward under bf16 autocast")
    p.add_argument("--fp8-compute", action="store_true", help="fp8_compute on the fp8 base (fp8 GEMMs; bf16 calls)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    device = device_or_exit(args.device)
    config = (dataclasses.replace(FLUX_DEV, depth=args.double, depth_single=args.single) if args.family == "flux"
              else dataclasses.replace(QWEN_IMAGE, num_layers=args.blocks))
    model = random_model(args.family, args.base, device, config)
    if args.fp8_compute:
        enable_fp8_compute(model)
    net = LoRANetwork(model, args.family, rank=16, alpha=16)
    net.apply()
    if args.compile != "none":
        for block in model.swappable_blocks():
            compile_block(block, backend=args.compile)
    net.to(device).train()
    inputs, tokens = inputs_for(args.family, args.res, device, args.text)
    started = time.perf_counter()
    saved_for_backward(model, net, inputs, args.autocast)  # compiles
    compiled = time.perf_counter()
    saved = saved_for_backward(model, net, inputs, args.autocast)
    print(f"{args.family} {args.base}, {len(model.swappable_blocks())} blocks, {tokens} + {args.text} tokens, "
          f"{args.compile}{', bf16 autocast' if args.autocast else ''}{', fp8_compute' if args.fp8_compute else ''}, "
          f"torch {torch.__version__}: saved "
          f"{sum(s[2] for s in saved) / MiB:.1f} MiB in {len(saved)} tensors (first step {compiled - started:.0f} s, "
          f"second {time.perf_counter() - compiled:.0f} s)")
    for shape, dtype, size in sorted(saved, key=lambda s: -s[2])[:8]:
        print(f"  {size / MiB:8.1f} MiB {dtype} {list(shape)}")


if __name__ == "__main__":
    main()
