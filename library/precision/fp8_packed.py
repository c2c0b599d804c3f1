"""Packed weights in fp8: a module holding [E, K, N] weights used as x @ W[e] (a mixture's experts, all
run as batched matmuls), stored as fp8.py quantizes them (quantize_packed_weight: FP8Linear's codes and
scales per expert, transposed) where the base is fp8.

A module declares its packed weights in the class attribute `packed_weights` (their names, each an
nn.Parameter [E, K, N] until stored in fp8) and reads them only through packed_weight (a weight of some
experts in a dtype) and packed_bmm (x @ W[experts]). prepare_fp8 / FP8LoadConverter find them by that
attribute and call quantize_packed(name, mode): the Parameter becomes the buffers `name` (float8_e4m3fn
codes [E, K, N]) and `name_scale` (bf16 [E, K/64, N] for fp8_scaled, fp32 0-dim for fp8_tensor_scaled,
none for fp8), which model.to(dtype) leaves alone.

Adapters. packed_bmm is the one place a packed weight is applied, so it is where a low-rank adapter of it joins:
`packed_adapters[name]` lists callables adapter(x [e, n, K], out [e, n, N], experts) -> out plus its delta, run in
order after the base's bmm on the same input (networks/lora_packed.py's PackedLoRAModule: two bmm's through its
rank, no weight-sized delta). The base weight is read as it is stored (fp8 or not), so an adapter works on either.

Memory. The experts are frozen (a LoRA of them trains its own factors), so gradients flow to the input only, and
autograd never keeps a dequantized weight: packed_bmm goes through dequantized_bmm (its Function holds the
codes and scales and dequantizes again in backward), and a forward runs the experts in chunks
(expert_chunks) so that one chunk of one weight is dequantized at a time: at most DEQUANTIZED_CHUNK_BYTES
(128 MiB). At the released size of the first family to use it (64 experts, gate_up [2048, 2688] and down
[1344, 2048] each) an expert's gate_up is 11.0 MB in bf16, so chunks of 12 experts (6 chunks): 132 MB
transient for one weight, where the whole dequantized block would be 1.06 GB in bf16 (its fp8 storage
0.54 GB with the scales).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from library.io import CheckpointError
from library.precision.autocast import matmul_input
from library.precision.dequantized_linear import dequantized_bmm
from library.precision.fp8 import (
    FP8_DTYPE, PACKED_SCALE_SUFFIX, SCALE_DTYPE, TENSOR_SCALE_DTYPE, _check_mode, apply_keeping_dtypes,
    dequantize_packed_weight, packed_scale_shape, quantize_packed_weight,
)

DEQUANTIZED_CHUNK_BYTES = 128 * 2**20  # the most one weight's dequantized chunk of experts takes (one expert at least)


class PackedWeights(nn.Module):
    """Base of a module whose `packed_weights` ([E, K, N] Parameters, used as x @ W[e]) may be stored in fp8."""

    packed_weights: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.packed_modes: dict[str, str] = {}  # weight name -> fp8 mode, for the weights stored in fp8
        # weight name -> adapters packed_bmm adds (see the module docstring); a plain dict: no state_dict entries
        self.packed_adapters: dict[str, list] = {}

    def quantize_packed(self, name: str, mode: str) -> None:
        """Store weight `name` in fp8 `mode` from now on: quantized where it is loaded, meta fp8 tensors of the
        right shapes (for a load converter to fill) where it is on `meta`."""
        _check_mode(mode)
        if name not in self.packed_weights:
            raise ValueError(f"{type(self).__name__} has no packed weight {name!r} (it has {self.packed_weights})")
        if name in self.packed_modes:
            raise ValueError(f"{type(self).__name__}.{name} is already stored in {self.packed_modes[name]}")
        w = self._parameters.pop(name)
        if w.is_meta:
            scales = {"fp8": None, "fp8_scaled": (packed_scale_shape(*w.shape), SCALE_DTYPE),
                      "fp8_tensor_scaled": ((), TENSOR_SCALE_DTYPE)}
            codes = torch.empty(w.shape, dtype=FP8_DTYPE, device="meta")
            scale = None if scales[mode] is None else torch.empty(scales[mode][0], dtype=scales[mode][1], device="meta")
        else:
            codes, scale = quantize_packed_weight(w, mode)
        self.register_buffer(name, codes)
        self.register_buffer(name + PACKED_SCALE_SUFFIX, scale)
        self.packed_modes[name] = mode

    def stored_names(self) -> tuple[str, ...]:
        """The tensors holding the fp8 weights: codes and scales (buffers; FSDP makes them frozen Parameters)."""
        return (*self.packed_modes, *(name + PACKED_SCALE_SUFFIX for name in self.packed_modes))

    def packed_scale(self, name: str) -> torch.Tensor | None:
        return getattr(self, name + PACKED_SCALE_SUFFIX, None)  # None: plain fp8 (a None buffer) or high precision

    def packed_weight(self, name: str, dtype: torch.dtype, experts: slice | int = slice(None)) -> torch.Tensor:
        """Weight `name` of `experts` (an index or a slice) in `dtype`: dequantized where it is stored in fp8."""
        w = getattr(self, name)
        if name not in self.packed_modes:
            return w[experts].to(dtype)
        return dequantize_packed_weight(w, self.packed_scale(name), dtype, experts)

    def packed_bmm(self, x: torch.Tensor, name: str, experts: slice = slice(None)) -> torch.Tensor:
        """bmm(x [e, n, K], weight `name` of `experts` [e, K, N]) -> [e, n, N], plus the deltas of the adapters
        in packed_adapters[name] (each given the same x). A high-precision weight is cast to x's dtype (a plain
        bmm); an fp8 one is dequantized in the matmul's dtype (autocast's while it is on, as FP8Linear's), in
        forward and again in backward, and never kept (dequantized_bmm)."""
        if name not in self.packed_modes:
            out = torch.bmm(x, self.packed_weight(name, x.dtype, experts))
        else:
            matmul_x, dtype = matmul_input(x, None)
            out = dequantized_bmm(matmul_x.to(dtype), dequantize_packed_weight, getattr(self, name),
                                  self.packed_scale(name), dtype, experts)
        for adapter in self.packed_adapters.get(name, ()):
            out = adapter(x, out, experts)
        return out

    def expert_chunks(self, dtype: torch.dtype) -> list[slice]:
        """The slices of experts a forward runs together: all of them where no weight is stored in fp8 (the
        weights are resident anyway); else as many as keep one fp8 weight's dequantized chunk (in `dtype`) within
        DEQUANTIZED_CHUNK_BYTES."""
        experts = getattr(self, self.packed_weights[0]).shape[0]
        if not self.packed_modes:
            return [slice(None)]
        per_expert = max(getattr(self, name)[0].numel() for name in self.packed_modes) * dtype.itemsize
        size = max(1, DEQUANTIZED_CHUNK_BYTES // per_expert)
        return [slice(begin, min(begin + size, experts)) for begin in range(0, experts, size)]

    def _apply(self, fn, recurse=True):
        apply = lambda: super(PackedWeights, self)._apply(fn, recurse)  # noqa: E731
        return apply_keeping_dtypes(self, fn, self.stored_names(), apply)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, mode in self.packed_modes.items():
            key = prefix + name
            if key in state_dict and state_dict[key].dtype != FP8_DTYPE:
                raise CheckpointError(f"'{key}': a packed weight stored in {mode} expects {FP8_DTYPE} codes, got "
                                      f"{state_dict[key].dtype}; load high-precision checkpoints through "
                                      f"fp8_load_converter(model, mode)")
            scale = key + PACKED_SCALE_SUFFIX
            if scale in state_dict:  # a load dtype may have widened it; bf16 values round-trip
                dtype = TENSOR_SCALE_DTYPE if mode == "fp8_tensor_scaled" else SCALE_DTYPE
                state_dict[scale] = state_dict[scale].to(dtype)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={self.packed_modes.get(name, 'high precision')}" for name in self.packed_weights)
