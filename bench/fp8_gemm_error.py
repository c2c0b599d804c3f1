"""How far the device's fp8 GEMMs (fp8_compute's forward and input gradient) are from the float64 product of
the same e4m3 codes, beyond one bf16 rounding, in units of the sum of the products' magnitudes (the
accumulation's error scale). Sets tests/test_fp8_compute.py's CUDA bound (FP8_ACCUMULATION). By hand:
    python bench/fp8_gemm_error.py [--device cuda]
"""

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from library.precision.fp8 import FP8Linear  # noqa: E402
from library.precision.fp8_compute import enable_fp8_compute, quantize_rows  # noqa: E402


def excess(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest error past one bf16 rounding / sum |a_k b_k|, largest error / largest |output|)."""
    exact = a @ b.t()
    err = (y.double() - exact).abs()
    past = (err - exact.abs() * 2.0 ** -8).clamp_min(0) / (a.abs() @ b.abs().t()).clamp_min(1e-300)
    return past.max().item(), (err.max() / exact.abs().max()).item()


def measure(mode: str, tokens: int, k: int, n: int, device: str) -> str:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    model = nn.Sequential(FP8Linear.from_linear(linear, mode))
    enable_fp8_compute(model)
    lin = model[0].to(device)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16).to(device).requires_grad_(True)
    g = torch.randn(tokens, n, generator=gen).to(torch.bfloat16).to(device)
    y = lin(x)
    y.backward(g)
    s_w = lin.row_scales().double()
    xq, s_x = quantize_rows(x.detach())
    fwd = excess(y, xq.double() * s_x.double(), lin.weight.double() * s_w[:, None])
    gq, s_g = quantize_rows(g.float() * s_w.float()[None, :])
    bwd = excess(x.grad, gq.double() * s_g.double(), lin.weight.double().t())
    return (f"{mode:17s} {tokens}x{k}x{n}: forward past one rounding {fwd[0]:.2e} of sum|ab| (largest error"
            f" {fwd[1]:.1e} of the largest output); input gradient {bwd[0]:.2e} ({bwd[1]:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}")
    for mode in ("fp8", "fp8_scaled", "fp8_tensor_scaled"):
        for tokens, k, n in ((51, 192, 96), (512, 3072, 3072), (512, 12288, 3072)):
            print(measure(mode, tokens, k, n, args.device))


if __name__ == "__main__":
    main()
