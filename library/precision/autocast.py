"""Autocast switched off around math that must run in the dtype it names: the model core's RoPE
angles and timestep embeddings (float32 / float64) and the fp8 Linear's matmul (its compute dtype);
and the dtype autocast would pick, for the quantized Linears and the LoRA modules that run their own
matmuls. It sits here, below the models, because fp8.py needs it too."""

from __future__ import annotations

import contextlib

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls in on this device while it is on, else None; `meta` (the memory
    planner) has no autocast."""
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def matmul_input(x: torch.Tensor, compute_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.dtype]:
    """A quantized Linear's input and the dtype its own matmul runs in: x in the layer's compute_dtype
    when set, the matmul in autocast's dtype while autocast is on, else in x's."""
    if compute_dtype is not None:
        x = x.to(compute_dtype)
    return x, autocast_dtype(x.device.type) or x.dtype


def autocast_off(device_type: str):
    """Autocast disabled for a block of float32 math; `meta` (the memory planner) has no autocast."""
    return contextlib.nullcontext() if device_type == "meta" else torch.autocast(device_type, enabled=False)
