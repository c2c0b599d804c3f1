"""The shared transformer core: norms, RoPE, attention, MLPs, modulation, timestep embedding (and, from
block_checkpoint.py, the blocks' gradient checkpointing: run_block, residual_projection, compile_block).

Every diffusion transformer and the Llama/Qwen2 LLM are built from this file. Precision rules that hold
for every model (see shared/DESIGN.md, "Precision: what breaks and why"):

- Norm statistics are computed in float32 and the result is cast back to the input dtype.
- RoPE angles are computed from int/float32 positions in float64 (float32 where the device has no
  float64, e.g. MPS) with autocast disabled, returned as float32 cos/sin tables. The tables are
  plain tensors computed per forward, never module buffers, so `model.to(dtype)` cannot touch them.
- The rotation itself runs in float32 and the result is cast back to the activation dtype.
- Attention is `F.scaled_dot_product_attention`; masks are boolean (True = attend).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.precision.autocast import autocast_off
# Gradient checkpointing lives in its own module; the families call it through core, with the rest of the core.
from library.models.block_checkpoint import (  # noqa: F401 (re-exported)
    SAVE_PROJECTIONS, Checkpointing, checkpointing, compile_block, compile_limit_hits, on_one_token, recompute_graph,
    recomputing, residual_projection, run_block, saves_only_weights, _kept_attention,
)


# ----------------------------------------------------------------------------------------------
# Norms


_WIDENED_EXACTLY = (torch.float32, torch.bfloat16, torch.float16)  # weight dtypes y * weight promotes exactly


# Devices whose F.rms_norm runs one fused kernel forward and one backward (aten._fused_rms_norm, CUDA since
# torch 2.8) where x and the weight share a dtype: the same math as below (float32 statistics, the weight
# applied in float32, one rounding to x.dtype), ~27 kernels fewer per call and training step (8 forward,
# as many again in checkpointing's recompute, ~14 backward, against one each: the eager step is bound by
# launching them, bench/RESULTS.md), and backward keeps x and a float32 [..., 1] rstd instead of a float32 copy of x.
# Elsewhere (the CPU, meta: the planner) F.rms_norm is the composite below, op for op.
FUSED_RMS_NORM_DEVICES = ("cuda",)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis. Statistics in fp32; output in x.dtype (weight applied in fp32).

    A bf16 / fp16 weight multiplies the float32 y as it is: type promotion widens it inside the kernel,
    exactly as a float32 copy would (each value is exact in float32), one cast fewer per call.
    On FUSED_RMS_NORM_DEVICES with the weight in x's dtype (or none), eager: PyTorch's fused kernel, with
    autocast off so it neither widens x nor returns float32 (torch.compile fuses the composite itself)."""
    if (x.device.type in FUSED_RMS_NORM_DEVICES and (weight is None or weight.dtype == x.dtype)
            and not torch.compiler.is_compiling()):
        if not torch.is_autocast_enabled(x.device.type):  # no torch.autocast to enter and leave: host time
            return F.rms_norm(x, (x.shape[-1],), weight, eps)  # is what this path saves in a launch-bound step
        with autocast_off(x.device.type):
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight if weight.dtype in _WIDENED_EXACTLY else weight.float())  # float32 [..., D]
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel `weight` (Llama/Qwen2, diffusers QK-norm names)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without scale/bias over the last axis: statistics in float32 (or wider), output in x.dtype.

    PyTorch's CPU and CUDA kernels accumulate bf16 / fp16 in float32 (opmath) and round the output once,
    so there x goes in as it is: no float32 copy in and cast out, and backward keeps x, not a float32
    copy (0.6 ms less per call at [1, 256, 3072] on the CPU; one rounding step apart from the copy in
    ~4e-5 of the elements: the accumulation order). Autocast is off around it: CUDA's lists layer_norm
    as a float32 op, which would widen x to a float32 copy and return float32. Other devices (MPS) get
    the explicit float32 copy."""
    if x.device.type not in ("cpu", "cuda", "meta") and x.dtype not in (torch.float32, torch.float64):
        return F.layer_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    with autocast_off(x.device.type):
        return F.layer_norm(x, (x.shape[-1],), eps=eps)


class LayerNormNoAffine(nn.Module):
    """LayerNorm without scale/bias (eps 1e-6), the pre-modulation norm of DiT blocks (`layer_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"LayerNormNoAffine({self.dim}) got input of shape {tuple(x.shape)}")
        return layer_norm(x, self.eps)


# ----------------------------------------------------------------------------------------------
# RoPE


def angle_dtype(device: torch.device) -> torch.dtype:
    # float64 everywhere it exists; MPS has no float64, float32 is still exact for positions < 2^24.
    return torch.float32 if device.type == "mps" else torch.float64


def rope_tables(positions: torch.Tensor, axes_dims: tuple[int, ...], theta: float):
    """cos/sin tables for (multi-axis) RoPE.

    positions: [..., L, n_axes] (or [..., L] for a single axis), int64 or float32. Never pass
        positions that went through a low-precision dtype: bf16 is exact only up to 256 and
        float8_e4m3fn only up to 16.
    axes_dims: rotary width of each axis (even), e.g. (16, 56, 56) for a 3-axis image
        transformer or (head_dim,) for the LLM. Axis i uses frequencies theta ** (-2j / axes_dims[i]).
    Returns (cos, sin), each float32 of shape [..., L, sum(axes_dims) // 2].
    """
    if positions.is_floating_point() and positions.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"RoPE positions must be int or float32/float64, got {positions.dtype}")
    if positions.dim() == 0 or (len(axes_dims) > 1 and positions.shape[-1] != len(axes_dims)):
        raise ValueError(f"positions shape {tuple(positions.shape)} does not fit axes {axes_dims}")
    if len(axes_dims) == 1 and (positions.dim() == 1 or positions.shape[-1] != 1):
        positions = positions.unsqueeze(-1)
    dtype = angle_dtype(positions.device)
    with autocast_off(positions.device.type):
        pos = positions.to(dtype)
        angles = []
        for i, dim in enumerate(axes_dims):
            if dim % 2:
                raise ValueError(f"RoPE axis width must be even, got {dim}")
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=pos.device) / dim))
            angles.append(pos[..., i : i + 1] * inv_freq)
        angles = torch.cat(angles, dim=-1)
        return angles.cos().float(), angles.sin().float()


def rope_tables_from_inv_freq(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """cos/sin tables for 1-D RoPE with given inverse frequencies (a scaled RoPE's, llm_rope.py).

    positions: int64 [L] or [B, L]. inv_freq: float64 [D/2], cast to the angle dtype of positions'
    device. scale multiplies both tables (YaRN's attention factor). Returns (cos, sin) float32 [..., L, D/2].
    """
    if positions.is_floating_point():
        raise TypeError(f"RoPE positions must be integer ids, got {positions.dtype}")
    dtype = angle_dtype(positions.device)
    with autocast_off(positions.device.type):
        angles = positions.to(dtype)[..., None] * inv_freq.to(positions.device, dtype)
        return (angles.cos() * scale).float(), (angles.sin() * scale).float()


def mrope_tables(positions: torch.Tensor, head_dim: int, theta: float, sections: tuple[int, ...],
                 interleaved: bool = False):
    """cos/sin tables for multimodal RoPE (Qwen2-VL / Qwen2.5-VL M-RoPE, Qwen3-VL's interleaved one).

    Unlike rope_tables' axes, which each own a frequency band of their own width, M-RoPE keeps the
    1-D frequencies theta ** (-2j / head_dim) and lets each frequency turn with one position axis
    (time, height, width). Contiguous (Qwen2.5-VL): band i of `sections` (e.g. (16, 24, 24) for
    head_dim 128) by positions[..., i]. Interleaved (Qwen3-VL, sections (24, 20, 20)): frequency j by
    height when j % 3 == 1 and j < 3 sections[1], by width when j % 3 == 2 and j < 3 sections[2], else by
    time (transformers' recomposition_frequencies). Either way, text tokens carry equal ids on all
    axes, which gives plain 1-D RoPE.
    positions: int64 [..., L, len(sections)]. Returns (cos, sin) float32 [..., L, head_dim // 2].
    """
    if positions.is_floating_point():
        raise TypeError(f"M-RoPE positions must be integer ids, got {positions.dtype}")
    if sum(sections) != head_dim // 2 or positions.shape[-1] != len(sections):
        raise ValueError(f"M-RoPE sections {sections} for head_dim {head_dim} and positions {tuple(positions.shape)}: "
                         f"expected sum(sections) == head_dim / 2 and one position axis per section")
    dtype = angle_dtype(positions.device)
    with autocast_off(positions.device.type):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype, device=positions.device) / head_dim))
        axis = mrope_axes(head_dim, sections, interleaved, positions.device)
        angles = positions.to(dtype)[..., axis] * inv_freq  # frequency j turns with axis[j]'s position
        return angles.cos().float(), angles.sin().float()


def mrope_axes(head_dim: int, sections: tuple[int, ...], interleaved: bool, device=None) -> torch.Tensor:
    """int64 [head_dim / 2]: the position axis each M-RoPE frequency turns with (mrope_tables' rule)."""
    if interleaved:
        j = torch.arange(head_dim // 2, device=device)
        axis = torch.zeros_like(j)
        for a in (1, 2):
            axis[(j % 3 == a) & (j < 3 * sections[a])] = a
        return axis
    return torch.repeat_interleave(torch.arange(len(sections), device=device), torch.tensor(sections, device=device))


def _complex_rotation(x32: torch.Tensor) -> bool:
    """Whether apply_rope may rotate interleaved pairs as complex numbers: in eager mode on CPU / CUDA
    (inductor generates no complex code and fuses the real formula itself; MPS complex support varies),
    on a layout view_as_complex accepts (pairs adjacent, even strides and offset)."""
    return (x32.device.type in ("cpu", "cuda", "meta") and not torch.compiler.is_compiling()
            and x32.stride(-1) == 1 and x32.storage_offset() % 2 == 0
            and all(s % 2 == 0 for s in x32.stride()[:-1]))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True):
    """Rotate x: [B, H, L, D] by the tables cos/sin: [L, D/2] or [B, L, D/2].

    interleaved=True pairs (x0, x1), (x2, x3), ... (BFL's and diffusers' image transformers);
    interleaved=False pairs the two halves (x_i, x_{i+D/2}) (Hugging Face Llama/Qwen2).
    Runs in float32, returns x.dtype.
    """
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None].float(), sin[:, None].float()  # [B, 1, L, D/2]
    x32 = x.float()
    if interleaved and _complex_rotation(x32):
        # The pair (x0, x1) as x0 + i x1 times cos + i sin is the rotation below in one complex64
        # multiply (float32 parts): bit-identical on the CPU, forward and backward, and one kernel
        # instead of nine (a 3072-wide bf16 training step on the CPU: x0.92-0.95).
        rotated = torch.view_as_complex(x32.unflatten(-1, (-1, 2))) * torch.complex(cos, sin)
        return torch.view_as_real(rotated).flatten(-2).to(x.dtype)
    if interleaved:
        x1, x2 = x32.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = x32.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Attention


def attention_mask(
    key_mask: torch.Tensor | None, q_len: int, k_len: int, causal: bool, device: torch.device, window: int = 0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean [B or 1, 1, q_len, k_len] mask (True = attend) from a key padding mask and/or
    causality. Rows with no visible key (padding queries under causal left-padding) are opened
    fully, so SDPA never returns NaN; those rows are padding (library/models/llm.py zeroes their
    output, as transformers does). window > 0 (causal only): query i sees only the `window` keys
    ending at its own position (sliding-window attention). documents [B, L] (self-attention, q_len ==
    k_len == L): a query sees only keys of its own document (packed sequences: block-diagonal)."""
    if key_mask is None and not causal and documents is None:
        return None
    mask = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        diagonal = k_len - q_len
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal)[None, None]
        if window:
            mask = mask.triu(diagonal - window + 1)
    if documents is not None:
        mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
    if key_mask is not None:
        mask = mask & key_mask.bool()[:, None, None, :]
        mask = mask | ~mask.any(-1, keepdim=True)
    return mask


# The attention kernel. One name, so the memory planner can run the fused kernels' memory profile
# on `meta` (where SDPA falls back to the math path and would materialize [B, H, Lq, Lk]).
sdpa = F.scaled_dot_product_attention


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention. q: [B, H, Lq, D], k/v: [B, Hkv, Lk, D] with H % Hkv == 0
    (grouped-query attention when Hkv < H). mask: boolean [B, Lk] key padding mask (combined
    with `causal`), or a full boolean/additive mask broadcastable to [B, H, Lq, Lk] that is used
    as given (it already holds any causality). Returns [B, Lq, H * D]."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None and causal and q.shape[-2] == k.shape[-2]:
        # No padding: let SDPA build causality itself, which keeps the flash kernel eligible on CUDA.
        with _kept_attention():
            out = sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2).flatten(2)
    if mask is not None and mask.dim() == 2:
        mask = attention_mask(mask, q.shape[-2], k.shape[-2], causal, q.device)
    elif causal and mask is None:  # Lq != Lk (a query suffix): causality aligned to the end
        mask = attention_mask(None, q.shape[-2], k.shape[-2], True, q.device)
    with _kept_attention():
        out = sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2).flatten(2)


# ----------------------------------------------------------------------------------------------
# MLPs


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the Llama/Qwen2 MLP, Hugging Face parameter names."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection `down_proj` reads."""
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


class GeluMLP(nn.Sequential):
    """Linear -> GELU(tanh) -> Linear, BFL layout (`mlp.0`, `mlp.2`)."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__(nn.Linear(dim, hidden, bias=bias), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim, bias=bias))


class FcMLP(nn.Module):
    """fc1 -> activation (GELU tanh unless given) -> fc2: the `fc1` / `fc2` layout some original single files keep
    (timm's Mlp)."""

    def __init__(self, dim: int, hidden: int, activation=None):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.activation = activation or functools.partial(F.gelu, approximate="tanh")

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection `fc2` reads."""
        return self.activation(self.fc1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.hidden(x))

    def gated(self, mod: Modulation, normed: torch.Tensor) -> torch.Tensor:
        """gate * mlp((1 + scale) * normed + shift) of one (shift, scale, gate) triple: fc2 is the block's projection
        into the residual (core.residual_projection may skip its base GEMM in checkpointing's recompute)."""
        return mod.gated_projection(self.fc2, self.hidden(mod.modulate(normed)))


class _GeluProj(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=bias)

    def forward(self, x):
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """The same GELU(tanh) MLP in the diffusers layout (`net.0.proj`, `net.2`)."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.net = nn.ModuleList([_GeluProj(dim, hidden, bias), nn.Identity(), nn.Linear(hidden, dim, bias=bias)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection `net.2` reads."""
        return self.net[1](self.net[0](x))


# ----------------------------------------------------------------------------------------------
# Modulation (adaLN) and timestep embedding


@dataclass
class Modulation:
    """One adaLN triple: y = (1 + scale) * norm(x) + shift; x = x + gate * f(y)."""

    shift: torch.Tensor
    scale: torch.Tensor
    gate: torch.Tensor

    def modulate(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.scale) * x + self.shift

    def gated(self, y: torch.Tensor) -> torch.Tensor:
        return self.gate * y

    def gated_projection(self, proj: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """gate * proj(h), the block's last step into the residual (see residual_projection)."""
        return self.gate * residual_projection(proj, h, self.gate.requires_grad)

    def gated_mlp(self, mlp: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        """gate * mlp(x) for an nn.Sequential MLP whose last layer projects into the residual."""
        for i in range(len(mlp) - 1):  # (slicing would build a new instance of mlp's own class)
            x = mlp[i](x)
        return self.gated_projection(mlp[-1], x)


def float32_modulated(y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(1 + scale) * y + shift in float32, one rounding to y.dtype: diffusers' order of roundings where a model's
    modulation is float32 (Modulation.modulate computes in the activation dtype)."""
    return (y.float() * (1 + scale.float()) + shift.float()).to(y.dtype)


def float32_gated(mod: Modulation, proj: nn.Module, h: torch.Tensor, dtype: torch.dtype,
                  last: bool = False) -> torch.Tensor:
    """gate * proj(h) in float32, rounded to `dtype`: the update a block adds to its residual (float32_modulated's
    order). last: proj is the block's last projection, whose output nothing in the block's recompute reads
    (residual_projection may skip its base GEMM there); an earlier one's output feeds the block on: computed in full."""
    out = residual_projection(proj, h, mod.gate.requires_grad) if last else proj(h)
    return (mod.gate.float() * out.float()).to(dtype)


def split_modulation(params: torch.Tensor, count: int) -> list[Modulation]:
    """[B, 3 * count * D] -> `count` Modulations, each field [B, 1, D] (broadcast over tokens)."""
    chunks = params[:, None, :].chunk(3 * count, dim=-1)
    return [Modulation(*chunks[3 * i : 3 * i + 3]) for i in range(count)]


def timestep_embedding(
    t: torch.Tensor, dim: int, max_period: float = 10000.0, time_factor: float = 1000.0, scale_first: bool = True
):
    """Sinusoidal embedding [B, dim] of t: [B] (flow-matching sigma in [0, 1], scaled by
    time_factor). Computed in float32 outside autocast; cos half first (BFL / diffusers
    flip_sin_to_cos=True, downscale_freq_shift=0).

    scale_first picks where time_factor enters, to reproduce each reference bit for bit in fp32:
    BFL's timestep_embedding scales t first, (1000 t) * f; diffusers' Timesteps(scale=1000) scales
    the product, (t * f) * 1000. The two differ by fp32 rounding of arguments up to 1000 (~6e-5 rad)."""
    with autocast_off(t.device.type):
        t = t.float()
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = (time_factor * t)[:, None] * freqs[None] if scale_first else time_factor * (t[:, None] * freqs[None])
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb


class TimestepMLP(nn.Module):
    """The MLP over a sinusoidal embedding in the original single files' names: `mlp.0` (freq_dim -> hidden), SiLU,
    `mlp.2` (hidden -> width); hidden is width unless a release fixes it otherwise."""

    def __init__(self, width: int, hidden: int | None = None, freq_dim: int = 256):
        super().__init__()
        hidden = hidden or width
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, width))

    def forward(self, freqs: torch.Tensor) -> torch.Tensor:
        return self.mlp(freqs)
