"""fp8 compute (`fp8_compute = true`): the frozen base's fp8 Linears run as real fp8 GEMMs
(torch._scaled_mm), in forward and in the activation-gradient backward; the LoRA path beside them
stays in the compute dtype (bf16). A GPU with fp8 tensor cores runs these GEMMs at about twice its
bf16 rate; the base weights are fp8 already, so only the activations are quantized per call.

The recipe is torchao's "rowwise" float8 recipe for a frozen weight, every operand float8_e4m3fn:
- weight W [N, K] = q * s_w[:, None]: one fp32 scale per output row, the form _scaled_mm's row-wise
  mode multiplies in its epilogue (block scales along K would need one GEMM per block). "fp8" layers
  use their codes with scale 1, "fp8_tensor_scaled" ones their codes with the tensor's scale on
  every row; "fp8_scaled" layers (a scale per 64 input columns) are requantized once, at enable time,
  to a bf16 scale per row (absmax / 448 rounded up, the fp8_scaled layout's [out, 1] form), from
  their dequantized float32 values: same memory, a coarser grid (rowwise_requantization_error).
- activation x [M, K]: e4m3 with one fp32 scale per row (token), absmax / 448, each call in three
  passes over x: the row absmax in x's dtype (exact), x / scale in float32, its cast to e4m3.
- forward: y = (xq @ q^T) * s_x[:, None] * s_w[None, :] in float32 accumulation, rounded once to bf16,
  plus the bias in bf16.
- backward (input gradient only; the base never trains): dx = g @ W = (g * s_w[None, :]) @ q, with
  g * s_w quantized per row to e4m3 like x (plain "fp8" layers, s_w = 1, skip the product), and q as
  a column-major copy (_scaled_mm's second operand must be column-major; the transposed codes live
  only during the call: kept, they would double the base's resident bytes).
- the GEMMs' weight-side fp32 scales (s_w as [1, out], ones [1, in] for the backward) are made once,
  at enable time (and after a state-dict load), as non-persistent buffers: no per-call casts.

Where it runs: the CPU (PyTorch's reference kernels: exact to the recipe, not fast; the tests' oracle
is an explicit float64 product of the same codes; torch 2.13's take per-row scales, 2.11's do not) and
CUDA devices with fp8 tensor cores (compute capability 8.9 and up). Layers whose in- or out-features
are not multiples of 16 (cuBLASLt's fp8 rule), and any call in another compute dtype than bf16, keep
FP8Linear's dequantize-then-matmul path.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn as nn

from library.precision.autocast import autocast_off
from library.precision.fp8 import FP8_DTYPE, FP8_MAX, SCALE_DTYPE, FP8Linear, dequantize_weight, quantize_weight

COMPUTE_DTYPE = torch.bfloat16  # _scaled_mm's row-wise output dtype on CUDA
ALIGN = 16  # in- and out-features must be multiples of this for an fp8 GEMM on CUDA


def fp8_gemm_available(device: torch.device | str) -> bool:
    """True where torch._scaled_mm runs with per-row scales: CUDA devices of compute capability >= 8.9,
    and the CPU where this torch's reference kernel takes them (2.13 does, 2.11 only one scale per
    tensor), which a 16 x 16 call finds out once."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device) >= (8, 9) and _rowwise_scaled_mm_runs(str(device))
    return device.type == "cpu" and _rowwise_scaled_mm_runs("cpu")


