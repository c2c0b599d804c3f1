"""The frozen low-bit Linears' products on a CPU without native bf16 GEMMs (an AVX2-only CPU: PyTorch's fallback runs a
row-major A @ row-major B at 0.2-0.3 GFLOPS, 60x below A column-major; bench/RESULTS.md): the input gradient
of DequantizedLinearFunction and the packed experts' forward copy A column-major there (layout_matmul), with
the values of the plain product to float32 rounding; where the CPU is native (or on CUDA) nothing changes."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from library.precision import dequantized_linear as dq, fp8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)


class FirstOperands(TorchDispatchMode):
    """Records whether each mm / bmm's first operand is column-major (its last dimension's stride not 1)."""

    def __init__(self):
        super().__init__()
        self.column_major = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.column_major.append(args[0].stride(-1) != 1)
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=[True, False], ids=["native", "fallback"])
def native(request, monkeypatch):
    monkeypatch.setitem(dq.NATIVE_CPU_GEMMS, torch.bfloat16, request.param)
    return request.param


def test_the_input_gradient_of_a_frozen_fp8_linear_takes_the_fallbacks_fast_layout(native):
    """fp8_scaled Linear in bf16 compute: its backward's grad_out @ W runs with grad_out column-major on a fallback
    CPU, row-major on a native one; grad_x equals the float32 product of the same bf16 operands to bf16 rounding."""
    torch.manual_seed(0)
    layer = fp8.FP8Linear.from_linear(nn.Linear(192, 96), "fp8_scaled")
    x = torch.randn(2, 40, 192, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 40, 96, dtype=torch.bfloat16)
    y = layer(x)
    with FirstOperands() as seen:
        y.backward(grad)
    assert seen.column_major == [not native]
    w = layer.dequantized_weight(torch.bfloat16).float()
    expected = grad.float() @ w
    assert (x.grad.float() - expected).abs().max() <= 2 ** -8 * expected.abs().max()


def test_the_packed_experts_forward_takes_the_fallbacks_fast_layout(native):
    """bmm(x, W) for packed frozen experts (W [e, K, N] row-major): x column-major on a fallback CPU; the backward's
    bmm(grad, W^T) already has the fast layout and is left; the values are the float32 product's to bf16 rounding."""
    torch.manual_seed(1)
    x = torch.randn(3, 24, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 64, 80)
    dequantize = lambda w: w.to(torch.bfloat16)  # noqa: E731
    with FirstOperands() as seen:
        y = dq.dequantized_bmm(x, dequantize, w)
        y.backward(torch.ones_like(y))
    assert seen.column_major == [not native, False]
    expected = x.detach().float() @ w.bfloat16().float()
    assert (y.float() - expected).abs().max() <= 2 ** -8 * expected.abs().max()


def test_float32_and_non_cpu_products_are_left_as_they_are(monkeypatch):
    monkeypatch.setitem(dq.NATIVE_CPU_GEMMS, torch.bfloat16, False)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with FirstOperands() as seen:
        dq.layout_matmul(a, b)
        dq.layout_matmul(a.bfloat16(), b.t().contiguous().t().bfloat16())  # b column-major: F.linear's layout
    assert seen.column_major == [False, False]


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine != "x86_64", reason="x86 oneDNN ISA")
def test_the_probe_reads_onednns_isa_as_an_avx2_only_cpu_would():
    """ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2-only CPU gives oneDNN) makes bf16 a fallback dtype at import."""
    code = ("from library.precision.dequantized_linear import NATIVE_CPU_GEMMS as n; import torch; "
            "print(n[torch.bfloat16])")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("native", [True, False])
def test_bf16_compute_on_a_cpu_without_native_gemms_is_said(monkeypatch, native):
    """One line says float32 compute is the faster one on such a CPU; nothing on a native one or off the CPU."""
    from types import SimpleNamespace

    from library.training.config import slow_cpu_compute_line

    monkeypatch.setitem(dq.NATIVE_CPU_GEMMS, torch.bfloat16, native)
    args = SimpleNamespace(mixed_precision="bf16", key_origins={"mixed_precision": "run.toml"}, config_file="run.toml")
    line = slow_cpu_compute_line(args, torch.device("cpu"))
    assert (line is None) == native and slow_cpu_compute_line(args, torch.device("meta")) is None
    if not native:
        assert line.startswith('run.toml: mixed_precision = "bf16" on a CPU without native bf16 matrix products')
        assert line.endswith('"no" (float32 compute) is the fastest here')
    assert slow_cpu_compute_line(SimpleNamespace(mixed_precision="no"), torch.device("cpu")) is None


def test_both_trainers_say_it_before_reading_data(monkeypatch, capsys, tiny_set, tmp_path):
    """The diffusion and the LLM trainer print the line (bf16 taken as not native here) and train on: each stops
    at its first refusal of the data, after the line."""
    import train_lora

    monkeypatch.setitem(dq.NATIVE_CPU_GEMMS, torch.bfloat16, False)
    missing = str(tmp_path / "missing.toml")
    runs = (["--config_file", os.path.join(ROOT, "configs", "quickstart.toml"), "--pretrained_model_name_or_path",
             tiny_set["flux_bfl"], "--ae", tiny_set["flux_vae_single"], "--clip_l", tiny_set["clip_l"], "--t5xxl",
             tiny_set["t5xxl"], "--dataset_config", missing, "--output_dir", str(tmp_path / "a")],
            ["--model_type", "llm", "--pretrained_model_name_or_path", tiny_set["llm"], "--train_data",
             str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "b")])
    for argv in runs:
        assert train_lora.main([*argv, "--mixed_precision", "bf16"]) != 0
        err = capsys.readouterr().err
        assert 'mixed_precision = "bf16" on a CPU without native bf16 matrix products' in err, err
