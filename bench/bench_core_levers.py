"""The model core's speed levers, each off and on in one process (issue 29).

Our training step (FLUX.1 / Qwen-Image widths, LoRA rank 16 on the default targets, gradient
checkpointing, bf16 under autocast as train_lora.py runs it, AdamW) with a lever as it was before
against as it is now; after warm-up the two alternate, and the median ratio now/before and the step
memory (bench_train_step.PeakMemory) are printed.

  rope       core.apply_rope rotates interleaved pairs as one complex multiply; before: the real formula
             (what it still runs under torch.compile)
  layernorm  core.layer_norm takes bf16 as it is (PyTorch accumulates in float32); before: a float32
             copy in and a cast out
  compile    torch_compile's core.compile_block (the checkpointed call compiled as one region, with the
             checkpoint inside); before: each block compiled in place and checkpointed from outside.
             Two models of the same seed, both compiled (inductor) in the warm-up steps.
  tail       core.residual_projection: in checkpointing's recompute the block's last projection into the
             residual runs its base GEMM on one token (its output is saved by nothing); before: in full
  save       checkpoint_saves_projections (core.SAVE_PROJECTIONS): where the gates train (FLUX.1) the
             forward keeps those projections' base outputs and the recompute skips their GEMMs; before:
             plain checkpointing (Qwen-Image's gates do not train: nothing changes there)
  save_compiled  the same under torch_compile (core.compile_block's saving region: its checkpoint
             policy keeps the marked projection outputs); before: the plain compiled region. One
             model, both regions compiled (inductor) in the warm-up steps.
  attention  checkpoint_saves_attention (core.Checkpointing(attention=True)): the forward keeps each
             attention kernel's outputs and the recompute runs no attention; before: plain checkpointing
  attention_compiled  the same under torch_compile (compile_block's region that keeps attention); before:
             the plain compiled region. One model, both regions compiled (inductor) in the warm-up steps.
  lora_factor  networks.lora_module: a LoRA factor of 1 (alpha = rank, multiplier 1) is not multiplied in; before:
             lx * 1.0 in the forward, the recompute and the backward (3 ops per module and step)
  lora_rows  networks.lora_module: where the up GEMM takes the sum (torch.addmm), down runs on [tokens, in] rows;
             before: on [B, L, in], its output reshaped into rows (2 view ops more per module and pass)
  lora_addmm networks.lora_module: the LoRA's up GEMM and the base output's sum in the form ADDMM_SUM_DEVICES gives
             this device (CPU: torch.addmm, the add in the GEMM's epilogue; CUDA: `out + up(lx)`, two ops);
             before: the other form. On CUDA addmm copies the base output into its result before a GEMM
             with beta = 1 (the H200 profile's device-to-device copies and beta GEMMs).
  lora_addmm_compiled  the same under torch_compile: inductor leaves addmm to cuBLAS, while `out + up(lx)`
             lets it fuse the add into the pointwise kernel that reads the sum next (sd-scripts' form).
             One model, both sides compiled (inductor) in the warm-up steps.
  rms_weight core.rms_norm widens a bf16 weight by type promotion; before: a float32 copy of it per call
  rms_fused  core.rms_norm on CUDA (FUSED_RMS_NORM_DEVICES) runs PyTorch's fused kernel where the weight is
             in x's dtype, eager; before: the composite (8 ops forward, ~14 backward). On the CPU both sides
             are the composite (a control: x1.00)
  quantized_compiled  an fp8_scaled base under torch_compile without checkpointing: core.compile_block
             lets the partitioner recompute the dequantized weights for backward
             (_keeping_weights_quantized); before: its default, which saves them (the base in bf16 for
             the step). Two models of the same seed, both compiled (inductor) in the warm-up steps.
  fp8_linear an fp8_scaled base, eager: FP8Linear holds its codes and scale on the autograd Function's ctx
             (no saved tensors, so no checkpoint pack / unpack hooks for them), runs no autocast switch,
             and takes plain ops where its input needs no gradient; before: save_for_backward, autocast
             switched off around every call, the Function always.
  nf4_linear an nf4 base (bitsandbytes' format), eager: the same first and third cuts in bnb_weights'
             _DequantizedLinearFunction (GGUF's and BFL's Functions took them alike); its autocast switch stays.
  fp8_function  an fp8_scaled base, eager: FP8Linear through the one Function all low-bit Linears share
             (dequantized_linear: dequantize_weight and its arguments passed in); before: fp8.py's own
             _FP8LinearFunction with the plain-ops check in FP8Linear.forward (as of 0780df6)
  nf4_function  an nf4 base, eager: _BnbLinear through dequantized_linear; before: the plain-ops check and
             the Function call in _BnbLinear.forward (as of 0780df6; its Function became the shared one)
  eager_checkpoint  plain checkpointing through library/models/eager_checkpoint.py (the forward under
             no_grad: one autograd node a block, its backward the recompute's graph); before: torch's
             non-reentrant checkpoint (its forward builds every op's node and packs each saved tensor)
  eager_checkpoint_kept  the same with checkpoint_saves_projections and _attention both on (CUDA's
             default where the plan fits)
  dequantized  an fp8_scaled base, eager: checkpoint_saves_dequantized (the recompute keeps each base Linear's
             dequantized weight for its backward: two dequantizations a step instead of three); before: plain
             checkpointing
  dequantized_nf4  the same on an nf4 base (bitsandbytes' dequantization)
  stand_in   an fp8_scaled base, eager: in the recompute the block's last projection, whose output nothing reads
             where its gate does not train (Qwen-Image), stands in as zeros; before: its base on one token, which
             dequantized the whole weight (FLUX.1's gates train: a control)
  per_sample an fp8_scaled base, eager: the forward keeps the outputs of the Linears on a per-sample input needing
             no gradient (the modulation) and the recompute takes them back (eager_checkpoint.OutputStash); before:
             the recompute runs them again, dequantizing their weights

"Before" is the old code path patched in for that run only; the same model serves both sides of rope and
layernorm, whose step-0 losses (no step taken) are printed for both sides: equal up to rounding, the
levers change no math.

    python bench/bench_core_levers.py                                   # CPU, mid, all levers
    python bench/bench_core_levers.py --levers lora_factor,rms_weight --size narrow --qwen-blocks 4 --image-tokens 16 --text-tokens 8
    python bench/bench_core_levers.py --device cuda --image-tokens 4096 --text-tokens 512 --double 2 --single 4 --qwen-blocks 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from bench_train_step import (  # noqa: E402
    MiB, add_our_lora, alternate, build_ours, fp8_twin, machine_summary, make_inputs, make_step, median, our_forward,
    pin_malloc_threshold,
)
from library.models import block_checkpoint, core, eager_checkpoint  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402
from library.precision import bnb_weights as bnb, fp8  # noqa: E402
from library.precision.autocast import autocast_off, matmul_input  # noqa: E402
from library.precision.dequantized_linear import DequantizedLinearFunction, needs_backward  # noqa: E402
from networks import lora_module  # noqa: E402
from networks.lora_module import LoRAModule  # noqa: E402
from tools.devices import device_or_exit  # noqa: E402

LEVERS = ("rope", "layernorm", "compile", "tail", "save", "save_compiled", "attention", "attention_compiled",
          "lora_factor", "lora_rows", "lora_addmm", "lora_addmm_compiled", "rms_weight", "rms_fused", "quantized_compiled", "fp8_linear", "nf4_linear", "fp8_function",
          "nf4_function", "eager_checkpoint", "eager_checkpoint_kept", "dequantized", "dequantized_nf4",
          "stand_in", "per_sample")
# the checkpointing each checkpointing lever's "now" side runs (its "before": plain checkpointing)
KEEPING = {"save": core.SAVE_PROJECTIONS, "save_compiled": core.SAVE_PROJECTIONS,
           "attention": core.checkpointing(True, save_attention=True),
           "attention_compiled": core.checkpointing(True, save_attention=True),
           "eager_checkpoint_kept": core.Checkpointing(True, True),
           "dequantized": core.checkpointing(True, save_dequantized=True),
           "dequantized_nf4": core.checkpointing(True, save_dequantized=True)}
FP8 = {"fp8_linear": "fp8_scaled", "nf4_linear": "nf4", "fp8_function": "fp8_scaled", "nf4_function": "nf4",
       "dequantized": "fp8_scaled", "dequantized_nf4": "nf4", "stand_in": "fp8_scaled",
       "per_sample": "fp8_scaled"}  # a
# lever's quantized base


@contextlib.contextmanager
def patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def layer_norm_with_copy(x: torch.Tensor, eps: float) -> torch.Tensor:
    """core.layer_norm before: the float32 copy in, the cast out."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm_with_copy(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """core.rms_norm before: the weight copied to float32 each call."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