@functools.cache
def _rowwise_scaled_mm_runs(device: str) -> bool:
    codes = torch.zeros(16, 16, device=device).to(FP8_DTYPE)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(codes, codes.t(), scale_a=ones, scale_b=ones.t(), out_dtype=COMPUTE_DTYPE)
    except RuntimeError:
        return False
    return True


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, K] (any float dtype) -> (e4m3 codes [M, K], float32 scales [M, 1]), t ~= codes * scales.
    An all-zero row gets the smallest normal scale (its codes are 0). Three passes over t: the row
    absmax in t's dtype (a max of magnitudes: exact, no float32 copy of t), t / scale in float32 (t
    widens inside the division) and the cast to e4m3. No clamp to +-448 between the last two:
    |t| / fl(absmax / 448) <= 448 (1 + 2^-23), which the cast rounds to 448."""
    absmax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True).float()
    scale = (absmax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (t / scale).to(FP8_DTYPE), scale


class _QuantizedInputs:
    """The e4m3 codes and row scales of the last two inputs, keyed by the tensor itself (a weak
    reference) and its version: Linears that read one activation (separate q, k and v projections,
    one stream's calls interleaved with another's) quantize it once, to the same bits. Eager only: a
    compiled graph merges the repeated quantization itself. Holds at most two inputs' codes (1 byte
    per element) past their last call. A write that bypasses the version counter (through x.data, or
    another tensor over x's storage) is not seen: the next call would reuse the old codes; no model
    writes its activations so."""

    SLOTS = 2

    def __init__(self):
        self.entries: list[tuple[weakref.ref, int, torch.Tensor, torch.Tensor]] = []

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., K] -> (codes [M, K], scales [M, 1]), outside autograd (the base gets no gradient)."""
        if torch.compiler.is_compiling() or x.is_inference():  # (an inference tensor has no version)
            return quantize_rows(x.detach().reshape(-1, x.shape[-1]))
        for ref, version, xq, s_x in self.entries:
            if ref() is x and version == x._version:
                return xq, s_x
        xq, s_x = quantize_rows(x.detach().reshape(-1, x.shape[-1]))
        self.entries = [(weakref.ref(x), x._version, xq, s_x)] + self.entries[:self.SLOTS - 1]
        return xq, s_x


quantized_inputs = _QuantizedInputs()


class _RowwiseFP8Matmul(torch.autograd.Function):
    """x [M, K] bf16 @ (q [N, K] e4m3 * s_w [1, N] fp32)^T -> [M, N] bf16, both GEMMs in fp8, from x's
    codes xq and row scales s_x (quantize_rows). Saves only the weight's codes and scales (resident
    anyway), never x: the base gets no gradient. ones [1, K] fp32 is the backward GEMM's weight-side
    scale; unit: s_w is all ones (the product with the gradient is skipped)."""

    @staticmethod
    def forward(ctx, x, xq, s_x, q, s_w, ones, unit):
        ctx.save_for_backward(q, s_w, ones)
        ctx.unit = unit
        return torch._scaled_mm(xq, q.t(), scale_a=s_x, scale_b=s_w, out_dtype=COMPUTE_DTYPE)

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        q, s_w, ones = ctx.saved_tensors
        return (rowwise_fp8_input_gradient(grad_out, q, s_w, ones, ctx.unit),) + (None,) * 6


def rowwise_fp8_input_gradient(grad_out: torch.Tensor, q: torch.Tensor, s_w: torch.Tensor, ones: torch.Tensor,
                               unit: bool) -> torch.Tensor:
    """_RowwiseFP8Matmul's input gradient: [M, N] bf16 -> [M, K] bf16 as an fp8 GEMM of the gradient's
    row codes and the weight's codes."""
    gq, s_g = quantize_rows(grad_out if unit else grad_out * s_w)  # bf16 * fp32: a float32 product
    return torch._scaled_mm(gq, q.t().contiguous().t(), scale_a=s_g, scale_b=ones, out_dtype=COMPUTE_DTYPE)


def rowwise_fp8_linear(x: torch.Tensor, q: torch.Tensor, s_w: torch.Tensor, ones: torch.Tensor, unit: bool,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, q * s_w^T, bias) as fp8 GEMMs (forward and input-gradient backward), in bf16.
    s_w: float32 [1, N]; ones: float32 [1, K] ones; unit: s_w is all ones."""
    xq, s_x = quantized_inputs(x)
    y = _RowwiseFP8Matmul.apply(x.reshape(-1, x.shape[-1]), xq, s_x, q, s_w, ones, unit)
    y = y.reshape(*x.shape[:-1], q.shape[0])
    return y if bias is None else y + bias.to(COMPUTE_DTYPE)


class FP8ComputeLinear(FP8Linear):
    """An FP8Linear whose bf16 calls run as fp8 GEMMs (rowwise_fp8_linear); the same buffers, state
    dict keys and dequantized_weight (merges, DoRA and the planner see an FP8Linear). Made by
    enable_fp8_compute, never built directly. Two non-persistent float32 buffers hold the GEMMs'
    weight-side scales, made once from weight_scale: forward_weight_scale [1, out] (s_w) and
    backward_weight_scale [1, in] (ones)."""

    fixed_dtype_buffers = FP8Linear.fixed_dtype_buffers + ("forward_weight_scale", "backward_weight_scale")

    def make_gemm_scales(self) -> None:
        """The float32 scales the GEMMs take, from the codes' weight_scale: [out, 1] bf16, 0-dim fp32
        or none (fp8: ones); on meta, meta tensors of these shapes."""
        device = self.weight.device
        if self.weight_scale is None:
            s_w = torch.ones(1, self.out_features, dtype=torch.float32, device=device)
        else:
            s_w = self.weight_scale.float().reshape(1, -1).expand(1, self.out_features).contiguous()
        self.register_buffer("forward_weight_scale", s_w, persistent=False)
        ones = torch.ones(1, self.in_features, dtype=torch.float32, device=device)
        self.register_buffer("backward_weight_scale", ones, persistent=False)

    def row_scales(self) -> torch.Tensor:
        """float32 [out]: the scale of each output row of the codes."""
        return self.forward_weight_scale.reshape(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, dtype = self.input_and_dtype(x)
        if dtype != COMPUTE_DTYPE or x.device.type == "meta":
            return super().forward(x)
        with autocast_off(x.device.type):
            return rowwise_fp8_linear(x.to(dtype), self.weight, self.forward_weight_scale, self.backward_weight_scale,
                                      self.weight_scale is None, self.bias)

    def input_gradient(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The input's gradient (in `dtype`) for the gradient of an output computed in `dtype`, as this
        layer's backward computes it: the fp8 GEMM where forward ran one (eager_checkpoint.output_given,
        whose recompute skips the forward GEMM)."""
        if dtype != COMPUTE_DTYPE or grad.device.type == "meta":
            return grad.to(dtype) @ self.dequantized_weight(dtype)  # FP8Linear's DequantizedLinearFunction
        rows = rowwise_fp8_input_gradient(grad.reshape(-1, grad.shape[-1]), self.weight, self.forward_weight_scale,
                                          self.backward_weight_scale, self.weight_scale is None)
        return rows.reshape(*grad.shape[:-1], self.in_features)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.make_gemm_scales()


def rowwise_requantize(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_scaled codes with block scales -> the same layout with one bf16 scale per row ([out, 1]):
    dequantized in float32, absmax / 448 per row rounded up to bf16, quantized to nearest."""
    return quantize_weight(dequantize_weight(q, scale, torch.float32), "fp8_scaled", per_row=True)


def rowwise_requantization_error(q: torch.Tensor, scale: torch.Tensor) -> float:
    """||W_rowwise - W_blocks|| / ||W_blocks|| of one fp8_scaled layer (the precision doctor's figure)."""
    before = dequantize_weight(q, scale, torch.float32).double()
    after = dequantize_weight(*rowwise_requantize(q, scale), torch.float32).double()
    norm = before.norm().item()
    return (after - before).norm().item() / norm if norm else 0.0


def eligible(layer: FP8Linear) -> bool:
    return layer.in_features % ALIGN == 0 and layer.out_features % ALIGN == 0


@torch.no_grad()
def enable_fp8_compute(model: nn.Module) -> int:
    """Turn every eligible FP8Linear of `model` into an FP8ComputeLinear, in place (before LoRA is
    applied: LoRA wraps the layer's forward). fp8_scaled block codes are requantized per row here;
    on `meta` only the scale's shape changes. Returns the number of layers turned."""
    turned = 0
    for layer in model.modules():
        if type(layer) is not FP8Linear or not eligible(layer):
            continue
        if layer.mode == "fp8_scaled" and layer.weight_scale.shape[1] != 1:
            if layer.weight.is_meta:
                layer.weight_scale = torch.empty(layer.out_features, 1, dtype=SCALE_DTYPE, device="meta")
            else:
                layer.weight, layer.weight_scale = rowwise_requantize(layer.weight, layer.weight_scale)
        layer.__class__ = FP8ComputeLinear
        layer.make_gemm_scales()
        turned += 1
    return turned
