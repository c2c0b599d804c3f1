"""Packed weights in fp8 or in bitsandbytes' formats: a module holding [E, K, N] weights used as x @ W[e] (a
mixture's experts, all run as batched matmuls), stored as fp8.py quantizes them where the base is fp8
(quantize_packed_weight: FP8Linear's codes and scales per expert, transposed) and as bnb_weights.py does where it
is nf4 / nf4_dq / int8 (quantize_packed: each expert as bitsandbytes quantizes a Linear weight).

A module declares its packed weights in the class attribute `packed_weights` (their names, each an
nn.Parameter [E, K, N] until stored quantized) and reads them only through packed_weight (a weight of some
experts in a dtype) and packed_bmm (x @ W[experts]). prepare_fp8 / FP8LoadConverter and prepare_bnb /
BnbLoadConverter find them by that attribute and call quantize_packed(name, mode): the Parameter becomes the
buffers `name` (the codes) and its statistics, which model.to(dtype) leaves alone. fp8: float8_e4m3fn codes
[E, K, N] and `name_scale` (bf16 [E, K/64, N] for fp8_scaled, fp32 0-dim for fp8_tensor_scaled, none for fp8).
nf4 / nf4_dq: uint8 codes [E, K N / 2], `name_absmax` (and nf4_dq's `name_absmax_scale` / `name_absmax_offset`);
int8: int8 codes [E, K, N] and `name_absmax` [E, N] (bnb_weights.packed_shapes says why those axes).

Adapters. packed_bmm is the one place a packed weight is applied, so it is where a low-rank adapter of it joins:
`packed_adapters[name]` lists callables adapter(x [e, n, K], out [e, n, N], experts) -> out plus its delta, run in
order after the base's bmm on the same input (networks/lora_packed.py's PackedLoRAModule: two bmm's through its
rank, no weight-sized delta). The base weight is read as it is stored (quantized or not), so an adapter works on
any storage.

Memory. The experts are frozen (a LoRA of them trains its own factors), so gradients flow to the input only, and
autograd never keeps a dequantized weight: packed_bmm goes through dequantized_bmm (its Function holds the
codes and scales and dequantizes again in backward), and a forward runs the experts in chunks
(expert_chunks) so that one chunk of one weight is dequantized at a time: at most DEQUANTIZED_CHUNK_BYTES
(128 MiB). At the released size of the first family to use it (64 experts, gate_up [2048, 2688] and down
[1344, 2048] each) an expert's gate_up is 11.0 MB in bf16, so chunks of 12 experts (6 chunks): 132 MB
transient for one weight, where the whole dequantized block would be 1.06 GB in bf16 (its fp8 storage
0.54 GB with the scales, its nf4 0.30 GB).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from library.io import CheckpointError
from library.precision import bnb_weights as bnb
from library.precision.autocast import matmul_input
from library.precision.dequantized_linear import dequantized_bmm
from library.precision.fp8 import (
    FP8_DTYPE, PACKED_SCALE_SUFFIX, SCALE_DTYPE, TENSOR_SCALE_DTYPE, apply_keeping_dtypes, dequantize_packed_weight,
    packed_scale_shape, quantize_packed_weight,
)
from library.precision.fp8 import MODES as FP8_MODES

DEQUANTIZED_CHUNK_BYTES = 128 * 2**20  # the most one weight's dequantized chunk of experts takes (one expert at least)


class PackedWeights(nn.Module):
    """Base of a module whose `packed_weights` ([E, K, N] Parameters, used as x @ W[e]) may be stored in fp8 or in
    bitsandbytes' nf4 / nf4_dq / int8."""

    packed_weights: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self.packed_modes: dict[str, str] = {}  # weight name -> its storage mode, for the weights stored quantized
        self.packed_stored: dict[str, tuple[str, ...]] = {}  # weight name -> its buffers (codes first, statistics)
        self.packed_shapes: dict[str, torch.Size] = {}  # weight name -> [E, K, N] of a weight stored quantized
        # weight name -> adapters packed_bmm adds (see the module docstring); a plain dict: no state_dict entries
        self.packed_adapters: dict[str, list] = {}

    def quantize_packed(self, name: str, mode: str) -> None:
        """Store weight `name` in `mode` (fp8.MODES or bnb_weights.MODES) from now on: quantized where it is
        loaded, meta tensors of the stored shapes and dtypes (for a load converter to fill) where it is on `meta`."""
        if mode not in (*FP8_MODES, *bnb.MODES):
            raise ValueError(f"a packed weight is stored in one of {(*FP8_MODES, *bnb.MODES)}, got {mode!r}")
        if name not in self.packed_weights:
            raise ValueError(f"{type(self).__name__} has no packed weight {name!r} (it has {self.packed_weights})")
        if name in self.packed_modes:
            raise ValueError(f"{type(self).__name__}.{name} is already stored in {self.packed_modes[name]}")
        w = self._parameters.pop(name)
        if mode in bnb.MODES:
            shapes = bnb.packed_shapes(*w.shape, mode)
            stored = ({suffix: torch.empty(shape, dtype=dtype, device="meta")
                       for suffix, (shape, dtype) in shapes.items()} if w.is_meta else bnb.quantize_packed(w, mode))
        elif w.is_meta:
            scales = {"fp8": None, "fp8_scaled": (packed_scale_shape(*w.shape), SCALE_DTYPE),
                      "fp8_tensor_scaled": ((), TENSOR_SCALE_DTYPE)}
            scale = None if scales[mode] is None else torch.empty(scales[mode][0], dtype=scales[mode][1], device="meta")
            stored = {"": torch.empty(w.shape, dtype=FP8_DTYPE, device="meta"), PACKED_SCALE_SUFFIX: scale}
        else:
            stored = dict(zip(("", PACKED_SCALE_SUFFIX), quantize_packed_weight(w, mode)))
        for suffix, tensor in stored.items():
            self.register_buffer(name + suffix, tensor)
        self.packed_modes[name], self.packed_shapes[name] = mode, w.shape
        self.packed_stored[name] = tuple(name + suffix for suffix in stored)

    def stored_names(self) -> tuple[str, ...]:
        """The tensors holding the quantized weights: codes and their statistics (buffers; FSDP makes them frozen
        Parameters)."""
        return tuple(buffer for name in self.packed_modes for buffer in self.packed_stored[name])

    def packed_shape(self, name: str) -> torch.Size:
        """[E, K, N] of weight `name`, however it is stored (nf4 codes are [E, K N / 2])."""
        return self.packed_shapes[name] if name in self.packed_modes else getattr(self, name).shape

    def packed_scale(self, name: str) -> torch.Tensor | None:
        return getattr(self, name + PACKED_SCALE_SUFFIX, None)  # None: plain fp8 (a None buffer) or high precision

    def _dequantizer(self, name: str, dtype: torch.dtype, experts: slice | int) -> tuple:
        """(dequantize, args) of a quantized weight `name`: dequantize(*args) is its `experts` in `dtype`."""
        mode = self.packed_modes[name]
        if mode in bnb.MODES:
            stored = [getattr(self, buffer) for buffer in self.packed_stored[name]]
            return partial(bnb.dequantize_packed, mode, tuple(self.packed_shapes[name]), dtype, experts), stored
        return dequantize_packed_weight, (getattr(self, name), self.packed_scale(name), dtype, experts)

    def packed_weight(self, name: str, dtype: torch.dtype, experts: slice | int = slice(None)) -> torch.Tensor:
        """Weight `name` of `experts` (an index or a slice) in `dtype`: dequantized where it is stored quantized."""
        if name not in self.packed_modes:
            return getattr(self, name)[experts].to(dtype)
        dequantize, args = self._dequantizer(name, dtype, experts)
        return dequantize(*args)

    def packed_bmm(self, x: torch.Tensor, name: str, experts: slice = slice(None)) -> torch.Tensor:
        """bmm(x [e, n, K], weight `name` of `experts` [e, K, N]) -> [e, n, N], plus the deltas of the adapters
        in packed_adapters[name] (each given the same x). A high-precision weight is cast to x's dtype (a plain
        bmm); a quantized one is dequantized in the matmul's dtype (autocast's while it is on, as FP8Linear's), in
        forward and again in backward, and never kept (dequantized_bmm)."""
        if name not in self.packed_modes:
            out = torch.bmm(x, self.packed_weight(name, x.dtype, experts))
        else:
            matmul_x, dtype = matmul_input(x, None)
            dequantize, args = self._dequantizer(name, dtype, experts)
            out = dequantized_bmm(matmul_x.to(dtype), dequantize, *args)
        for adapter in self.packed_adapters.get(name, ()):
            out = adapter(x, out, experts)
        return out

    def expert_chunks(self, dtype: torch.dtype) -> list[slice]:
        """The slices of experts a forward runs together: all of them where no weight is stored quantized (the
        weights are resident anyway); else as many as keep one quantized weight's dequantized chunk (in `dtype`)
        within DEQUANTIZED_CHUNK_BYTES."""
        experts = self.packed_shape(self.packed_weights[0])[0]
        if not self.packed_modes:
            return [slice(None)]
        per_expert = max(self.packed_shape(name)[1:].numel() for name in self.packed_modes) * dtype.itemsize
        size = max(1, DEQUANTIZED_CHUNK_BYTES // per_expert)
        return [slice(begin, min(begin + size, experts)) for begin in range(0, experts, size)]

    def _apply(self, fn, recurse=True):
        apply = lambda: super(PackedWeights, self)._apply(fn, recurse)  # noqa: E731
        return apply_keeping_dtypes(self, fn, self.stored_names(), apply)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, mode in self.packed_modes.items():
            key = prefix + name
            if mode in bnb.MODES:
                _check_stored_dtypes(self, state_dict, prefix, name, mode)
                continue
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


def _check_stored_dtypes(module: PackedWeights, state_dict, prefix: str, name: str, mode: str) -> None:
    """One CheckpointError line where a stored tensor of weight `name` (nf4 / int8) is not of its buffer's dtype."""
    for buffer in module.packed_stored[name]:
        key, want = prefix + buffer, getattr(module, buffer).dtype  # a buffer, or FSDP's frozen Parameter
        if key in state_dict and state_dict[key].dtype != want:
            raise CheckpointError(f"'{key}': a packed weight stored in {mode} expects {want}, got "
                                  f"{state_dict[key].dtype}; load high-precision checkpoints through "
                                  f"bnb_load_converter(model)")
