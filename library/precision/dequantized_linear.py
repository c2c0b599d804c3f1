"""The one autograd path of every frozen low-bit base Linear (fp8.py's FP8Linear, bnb_weights' nf4 /
nf4_dq / int8, gguf_weights' blocks, bfl_weights' fp8r / nvfp4): y = x @ dequantize(*args)^T + b; and its
batched sibling for packed weights (fp8_packed.py: a mixture's experts), y = bmm(x, dequantize(*args)).

Each format brings only its dequantize function and arguments (its stored tensors, and what else it
needs: shape, block type, the compute dtype); dequantize(*args) returns the [out, in] weight in the
matmul's dtype. It sits in its own module, below the formats, because all four import it and fp8.py is
imported by two of them."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F


def _native_cpu_gemms() -> dict[torch.dtype, bool]:
    """Whether the CPU's bf16 / fp16 GEMMs run in oneDNN (bf16: AVX-512 or newer; fp16: AVX-512 FP16 or AMX), as
    torch reports (an environment's ONEDNN_MAX_CPU_ISA counts: AVX2 there is an AVX2-only CPU); read once, at import,
    so a compiled graph sees a constant. A build without oneDNN's probes: taken as native."""
    try:
        return {torch.bfloat16: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                torch.float16: bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())}
    except (AttributeError, RuntimeError):
        return {}


NATIVE_CPU_GEMMS = _native_cpu_gemms()


def native_cpu_matmul(dtype: torch.dtype) -> bool:
    """True where the CPU multiplies `dtype` natively (float32 always). Elsewhere (bf16 on an AVX2-only CPU, fp16 on
    most) PyTorch's fallback runs a row-major A @ row-major B 60x below the same product with A column-major."""
    return NATIVE_CPU_GEMMS.get(dtype, True)


