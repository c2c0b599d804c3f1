"""One released-size Nucleus-Image MoE block's routed experts (library/models/nucleus_image/model.py
SwiGLUExperts: 64 experts, gate_up [2048, 2688], down [1344, 2048], random bf16 weights N(0, 0.02)) stored as
bf16, fp8_scaled, nf4, nf4_dq, int8 (library/precision/fp8_packed.py PackedWeights), each with an experts LoRA
(networks/lora_packed.py PackedLoRAModule on both weights, rank 16), on the tokens one 1024 px image gives one of
the released later blocks: 4096 image tokens, batch 1, capacity factor 2 -> 128 tokens per expert.

    python bench/bench_packed_experts.py [--formats bf16,fp8_scaled,nf4,int8] [--experts 64] [--tokens 4096]
        [--capacity-factor 2] [--rank 16] [--reps 3] [--compute bf16|fp32] [--threads 2] [--int8_dequant]

Per format: the time to quantize the experts from the bf16 weights (and the peak RSS that takes above its start),
the stored bytes against the memory planner's count (the module built on `meta` and quantize_packed there: what
memory_plan.module_bytes adds up), then forward + backward of the module with its LoRA (x and both LoRAs get
gradients, the base none: a LoRA step's experts), timed against the bf16-stored module in the same process (rounds
alternate the formats, medians reported), its peak RSS above the step's start (VmHWM reset through
/proc/self/clear_refs before each step, glibc's mmap threshold pinned so that freed tensors leave the RSS) against
the bf16-stored module's (the same activations, no dequantization) and fp8_packed.DEQUANTIZED_CHUNK_BYTES, and the
output's and the input gradient's relative L2 error against the bf16-stored module's on the same input.

Compute as the trainer runs a CPU step with mixed_precision = "bf16" (--compute bf16): no autocast, the module's
tokens in bf16 (the model's compute_dtype), a quantized weight dequantized to bf16, the LoRA branch in its float32
factors and cast back (LoRAModule). --compute fp32: mixed_precision = "no", everything float32.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train_step import MiB, machine_summary, pin_malloc_threshold, reset_peak, status_bytes  # noqa: E402
from library.models.nucleus_image.model import NUCLEUS_IMAGE, SwiGLUExperts, expert_capacity  # noqa: E402
from library.precision.fp8_packed import DEQUANTIZED_CHUNK_BYTES  # noqa: E402
from library.training.memory_plan import module_bytes  # noqa: E402
from networks.lora_packed import PackedLoRAModule, PackedTarget  # noqa: E402

FORMATS = ("bf16", "fp8_scaled", "fp8", "nf4", "nf4_dq", "int8")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MB = 1e6


class PeakRss:
    """Peak RSS above the start inside a `with` block (VmHWM after a reset at the start)."""

    def __enter__(self):
        gc.collect()
        reset_peak()
        self.start = status_bytes("VmRSS")
        return self

    def __exit__(self, *exc):
        self.above = status_bytes("VmHWM") - self.start
        return False


def random_experts(experts: int, dim: int, inner: int, seed: int) -> SwiGLUExperts:
    """The experts in bf16, N(0, 0.02) drawn in bf16 (no float32 copy of 1 GB), frozen."""
    with torch.device("meta"):
        module = SwiGLUExperts(dim, inner, experts)
    g = torch.Generator().manual_seed(seed)
    for name in module.packed_weights:
        shape = getattr(module, name).shape
        value = torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
        setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    return module


def stored_in(reference: SwiGLUExperts, fmt: str) -> tuple[SwiGLUExperts, float, int]:
    """(a module holding the reference's weights stored in `fmt`, seconds quantize_packed took on both, peak RSS
    above the start while quantizing). bf16: the reference itself."""
    if fmt == "bf16":
        return reference, 0.0, 0
    with torch.device("meta"):
        module = SwiGLUExperts(*planned_shape(reference))
    for name in module.packed_weights:  # the reference's tensors, not copies: quantize_packed reads them
        setattr(module, name, torch.nn.Parameter(getattr(reference, name), requires_grad=False))
    with PeakRss() as rss:
        start = time.perf_counter()
        for name in module.packed_weights:
            module.quantize_packed(name, fmt)
        seconds = time.perf_counter() - start
    return module, seconds, rss.above


def planned_shape(module: SwiGLUExperts) -> tuple[int, int, int]:
    experts, dim, two_inner = module.packed_shape("gate_up_proj")
    return dim, two_inner // 2, experts


def planned_bytes(reference: SwiGLUExperts, fmt: str) -> int:
    """What the memory planner counts for these experts in `fmt`: the module on meta, stored there."""
    with torch.device("meta"):
        module = SwiGLUExperts(*planned_shape(reference))
    if fmt != "bf16":
        for name in module.packed_weights:
            module.quantize_packed(name, fmt)
    else:
        module.to(torch.bfloat16)
    return module_bytes(module)


def attach_lora(module: SwiGLUExperts, rank: int, seed: int) -> list[PackedLoRAModule]:
    """An experts LoRA on both weights, the same factors for every format (down kaiming, as PEFT's lora_A; up
    N(0, 0.01) instead of zeros, so that both factors get gradients and the branch adds a delta)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    loras = []
    for name in module.packed_weights:
        lora = PackedLoRAModule(f"experts_{name}", PackedTarget(module, name), rank)
        with torch.no_grad():
            lora.lora_up.weight.normal_(0, 0.01, generator=g)
        lora.apply_to_base()
        loras.append(lora)
    return loras


