"""Eager-step cuts (bench/op_counts.py, bench/RESULTS.md): each drops aten ops or host work from a training
step and changes no bit of the prediction or the LoRA gradients, on the CPU in float32 and under bf16
autocast. The old code path is patched back in for the comparison; the op counts (or the calls of what was
cut) prove the cut is taken."""

import collections
import contextlib
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from library.models import core
from library.models.qwen_image.model import QwenImage, QwenImageConfig
from library.models.registry import arch_spec
from library.precision import dequantized_linear, fp8
from library.precision.dequantized_linear import DequantizedLinearFunction
from library.precision.fp8 import quantize_module
from networks import lora_module
from networks.lora import LoRANetwork
from networks.lora_module import LoRAModule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from bench_core_levers import (  # noqa: E402  (the levers' old paths)
    add_up_multiplying, fp8_forward_saving_codes, rms_norm_with_copy,
)

TINY = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                       axes_dims_rope=(8, 12, 12))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _step(dtype, autocast: bool, fp8_mode: str | None = None):
    """(prediction, LoRA grads, op counts) of one checkpointed training step of a tiny model (its base
    quantized to fp8_mode if given) whose LoRA up weights are non-zero (so the gradients reach every
    LoRA weight)."""
    torch.manual_seed(0)
    model = QwenImage(TINY).to(dtype).requires_grad_(False).train()
    if fp8_mode:
        quantize_module(model, fp8_mode, arch_spec("qwen_image").fp8)
    model.compute_dtype = dtype
    model.gradient_checkpointing = core.checkpointing(True, save_attention=True)
    network = LoRANetwork(model, "qwen_image", 4, alpha=4)
    network.apply()
    for m in network.lora_modules():
        torch.nn.init.normal_(m.lora_up.weight, std=0.1)
    g = torch.Generator().manual_seed(1)
    img, txt = torch.randn(1, 16, 64, generator=g), torch.randn(1, 8, 32, generator=g)
    mask, sigma = torch.ones(1, 8, dtype=torch.bool), torch.full((1,), 0.5)
    ops = _Ops()
    with ops:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            pred = model(img, txt, mask, sigma, [(1, 4, 4)])
        F.mse_loss(pred.float(), torch.zeros_like(pred, dtype=torch.float32)).backward()
    # (the last block's text-stream LoRAs feed nothing: no gradient)
    grads = [p.grad.clone() for p in network.trainable_parameters() if p.grad is not None]
    return pred.detach(), grads, ops.counts


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, True)])
def test_lora_rows_factor_one_and_rms_norm_weight_cuts_are_bit_identical(monkeypatch, dtype, autocast):
    pred, grads, ops = _step(dtype, autocast)
    with monkeypatch.context() as m:
        m.setattr(core, "rms_norm", rms_norm_with_copy)
        m.setattr(LoRAModule, "_add_up", add_up_multiplying)
        m.setattr(LoRAModule, "_up_takes_rows", lambda *args: False)  # before: down on [B, L, in]
        old_pred, old_grads, old_ops = _step(dtype, autocast)
    assert torch.equal(pred, old_pred)
    assert len(grads) == len(old_grads) == 42 and all(torch.equal(a, b) for a, b in zip(grads, old_grads))
    # 12 LoRA modules per block, 2 blocks: a multiply each in the forward and the recompute, and in the
    # backward for the 21 whose output reaches the loss
    assert old_ops["mul"] - ops["mul"] == 24 + 24 + 21
    # down on 2-D rows: no _unsafe_view of its output and no reshape into rows, in the forward and the
    # recompute; in backward no view back for either (21 modules)
    assert old_ops["_unsafe_view"] - ops["_unsafe_view"] == 24 + 24
    assert old_ops["view"] - ops["view"] == 24 + 24 + 2 * 21
    # 4 QK norms per block (+ the text-input norm once): a weight copy in the forward and the recompute
    assert old_ops["_to_copy"] - ops["_to_copy"] == (0 if dtype == torch.float32 else 2 * 8 + 1)


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, True)])
def test_the_lora_sum_outside_addmm_devices_is_the_same_sum(monkeypatch, dtype, autocast):
    """Off ADDMM_SUM_DEVICES (CUDA: the H200 ran `out + up(lx)` faster) the sum is the addmm's, up to
    where bf16 rounds (addmm rounds the sum once, the separate add rounds the GEMM's output first)."""
    assert lora_module.ADDMM_SUM_DEVICES == ("cpu",)
    pred, grads, ops = _step(dtype, autocast)
    with monkeypatch.context() as m:
        m.setattr(lora_module, "ADDMM_SUM_DEVICES", ())
        old_pred, old_grads, old_ops = _step(dtype, autocast)
    # bf16: a gradient of max 1.9e-6 differed by 2.1% on an AMD EPYC with AVX-512 (the sums round in another order)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert ops["addmm"] - old_ops["addmm"] == 24 + 24  # 24 LoRA sums left their GEMMs, forward and recompute
    assert (pred.float() - old_pred.float()).abs().max() <= tol * pred.float().abs().max()
    assert len(grads) == len(old_grads) == 42
    for a, b in zip(grads, old_grads):
        assert (a.float() - b.float()).abs().max() <= tol * a.float().abs().max() + 1e-12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_lora_sum_on_cuda_is_the_gemm_then_an_add():
    """On CUDA (not in ADDMM_SUM_DEVICES) the LoRA's output is `out + up(rows)`: no addmm in the graph,
    and under bf16 autocast the same output and LoRA gradients as the CPU's addmm form in float64."""
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 48)
    lora = LoRAModule("m", base, rank=8, alpha=4.0)
    torch.nn.init.normal_(lora.lora_up.weight)
    lora.apply_to_base()
    x = torch.randn(2, 32, 64)
    results = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float64)):
        base.to(device, torch.float32 if device == "cuda" else dtype)
        lora.to(device, torch.float32 if device == "cuda" else dtype)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            y = base(x.to(device, torch.float32 if device == "cuda" else dtype))
        if device == "cuda":
            assert "Addmm" not in y.grad_fn.name() and y.grad_fn.name() == "AddBackward0"
        grads = torch.autograd.grad(y.float().square().sum(), [lora.lora_down.weight, lora.lora_up.weight])
        results.append([t.detach().double().cpu() for t in (y, *grads)])
    for got, want in zip(*results):
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, True)])
def test_fp8_linear_host_cuts_are_bit_identical(monkeypatch, dtype, autocast):
    """FP8Linear holds its codes on the Function's ctx instead of saving them, switches no autocast and
    takes plain ops where its input needs no gradient (the modulation Linears' timestep embedding):
    the same ops and bits as the Function with saved codes around every call."""
    # the cut is compared alone: on a CPU without native bf16 GEMMs the input gradient's layout copy
    # (dequantized_linear.layout_matmul, tests/test_cpu_gemm_layout.py) is not in the old path
    monkeypatch.setattr(dequantized_linear, "NATIVE_CPU_GEMMS", {})
    calls = []
    apply = DequantizedLinearFunction.apply
    monkeypatch.setattr(DequantizedLinearFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    fp8._pair_table(torch.bfloat16 if autocast else dtype)  # built before counting (CPU dequantization)
    pred, grads, ops = _step(dtype, autocast, "fp8_scaled")
    with monkeypatch.context() as m:
        m.setattr(fp8.FP8Linear, "forward", fp8_forward_saving_codes)
        old_pred, old_grads, old_ops = _step(dtype, autocast, "fp8_scaled")
    assert torch.equal(pred, old_pred)
    assert len(grads) == len(old_grads) == 42 and all(torch.equal(a, b) for a, b in zip(grads, old_grads))
    assert ops == old_ops  # the cut is host work only: no aten op more or less
    # the recompute: the Function where the input needs a gradient, 12 quantized Linears a block but 6 in
    # the first (its q / k / v projections read the frozen embedders' output), less the 2 MLP outputs a
    # block (their stand-in runs on one token under no_grad: block_checkpoint._stand_in); plain ops for img_mod and
    # txt_mod (the frozen timestep embedding), for those, and in the forward (eager_checkpoint's runs
    # under no_grad)
    assert len(calls) == 12 + 6 - 2 * 2


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_weight_widened_by_promotion_equals_a_float32_copy(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(x_dtype).requires_grad_(True)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(w_dtype).requires_grad_(True)
    x0, w0 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y, y0 = core.rms_norm(x, w, 1e-6), rms_norm_with_copy(x0, w0, 1e-6)
    grad = torch.randn(y.shape, generator=g).to(y.dtype)
    y.backward(grad)
    y0.backward(grad)
    assert y.dtype == y0.dtype == x_dtype and torch.equal(y, y0)
    assert torch.equal(x.grad, x0.grad) and torch.equal(w.grad, w0.grad)


# core.rms_norm on CUDA: PyTorch's fused kernel (aten._fused_rms_norm and its backward) where the weight is in
# x's dtype. Its CUDA kernels cannot run here: their math is checked through PyTorch's own decompositions of
# the two ops (what inductor and the meta kernels use), and the routing on the CPU with the device list patched.


def _fused_rms_norm_by_decomposition(x, w, eps, grad):
    """(y, dL/dx) of aten._fused_rms_norm forward and backward as PyTorch decomposes them (the formulas its
    meta kernels and inductor use), run as eager ops on the CPU."""
    from torch._decomp import decomposition_table

    aten = torch.ops.aten
    y, rstd = decomposition_table[aten._fused_rms_norm.default](x, [x.shape[-1]], w, eps)
    dx, _ = decomposition_table[aten._fused_rms_norm_backward.default](grad, x, [x.shape[-1]], rstd, w, [True, False])
    return y, dx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
def test_the_fused_rms_norm_kernels_math_equals_ours(dtype, weighted):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 300, 128, generator=g)).to(dtype).requires_grad_(True)
    w = (1 + 0.3 * torch.randn(128, generator=g)).to(dtype) if weighted else None
    y = core.rms_norm(x, w, 1e-6)
    grad = torch.randn(y.shape, generator=g).to(dtype)
    dx, = torch.autograd.grad(y, x, grad)
    y_fused, dx_fused = _fused_rms_norm_by_decomposition(x.detach(), w, 1e-6, grad)
    assert y_fused.dtype == y.dtype == dx_fused.dtype == dtype
    tiny = torch.finfo(dtype).eps  # one rounding of the output dtype apart at most (the sums' order)
    assert torch.allclose(y_fused.float(), y.float(), rtol=tiny, atol=tiny)
    assert torch.allclose(dx_fused.float(), dx.float(), rtol=4 * tiny, atol=4 * tiny * dx.abs().max().item())


