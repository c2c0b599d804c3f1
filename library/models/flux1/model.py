"""FLUX.1 (dev / schnell) transformer on the shared core, with Black Forest Labs' module names.

Module paths mirror the BFL single-file checkpoint keys (`double_blocks.N.img_attn.qkv`,
`single_blocks.N.linear1`, ...), so a BFL state dict loads with a plain `load_state_dict`.
Loading, diffusers key conversion and saving live in library/models/flux1/checkpoint.py.

Precision (see shared/DESIGN.md): the model carries an explicit `compute_dtype`; image/text/pooled
inputs are cast to it at entry. Position ids stay int64/float32 and become float32 RoPE tables
outside autocast; timesteps and guidance are embedded in float32 and only then cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    GeluMLP,
    LayerNormNoAffine,
    Modulation,
    apply_rope,
    attention,
    rms_norm,
    rope_tables,
    run_block,
    split_modulation,
    timestep_embedding,
)


@dataclass(frozen=True)
class FluxConfig:
    in_channels: int = 64  # 16 latent channels x 2x2 patch; the output has the same width
    vec_in_dim: int = 768  # CLIP-L pooled output
    context_in_dim: int = 4096  # T5-XXL hidden states
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single: int = 38  # single-stream blocks
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE widths of the (index, row, col) axes; sum == head_dim
    theta: float = 10000.0
    qkv_bias: bool = True
    guidance_embed: bool = False  # dev: distilled guidance embedding (`guidance_in`)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"axes_dim {self.axes_dim} must sum to head_dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


FLUX_DEV = FluxConfig(guidance_embed=True)
FLUX_SCHNELL = FluxConfig(guidance_embed=False)


# ----------------------------------------------------------------------------------------------
# Layers


class MLPEmbedder(nn.Module):
    """in_layer -> SiLU -> out_layer: embeds timesteps, guidance and the pooled text vector."""

    def __init__(self, in_dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden, bias=bias)
        self.out_layer = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class ScaleRMSNorm(nn.Module):
    """RMSNorm whose learned weight BFL calls `scale` (eps 1e-6, statistics in fp32)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale, 1e-6)


