"""nf4 and int8 base weights through bitsandbytes: the frozen transformer's Linears stored in 4 or
8 bits (diffusers' QLoRA recipe, OneTrainer, SimpleTuner), dequantized per forward to the compute
dtype, so a LoRA trains over the base an 8-12 GB card can hold.

Formats (base_precision; bytes per weight on a Linear of 3072 inputs):
  nf4     QLoRA's 4-bit NormalFloat: two codes per byte, blocks of 64 consecutive weights (of the
          row-major weight, so along `in`) with one float32 absmax each: 0.5 + 4/64 = 0.5625.
  nf4_dq  nf4 with QLoRA's double quantization: the absmaxes minus their float32 mean stored as
          uint8 codes of bitsandbytes' dynamic map, in blocks of 256 with one float32 scale each:
          0.5 + 1/64 + 4/(64 * 256) = 0.5159 (+ 4 bytes per layer).
  int8    row-wise absmax int8, weight-only: one float32 absmax per output row: 1 + 4/3072 = 1.0013.

Everything numeric is bitsandbytes' own functional API (0.50; its CPU backend runs all of it):
quantize_4bit / dequantize_4bit (nf4: float32 code[q] * absmax, rounded once to the compute dtype;
the CPU kernel writing bf16 gives exactly its float32 result rounded once, tests/test_bnb_weights.py),
int8_vectorwise_quant / int8_vectorwise_dequant (float32 q * absmax * (1/127), then one cast to the
compute dtype). Quantization reads the source weight in float32 (a bf16 file's values exactly).

Why int8 is weight-only and not LLM.int8() (bitsandbytes' Linear8bitLt with its outlier matmul):
LLM.int8() also quantizes the activations per row and runs an int8 matmul, keeping the input columns
with an outlier above a threshold (6.0) in fp16. For a frozen base under a LoRA that buys nothing and
costs three things: (1) the base's output gains activation-quantization noise the deployed bf16 /
int8-weight base does not have, and which columns count as outliers changes with every batch, so the
LoRA trains against a moving base; (2) the input gradient the LoRA needs is a float matmul with the
dequantized weight anyway (bitsandbytes' own backward does that); (3) the int8 matmul is CUDA-only
(on CPU only with AVX-512), so CPU and GPU would compute different bases. Weight-only int8 is
x @ dequant(W)^T in the compute dtype: the same numbers everywhere, exactly testable, and the memory
saving (1 byte per weight) is the same.

The layers keep the packed bytes and their statistics as buffers: `.to(device)` and block swap move
them, `model.to(bf16)` leaves their dtypes alone, they never train. Backward re-dequantizes (as
fp8.py's FP8Linear does) so no dequantized copy lives between forward and backward. Which Linears
are quantized: the architecture's fp8 keep rules (its spec's FP8Rules), the same as fp8.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from library.io import CheckpointError
from library.precision.autocast import autocast_off, matmul_input
from library.precision.dequantized_linear import dequantized_linear
from library.precision.fp8 import (
    KeepRules, apply_keeping_dtypes, is_high_precision, packed_weight_names, quantize_packed_weights,
)

MODES = ("nf4", "nf4_dq", "int8")
NF4_BLOCK = 64  # weights per absmax (QLoRA's and bitsandbytes' default)
NESTED_BLOCK = 256  # absmaxes per scale under double quantization (what quantize_4bit uses)
INT8_MAX = 127
# Keys of bitsandbytes' own serialized layers (Params4bit / Int8Params state dicts: the
# single-file "bnb-nf4" releases, diffusers' BitsAndBytesConfig folders), a layout not read (refuse_serialized).
SERIALIZED = {".quant_state.bitsandbytes__nf4": "nf4", ".quant_state.bitsandbytes__fp4": "fp4", ".SCB": "int8"}


def _bnb():
    """bitsandbytes.functional, imported on first use (it loads its native library)."""
    import bitsandbytes.functional as bnbf

    return bnbf


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"bitsandbytes base precision must be one of {MODES}, got {mode!r}")


LOADING_ADVICE = 'give the bf16 checkpoint (base_precision = "nf4" or "int8" quantizes it while loading)'


def refuse_serialized(keys, where: str, advice: str = LOADING_ADVICE) -> None:
    """CheckpointError naming the first key that shows a checkpoint stored by bitsandbytes itself:
    its packed layers are not read (our nf4 / int8 quantize a high-precision file while loading).
    `advice` ends the line: the default is for training and generating; a tool reading bases gives its own."""
    for key in keys:
        kind = next((k for suffix, k in SERIALIZED.items() if key.endswith(suffix)), None)
        if kind:
            raise CheckpointError(f"{where}: '{key}' shows a checkpoint stored by bitsandbytes ({kind}), which is not "
                                  f"read; {advice}")


# ----------------------------------------------------------------------------------------------
# Quantization and dequantization (bitsandbytes' functional API)


def nf4_shapes(out_features: int, in_features: int, double_quant: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored tensors of an nf4 weight: name -> (shape, dtype), as quantize_4bit returns them."""
    n = out_features * in_features
    blocks = -(-n // NF4_BLOCK)
    shapes = {"weight": (((n + 1) // 2, 1), torch.uint8)}
    if not double_quant:
        return {**shapes, "weight_absmax": ((blocks,), torch.float32)}
    return {**shapes, "weight_absmax": ((blocks,), torch.uint8), "weight_absmax_scale": ((-(-blocks // NESTED_BLOCK),), torch.float32),
            "weight_absmax_offset": ((), torch.float32)}


def int8_shapes(out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {"weight": ((out_features, in_features), torch.int8), "weight_absmax": ((out_features,), torch.float32)}


def quantize_nf4(w: torch.Tensor, double_quant: bool = False) -> dict[str, torch.Tensor]:
    """w [out, in] (any float dtype, read as float32) -> the stored nf4 tensors (nf4_shapes)."""
    _check_weight(w)
    packed, state = _bnb().quantize_4bit(w.detach().float(), blocksize=NF4_BLOCK, quant_type="nf4",
                                         compress_statistics=double_quant)
    if not double_quant:
        return {"weight": packed, "weight_absmax": state.absmax}
    if state.state2.blocksize != NESTED_BLOCK or not torch.equal(state.state2.code, _dynamic_map(w.device)):
        raise RuntimeError("bitsandbytes' double quantization changed (block or map); nf4_dq cannot be stored")
    return {"weight": packed, "weight_absmax": state.absmax, "weight_absmax_scale": state.state2.absmax,
            "weight_absmax_offset": state.offset.reshape(())}


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w [out, in] -> {"weight": int8 [out, in], "weight_absmax": float32 [out]}: bitsandbytes'
    int8_vectorwise_quant on the float32 weight (so q = round(w * 127 / absmax) is computed in
    float32), without outlier columns. An all-zero row has absmax 0, where bitsandbytes divides by
    zero: its codes are set to 0 (dequantized 0 * 0 = 0, the row's value)."""
    _check_weight(w)
    q, absmax, _ = _bnb().int8_vectorwise_quant(w.detach().float(), threshold=0.0)
    q[absmax == 0] = 0
    return {"weight": q, "weight_absmax": absmax}


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"bitsandbytes quantization: expected a 2-D Linear weight [out, in], got shape {tuple(w.shape)}")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"bitsandbytes quantization: weight is {w.dtype}; give bf16/fp16/fp32 weights "
                         f"(re-quantizing an fp8 weight compounds its error)")


_DYNAMIC_MAPS: dict[torch.device, torch.Tensor] = {}


def _dynamic_map(device) -> torch.Tensor:
    """bitsandbytes' signed dynamic map (the codes of double-quantized absmaxes), float32 [256]."""
    device = torch.device(device)
    if device not in _DYNAMIC_MAPS:
        _DYNAMIC_MAPS[device] = _bnb().create_dynamic_map(signed=True).to(device)
    return _DYNAMIC_MAPS[device]


def dequantize_nf4(shape, dtype: torch.dtype, weight: torch.Tensor, absmax: torch.Tensor,
                   absmax_scale: torch.Tensor | None = None, absmax_offset: torch.Tensor | None = None) -> torch.Tensor:
    """The [out, in] weight in `dtype` (bf16 / fp16 / fp32) through bitsandbytes' dequantize_4bit.
    Double quantization: the absmaxes are first dequantized by bitsandbytes (float32) and offset."""
    QuantState = _bnb().QuantState
    nested = {}
    if absmax_scale is not None:
        state2 = QuantState(absmax=absmax_scale, code=_dynamic_map(absmax.device), blocksize=NESTED_BLOCK, dtype=torch.float32)
        nested = {"offset": absmax_offset, "state2": state2}
    # quantize_4bit (and the CUDA kernel) count blocks of 64 over the flat weight; bitsandbytes 0.50's CPU kernel counts
    # them per row (ceil(in / 64) a row), so a row off the block (in % 64 != 0: a packed expert [K, N] with N = 96)
    # read other blocks' absmaxes: 0.26 relative error on a [12, 96] weight instead of 0.093. Such a weight is read
    # as one flat row, where both counts agree (tests/test_bnb_weights.py, QLoRA's table).
    flat = tuple(shape) if shape[-1] % NF4_BLOCK == 0 else (1, torch.Size(shape).numel())
    state = QuantState(absmax=absmax, shape=torch.Size(flat), dtype=dtype, blocksize=NF4_BLOCK, quant_type="nf4",
                       **nested)
    return _bnb().dequantize_4bit(weight, state).reshape(shape)


INT8_STEP = 7.874015718698502e-3  # int8_vectorwise_dequant's factor (1 / 127 as bitsandbytes writes it)


def dequantize_int8(shape, dtype: torch.dtype, weight: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """The weight in `dtype`: bitsandbytes' int8_vectorwise_dequant (float32), cast once."""
    return _bnb().int8_vectorwise_dequant(weight, absmax).to(dtype)


# ----------------------------------------------------------------------------------------------
# Packed weights (fp8_packed.PackedWeights: a mixture's experts, W [E, K, N] used as x @ W[e], K contracted)


def packed_shapes(experts: int, k: int, n: int, mode: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stored tensors of a packed weight [E, K, N] in `mode`: suffix of the weight's name ("": the codes) ->
    (shape, dtype), every one with the experts on its first axis (chunks and FSDP slice them by expert).

    nf4 / nf4_dq: each expert's W[e] as stored, [K, N] row-major, quantized as quantize_4bit quantizes a Linear
    weight: blocks of 64 consecutive weights (along N). Codes [E, K N / 2] uint8, absmax [E, K N / 64] float32
    (nf4_dq: uint8 codes, float32 [E, blocks / 256] scales and one float32 offset per expert): 0.5625 / 0.516
    bytes a weight, as a Linear's. A block of 64 weights has one absmax along either axis; this one reads W[e]
    with no transpose, when quantizing and on every dequantization.
    int8: codes int8 [E, K, N] (W[e]'s layout), absmax [E, N] float32: one absmax per output feature n over the
    whole contraction K, the axis of Int8Linear holding expert e (its weight W[e]^T [N, K], one absmax a row).
    That axis so the codes and absmaxes are Int8Linear's of W[e]^T (the same error, tested equal), and because a
    scale per output factors out of the contraction, x @ (q[:, n] s[n]) = (x @ q[:, n]) s[n], as an int8 GEMM
    needs (bitsandbytes' int8 matmul takes the weight's stats per output); one per row k scales inputs instead.
    1 + 4 / K bytes a weight (1.002 for K = 2048)."""
    _check_mode(mode)
    if mode == "int8":
        return {"": ((experts, k, n), torch.int8), "_absmax": ((experts, n), torch.float32)}
    per_expert = nf4_shapes(k, n, double_quant=mode == "nf4_dq")  # the codes (n/2, 1) flatten to one axis
    return {name.removeprefix("weight"): ((experts, torch.Size(shape).numel()) if shape else (experts,), dtype)
            for name, (shape, dtype) in per_expert.items()}


def quantize_packed(w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """w [E, K, N] (bf16/fp16/fp32, read as float32) -> its stored tensors by suffix (packed_shapes): expert by
    expert through quantize_nf4 (W[e]) / quantize_int8 (W[e]^T, Int8Linear's weight). Peak: one expert in float32."""
    _check_mode(mode)
    if w.dim() != 3:
        raise ValueError(f"bitsandbytes quantization: expected a packed weight [E, K, N], got shape {tuple(w.shape)}")
    stored = {suffix: torch.empty(shape, dtype=dtype, device=w.device)
              for suffix, (shape, dtype) in packed_shapes(*w.shape, mode).items()}
    for e in range(w.shape[0]):
        if mode == "int8":
            parts = quantize_int8(w[e].T)
            parts["weight"] = parts["weight"].T  # [N, K] -> W[e]'s layout [K, N]
        else:
            parts = quantize_nf4(w[e], double_quant=mode == "nf4_dq")
        for name, t in parts.items():
            target = stored[name.removeprefix("weight")][e]
            target.copy_(t.reshape(target.shape))
    return stored


def dequantize_packed(mode: str, shape: tuple[int, int, int], dtype: torch.dtype, experts: slice | int,
                      *stored: torch.Tensor) -> torch.Tensor:
    """The packed weight of `experts` (an index or a slice) in `dtype` from its stored tensors (packed_shapes'
    order): [e, K, N] ([K, N] for an index), each expert through dequantize_nf4 / dequantize_int8 (bitsandbytes'
    own dequantization, rounded once to `dtype`). Peak: those experts' weight in `dtype` and one expert's transient."""
    _, k, n = shape
    if isinstance(experts, int):
        return _dequantize_expert(mode, k, n, dtype, [t[experts] for t in stored])
    indices = range(shape[0])[experts]
    out = torch.empty((len(indices), k, n), dtype=dtype, device=stored[0].device)
    for i, e in enumerate(indices):
        out[i] = _dequantize_expert(mode, k, n, dtype, [t[e] for t in stored])
    return out


def _dequantize_expert(mode: str, k: int, n: int, dtype: torch.dtype, stored: list[torch.Tensor]) -> torch.Tensor:
    if mode == "int8":  # int8_vectorwise_dequant of Int8Linear's W[e]^T [N, K] (q * absmax[n], then * INT8_STEP,
        # float32), computed in W[e]'s own layout [K, N]: the same products bit for bit, without reading the codes
        # through a transpose and copying the result back (a 12-expert chunk x0.76-0.79 on the CPU: bench/RESULTS.md)
        codes, absmax = stored
        return (codes * absmax).mul_(INT8_STEP).to(dtype)
    codes, *statistics = stored
    return dequantize_nf4((k, n), dtype, codes.reshape(-1, 1), *statistics)


# ----------------------------------------------------------------------------------------------
# The layers


class _BnbLinear(nn.Module):
    """A frozen Linear whose weight is stored in a bitsandbytes format (NF4Linear, Int8Linear).

    State dict: the stored tensors (`weight` and its statistics, buffers of the format's shapes and
    dtypes) and `bias` (high precision, frozen). forward dequantizes to the input's dtype (or the
    autocast dtype) and runs F.linear: gradients reach the input (a LoRA sits on top), never the
    base. compute_dtype: None follows the input; a dtype makes the layer cast its input to it."""

    backward_saves_weights_only = True  # its autograd Function keeps the stored tensors, never x

    mode: str

    def __init__(self, in_features: int, out_features: int, bias: bool, stored: dict, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype: torch.dtype | None = None
        self.stored_names = tuple(stored)
        for name, (shape, dtype) in stored.items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device))
        b = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        self.bias = b if bias else None

    def _dequantizer(self, dtype: torch.dtype):
        """f(*stored) -> the weight in `dtype` (no tensor is held: block swap reloads the stored ones)."""
        raise NotImplementedError

    def _stored(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.stored_names]

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self._dequantizer(dtype)(*self._stored())

    def load_quantized(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.stored_names:
            setattr(self, name, tensors[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, dtype = matmul_input(x, self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        x = x.to(dtype)
        with autocast_off(x.device.type):  # the matmul runs in exactly `dtype`
            return dequantized_linear(x, bias, self._dequantizer(dtype), *self._stored())

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtypes(self, fn, self.stored_names, lambda: super(_BnbLinear, self)._apply(fn, recurse))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in self.stored_names:
            key, want = prefix + name, self._buffers[name].dtype
            if key in state_dict and state_dict[key].dtype != want:
                raise CheckpointError(f"'{key}': {type(self).__name__} ({self.mode}) expects {want}, got "
                                      f"{state_dict[key].dtype}; load high-precision checkpoints through bnb_load_converter")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, mode={self.mode}"


class NF4Linear(_BnbLinear):
    """nf4 (double_quant=False) or nf4_dq storage: the buffers of nf4_shapes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, double_quant: bool = False,
                 device=None, bias_dtype: torch.dtype = torch.float32):
        self.mode = "nf4_dq" if double_quant else "nf4"
        super().__init__(in_features, out_features, bias, nf4_shapes(out_features, in_features, double_quant),
                         device, bias_dtype)

    def _dequantizer(self, dtype):
        return partial(dequantize_nf4, (self.out_features, self.in_features), dtype)


class Int8Linear(_BnbLinear):
    """Row-wise absmax int8 storage: `weight` int8 [out, in], `weight_absmax` float32 [out]."""

    mode = "int8"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 bias_dtype: torch.dtype = torch.float32):
        super().__init__(in_features, out_features, bias, int8_shapes(out_features, in_features), device, bias_dtype)

    def _dequantizer(self, dtype):
        return partial(dequantize_int8, (self.out_features, self.in_features), dtype)


def quantize(w: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """The stored tensors of `w` in `mode` (nf4 / nf4_dq / int8), by buffer name."""
    _check_mode(mode)
    return quantize_int8(w) if mode == "int8" else quantize_nf4(w, double_quant=mode == "nf4_dq")


def empty_layer(in_features: int, out_features: int, bias: bool, mode: str, device=None) -> _BnbLinear:
    _check_mode(mode)
    if mode == "int8":
        return Int8Linear(in_features, out_features, bias, device=device)
    return NF4Linear(in_features, out_features, bias, double_quant=mode == "nf4_dq", device=device)


def from_linear(linear: nn.Linear, mode: str) -> _BnbLinear:
    """Quantize a loaded nn.Linear, or mirror a `meta` one with meta tensors of the stored shapes."""
    layer = empty_layer(linear.in_features, linear.out_features, linear.bias is not None, mode, device="meta")
    if not linear.weight.is_meta:
        layer.load_quantized(quantize(linear.weight, mode))
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return layer


# ----------------------------------------------------------------------------------------------
# Whole models


def prepare_bnb(model: nn.Module, mode: str, rules: KeepRules) -> nn.Module:
    """Replace every nn.Linear that `rules` (the architecture's fp8 keep rules) does not keep in high
    precision by an NF4Linear / Int8Linear, and store the packed weights the rules do not keep (a mixture's
    experts, fp8_packed.PackedWeights) in `mode` too (packed_shapes), in place. On a `meta` model the layers
    hold meta tensors for load_streaming(convert=bnb_load_converter(model)) to fill; on a loaded model the
    weights are quantized here. Returns the model."""
    _check_mode(mode)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            # Exact nn.Linear only: subclasses (e.g. nn.MultiheadAttention's out_proj) may read .weight directly.
            if type(child) is nn.Linear and not is_high_precision(name, rules):
                setattr(parent, child_name, from_linear(child, mode))
    return quantize_packed_weights(model, mode, rules)


class BnbLoadConverter:
    """load_streaming(convert=...) hook: `X.weight` of every NF4Linear / Int8Linear X is quantized as
    it is read into X's stored tensors, and every packed weight P stored in nf4 / int8 into P and its
    statistics (packed_shapes); all other tensors pass through. keep_dtype(key) is True for
    those weights, so they arrive in the file's dtype (quantized from it, never via a narrower cast).
    Peak memory: the quantized model so far plus one weight in float32."""

    def __init__(self, model: nn.Module):
        if not isinstance(model, nn.Module):
            raise TypeError("bnb_load_converter(model): pass the model prepared by prepare_bnb")
        self.modes = {f"{name}.weight": m.mode for name, m in model.named_modules() if isinstance(m, _BnbLinear)}
        self.packed = {name: module.packed_modes[weight]
                       for name, (module, weight) in packed_weight_names(model).items()
                       if module.packed_modes.get(weight) in MODES}  # fmt: skip

    def keep_dtype(self, key: str) -> bool:
        return key in self.modes or key in self.packed

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        mode = self.modes.get(key) or self.packed.get(key)
        if mode is None:
            return {key: tensor}
        if not tensor.is_floating_point() or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"'{key}' is {tensor.dtype}: {mode} quantizes bf16/fp16/fp32 weights "
                                  f"(re-quantizing a quantized weight compounds its error); give a bf16/fp16/fp32 checkpoint")
        if key in self.packed:
            return {key + suffix: t for suffix, t in quantize_packed(tensor, mode).items()}
        stem = key[: -len("weight")]
        return {stem + name: t for name, t in quantize(tensor, mode).items()}


def bnb_load_converter(model: nn.Module) -> BnbLoadConverter:
    """The load_streaming convert hook for a model prepared by prepare_bnb."""
    return BnbLoadConverter(model)


def bytes_per_weight(mode: str, out_features: int = 3072, in_features: int = 3072) -> float:
    """Stored bytes (codes and statistics) per weight of an [out, in] Linear in `mode`."""
    _check_mode(mode)
    shapes = int8_shapes(out_features, in_features) if mode == "int8" else nf4_shapes(out_features, in_features, mode == "nf4_dq")
    total = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in shapes.values())
    return total / (out_features * in_features)
