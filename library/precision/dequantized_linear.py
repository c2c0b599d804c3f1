"""The one autograd path of every frozen low-bit base Linear (fp8.py's FP8Linear, bnb_weights' nf4 /
nf4_dq / int8, gguf_weights' blocks, bfl_weights' fp8r / nvfp4): y = x @ dequantize(*args)^T + b; and its
batched sibling for packed weights (fp8_packed.py: a mixture's experts), y = bmm(x, dequantize(*args)).

Each format brings only its dequantize function and arguments (its stored tensors, and what else it
needs: shape, block type, the compute dtype); dequantize(*args) returns the [out, in] weight in the
matmul's dtype. It sits in its own module, below the formats, because all four import it and fp8.py is
imported by two of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def needs_backward(x: torch.Tensor) -> bool:
    """True where a frozen quantized Linear's input will get a gradient: only then does its weight
    need dequantizing again in backward (DequantizedLinearFunction); otherwise plain ops save nothing."""
    return x.requires_grad and torch.is_grad_enabled()


class DequantizedLinearFunction(torch.autograd.Function):
    """y = x @ dequantize(*args)^T + b whose backward dequantizes again instead of keeping the weight:
    autograd would otherwise save every layer's dequantized copy until backward, holding the whole base
    in the compute dtype during a step and undoing the format's memory saving. The base gets no gradient.

    The stored tensors in `args` are held on ctx, not passed through save_for_backward: they are the
    layer's own buffers, resident anyway and never written in place (block swap moves their storage
    under the same tensor objects, which ctx sees as a saved tensor would). A saved tensor costs a
    Python pack hook in checkpointing's forward and in its recompute, an unpack in backward and the
    recompute's check; with FP8Linear.forward's other two cuts, a narrow fp8_scaled training step on one
    CPU thread ran x0.94-0.95 (bench/RESULTS.md, issue 29)."""

    @staticmethod
    def forward(ctx, x, bias, dequantize, *args):
        ctx.dequantize, ctx.args = dequantize, args
        return F.linear(x, dequantize(*args), bias)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = ctx.dequantize(*ctx.args)
            grad_x = grad_out.to(w.dtype) @ w
        return (grad_x, None, None) + (None,) * len(ctx.args)


def dequantized_linear(x: torch.Tensor, bias: torch.Tensor | None, dequantize, *args) -> torch.Tensor:
    """F.linear(x, dequantize(*args), bias) for a frozen low-bit weight: through
    DequantizedLinearFunction where x needs a gradient, else as plain ops (a modulation Linear's
    timestep embedding, sampling), which save nothing and give the same bits. x and bias are in the
    matmul's dtype, the one dequantize returns."""
    if not needs_backward(x):
        return F.linear(x, dequantize(*args), bias)
    return DequantizedLinearFunction.apply(x, bias, dequantize, *args)


class DequantizedBmmFunction(torch.autograd.Function):
    """y = bmm(x, dequantize(*args)) (x [e, n, K], the weight [e, K, N]) whose backward dequantizes again
    instead of keeping the weight, for packed frozen weights (a mixture's experts) as DequantizedLinearFunction
    is for Linears: the stored tensors held on ctx, the base given no gradient."""

    @staticmethod
    def forward(ctx, x, dequantize, *args):
        ctx.dequantize, ctx.args = dequantize, args
        return torch.bmm(x, dequantize(*args))

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = ctx.dequantize(*ctx.args)
            grad_x = torch.bmm(grad_out.to(w.dtype), w.transpose(1, 2))
        return (grad_x, None) + (None,) * len(ctx.args)


def dequantized_bmm(x: torch.Tensor, dequantize, *args) -> torch.Tensor:
    """torch.bmm(x, dequantize(*args)) for a frozen packed low-bit weight: through DequantizedBmmFunction where x
    needs a gradient, else as plain ops (the same bits). x in the dtype dequantize returns."""
    if not needs_backward(x):
        return torch.bmm(x, dequantize(*args))
    return DequantizedBmmFunction.apply(x, dequantize, *args)