def step(module: SwiGLUExperts, loras: list, x: torch.Tensor, grad_out: torch.Tensor):
    """Forward + backward of the experts with their LoRA: (output, input gradient), both detached."""
    for lora in loras:
        for p in lora.parameters():
            p.grad = None
    x = x.detach().requires_grad_(True)  # the tokens carry a gradient (the LoRAs upstream of the experts)
    out = module(x)
    out.backward(grad_out)
    return out.detach(), x.grad


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def int8_dequant_against_bitsandbytes_layout(reference: SwiGLUExperts, dtype: torch.dtype, reps: int) -> None:
    """--int8_dequant: one chunk of the int8 gate_up (the trainer's expert_chunks) dequantized by ours
    (bnb_weights.dequantize_packed: W[e]'s own layout) and by bitsandbytes' int8_vectorwise_dequant through Int8Linear's
    transposed layout (the reference: ours before), alternated; equal bit for bit, or the run stops."""
    from library.precision import bnb_weights

    module, _, _ = stored_in(reference, "int8")
    shape, chunk = module.packed_shape("gate_up_proj"), module.expert_chunks(dtype)[0]
    stored = [getattr(module, "gate_up_proj" + suffix) for suffix in bnb_weights.packed_shapes(*shape, "int8")]

    def bitsandbytes_layout():
        out = torch.empty((chunk.stop - chunk.start, shape[1], shape[2]), dtype=dtype)
        for i, e in enumerate(range(chunk.start, chunk.stop)):
            out[i] = bnb_weights.dequantize_int8(shape[2:0:-1], dtype, stored[0][e].T, stored[1][e]).T
        return out

    def ours():
        return bnb_weights.dequantize_packed("int8", shape, dtype, chunk, *stored)

    if not torch.equal(ours(), bitsandbytes_layout()):
        raise SystemExit("int8 dequantization: ours differs from bitsandbytes' own")
    times = {ours: [], bitsandbytes_layout: []}
    for _ in range(reps):
        for f in times:
            start = time.perf_counter()
            f()
            times[f].append(time.perf_counter() - start)
    mine, theirs = statistics.median(times[ours]), statistics.median(times[bitsandbytes_layout])
    print(f"int8 gate_up chunk {chunk.start}:{chunk.stop} [{shape[1]}, {shape[2]}] -> {dtype}, median of {reps}: ours "
          f"{mine * 1e3:.0f} ms, through Int8Linear's layout {theirs * 1e3:.0f} ms (x{mine / theirs:.2f}); bit-equal")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="bf16,fp8_scaled,nf4,int8", help=f"comma list of {FORMATS}")
    p.add_argument("--experts", type=int, default=NUCLEUS_IMAGE.num_experts)
    p.add_argument("--tokens", type=int, default=4096, help="image tokens of one sample (4096: 1024 px)")
    p.add_argument("--capacity-factor", type=float, default=2.0, help="the released later blocks' 2")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=3, help="timed rounds after one warm-up round")
    p.add_argument("--compute", choices=DTYPES, default="bf16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--int8_dequant", action="store_true", help="only time the int8 dequantization of one chunk, ours "
                                                                "against bitsandbytes' through Int8Linear's layout")
    args = p.parse_args()
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        p.error(f"--formats: {unknown} not in {FORMATS}")
    if "bf16" not in formats:
        formats.insert(0, "bf16")  # the reference every ratio and error is against
    torch.set_num_threads(args.threads)
    pinned = pin_malloc_threshold()
    dtype = DTYPES[args.compute]
    dim, inner = NUCLEUS_IMAGE.inner_dim, NUCLEUS_IMAGE.moe_intermediate_dim
    capacity = expert_capacity(args.capacity_factor, args.tokens, args.experts)
    print(machine_summary())
    print(f"experts {args.experts} x (gate_up [{dim}, {2 * inner}], down [{inner}, {dim}]); {args.tokens} tokens, "
          f"capacity factor {args.capacity_factor} -> {capacity} tokens an expert; LoRA rank {args.rank}; compute "
          f"{args.compute} (no autocast, LoRA branch float32); malloc threshold pinned {pinned}; "
          f"VmHWM reset {reset_peak()}")

    reference = random_experts(args.experts, dim, inner, args.seed)
    if args.int8_dequant:
        return int8_dequant_against_bitsandbytes_layout(reference, dtype, max(args.reps, 5))
    weights = sum(reference.packed_shape(n).numel() for n in reference.packed_weights)
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.experts, capacity, dim, generator=g).to(dtype)  # LayerNormed, modulated tokens: ~N(0, 1)
    grad_out = torch.randn(args.experts, capacity, dim, generator=g).to(dtype)

    rows = {}
    for fmt in formats:
        module, seconds, quantize_peak = stored_in(reference, fmt)
        rows[fmt] = {"module": module, "loras": attach_lora(module, args.rank, args.seed + 2), "quantize_s": seconds,
                     "quantize_peak": quantize_peak, "stored": module_bytes(module),
                     "planned": planned_bytes(reference, fmt), "times": [], "peaks": []}
        if fmt != "bf16":
            print(f"quantized {fmt} in {seconds:.1f} s, peak RSS +{quantize_peak / MiB:.0f} MiB; "
                  f"chunks {[(c.start, c.stop) for c in module.expert_chunks(dtype)]}", flush=True)

    for rnd in range(args.reps + 1):  # round 0 warms up (bitsandbytes' library, the fp8 table, the allocator)
        for fmt in formats:
            row = rows[fmt]
            with PeakRss() as rss:
                start = time.perf_counter()
                out, grad_x = step(row["module"], row["loras"], x, grad_out)
                seconds = time.perf_counter() - start
            if rnd == 0:
                row["out"], row["grad_x"] = out, grad_x
                continue
            row["times"].append(seconds)
            row["peaks"].append(rss.above)
            del out, grad_x
        if rnd:
            print(f"round {rnd}: " + ", ".join(f"{f} {rows[f]['times'][-1]:.2f} s" for f in formats), flush=True)

    ref = rows["bf16"]
    ref_time, ref_peak = statistics.median(ref["times"]), max(ref["peaks"])
    print(f"\nforward + backward, median of {args.reps}; peak = max over the timed steps; chunk bound "
          f"{DEQUANTIZED_CHUNK_BYTES / MiB:.0f} MiB")
    header = ("| format | quantize s (peak RSS MiB) | stored MB | planner MB | bytes/weight | step s | x bf16 | "
              "peak MiB | above bf16's MiB | out rel. err | grad x rel. err |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    summary = []
    for fmt in formats:
        row = rows[fmt]
        t, peak = statistics.median(row["times"]), max(row["peaks"])
        err_out, err_grad = relative_error(row["out"], ref["out"]), relative_error(row["grad_x"], ref["grad_x"])
        same = "" if row["stored"] == row["planned"] else " (DIFFERS)"
        print(f"| {fmt} | {row['quantize_s']:.1f} ({row['quantize_peak'] / MiB:.0f}) | {row['stored'] / MB:.1f} | "
              f"{row['planned'] / MB:.1f}{same} | {row['stored'] / weights:.4f} | {t:.2f} | {t / ref_time:.2f} | "
              f"{peak / MiB:.0f} | {(peak - ref_peak) / MiB:+.0f} | {err_out:.4f} | {err_grad:.4f} |")
        summary.append(f"{fmt} x{t / ref_time:.2f} +{(peak - ref_peak) / MiB:.0f} MiB err {err_out:.4f}")
    print("SUMMARY: " + ", ".join(summary))


if __name__ == "__main__":
    main()
