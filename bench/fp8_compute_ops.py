"""Per-call work of one fp8_compute Linear (library/precision/fp8_compute.py) beside its GEMM: the ops
one forward and one backward dispatch below autograd (a TorchDispatchMode on the CPU; on a GPU each
non-view op is one kernel launch, the same ops) and the bytes they read and write.

Shapes: x [M, K], weight [N, K] with M = 2 K and N = K, so every activation-sized tensor (x, y, the
output gradient, the input gradient, their float32 and e4m3 forms) has M K elements, the weight N K, and
a row or column vector of the weight (its scales) N = K. Bytes are per activation element: shape-free,
multiply by M K for a real layer ([4608, 3072]: 14.2 M elements).

    python bench/fp8_compute_ops.py [--k 256] [--bias] [--list]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.precision.fp8 import FP8Linear  # noqa: E402
from library.precision.fp8_compute import enable_fp8_compute  # noqa: E402

MODES = ("fp8", "fp8_scaled", "fp8_tensor_scaled")


@dataclass
class Work:
    """One direction (forward or backward) of one call. gemm: the fp8 GEMMs; passes: other ops that
    read or write an activation-sized tensor, bytes: what they read and write of such tensors, per
    element; weight_copies: ops
    writing a tensor of the weight's size; vector_ops: ops writing a tensor of a weight row's or
    column's length (scales or ones remade per call); ops: every non-view op, the GEMM included."""

    ops: list[str] = field(default_factory=list)
    gemm: int = 0
    passes: int = 0
    bytes: float = 0.0
    weight_copies: int = 0
    vector_ops: int = 0


class OpLog(TorchDispatchMode):
    """Sorts each non-view op by the sizes it touches (see Work)."""

    def __init__(self, tokens: int, features: int):
        super().__init__()
        self.activation, self.weight, self.vector = tokens * features, features * features, features
        self.work = Work()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
            return out  # a view: no data moved
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        work = self.work
        work.ops.append(func.__name__)
        if func is torch.ops.aten._scaled_mm.default:
            work.gemm += 1
        elif big := [t for t in ins + outs if t.numel() == self.activation]:
            work.passes += 1
            work.bytes += sum(t.element_size() for t in big)  # per element; the [M, 1] scales left out
        if any(t.numel() == self.weight for t in outs):
            work.weight_copies += 1
        elif any(t.numel() == self.vector for t in outs):
            work.vector_ops += 1
        return out


def computed_layer(mode: str, features: int, bias: bool) -> nn.Module:
    linear = nn.Linear(features, features, bias=bias)
    model = nn.Sequential(FP8Linear.from_linear(linear, mode)).to(torch.bfloat16)  # the bias in bf16, as trained
    assert enable_fp8_compute(model) == 1
    return model


def per_call_work(layer: nn.Module, features: int) -> dict[str, Work]:
    """{"forward": Work, "backward": Work} of one bf16 call on x [2 features, features]."""
    tokens = 2 * features
    x = torch.randn(tokens, features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x.requires_grad_(True)
    with OpLog(tokens, features) as forward:
        y = layer(x)
    grad = torch.ones_like(y)
    with OpLog(tokens, features) as backward:
        y.backward(grad)
    return {"forward": forward.work, "backward": backward.work}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=256, help="in- and out-features (a multiple of 16); M = 2 k")
    parser.add_argument("--bias", action="store_true", help="layers with a bias (one more pass: y + bias)")
    parser.add_argument("--list", action="store_true", help="print each direction's ops in order")
    args = parser.parse_args(argv)
    print(f"per call, x [{2 * args.k}, {args.k}], weight [{args.k}, {args.k}], bias {args.bias}; bytes per activation element")
    for mode in MODES:
        for direction, w in per_call_work(computed_layer(mode, args.k, args.bias), args.k).items():
            print(f"  {mode:<18} {direction:<8} ops {len(w.ops):2d} (GEMM {w.gemm})  activation passes {w.passes} "
                  f"{w.bytes:5.1f} B  weight copies {w.weight_copies}  weight-vector ops {w.vector_ops}")
            if args.list:
                print("    " + " ".join(w.ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