class QKNorm(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.query_norm = ScaleRMSNorm(head_dim)
        self.key_norm = ScaleRMSNorm(head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_norm(q), self.key_norm(k)


def split_heads(qkv: torch.Tensor, num_heads: int):
    """Fused projection [B, L, 3*H*D] -> q, k, v each [B, H, L, D] ("B L (K H D) -> K B H L D")."""
    return qkv.unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)


class SelfAttention(nn.Module):
    """One stream's attention weights: fused `qkv`, QK-norm `norm`, output `proj`."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, proj_bias: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)

    def heads(self, x: torch.Tensor):
        """x [B, L, dim] -> normalised q, k and v, each [B, H, L, D]."""
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        q, k = self.norm(q, k)
        return q, k, v


class Modulator(nn.Module):
    """adaLN projection `lin` of SiLU(vec) into `count` (shift, scale, gate) triples."""

    def __init__(self, dim: int, count: int, bias: bool = True):
        super().__init__()
        self.count = count
        self.lin = nn.Linear(dim, 3 * count * dim, bias=bias)

    def forward(self, vec: torch.Tensor) -> list[Modulation]:
        return split_modulation(self.lin(F.silu(vec)), self.count)


def rope_attention(q, k, v, cos, sin) -> torch.Tensor:
    """Rotate q/k (interleaved pairs, fp32 rotation) and attend. Returns [B, L, H*D]."""
    return attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)


# ----------------------------------------------------------------------------------------------
# Blocks


class DoubleStreamBlock(nn.Module):
    """Image and text keep their own weights and attend jointly over [txt, img]."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        h = cfg.hidden_size
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_mod", Modulator(h, 2))
            setattr(self, f"{stream}_norm1", LayerNormNoAffine(h))
            setattr(self, f"{stream}_attn", SelfAttention(h, cfg.num_heads, cfg.qkv_bias))
            setattr(self, f"{stream}_norm2", LayerNormNoAffine(h))
            setattr(self, f"{stream}_mlp", GeluMLP(h, cfg.mlp_hidden))

    def forward(self, img, txt, vec, cos, sin):
        """img [B, L, h], txt [B, T, h], vec [B, h]; cos/sin fp32 [B, T+L, D/2] (text first)."""
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        img_q, img_k, img_v = self.img_attn.heads(img_mod1.modulate(self.img_norm1(img)))
        txt_q, txt_k, txt_v = self.txt_attn.heads(txt_mod1.modulate(self.txt_norm1(txt)))

        q, k, v = (torch.cat(pair, dim=2) for pair in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
        txt_attn, img_attn = rope_attention(q, k, v, cos, sin).split((txt.shape[1], img.shape[1]), dim=1)

        img = img + img_mod1.gate * self.img_attn.proj(img_attn)
        img = img + img_mod2.gated_mlp(self.img_mlp, img_mod2.modulate(self.img_norm2(img)))
        txt = txt + txt_mod1.gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt_mod2.gated_mlp(self.txt_mlp, txt_mod2.modulate(self.txt_norm2(txt)))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over [txt, img]: attention and MLP run in parallel from one fused `linear1`."""

    def __init__(self, cfg: FluxConfig):
        super().__init__()
        h, self.mlp_hidden, self.num_heads = cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads
        self.linear1 = nn.Linear(h, 3 * h + self.mlp_hidden)  # [q | k | v | mlp in]
        self.linear2 = nn.Linear(h + self.mlp_hidden, h)  # [attention out | mlp out] -> h
        self.norm = QKNorm(cfg.head_dim)
        self.pre_norm = LayerNormNoAffine(h)
        self.modulation = Modulator(h, 1)

    def forward(self, x, vec, cos, sin):
        """x [B, T+L, h], vec [B, h]; cos/sin fp32 [B, T+L, D/2]."""
        (mod,) = self.modulation(vec)
        qkv, mlp = self.linear1(mod.modulate(self.pre_norm(x))).split((3 * x.shape[-1], self.mlp_hidden), dim=-1)
        q, k, v = split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k)
        h = torch.cat((rope_attention(q, k, v, cos, sin), F.gelu(mlp, approximate="tanh")), dim=-1)
        return x + mod.gated_projection(self.linear2, h)


class LastLayer(nn.Module):
    """Final adaLN (shift, scale: BFL order) and projection back to patch channels."""

    def __init__(self, hidden: int, out_channels: int, bias: bool = True):
        super().__init__()
        self.norm_final = LayerNormNoAffine(hidden)
        self.linear = nn.Linear(hidden, out_channels, bias=bias)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden, bias=bias))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None].chunk(2, dim=-1)
        return self.linear((1 + scale) * self.norm_final(x) + shift)


# ----------------------------------------------------------------------------------------------
# Model


class Flux(nn.Module):
    def __init__(self, config: FluxConfig = FLUX_DEV):
        super().__init__()
        self.config = cfg = config
        h = cfg.hidden_size
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.img_in = nn.Linear(cfg.in_channels, h)
        self.time_in = MLPEmbedder(256, h)
        self.vector_in = MLPEmbedder(cfg.vec_in_dim, h)
        self.guidance_in = MLPEmbedder(256, h) if cfg.guidance_embed else None
        self.txt_in = nn.Linear(cfg.context_in_dim, h)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.depth_single))
        self.final_layer = LastLayer(h, cfg.in_channels)

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        y: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for packed latents.

        img [B, L, in_channels], txt [B, T, context_in_dim], y [B, vec_in_dim]: cast to compute_dtype.
        img_ids [B, L, 3], txt_ids [B, T, 3] (or [L, 3] / [T, 3]): int64 or float32 positions.
        timesteps [B]: sigma in [0, 1], embedded as 1000 * sigma in float32.
        guidance [B]: the guidance scale (e.g. 3.5), embedded as 1000 * g; required when the model has
            `guidance_in` (dev), ignored otherwise (schnell), as in BFL's code.
        Returns [B, L, in_channels] in compute_dtype.
        """
        dtype = self.compute_dtype
        if self.guidance_in is not None and guidance is None:
            raise ValueError("this FLUX model has a guidance embedding (dev): pass guidance [B], e.g. 1.0 or 3.5")

        # Positions -> float32 cos/sin tables [B, T+L, head_dim/2], computed outside autocast.
        ids = torch.cat((_batched_ids(txt_ids, img_ids.dtype), _batched_ids(img_ids, img_ids.dtype)), dim=1)
        cos, sin = rope_tables(ids, self.config.axes_dim, self.config.theta)

        # Conditioning vector: float32 sinusoidal embeddings, cast to compute_dtype before the MLPs.
        vec = self.time_in(timestep_embedding(timesteps, 256).to(dtype))
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(dtype))
        vec = vec + self.vector_in(y.to(dtype))

        img = self.img_in(img.to(dtype))
        txt = self.txt_in(txt.to(dtype))
        ckpt, swap, depth = self.gradient_checkpointing, self.block_swap, len(self.double_blocks)
        for i, block in enumerate(self.double_blocks):
            img, txt = run_block(block, ckpt, img, txt, vec, cos, sin, swap=swap, index=i)
        x = torch.cat((txt, img), dim=1)
        for i, block in enumerate(self.single_blocks):
            x = run_block(block, ckpt, x, vec, cos, sin, swap=swap, index=depth + i)
        return self.final_layer(x[:, txt.shape[1] :], vec)

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N of these: single blocks first)."""
        return [*self.double_blocks, *self.single_blocks]


def _batched_ids(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[L, 3] or [B, L, 3] ids -> [B or 1, L, 3]; text and image ids share one int/fp32 dtype."""
    if ids.is_floating_point() and ids.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"FLUX position ids must be int64 or float32, got {ids.dtype}")
    return (ids[None] if ids.dim() == 2 else ids).to(dtype)


def make_img_ids(batch: int, h: int, w: int, device=None) -> torch.Tensor:
    """Image position ids [batch, h*w, 3] int64: (0, row, col) for an h x w grid of 2x2 patches."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    ids = torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).reshape(h * w, 3)
    return ids[None].expand(batch, -1, -1).contiguous()


def make_txt_ids(batch: int, length: int, device=None) -> torch.Tensor:
    """Text position ids [batch, length, 3] int64: all zeros (text carries no RoPE position)."""
    return torch.zeros(batch, length, 3, dtype=torch.int64, device=device)



def random_inputs(config: FluxConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    text embeddings N(0, 1), the CLIP pooled vector N(0, 1), guidance 1.0 where the model embeds it."""
    from library.models.spec import RandomInputs

    fixed = dict(img_ids=make_img_ids(1, h, w), txt=torch.randn(1, text_len, config.context_in_dim, generator=generator),
                 txt_ids=make_txt_ids(1, text_len), y=torch.randn(1, config.vec_in_dim, generator=generator),
                 guidance=torch.ones(1) if config.guidance_embed else None)
    positions = torch.cat([fixed["txt_ids"], fixed["img_ids"]], dim=1)
    return RandomInputs(fixed, positions, tuple(config.axes_dim), float(config.theta))