def test_rms_norm_takes_the_fused_kernel_where_the_dtypes_match_eager_and_autocast_off(monkeypatch):
    calls = []

    def spy(x, shape, weight, eps):
        calls.append((x.dtype, None if weight is None else weight.dtype, torch.is_autocast_enabled("cpu")))
        return real(x, shape, weight, eps)

    real = F.rms_norm
    monkeypatch.setattr(core, "FUSED_RMS_NORM_DEVICES", ("cpu",))  # the CUDA path, on the CPU
    monkeypatch.setattr(F, "rms_norm", spy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (1 + 0.3 * torch.randn(64, generator=g)).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = core.rms_norm(x, w, 1e-6)
    assert calls == [(torch.bfloat16, torch.bfloat16, False)] and y.dtype == torch.bfloat16
    monkeypatch.setattr(core, "FUSED_RMS_NORM_DEVICES", ())
    y_composite = core.rms_norm(x, w, 1e-6)
    assert len(calls) == 1 and torch.equal(y, y_composite)  # the CPU's F.rms_norm is the composite, bit for bit
    monkeypatch.setattr(core, "FUSED_RMS_NORM_DEVICES", ("cpu",))
    core.rms_norm(x, w.float(), 1e-6)  # a float32 weight (Krea 2's 1 + scale): the composite, as PyTorch would
    core.rms_norm(x.float(), w, 1e-6)
    core.rms_norm(x, None, 1e-6)
    assert calls[1:] == [(torch.bfloat16, None, False)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # compiled regions keep their graphs
    core.rms_norm(x, w, 1e-6)
    assert len(calls) == 2
