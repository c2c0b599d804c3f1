"""fp8 base weights: plain cast ("fp8") and block-scaled ("fp8_scaled") float8_e4m3fn storage with
high-precision compute.

Why two modes (shared/DESIGN.md, "Precision"): e4m3 has 3 mantissa bits, a largest value of 448 and
a smallest normal of 2^-6. A plain cast (what sd-scripts' fp8_base does) puts weights ~N(0, 0.02)
mostly into the subnormal range, where the step is a fixed 2^-9: median relative weight error 3.6%,
and it grows as the weights get smaller. "fp8_scaled" divides each block of 64 input columns by
absmax / 448 first, so every block uses the normal range and the error is the format's floor
(~2% relative) whatever the weight scale. A LoRA trained on a bf16 base then sees a base much
closer to the one it learned on.

Layout of the scaled mode: weight [out, in] float8_e4m3fn, weight_scale [out, in / 64] bfloat16
(per output row when in % 64 != 0: [out, 1]). w ~= weight.view(out, in/64, 64) * scale[..., None].
The scale is bf16, rounded up (never down) from absmax / 448 so no block overflows 448: bf16 keeps the
overhead at 2/64 = 0.031 bytes per weight (fp32 would be 0.0625), and the product of a 4-bit e4m3
mantissa and an 8-bit bf16 mantissa is exact in fp32, so dequantizing straight in bf16 gives the same
bits as dequantizing in fp32 and rounding once.

Third layout, "fp8_tensor_scaled" (read from ComfyUI's scaled fp8 checkpoints, fp8_checkpoints.py):
weight [out, in] float8_e4m3fn and weight_scale a 0-dim float32, dequantized exactly as ComfyUI
does: weight.to(dtype) * weight_scale.to(dtype), both operands cast to the compute dtype first and
the product rounded once in it (so in bf16 the scale is rounded to bf16 before the multiply).

Always kept in high precision (each architecture's FP8Rules.keep, from its spec): embedders,
input/output projections, the final layer, and (not Linear anyway) norms and RoPE, which core.py
computes in fp32.

Packed weights (a mixture's experts: W [E, K, N] used as x @ W[e], K the contraction) are stored as
FP8Linear's weights would be: expert e's W[e] is the Linear weight W[e]^T [N, K] quantized by
quantize_weight, so the codes are float8_e4m3fn [E, K, N] and "fp8_scaled" keeps bf16 scales over
blocks of 64 along K, [E, K/64, N] (per (expert, column) when K % 64 != 0: [E, 1, N]), under the state
dict key `<name>_scale` (ComfyUI's name for a packed weight's scale); "fp8_tensor_scaled" one fp32
scale for the whole tensor. A module declares such weights by a class attribute `packed_weights`
(fp8_packed.PackedWeights, which holds and reads them); prepare_fp8 and FP8LoadConverter find them by it.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch
import torch.nn as nn

from library.io import CheckpointError, CheckpointReader
from library.precision.autocast import matmul_input
from library.precision.dequantized_linear import dequantized_linear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_OVERFLOW = 464.0  # e4m3fn rounds a value below it to at most 448; from it on a plain cast clips (ours: clamp)
FP8_CHECKPOINT_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors dtype names of already-fp8 tensors
SCALE_DTYPE = torch.bfloat16
TENSOR_SCALE_DTYPE = torch.float32  # "fp8_tensor_scaled": one scale per weight, as ComfyUI stores it
BLOCK = 64  # input columns sharing one scale
MODES = ("fp8", "fp8_scaled", "fp8_tensor_scaled")

# Per-block modulation (adaLN) Linears: quantized, as sd-scripts' fp8_base does. They can be a large
# share of a model (over a quarter of the weights in the first family) and fp8 is chosen to save memory; the measurement behind
# the choice is beside the rules of the architecture it was made on (its spec's FP8 comment and
# tests/test_fp8.py::test_modulation_choice_matches_measurement). False keeps each spec's
# `modulation` Linears in high precision too.
QUANTIZE_MODULATION = True


class KeepRules(Protocol):
    """What fp8 needs to know of an architecture (library/models/spec.py FP8Rules): regexes of the
    Linears kept in high precision, and of the modulation Linears that QUANTIZE_MODULATION decides."""

    keep: tuple[str, ...]
    modulation: tuple[str, ...]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"fp8 mode must be one of {MODES}, got {mode!r}")


def _check_rules(rules: KeepRules) -> None:
    if isinstance(rules, str) or not hasattr(rules, "keep"):
        raise TypeError(f"fp8: pass the architecture's keep rules (registry arch_spec(arch).fp8), got {rules!r}")


def is_high_precision(name: str, rules: KeepRules) -> bool:
    """True if the module with qualified name `name` stays in high precision under `rules`."""
    _check_rules(rules)
    patterns = rules.keep if QUANTIZE_MODULATION else (*rules.keep, *rules.modulation)
    return any(re.fullmatch(p, name) for p in patterns)


# ----------------------------------------------------------------------------------------------
# Quantization


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of weight_scale: one scale per 64 input columns, or per output row as a fallback."""
    return (out_features, in_features // BLOCK) if in_features % BLOCK == 0 else (out_features, 1)


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 (positive) -> the smallest bf16 >= x, so dividing by it never pushes a block past 448."""
    y = x.to(torch.bfloat16)
    below = y.float() < x
    # Positive bf16 values are ordered like their bit patterns: +1 on the bits is the next bf16.
    bumped = (y.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(below, bumped, y)


def quantize_weight(w: torch.Tensor, mode: str, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [out, in] (bf16/fp16/fp32) -> (q float8_e4m3fn [out, in], scale bf16 [out, in/64] or None).

    Computed in fp32 from the source values (never from an fp8 tensor). "fp8" is a plain cast,
    clamped to +-448; "fp8_scaled" divides each block by its bf16 scale (absmax / 448 rounded up);
    "fp8_tensor_scaled" divides by one fp32 scale absmax / 448 (ComfyUI's choice), scale 0-dim fp32.
    per_row: "fp8_scaled" with one block per row (scale [out, 1]: the layout fp8 GEMMs take)."""
    _check_mode(mode)
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"quantize_weight: weight is already {w.dtype}; re-quantizing fp8 compounds its error")
    if w.dim() != 2:
        raise ValueError(f"quantize_weight: expected a 2-D Linear weight [out, in], got shape {tuple(w.shape)}")
    w32 = w.detach().float()
    if mode == "fp8":
        return w32.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), None
    if mode == "fp8_tensor_scaled":
        scale = (w32.abs().amax() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # fp32, 0-dim
        return (w32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    out_features, in_features = w.shape
    rows, blocks = (out_features, 1) if per_row else scale_shape(out_features, in_features)
    w32 = w32.reshape(rows, blocks, in_features // blocks)
    # Zero blocks get the tiniest normal scale instead of 0: 0 / tiny = 0, never 0 / 0.
    absmax = w32.abs().amax(-1)  # fp32 [out, blocks]
    scale = round_up_to_bf16((absmax / FP8_MAX).clamp_min(torch.finfo(SCALE_DTYPE).tiny))
    q = (w32 / scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(out_features, in_features), scale


# On the CPU PyTorch converts float8_e4m3fn one element at a time (~4-5 ns each), which made an fp8
# step cost several bf16 steps there. Two codes at a time through a 65,536-entry table of their two
# converted values (256 KiB for 2-byte dtypes, so it stays in L2) is one gather per pair: 3.7x
# faster on a 3072x3072 weight (bench/bench_fp8_dequant.py) and bit-identical, since the table
# holds what .to(dtype) gives for every code. CUDA keeps the native cast (a fused kernel there).
_PAIR_TABLES: dict[torch.dtype, torch.Tensor] = {}
CPU_TABLE = True  # False: the native cast everywhere (bench/bench_fp8_dequant.py compares the two)
PAIR_CHUNK = 1 << 18  # pairs looked up at a time: a 1 MiB int32 index, the table and the chunk stay in L2


def _pair_table(dtype: torch.dtype) -> torch.Tensor:
    """[65536] int32 (2-byte dtypes) or int64 (4-byte): entry i holds the two `dtype` values of the
    two e4m3 codes whose bytes, in memory order, make the uint16 i."""
    table = _PAIR_TABLES.get(dtype)
    if table is None:
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).to(dtype)  # torch's own cast
        pairs = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(-1, 2).long()
        packed = torch.int32 if dtype.itemsize == 2 else torch.int64
        table = _PAIR_TABLES[dtype] = values[pairs].contiguous().view(packed).view(-1)
    return table


def fp8_to(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q.to(dtype), bit for bit, for a float8_e4m3fn tensor: by table on the CPU, natively elsewhere."""
    # Under torch.compile the native cast (inductor fuses it into the dequantizing multiply; the table's
    # storage checks would break the graph).
    usable = (CPU_TABLE and not torch.compiler.is_compiling() and q.device.type == "cpu" and q.dtype == FP8_DTYPE and dtype.itemsize in (2, 4) and dtype.is_floating_point
              and q.dim() > 0 and q.shape[-1] % 2 == 0 and q.is_contiguous() and q.storage_offset() % 2 == 0)
    if not usable:
        return q.to(dtype)
    table, codes = _pair_table(dtype), q.view(torch.uint16).reshape(-1)
    if codes.numel() <= PAIR_CHUNK:
        return table.index_select(0, codes.to(torch.int32)).view(dtype).view(q.shape)
    out = torch.empty(q.shape, dtype=dtype)
    pairs = out.view(-1).view(table.dtype)  # one packed entry per two codes
    # By chunks: index_select wants int32 / int64 indices, which for a whole weight were a transient of 2 bytes
    # an element beside the output (33 MB for a 3072 x 10752 weight), memory a GPU's native cast never takes.
    for begin in range(0, codes.numel(), PAIR_CHUNK):
        index = codes[begin : begin + PAIR_CHUNK].to(torch.int32)
        torch.index_select(table, 0, index, out=pairs[begin : begin + PAIR_CHUNK])
    return out


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """float8 q [out, in] (+ scale) -> weight in `dtype`. Peak memory: one weight in `dtype`.

    Block scales: bf16/fp32 multiply in place in the target dtype (exact products, one rounding);
    other dtypes (fp16, whose range may not hold a tiny scale) go through fp32. A 0-dim (per-tensor,
    ComfyUI) scale: q.to(dtype) * scale.to(dtype) in every dtype, ComfyUI's own order and rounding."""
    if scale is not None and scale.dim() == 0:
        return fp8_to(q, dtype).mul_(scale.to(dtype))
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    w = fp8_to(q, work)  # exact: every e4m3 value is a bf16/fp16/fp32 value
    if scale is not None:
        rows, blocks = scale.shape
        w.view(rows, blocks, -1).mul_(scale.to(work)[..., None])
    return w.to(dtype)


PACKED_SCALE_SUFFIX = "_scale"  # a packed weight's scale: state dict key f"{name}_scale"


def packed_scale_shape(experts: int, k: int, n: int) -> tuple[int, int, int]:
    """Shape of a packed weight's fp8_scaled scale: one per 64 rows of K per (expert, column), or per
    (expert, column) as a fallback: scale_shape(n, k) of each expert's Linear weight W[e]^T, transposed."""
    return (experts, k // BLOCK, n) if k % BLOCK == 0 else (experts, 1, n)


def quantize_packed_weight(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [E, K, N] used as x @ w[e] (bf16/fp16/fp32) -> (codes float8_e4m3fn [E, K, N], scale or None).

    "fp8" / "fp8_scaled": each expert's w[e] exactly as quantize_weight quantizes the Linear weight
    w[e]^T [N, K] (the same codes, transposed; scale bf16 [E, K/64, N], packed_scale_shape), so the
    error is FP8Linear's. "fp8_tensor_scaled": one fp32 scale absmax / 448 for the whole tensor (scale
    0-dim), as ComfyUI stores a packed weight. Expert by expert: the peak is one expert in fp32."""
    _check_mode(mode)
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"quantize_packed_weight: weight is already {w.dtype}; re-quantizing fp8 compounds its error")
    if w.dim() != 3:
        raise ValueError(f"quantize_packed_weight: expected a packed weight [E, K, N], got shape {tuple(w.shape)}")
    codes = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = None
    if mode == "fp8_scaled":
        scale = torch.empty(packed_scale_shape(*w.shape), dtype=SCALE_DTYPE, device=w.device)
    elif mode == "fp8_tensor_scaled":
        scale = (w.detach().abs().amax().float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # fp32, 0-dim
    for e in range(w.shape[0]):
        if mode == "fp8_tensor_scaled":
            codes[e] = (w[e].detach().float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            continue
        q, s = quantize_weight(w[e].T, mode)  # [N, K] codes, [N, K/64] scales
        codes[e] = q.T
        if s is not None:
            scale[e] = s.T
    return codes, scale


def dequantize_packed_weight(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
                             experts: slice | int = slice(None)) -> torch.Tensor:
    """The packed weight of `experts` (an index or a slice of codes [E, K, N]) in `dtype`: [e, K, N] (or
    [K, N] for an index), dequantize_weight's arithmetic (one rounding in bf16 / fp32; a 0-dim scale
    ComfyUI's q.to(dtype) * scale.to(dtype)). Peak memory: those experts' weight in `dtype`."""
    single = isinstance(experts, int)
    if single:
        experts = slice(experts, experts + 1)
    q = codes[experts]
    if scale is not None and scale.dim() == 0:
        w = fp8_to(q, dtype).mul_(scale.to(dtype))
    else:
        work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        w = fp8_to(q, work)  # exact: every e4m3 value is a bf16/fp16/fp32 value
        if scale is not None:
            s = scale[experts]  # [e, blocks, N]
            w.view(s.shape[0], s.shape[1], -1, s.shape[2]).mul_(s.to(work)[:, :, None, :])
        w = w.to(dtype)
    return w[0] if single else w


def stochastic_round_to_fp8(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased stochastic rounding of x (any float dtype, values clamped to +-448) to float8_e4m3fn.

    Each value goes to one of its two e4m3 neighbours, the upper one with probability
    (x - lower) / step, so E[result] = x. Use it when a high-precision result must be stored in
    fp8 (e.g. a LoRA merged into an fp8 checkpoint): round-to-nearest drops every delta smaller
    than half a step."""
    x = x.detach().float().clamp(-FP8_MAX, FP8_MAX)
    _, exponent = torch.frexp(x)  # x = m * 2^exponent, m in [0.5, 1): binade is 2^(exponent - 1)
    # 3 mantissa bits: step 2^(e - 3) in binade e; below the smallest normal 2^-6 the step stays 2^-9.
    step = torch.exp2(((exponent - 1).clamp_min(-6) - 3).float())
    lower = torch.floor(x / step) * step  # exact: division by a power of two
    p_up = (x - lower) / step
    u = torch.rand(x.shape, generator=generator, device=x.device)
    return (lower + step * (u < p_up)).to(FP8_DTYPE)  # both neighbours are exact e4m3 values


# ----------------------------------------------------------------------------------------------
# The layer


def apply_keeping_dtypes(module: nn.Module, fn, names: tuple[str, ...], apply) -> nn.Module:
    """nn.Module._apply for a layer whose stored buffers `names` (codes and their scales) keep their
    dtypes: model.to(bf16) must not turn them into something else; device moves (and to_empty) still
    apply. `apply()` runs the module's own _apply on everything else. A zero-size probe tells what fn
    would do to a dtype."""
    held = {k: module._buffers[k] for k in names if module._buffers.get(k) is not None}
    for k in held:
        module._buffers[k] = None
    try:
        apply()
    finally:
        for k, t in held.items():
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            module._buffers[k] = fn(t) if probe.dtype == t.dtype else t.to(probe.device)
    return module


class FP8Linear(nn.Module):
    """A frozen Linear whose weight is stored as float8_e4m3fn (+ bf16 block scales or one fp32 scale).

    State dict: `weight` (float8_e4m3fn [out, in]), `weight_scale` (bf16 [out, in/64] for
    "fp8_scaled", fp32 0-dim for "fp8_tensor_scaled", absent for "fp8"),
    `bias` (high precision, frozen). The weight and scale are buffers: they never train, and
    `model.to(dtype)` / `.half()` leave their dtypes alone (they still follow device moves).
    forward dequantizes to the input's dtype (the model's compute dtype, or the autocast dtype)
    and runs F.linear: gradients flow to the input (LoRA sits on top), never to the base.
    compute_dtype: None follows the input; a dtype makes the layer cast its input to it.
    """

    backward_saves_weights_only = True  # its autograd Function keeps the stored tensors, never x
    fixed_dtype_buffers = ("weight", "weight_scale")  # model.to(dtype) leaves these dtypes alone

    def __init__(self, in_features: int, out_features: int, bias: bool = True, mode: str = "fp8_scaled",
                 device=None, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        _check_mode(mode)
        self.in_features, self.out_features, self.mode = in_features, out_features, mode
        self.compute_dtype: torch.dtype | None = None
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        scale = {"fp8": None, "fp8_tensor_scaled": torch.ones((), dtype=TENSOR_SCALE_DTYPE, device=device),
                 "fp8_scaled": torch.ones(scale_shape(out_features, in_features), dtype=SCALE_DTYPE, device=device)}
        self.register_buffer("weight_scale", scale[mode])
        b = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        self.bias = b if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str) -> "FP8Linear":
        """Quantize a loaded nn.Linear, or mirror a `meta` one with meta fp8 tensors of the right shape."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, mode, device="meta")
        if w.is_meta:
            layer.weight = torch.empty(w.shape, dtype=FP8_DTYPE, device="meta")
        else:
            layer.weight, layer.weight_scale = quantize_weight(w, mode)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, dtype)

    def input_and_dtype(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """(x in the layer's compute_dtype if set, the dtype the matmul runs in: autocast's or x's)."""
        return matmul_input(x, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, dtype = self.input_and_dtype(x)
        x, bias = x.to(dtype), None if self.bias is None else self.bias.to(dtype)
        # Every operand is in `dtype`, which is autocast's while it is on (matmul_input): autocast casts
        # nothing here, so the matmul runs in exactly that dtype without switching autocast off. The
        # weight is dequantized in forward and, where x needs a gradient, again in backward.
        return dequantized_linear(x, bias, dequantize_weight, self.weight, self.weight_scale, dtype)

    def _apply(self, fn, recurse=True):
        return apply_keeping_dtypes(self, fn, self.fixed_dtype_buffers, lambda: super(FP8Linear, self)._apply(fn, recurse))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        if key in state_dict and state_dict[key].dtype != FP8_DTYPE:
            raise CheckpointError(
                f"'{key}': FP8Linear expects {FP8_DTYPE} codes, got {state_dict[key].dtype}; "
                f"load high-precision checkpoints through fp8_load_converter(model, mode)"
            )
        if prefix + "weight_scale" in state_dict:  # a load dtype may have widened it; bf16 values round-trip
            dtype = TENSOR_SCALE_DTYPE if self.mode == "fp8_tensor_scaled" else SCALE_DTYPE
            state_dict[prefix + "weight_scale"] = state_dict[prefix + "weight_scale"].to(dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, mode={self.mode}"


# ----------------------------------------------------------------------------------------------
# Whole models


def _replace_linears(model: nn.Module, mode: str, rules: KeepRules) -> nn.Module:
    _check_mode(mode)
    _check_rules(rules)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            # Exact nn.Linear only: subclasses (e.g. nn.MultiheadAttention's out_proj) may read .weight directly.
            if type(child) is nn.Linear and not is_high_precision(name, rules):
                setattr(parent, child_name, FP8Linear.from_linear(child, mode))
    return model


def packed_weight_names(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Qualified name -> (module, weight name) of every packed weight of `model`: those its modules name in
    their class attribute `packed_weights` (fp8_packed.PackedWeights), stored in fp8 or not."""
    return {f"{name}.{weight}" if name else weight: (module, weight)
            for name, module in model.named_modules() for weight in getattr(type(module), "packed_weights", ())}


def keeps_packed(name: str, rules: KeepRules) -> bool:
    """True if the packed weight `name` (module.weight) stays in high precision: `rules` name it or its module."""
    return is_high_precision(name, rules) or is_high_precision(name.rpartition(".")[0], rules)


def quantize_packed_weights(model: nn.Module, mode: str, rules: KeepRules) -> nn.Module:
    """Store every packed weight of `model` that `rules` do not keep (and that is not stored already) in `mode`: an
    fp8 mode here, bitsandbytes' nf4 / nf4_dq / int8 (bnb_weights.prepare_bnb); PackedWeights.quantize_packed."""
    for name, (module, weight) in packed_weight_names(model).items():
        if weight not in module.packed_modes and not keeps_packed(name, rules):
            module.quantize_packed(weight, mode)
    return model


def prepare_fp8(model: nn.Module, mode: str, rules: KeepRules, packed: bool = True) -> nn.Module:
    """Replace every nn.Linear that `rules` does not keep in high precision by an FP8Linear, in place, and
    store the packed weights (packed=True; fp8_packed.PackedWeights) that the rules do not keep in fp8.

    On a `meta` model the new layers hold meta fp8 tensors of the right shapes for
    load_streaming(convert=fp8_load_converter(model, mode)) to fill; on a loaded model the
    weights are quantized. Returns the model."""
    _replace_linears(model, mode, rules)
    return quantize_packed_weights(model, mode, rules) if packed else model


def quantize_module(model: nn.Module, mode: str, rules: KeepRules) -> nn.Module:
    """In-memory fp8 conversion of an already loaded high-precision model (tests, diagnostics)."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"quantize_module: '{meta[0]}' is on the meta device; use prepare_fp8 + load_streaming")
    return prepare_fp8(model, mode, rules)


def _refuse_fp8_source(key: str, tensor: torch.Tensor) -> None:
    if tensor.dtype == torch.float8_e5m2:  # a plain e5m2 file (fp8_checkpoints.py): widened, not re-quantized
        raise CheckpointError(f"'{key}' is float8_e5m2: it widens exactly to bf16 but not to the fp8 base asked "
                              f"for; set base_precision = \"bf16\" (fp8_base = false), or give a bf16 checkpoint")
    if tensor.dtype == torch.float8_e4m3fn:
        raise CheckpointError(f"'{key}' is already {tensor.dtype}: re-quantizing fp8 compounds error; "
                              f"give a bf16/fp16/fp32 checkpoint")


class FP8LoadConverter:
    """load_streaming(convert=...) hook: `X.weight` of every FP8Linear X is quantized on the fly
    into {X.weight: fp8, X.weight_scale: bf16}, and every packed weight P stored in fp8 into {P: fp8,
    P_scale: its scale}; all other tensors pass through unchanged.

    keep_dtype(key) is True for those weights, so load_streaming hands them over in the file's
    dtype (quantizing fp32 -> fp8 directly, not fp32 -> bf16 -> fp8)."""

    def __init__(self, model: nn.Module, mode: str | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError("fp8_load_converter(model, mode): pass the model prepared by prepare_fp8")
        layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
        self.quantized = {f"{name}.weight": m.mode for name, m in layers.items()}
        self.packed = {name: module.packed_modes[weight]
                       for name, (module, weight) in packed_weight_names(model).items()
                       if weight in module.packed_modes}  # fmt: skip
        modes = {*self.quantized.values(), *self.packed.values()}
        if mode is not None:
            _check_mode(mode)
            if modes - {mode}:
                raise ValueError(f"fp8_load_converter: model was prepared with {sorted(modes)}, not {mode!r}")

    def keep_dtype(self, key: str) -> bool:
        return key in self.quantized or key in self.packed

    def __call__(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if key in self.packed:
            _refuse_fp8_source(key, tensor)
            q, scale = quantize_packed_weight(tensor, self.packed[key])
            return {key: q} if scale is None else {key: q, key + PACKED_SCALE_SUFFIX: scale}
        if key not in self.quantized:
            return {key: tensor}
        _refuse_fp8_source(key, tensor)
        q, scale = quantize_weight(tensor, self.quantized[key])
        parts = {key: q}
        if scale is not None:
            parts[key[: -len("weight")] + "weight_scale"] = scale
        return parts


def fp8_load_converter(model: nn.Module, mode: str | None = None) -> FP8LoadConverter:
    """The load_streaming convert hook for a model prepared by prepare_fp8 (mode defaults to its own)."""
    return FP8LoadConverter(model, mode)


def refuse_fp8_checkpoint(reader: CheckpointReader, path: str | None = None) -> None:
    """Raise CheckpointError if the checkpoint already stores fp8 tensors (we quantize only once)."""
    fp8 = [k for k in reader.keys() if reader.dtype_name(k) in FP8_CHECKPOINT_DTYPES]
    if fp8:
        raise CheckpointError(
            f"{path or reader.path}: '{fp8[0]}' is stored as {reader.dtype_name(fp8[0])} ({len(fp8)} fp8 tensors): "
            f"widening fp8 weights does not restore them and re-quantizing compounds their rounding error; "
            f"give a bf16/fp16/fp32 checkpoint (fp8 is applied while loading)"
        )


def bytes_per_parameter(model: nn.Module) -> float:
    """Bytes of all parameters and buffers / number of base weight elements (scales excluded: the
    buffers named `weight_scale` or `<packed weight>_scale`)."""
    params, buffers = list(model.parameters()), list(model.named_buffers())
    total = sum(t.numel() * t.element_size() for t in (*params, *(b for _, b in buffers)))
    base = sum(t.numel() for t in params) + sum(b.numel() for n, b in buffers if not n.endswith(PACKED_SCALE_SUFFIX))
    return total / base
