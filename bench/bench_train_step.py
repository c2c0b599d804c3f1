"""One LoRA training step (forward + backward + AdamW), ours against diffusers + peft, and the cost of fp8.

For FLUX.1 and Qwen-Image, in one process and on the same frozen base weights (the diffusers model's
tensors are views of ours: no second copy), times the same step done two ways:
  ours  library.models.flux1.model.Flux / library.models.qwen_image.model.QwenImage + networks.lora.LoRANetwork (default
        TARGETS), called through the family's `predict`, as train_lora.py does;
  ref   diffusers FluxTransformer2DModel / QwenImageTransformer2DModel + `add_adapter(peft LoraConfig)`
        on the diffusers modules that hold the same weights (derived from our LoRA module paths through
        flux_diffusers_module_map; FLUX's fused qkv / linear1 are split in diffusers, so the reference
        has more, narrower adapters). LoRA parameters are float32 in both (diffusers' training scripts
        cast them with cast_training_params), alpha == rank.
Both get the same inputs (256 image tokens = a 256x256 image, 64 text tokens, batch 1 by default) and an
MSE loss against a fixed random target. Runs alternate (ours, ref, ours, ref, ...) after warmup, so slow
drift of a shared machine hits both; the median time ratio ours/ref is reported.
Then the fp8 cost: our step on a bf16/fp32 base against the same base quantized by library.precision.fp8
(`fp8` plain cast, `fp8_scaled` block-scaled), and with --dtype bf16 `fp8_compute` (the fp8_scaled base
run as fp8 GEMMs, library/precision/fp8_compute.py; on the CPU PyTorch's reference kernels: the
ratio means something on a GPU of compute capability >= 8.9 only), alternating them.

Memory: on CUDA, torch.cuda.max_memory_allocated above the allocation before the step. On CPU, the
peak resident set (/proc/self/statm sampled every 2 ms by a thread) above the RSS before the step,
with glibc's mmap threshold pinned to 64 KiB so freed tensors go back to the OS at once and RSS follows
live memory. After warmup this is the step's transient memory (activations, saved weights, grads),
not the resident weights or the optimizer state.

    python bench/bench_train_step.py                       # tiny and mid, FLUX and Qwen-Image, fp32
    python bench/bench_train_step.py --sizes mid --dtype bf16 --reps 3
    python bench/bench_train_step.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from library.models.flux1.family import FluxFamily
from library.models.qwen_image.family import QwenImageFamily  # noqa: E402
from library.models.flux1.model import Flux, FluxConfig  # noqa: E402
from library.models.flux1.checkpoint import _norm_names, flux_diffusers_module_map  # noqa: E402
from library.precision.fp8 import bytes_per_parameter, fp8_load_converter, prepare_fp8  # noqa: E402
from library.precision.fp8_compute import enable_fp8_compute, fp8_gemm_available  # noqa: E402
from library.models.qwen_image.model import QwenImage, QwenImageConfig  # noqa: E402
from networks.lora import LoRANetwork  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_flops import count_step, matmul_peak  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402
from library.training.host_memory import return_freed_buffers  # noqa: E402
from tools.devices import device_or_exit  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GiB, MiB = 2**30, 2**20

# ----------------------------------------------------------------------------------------------
# Measuring (shared with bench_full_flux_cpu.py and bench_data.py)


def pin_malloc_threshold(threshold: int = 64 * 1024) -> bool:
    """glibc: allocations above `threshold` are mmapped and unmapped on free, so RSS tracks live
    tensors (the default threshold grows up to 32 MiB and then keeps freed memory in the heap)."""
    return return_freed_buffers(threshold)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def status_bytes(field: str) -> int:
    """A kB field of /proc/self/status (VmHWM, VmRSS, RssAnon, ...) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the next reading is the next phase's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory growth inside a `with` block: CUDA allocator stats, or sampled RSS on CPU."""

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device, self.interval, self.peak = device, interval, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        self.start, self.high, self.running = rss_bytes(), rss_bytes(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.high = max(self.high, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.running = False
            self.thread.join()
            self.peak = max(self.high, rss_bytes()) - self.start
        return False


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated above the step's start"
    return "peak RSS (/proc/self/statm, 2 ms sampling) above the step's start"


def machine_summary() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


CPU_MEMORY_ROUNDS = 2


def alternate(steps: dict, warmup: int, reps: int, device: torch.device, clock=time.perf_counter) -> dict[str, dict]:
    """Run each step `warmup` times, then `reps` rounds of all steps in turn. Returns per name the
    step times (s), peak memory growths (bytes) and the first loss. On CUDA each timed step also reads
    the allocator's peak; on the CPU the RSS sampling thread would compete with the step for the cores
    and the GIL (it slowed a 2-core mid step by up to 20%), so the timed rounds run without it and
    CPU_MEMORY_ROUNDS more rounds sample the memory. clock: wall time by default; time.thread_time for
    a step that runs in this thread alone (one torch thread on the CPU, where autograd runs backward in
    the calling thread): it leaves out the time other processes hold the core, which on a shared
    machine spread wall-clock ratios of one step over 0.90-1.02."""
    results = {name: {"times": [], "peaks": [], "loss": None} for name in steps}
    for _ in range(warmup):
        for name, step in steps.items():
            loss = step()
            results[name]["loss"] = results[name]["loss"] if results[name]["loss"] is not None else loss
    sample_while_timing = device.type == "cuda"
    for _ in range(reps):
        for name, step in steps.items():
            with PeakMemory(device) if sample_while_timing else contextlib.nullcontext() as mem:
                start = clock()
                step()
                synchronize(device)
                elapsed = clock() - start
            results[name]["times"].append(elapsed)
            if sample_while_timing:
                results[name]["peaks"].append(mem.peak)
    for _ in range(0 if sample_while_timing else CPU_MEMORY_ROUNDS):
        for name, step in steps.items():
            with PeakMemory(device) as mem:
                step()
            results[name]["peaks"].append(mem.peak)
    return results


def median(values) -> float:
    return statistics.median(values)


# ----------------------------------------------------------------------------------------------
# Models: ours with random weights, the diffusers model on views of the same tensors


def flux_config(size: str, double: int, single: int) -> FluxConfig:
    """tiny: toy widths, 2 + 2 blocks; narrow: toy widths, `double` + `single` blocks; else FLUX.1-dev widths."""
    if size in ("tiny", "narrow"):  # head_dim 32 = 4 + 14 + 14
        return FluxConfig(in_channels=64, vec_in_dim=16, context_in_dim=32, hidden_size=64, num_heads=2,
                          depth=double if size == "narrow" else 2, depth_single=single if size == "narrow" else 2,
                          axes_dim=(4, 14, 14), guidance_embed=True)
    return FluxConfig(depth=double, depth_single=single, guidance_embed=True)  # FLUX.1-dev widths


def qwen_config(size: str, blocks: int) -> QwenImageConfig:
    """tiny: toy widths, 2 blocks; narrow: toy widths, `blocks` blocks; else Qwen-Image widths."""
    if size in ("tiny", "narrow"):
        return QwenImageConfig(num_layers=blocks if size == "narrow" else 2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                               axes_dims_rope=(8, 12, 12))
    return QwenImageConfig(num_layers=blocks)  # Qwen-Image widths


def flux_state_as_diffusers_views(model: Flux) -> dict[str, torch.Tensor]:
    """Our FLUX state dict under diffusers names, as views where diffusers' module is one row
    range of ours (fused qkv / linear1 split by rows); only the final adaLN (rows swapped) is copied."""
    cfg, sd = model.config, model.state_dict()
    table = flux_diffusers_module_map(cfg.depth, cfg.depth_single, cfg.hidden_size, cfg.mlp_hidden,
                                      cfg.in_channels, cfg.guidance_embed)
    out = {}
    for module, parts in table.items():
        for suffix in ("weight", "bias"):
            pieces: dict[str, list] = {}
            for target, start, end in parts:
                pieces.setdefault(target, []).append(sd[f"{module}.{suffix}"][start:end])
            for target, views in pieces.items():
                out[f"{target}.{suffix}"] = views[0] if len(views) == 1 else torch.cat(views)
    for bfl, diffusers in _norm_names(cfg.depth, cfg.depth_single).items():
        out[diffusers] = sd[bfl]
    return out


def build_ours(family: str, size: str, args, dtype: torch.dtype, device: torch.device):
    """Our model with seeded random weights (PyTorch's default init) in `dtype`, compute in `dtype`."""
    torch.manual_seed(0)
    if family == "flux":
        model = Flux(flux_config(size, args.double, args.single))
    else:
        model = QwenImage(qwen_config(size, args.qwen_blocks))
    model = model.to(device=device, dtype=dtype)
    model.compute_dtype = dtype
    return model


def build_reference(family: str, ours):
    """The diffusers model holding the very tensors of `ours` (views, no copy)."""
    from accelerate import init_empty_weights

    if family == "flux":
        from diffusers import FluxTransformer2DModel as cls
        from library.models.flux1.checkpoint import diffusers_config

        config, state = diffusers_config(ours.config), flux_state_as_diffusers_views(ours)
    else:
        from diffusers import QwenImageTransformer2DModel as cls

        config, state = ours.config.to_diffusers(), ours.state_dict()  # same names
    with init_empty_weights():  # parameters on meta; diffusers' RoPE tables stay real
        ref = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    ref.load_state_dict(state, strict=True, assign=True)
    return ref


def fp8_twin(base, family: str, mode: str):
    """`base` with its Linears quantized by library.precision.fp8 (what quantize_module does), built on meta
    and filled through fp8_load_converter, so the high-precision tensors are shared, not copied."""
    with torch.device("meta"):
        twin = type(base)(base.config)
    convert = fp8_load_converter(prepare_fp8(twin, mode, arch_spec(family).fp8), mode)
    state = {k: v for key, tensor in base.state_dict().items() for k, v in convert(key, tensor).items()}
    twin.load_state_dict(state, strict=True, assign=True)
    twin.compute_dtype = base.compute_dtype
    return twin


def add_our_lora(model, family: str, rank: int) -> tuple[LoRANetwork, list]:
    network = LoRANetwork(model, family, rank, alpha=rank)
    network.to(next(p.device for p in model.parameters()))
    network.apply()
    return network, network.trainable_parameters()


def add_peft_lora(ref, targets: list[str], rank: int) -> list:
    """diffusers' own LoRA path (ModelMixin.add_adapter -> peft.inject_adapter_in_model) on exactly
    `targets`; LoRA weights cast to float32 as diffusers' cast_training_params does."""
    from peft import LoraConfig

    pattern = "|".join(re.escape(t) for t in targets)  # peft full-matches a string target against module names
    ref.requires_grad_(False)
    ref.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=True, target_modules=pattern))
    params = [p for n, p in ref.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    return params


def peft_targets(family: str, model, network: LoRANetwork) -> list[str]:
    """The diffusers module names holding the weights our network adapts."""
    paths = [m.name for m in network.lora_modules()]
    if family == "qwen_image":
        return paths
    cfg = model.config
    table = flux_diffusers_module_map(cfg.depth, cfg.depth_single, cfg.hidden_size, cfg.mlp_hidden)
    return sorted({target for path in paths for target, _, _ in table[path]})


# ----------------------------------------------------------------------------------------------
# Steps


def make_inputs(family: str, cfg, image_tokens: int, text_tokens: int, batch: int, device):
    side = int(image_tokens**0.5)
    if side * side != image_tokens:
        raise ValueError(f"--image-tokens must be a square (h = w patches), got {image_tokens}")
    g = torch.Generator().manual_seed(3)
    context = cfg.context_in_dim if family == "flux" else cfg.joint_attention_dim
    x = {
        "h": side, "w": side,
        "x_t": torch.randn(batch, image_tokens, 64, generator=g),  # float32, packed latents
        "sigmas": torch.rand(batch, generator=g),  # float32
        "txt": torch.randn(batch, text_tokens, context, generator=g),
        "target": torch.randn(batch, image_tokens, 64, generator=g),
    }
    if family == "flux":
        x["pooled"] = torch.randn(batch, cfg.vec_in_dim, generator=g)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in x.items()}