def layout_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (2D, or batched as torch.bmm), b in the product's dtype. On a CPU without native GEMMs in that dtype
    (native_cpu_matmul), where b is row-major, a is copied column-major first: PyTorch's fallback runs a row-major
    a @ row-major b at 0.3 GFLOPS and a column-major a at 18 (bf16, [320, 3072] @ [3072, 3072], one thread of an
    AMD EPYC with oneDNN held to AVX2, bench/RESULTS.md); the copy is ~1% of the product's time. A row-major a
    times a transposed b (F.linear's x @ w^T) runs at ~15 as it is. The same products and sums in another loop
    order: equal to float32 rounding, not bit for bit."""
    a = a.to(b.dtype)
    if a.device.type == "cpu" and not native_cpu_matmul(b.dtype) and b.stride(-1) == 1:
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    return a @ b


def input_gradient(grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_out [..., out] @ weight [out, in]: a frozen Linear's input gradient, in weight's dtype. Where the product
    is native, matmul as it is (its own fold into rows: the ops a plain Linear's backward takes); elsewhere
    layout_matmul on the rows (a column-major copy of a 3-D grad_out would be undone by matmul's fold)."""
    if grad_out.device.type != "cpu" or native_cpu_matmul(weight.dtype):
        return grad_out.to(weight.dtype) @ weight
    rows = grad_out.reshape(-1, grad_out.shape[-1])
    return layout_matmul(rows, weight).reshape(*grad_out.shape[:-1], weight.shape[1])


# .on: a forward whose graph backward runs at once (eager checkpointing's recompute: keeping_dequantized_weights);
# .outputs: eager checkpointing's stash of per-sample outputs (keeping_outputs)
_keeping = threading.local()


@contextlib.contextmanager
def _kept(name: str, value):
    """_keeping.name = value for the block, then back to what it was."""
    previous = getattr(_keeping, name, None)
    setattr(_keeping, name, value)
    try:
        yield
    finally:
        setattr(_keeping, name, previous)


def keeping_dequantized_weights(on: bool = True):
    """While on, the Functions below keep the weight their forward dequantized for their backward instead of
    dequantizing it again there: for a forward whose backward follows at once (eager checkpointing's recompute, one
    block: block_checkpoint._checkpoint_contexts), so the step dequantizes each weight twice (forward, recompute)
    rather than three times, for the block's dequantized weights held from its recompute through their own backward
    (each freed once its node has run). checkpoint_saves_dequantized; elsewhere the weights would stay for the step."""
    return _kept("on", on)


def _keeps() -> bool:
    """Whether a forward keeps its dequantized weight now; never in a compiled graph (its partitioner decides)."""
    return not torch.compiler.is_compiling() and bool(getattr(_keeping, "on", False))


def _kept_or_dequantized(ctx) -> torch.Tensor:
    """The weight the forward kept (released here: a node runs its backward once) or dequantized again."""
    w = ctx.weight
    ctx.weight = None
    return ctx.dequantize(*ctx.args) if w is None else w


def needs_backward(x: torch.Tensor) -> bool:
    """True where a frozen quantized Linear's input will get a gradient: only then does its weight
    need dequantizing again in backward (DequantizedLinearFunction); otherwise plain ops save nothing."""
    return x.requires_grad and torch.is_grad_enabled()


class DequantizedLinearFunction(torch.autograd.Function):
    """y = x @ dequantize(*args)^T + b whose backward dequantizes again instead of keeping the weight:
    autograd would otherwise save every layer's dequantized copy until backward, holding the whole base
    in the compute dtype during a step and undoing the format's memory saving (except where the forward's
    backward follows at once: keeping_dequantized_weights). The base gets no gradient.

    The stored tensors in `args` are held on ctx, not passed through save_for_backward: they are the
    layer's own buffers, resident anyway and never written in place (block swap moves their storage
    under the same tensor objects, which ctx sees as a saved tensor would). A saved tensor costs a
    Python pack hook in checkpointing's forward and in its recompute, an unpack in backward and the
    recompute's check; with FP8Linear.forward's other two cuts, a narrow fp8_scaled training step on one
    CPU thread ran x0.94-0.95 (bench/RESULTS.md, issue 29)."""

    @staticmethod
    def forward(ctx, x, bias, dequantize, *args):
        w = dequantize(*args)
        ctx.dequantize, ctx.args = dequantize, args
        ctx.weight = w if _keeps() else None
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = input_gradient(grad_out, _kept_or_dequantized(ctx))
        ctx.weight = None
        return (grad_x, None, None) + (None,) * len(ctx.args)


def dequantized_linear(x: torch.Tensor, bias: torch.Tensor | None, dequantize, *args) -> torch.Tensor:
    """F.linear(x, dequantize(*args), bias) for a frozen low-bit weight: through
    DequantizedLinearFunction where x needs a gradient, else as plain ops (a modulation Linear's
    timestep embedding, sampling), which save nothing and give the same bits. x and bias are in the
    matmul's dtype, the one dequantize returns."""
    outputs = None if torch.compiler.is_compiling() else getattr(_keeping, "outputs", None)
    if outputs is not None:  # in an eager checkpointed block: a per-sample output may be kept (keeping_outputs)
        return outputs(x, args, lambda: _linear(x, bias, dequantize, args))
    return _linear(x, bias, dequantize, args)


def _linear(x: torch.Tensor, bias: torch.Tensor | None, dequantize, args: tuple) -> torch.Tensor:
    if not needs_backward(x):
        return F.linear(x, dequantize(*args), bias)
    return DequantizedLinearFunction.apply(x, bias, dequantize, *args)


def keeping_outputs(outputs):
    """While set, every dequantized_linear call goes through outputs(x, stored, compute) (eager_checkpoint.OutputStash:
    eager checkpointing keeps the outputs of calls whose per-sample input needs no gradient, a modulation Linear's,
    from the forward for the recompute, which then dequantizes no weight for them; stored: the layer's arguments)."""
    return _kept("outputs", outputs)


class DequantizedBmmFunction(torch.autograd.Function):
    """y = bmm(x, dequantize(*args)) (x [e, n, K], the weight [e, K, N]) whose backward dequantizes again
    instead of keeping the weight, for packed frozen weights (a mixture's experts) as DequantizedLinearFunction
    is for Linears: the stored tensors held on ctx, the base given no gradient."""

    @staticmethod
    def forward(ctx, x, dequantize, *args):
        w = dequantize(*args)
        ctx.dequantize, ctx.args = dequantize, args
        ctx.weight = w if _keeps() else None
        return layout_matmul(x, w)

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = _kept_or_dequantized(ctx)
            grad_x = torch.bmm(grad_out.to(w.dtype), w.transpose(1, 2))
        ctx.weight = None
        return (grad_x, None) + (None,) * len(ctx.args)


def dequantized_bmm(x: torch.Tensor, dequantize, *args) -> torch.Tensor:
    """torch.bmm(x, dequantize(*args)) for a frozen packed low-bit weight: through DequantizedBmmFunction where x
    needs a gradient, else as plain ops (the same bits). x in the dtype dequantize returns."""
    if not needs_backward(x):
        return layout_matmul(x, dequantize(*args))
    return DequantizedBmmFunction.apply(x, dequantize, *args)