def add_up_multiplying(self, out, lx, factor, dtype):
    """LoRAModule._add_up before: the factor multiplied in even when it is 1."""
    if out.dtype != dtype or lx.dtype != dtype:
        return out + (self.lora_up(lx) * factor).to(out.dtype)
    rows = (lx * factor).reshape(-1, lx.shape[-1])
    return torch.addmm(out.reshape(-1, out.shape[-1]), rows, self.lora_up.weight.t()).view(out.shape)


class FP8LinearFunctionSavingCodes(torch.autograd.Function):
    """fp8._FP8LinearFunction before: the codes and scale through save_for_backward."""

    @staticmethod
    def forward(ctx, x, q, scale, bias, dtype):
        ctx.save_for_backward(q, scale)
        ctx.dtype = dtype
        return F.linear(x, fp8.dequantize_weight(q, scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        q, scale = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.to(ctx.dtype) @ fp8.dequantize_weight(q, scale, ctx.dtype)
        return grad_x, None, None, None, None


def fp8_forward_saving_codes(self, x: torch.Tensor) -> torch.Tensor:
    """FP8Linear.forward before: autocast switched off around the Function, which every call goes through."""
    x, dtype = self.input_and_dtype(x)
    bias = None if self.bias is None else self.bias.to(dtype)
    with autocast_off(x.device.type):
        return FP8LinearFunctionSavingCodes.apply(x.to(dtype), self.weight, self.weight_scale, bias, dtype)


class BnbLinearFunctionSavingStored(torch.autograd.Function):
    """bnb_weights._DequantizedLinearFunction before: the stored tensors through save_for_backward."""

    @staticmethod
    def forward(ctx, x, bias, dequantize, *stored):
        ctx.save_for_backward(*stored)
        ctx.dequantize = dequantize
        return F.linear(x, dequantize(*stored), bias)

    @staticmethod
    def backward(ctx, grad_out):
        stored = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = ctx.dequantize(*stored)
            grad_x = grad_out.to(w.dtype) @ w
        return (grad_x, None, None) + (None,) * len(stored)


def bnb_forward_saving_stored(self, x: torch.Tensor) -> torch.Tensor:
    """_BnbLinear.forward before: every call through the Function."""
    x, dtype = matmul_input(x, self.compute_dtype)
    bias = None if self.bias is None else self.bias.to(dtype)
    with autocast_off(x.device.type):
        return BnbLinearFunctionSavingStored.apply(x.to(dtype), bias, self._dequantizer(dtype), *self._stored())


class FP8OwnLinearFunction(torch.autograd.Function):
    """fp8._FP8LinearFunction before the shared DequantizedLinearFunction: codes and scale on ctx."""

    @staticmethod
    def forward(ctx, x, q, scale, bias, dtype):
        ctx.q, ctx.scale, ctx.dtype = q, scale, dtype
        return F.linear(x, fp8.dequantize_weight(q, scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.to(ctx.dtype) @ fp8.dequantize_weight(ctx.q, ctx.scale, ctx.dtype)
        return grad_x, None, None, None, None


def fp8_forward_own_function(self, x: torch.Tensor) -> torch.Tensor:
    """FP8Linear.forward before dequantized_linear: its own Function, the plain-ops check inline."""
    x, dtype = self.input_and_dtype(x)
    x, bias = x.to(dtype), None if self.bias is None else self.bias.to(dtype)
    if not needs_backward(x):
        return F.linear(x, self.dequantized_weight(dtype), bias)
    return FP8OwnLinearFunction.apply(x, self.weight, self.weight_scale, bias, dtype)


def bnb_forward_inline_check(self, x: torch.Tensor) -> torch.Tensor:
    """_BnbLinear.forward before dequantized_linear: the plain-ops check and the Function call inline."""
    x, dtype = matmul_input(x, self.compute_dtype)
    bias = None if self.bias is None else self.bias.to(dtype)
    x = x.to(dtype)
    with autocast_off(x.device.type):
        if not needs_backward(x):
            return F.linear(x, self.dequantized_weight(dtype), bias)
        return DequantizedLinearFunction.apply(x, bias, self._dequantizer(dtype), *self._stored())


@contextlib.contextmanager
def layer_forward(model, layer_type, forward):
    """`forward` as every `layer_type`'s forward: the class's, and the one each LoRA module kept when applied."""
    adapters = [m.forward.__self__ for m in model.modules() if isinstance(m, layer_type) and "forward" in vars(m)]
    kept = [a._original_forward for a in adapters]
    for a in adapters:
        a._original_forward = types.MethodType(forward, a.base)
    try:
        with patched(layer_type, "forward", forward):
            yield
    finally:
        for a, f in zip(adapters, kept):
            a._original_forward = f


def stand_in_on_one_token(forward, h: torch.Tensor) -> torch.Tensor:
    """block_checkpoint._stand_in before: the base run on one token under no_grad for every layer."""
    with torch.no_grad():
        out = block_checkpoint.on_one_token(forward, h)
    return eager_checkpoint.output_given(h, out, forward)


def before(lever: str, model):
    """The old path of `lever`, patched in for one run (rope, layernorm, tail, save, lora_*, rms_*,
    fp8_linear, nf4_linear, fp8_function, nf4_function, eager_checkpoint*)."""
    if lever in ("eager_checkpoint", "eager_checkpoint_kept"):
        return patched(eager_checkpoint, "usable", lambda: False)
    if lever == "stand_in":
        return patched(block_checkpoint, "_stand_in", stand_in_on_one_token)
    if lever == "per_sample":
        return patched(eager_checkpoint.OutputStash, "call", lambda self, recompute, x, stored, compute: compute())
    if lever == "fp8_linear":
        return layer_forward(model, fp8.FP8Linear, fp8_forward_saving_codes)
    if lever == "nf4_linear":
        return layer_forward(model, bnb._BnbLinear, bnb_forward_saving_stored)
    if lever == "fp8_function":
        return layer_forward(model, fp8.FP8Linear, fp8_forward_own_function)
    if lever == "nf4_function":
        return layer_forward(model, bnb._BnbLinear, bnb_forward_inline_check)
    if lever in KEEPING:
        return patched(model, "gradient_checkpointing", True)
    if lever == "rope":
        return patched(core, "_complex_rotation", lambda x32: False)
    if lever == "tail":
        return patched(block_checkpoint, "recomputing", lambda: False)
    if lever == "lora_factor":
        return patched(LoRAModule, "_add_up", add_up_multiplying)
    if lever in ("lora_addmm", "lora_addmm_compiled"):  # before: the other form of the sum on this device
        device, fused = next(model.parameters()).device.type, lora_module.ADDMM_SUM_DEVICES
        return patched(lora_module, "ADDMM_SUM_DEVICES", tuple(d for d in fused if d != device) if device in fused
                       else fused + (device,))
    if lever == "lora_rows":
        return patched(LoRAModule, "_up_takes_rows", lambda *args: False)
    if lever == "rms_weight":
        return patched(core, "rms_norm", rms_norm_with_copy)
    if lever == "rms_fused":
        return patched(core, "FUSED_RMS_NORM_DEVICES", ())
    return patched(core, "layer_norm", layer_norm_with_copy)


def trained_model(family: str, args, checkpointing=True, fp8: str | None = None):
    """(step, loss, model) for our mid model with a fresh LoRA, checkpointing on, frozen base in train
    mode (fp8: quantized so); loss() is the step's loss without a step."""
    model = build_ours(family, args.size, args, torch.bfloat16, args.device)
    if fp8 in bnb.MODES:  # quantized in place, on the CPU (bitsandbytes' own quantization)
        model = bnb.prepare_bnb(model, fp8, arch_spec(family).fp8)
    elif fp8:
        model = fp8_twin(model, family, fp8)
    model = model.requires_grad_(False).train()
    model.gradient_checkpointing = checkpointing
    x = make_inputs(family, model.config, args.image_tokens, args.text_tokens, 1, args.device)
    _, params = add_our_lora(model, family, args.rank)

    def forward():
        with torch.autocast(args.device.type, dtype=torch.bfloat16):
            return our_forward(family, model, x)

    def loss() -> float:
        with torch.no_grad():
            return F.mse_loss(forward().float(), x["target"]).item()

    return make_step(forward, params, x["target"]), loss, model


def compare(family: str, lever: str, args) -> float:
    if lever == "compile":
        step_before, _, old = trained_model(family, args)
        step_now, _, new = trained_model(family, args)
        for block in old.swappable_blocks():
            block.compile()  # the block alone; run_block checkpoints it from outside
        for block in new.swappable_blocks():
            core.compile_block(block)
        steps = {"before": step_before, "now": step_now}
    elif lever == "quantized_compiled":
        step_before, _, old = trained_model(family, args, False, "fp8_scaled")
        step_now, _, new = trained_model(family, args, False, "fp8_scaled")
        with patched(block_checkpoint, "_keeping_weights_quantized", lambda compiled: compiled):
            for block in old.swappable_blocks():  # (an option at its default: dynamo would otherwise reuse
                core.compile_block(block, options={"epilogue_fusion": True})  # one model's code for both)
        for block in new.swappable_blocks():
            core.compile_block(block)
        steps = {"before": step_before, "now": step_now}
    else:
        step, loss, model = trained_model(family, args, KEEPING.get(lever, True), FP8.get(lever))
        if lever.endswith("_compiled"):
            for block in model.swappable_blocks():
                core.compile_block(block)
        with before(lever, model):
            loss_before = loss()
        print(f"[{family} {lever}] step-0 loss before {loss_before:.6f} now {loss():.6f}")

        def step_before():
            with before(lever, model):
                return step()

        steps = {"before": step_before, "now": step}
    res = alternate(steps, args.warmup, args.reps, args.device, args.clock)
    t_b, t_n = median(res["before"]["times"]), median(res["now"]["times"])
    # each round's ratio (its two steps ran back to back, under about the same load), median and quartiles
    ratios = sorted(n / b for n, b in zip(res["now"]["times"], res["before"]["times"]))
    quartile = len(ratios) // 4
    m_b, m_n = median(res["before"]["peaks"]), median(res["now"]["peaks"])
    first = (f"; first step losses (two models) {res['before']['loss']:.6f} / {res['now']['loss']:.6f}"
             if lever in ("compile", "quantized_compiled") else "")
    print(f"[{family} {lever}] before {t_b:.4f} s  now {t_n:.4f} s  now/before x{t_n / t_b:.3f} (per round: median "
          f"x{median(ratios):.3f}, quartiles x{ratios[quartile]:.3f}-x{ratios[-1 - quartile]:.3f}); step memory "
          f"{m_b / MiB:.0f} -> {m_n / MiB:.0f} MiB{first}", flush=True)
    return t_n / t_b


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="flux,qwen_image")
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--size", default="mid", choices=("mid", "narrow"),
                   help="mid: full widths; narrow: toy widths (the per-op host overhead alone), same block counts")
    p.add_argument("--double", type=int, default=1, help="FLUX: double blocks at width 3072")
    p.add_argument("--single", type=int, default=1, help="FLUX: single blocks at width 3072")
    p.add_argument("--qwen-blocks", type=int, default=2)
    p.add_argument("--image-tokens", type=int, default=256)
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    args.device = device_or_exit(args.device)
    unknown = set(args.levers.split(",")) - set(LEVERS)
    if unknown:
        raise SystemExit(f"--levers: unknown {sorted(unknown)}; expected some of {', '.join(LEVERS)}")
    args.clock = time.perf_counter
    if args.device.type == "cpu":
        pin_malloc_threshold()
        if args.size == "narrow":  # toy ops take microseconds: more threads only add OpenMP sync stalls
            torch.set_num_threads(1)
            args.clock = time.thread_time  # the step runs in this thread alone: its CPU time, not the load's
    clock = "thread CPU" if args.clock is time.thread_time else "wall"
    print(f"machine: {machine_summary()}; {args.image_tokens} + {args.text_tokens} tokens, bf16 autocast, "
          f"checkpointing; {clock} time")
    summary = []
    for family in args.families.split(","):
        for lever in args.levers.split(","):
            summary.append(f"{family} {lever} x{compare(family, lever, args):.3f}")
    print("SUMMARY (now/before): " + "; ".join(summary))


if __name__ == "__main__":
    main()