def our_forward(family: str, model, x: dict) -> torch.Tensor:
    if family == "flux":
        return FluxFamily("unused").predict(model, x["x_t"], x["sigmas"], {"t5": x["txt"], "clip_pooled": x["pooled"]},
                                            x["h"], x["w"], guidance=1.0)
    mask = torch.ones(x["txt"].shape[:2], dtype=torch.bool, device=x["txt"].device)
    return QwenImageFamily("unused").predict(model, x["x_t"], x["sigmas"], {"embeds": x["txt"], "mask": mask},
                                             x["h"], x["w"], None)


def ref_forward(family: str, model, x: dict, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' call as its training scripts make it: inputs in the model dtype, sigma as timestep."""
    b, device = x["x_t"].shape[0], x["x_t"].device
    if family == "flux":
        from diffusers import FluxPipeline

        img_ids = FluxPipeline._prepare_latent_image_ids(b, x["h"], x["w"], device, dtype)
        return model(hidden_states=x["x_t"].to(dtype), encoder_hidden_states=x["txt"].to(dtype),
                     pooled_projections=x["pooled"].to(dtype), timestep=x["sigmas"].to(dtype), img_ids=img_ids,
                     txt_ids=torch.zeros(x["txt"].shape[1], 3, device=device, dtype=dtype),
                     guidance=torch.ones(b, device=device, dtype=torch.float32), return_dict=False)[0]
    mask = torch.ones(x["txt"].shape[:2], dtype=torch.long, device=device)
    return model(hidden_states=x["x_t"].to(dtype), encoder_hidden_states=x["txt"].to(dtype),
                 encoder_hidden_states_mask=mask, timestep=x["sigmas"].to(dtype),
                 img_shapes=[[(1, x["h"], x["w"])]] * b, return_dict=False)[0]


def compile_blocks(model):
    """torch.compile each transformer block, as train_lora.py's torch_compile does (core.compile_block: in
    place, and the checkpointed call as one region, which only our run_block uses; ours: double/single_blocks,
    transformer_blocks; diffusers: transformer_blocks, single_transformer_blocks)."""
    from library.models.core import compile_block

    for name in ("double_blocks", "single_blocks", "transformer_blocks", "single_transformer_blocks"):
        for block in getattr(model, name, []):
            compile_block(block)


def mfu(family: str, cfg, args, seconds: float) -> float:
    """The step's matmul FLOPs (bench/step_flops.py) per second over the device's measured GEMM peak."""
    if not args.peak:
        return float("nan")
    flops = count_step(family, cfg, args.batch, args.image_tokens, args.text_tokens, args.rank, args.checkpointing)
    return flops["total"] / seconds / args.peak


def make_step(forward, params: list, target: torch.Tensor):
    """forward() -> prediction; the step: zero grads, MSE (float32), backward, AdamW. Returns the loss."""
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(forward().float(), target)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


# ----------------------------------------------------------------------------------------------
# The two comparisons


def compare_with_reference(family: str, size: str, args, dtype, device) -> dict:
    ours = build_ours(family, size, args, dtype, device)
    ref, cfg = build_reference(family, ours), ours.config
    for m in (ours, ref):
        m.train()
    if args.checkpointing:
        ours.gradient_checkpointing = True
        ref.enable_gradient_checkpointing()
    x = make_inputs(family, cfg, args.image_tokens, args.text_tokens, args.batch, device)
    network, our_params = add_our_lora(ours, family, args.rank)
    ref_params = add_peft_lora(ref, peft_targets(family, ours, network), args.rank)
    if args.compile:  # after the adapters, so the compiled forward includes them
        compile_blocks(ours), compile_blocks(ref)
    with torch.no_grad():  # same base weights: with LoRA up = 0 both predict the same velocity
        diff = (our_forward(family, ours, x).float() - ref_forward(family, ref, x, dtype).float()).abs().max().item()
    steps = {
        "ours": make_step(lambda: our_forward(family, ours, x), our_params, x["target"]),
        "ref": make_step(lambda: ref_forward(family, ref, x, dtype), ref_params, x["target"]),
    }
    res = alternate(steps, args.warmup, args.reps, device)
    t_ours, t_ref = median(res["ours"]["times"]), median(res["ref"]["times"])
    m_ours, m_ref = median(res["ours"]["peaks"]), median(res["ref"]["peaks"])
    n_ours, n_ref = sum(p.numel() for p in our_params), sum(p.numel() for p in ref_params)
    print(f"[{family} {size} {args.dtype}] base {sum(p.numel() for p in ours.parameters()) / 1e6:.1f} M params, "
          f"prediction max |ours - ref| at step 0: {diff:.2e}; LoRA params ours {n_ours:,} ({len(our_params) // 2} "
          f"modules), ref {n_ref:,} ({len(ref_params) // 2} modules)")
    print(f"  step time  ours {t_ours:.3f} s  ref {t_ref:.3f} s  ratio ours/ref {t_ours / t_ref:.2f}  "
          f"(medians of {args.reps}; ours {fmt(res['ours']['times'])}, ref {fmt(res['ref']['times'])})")
    print(f"  step memory ours {m_ours / MiB:.0f} MiB  ref {m_ref / MiB:.0f} MiB  ratio {m_ours / max(m_ref, 1):.2f}")
    print(f"  MFU at the median step ours {mfu(family, cfg, args, t_ours):.1%} ref {mfu(family, cfg, args, t_ref):.1%}")
    print(f"  first loss ours {res['ours']['loss']:.6f} ref {res['ref']['loss']:.6f}")
    del steps, ours, ref
    return {"time_ratio": t_ours / t_ref, "mem_ratio": m_ours / max(m_ref, 1), "t_ours": t_ours, "t_ref": t_ref}


def compare_fp8(family: str, size: str, args, dtype, device) -> dict:
    """Our step on the high-precision base vs the same weights quantized (fp8, fp8_scaled)."""
    base = build_ours(family, size, args, dtype, device)
    x = make_inputs(family, base.config, args.image_tokens, args.text_tokens, args.batch, device)
    models = {args.dtype: base, **{mode: fp8_twin(base, family, mode) for mode in ("fp8", "fp8_scaled")}}
    if dtype == torch.bfloat16 and fp8_gemm_available(device):
        models["fp8_compute"] = fp8_twin(base, family, "fp8_scaled")
        enable_fp8_compute(models["fp8_compute"])
    steps, sizes = {}, {}
    for name, model in models.items():
        model.train()
        model.gradient_checkpointing = args.checkpointing
        _, params = add_our_lora(model, family, args.rank)
        if args.compile:
            compile_blocks(model)
        steps[name] = make_step(lambda m=model: our_forward(family, m, x), params, x["target"])
        sizes[name] = bytes_per_parameter(model)
    res = alternate(steps, args.warmup, args.reps, device)
    base_t, base_m = median(res[args.dtype]["times"]), median(res[args.dtype]["peaks"])
    out = {}
    print(f"[{family} {size} fp8 overhead, compute {args.dtype}]")
    for name in models:
        t, m = median(res[name]["times"]), median(res[name]["peaks"])
        out[name] = t / base_t
        print(f"  {name:10s} {sizes[name]:.3f} B/param  step {t:.3f} s (x{t / base_t:.2f})  "
              f"step memory {m / MiB:.0f} MiB (x{m / max(base_m, 1):.2f})  MFU {mfu(family, base.config, args, t):.1%}  "
              f"first loss {res[name]['loss']:.6f}")
    return out


def fmt(times) -> str:
    return "[" + ", ".join(f"{t:.3f}" for t in times) + "]"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--families", default="flux,qwen_image")
    p.add_argument("--sizes", default="tiny,mid", help="tiny (toy widths) and/or mid (full width, few blocks)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="base and compute dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--double", type=int, default=2, help="FLUX mid: double blocks at width 3072")
    p.add_argument("--single", type=int, default=2, help="FLUX mid: single blocks at width 3072")
    p.add_argument("--qwen-blocks", type=int, default=2, help="Qwen-Image mid: blocks at width 3072")
    p.add_argument("--image-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5, help="timed rounds for mid")
    p.add_argument("--tiny-reps", type=int, default=20, help="timed rounds for tiny (milliseconds each)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for mid (0: torch's default); tiny always runs on 1 thread")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in both")
    p.add_argument("--skip-fp8", action="store_true")
    p.add_argument("--skip-ref", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each block (both models)")
    p.add_argument("--mfu", action="store_true", help="measure the device's GEMM peak in --dtype and print MFU")
    args = p.parse_args(argv)
    device, dtype = device_or_exit(args.device), DTYPES[args.dtype]
    if torch.device(args.device).type == "cuda":
        # torch 2.11 + H100: cuDNN attention hits an illegal memory access on diffusers' FLUX call
        # (its strided q/k/v) at 4608 tokens; both sides then use flash / memory-efficient SDPA.
        torch.backends.cuda.enable_cudnn_sdp(False)
    args.peak = matmul_peak(dtype, 8192 if device.type == "cuda" else 4096, device=device) if args.mfu else 0.0
    pinned = pin_malloc_threshold() if device.type == "cpu" else False
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"machine: {machine_summary()}; device {device}{gpu}; memory: {memory_method(device)}"
          f"{' (malloc mmap threshold pinned)' if pinned else ''}; compile {args.compile}; "
          f"GEMM peak {args.peak / 1e12:.1f} TFLOP/s {args.dtype}")
    summary = []
    start = time.time()
    default_threads, mid_reps = torch.get_num_threads(), args.reps
    for size in args.sizes.split(","):
        # Toy ops take microseconds: on a shared machine, more threads only add OpenMP sync stalls.
        torch.set_num_threads(1 if size == "tiny" else (args.threads or default_threads))
        args.reps = args.tiny_reps if size == "tiny" else mid_reps
        print(f"--- {size}: {torch.get_num_threads()} torch thread(s)")
        for family in args.families.split(","):
            if not args.skip_ref:
                r = compare_with_reference(family, size, args, dtype, device)
                summary.append(f"{family}/{size} ours/ref time {r['time_ratio']:.2f} mem {r['mem_ratio']:.2f}")
            if not args.skip_fp8:
                r = compare_fp8(family, size, args, dtype, device)
                summary.append(f"{family}/{size} fp8 x{r['fp8']:.2f} fp8_scaled x{r['fp8_scaled']:.2f}"
                               + (f" fp8_compute x{r['fp8_compute']:.2f}" if "fp8_compute" in r else ""))
    print(f"SUMMARY ({args.dtype}, {device}, compile {args.compile}, {time.time() - start:.0f} s): " + "; ".join(summary))


if __name__ == "__main__":
    main()
