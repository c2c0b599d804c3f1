"""FLUX.2 ([dev], [klein] 4B / 9B) transformer on the shared core, with Black Forest Labs' module names.

What FLUX.2 changes against FLUX.1 (library/models/flux1/model.py, whose layers it reuses):
- No pooled text vector (`vector_in`): the conditioning vector is the timestep embedding (plus the
  guidance embedding for [dev]; [klein] has none).
- Modulation is shared: one `double_stream_modulation_img` / `_txt` projection serves every double
  block and one `single_stream_modulation` every single block, computed once per forward.
- The MLPs are SwiGLU with the gate and the up projection fused in one Linear (`img_mlp.0`: first
  half gate, second half up), and the single blocks' `linear1` holds [q | k | v | gate | up].
- No biases anywhere; RoPE over 4 axes (t, h, w, l) with theta 2000; text tokens carry their index
  on the l axis, image tokens their row / column on h / w.

Module paths mirror BFL's FLUX.2 single-file keys (`double_blocks.N.img_attn.qkv`,
`double_stream_modulation_img.lin`, `single_blocks.N.linear1`, ...; the names diffusers'
`convert_flux2_transformer_checkpoint_to_diffusers` reads), so a BFL file loads by plain key.
Loading and the diffusers name map live in library/models/flux2/checkpoint.py.

Precision as for FLUX.1 (shared/DESIGN.md): inputs are cast to `compute_dtype` at entry; position
ids stay int64/float32 and become float32 RoPE tables outside autocast; timesteps and guidance are
embedded in float32 and only then cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import LayerNormNoAffine, rope_tables, run_block, split_modulation, timestep_embedding
from library.models.flux1.model import (
    LastLayer,
    MLPEmbedder,
    Modulator,
    QKNorm,
    SelfAttention,
    _batched_ids,
    rope_attention,
    split_heads,
)


@dataclass(frozen=True)
class Flux2Config:
    in_channels: int = 128  # 32 latent channels x 2x2 patch; the output has the same width
    context_in_dim: int = 15360  # text hidden states: 3 stacked layers x the text encoder's width
    hidden_size: int = 6144
    mlp_ratio: float = 3.0  # SwiGLU hidden width = hidden_size * mlp_ratio
    num_heads: int = 48
    depth: int = 8  # double-stream blocks
    depth_single: int = 48  # single-stream blocks
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)  # RoPE widths of the (t, h, w, l) axes; sum == head_dim
    theta: float = 2000.0
    guidance_embed: bool = True  # [dev]: distilled guidance embedding (`guidance_in`); [klein]: none
    time_dim: int = 256  # width of the sinusoidal timestep / guidance embedding

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


# The released sizes (the transformer/config.json of black-forest-labs/FLUX.2-dev, FLUX.2-klein-4B and
# FLUX.2-klein-9B; the klein "base" checkpoints share their distilled sibling's architecture).
FLUX2_DEV = Flux2Config()
FLUX2_KLEIN_4B = Flux2Config(context_in_dim=7680, hidden_size=3072, num_heads=24, depth=5, depth_single=20, guidance_embed=False)
FLUX2_KLEIN_9B = Flux2Config(context_in_dim=12288, hidden_size=4096, num_heads=32, depth=8, depth_single=24, guidance_embed=False)
FLUX2_CONFIGS = {"dev": FLUX2_DEV, "klein_4b": FLUX2_KLEIN_4B, "klein_9b": FLUX2_KLEIN_9B}


# ----------------------------------------------------------------------------------------------
# Layers


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused [gate | up] projection (BFL's SiLUActivation, diffusers' Flux2SwiGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)


class SwiGLUMLP(nn.Sequential):
    """Linear(dim, 2 * hidden) -> SwiGLU -> Linear(hidden, dim), no biases: BFL's `mlp.0`, `mlp.2`."""

    def __init__(self, dim: int, hidden: int):
        super().__init__(nn.Linear(dim, 2 * hidden, bias=False), SwiGLUAct(), nn.Linear(hidden, dim, bias=False))


# ----------------------------------------------------------------------------------------------
# Blocks


class DoubleStreamBlock(nn.Module):
    """Image and text keep their own weights and attend jointly over [txt, img]; their adaLN
    parameters come from the model's shared modulation (no per-block modulation weights)."""

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        h = cfg.hidden_size
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_norm1", LayerNormNoAffine(h))
            setattr(self, f"{stream}_attn", SelfAttention(h, cfg.num_heads, qkv_bias=False, proj_bias=False))
            setattr(self, f"{stream}_norm2", LayerNormNoAffine(h))
            setattr(self, f"{stream}_mlp", SwiGLUMLP(h, cfg.mlp_hidden))

    def forward(self, img, txt, img_mod, txt_mod, cos, sin):
        """img [B, L, h], txt [B, T, h]; img_mod / txt_mod [B, 6h] (two shift/scale/gate triples,
        split here so that checkpointing sees plain tensors); cos/sin fp32 [B, T+L, D/2], text first."""
        img_mod1, img_mod2 = split_modulation(img_mod, 2)
        txt_mod1, txt_mod2 = split_modulation(txt_mod, 2)
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
    """One stream over [txt, img]: attention and the SwiGLU MLP run in parallel from one fused
    `linear1` [q | k | v | gate | up] and end in one `linear2` over [attention out | mlp out]."""

    def __init__(self, cfg: Flux2Config):
        super().__init__()
        h, self.mlp_hidden, self.num_heads = cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads
        self.linear1 = nn.Linear(h, 3 * h + 2 * self.mlp_hidden, bias=False)
        self.linear2 = nn.Linear(h + self.mlp_hidden, h, bias=False)
        self.norm = QKNorm(cfg.head_dim)
        self.pre_norm = LayerNormNoAffine(h)

    def forward(self, x, mod, cos, sin):
        """x [B, T+L, h], mod [B, 3h] (the shared single-stream modulation); cos/sin fp32 [B, T+L, D/2]."""
        (mod,) = split_modulation(mod, 1)
        qkv, mlp = self.linear1(mod.modulate(self.pre_norm(x))).split((3 * x.shape[-1], 2 * self.mlp_hidden), dim=-1)
        q, k, v = split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k)
        h = torch.cat((rope_attention(q, k, v, cos, sin), swiglu(mlp)), dim=-1)
        return x + mod.gated_projection(self.linear2, h)


# ----------------------------------------------------------------------------------------------
# Model


class Flux2(nn.Module):
    def __init__(self, config: Flux2Config = FLUX2_KLEIN_4B):
        super().__init__()
        self.config = cfg = config
        h = cfg.hidden_size
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.img_in = nn.Linear(cfg.in_channels, h, bias=False)
        self.txt_in = nn.Linear(cfg.context_in_dim, h, bias=False)
        self.time_in = MLPEmbedder(cfg.time_dim, h, bias=False)
        self.guidance_in = MLPEmbedder(cfg.time_dim, h, bias=False) if cfg.guidance_embed else None
        self.double_stream_modulation_img = Modulator(h, 2, bias=False)
        self.double_stream_modulation_txt = Modulator(h, 2, bias=False)
        self.single_stream_modulation = Modulator(h, 1, bias=False)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.depth_single))
        self.final_layer = LastLayer(h, cfg.in_channels, bias=False)

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for packed latents.

        img [B, L, in_channels], txt [B, T, context_in_dim]: cast to compute_dtype.
        img_ids [B, L, 4], txt_ids [B, T, 4] (or [L, 4] / [T, 4]): int64 or float32 (t, h, w, l) positions.
        timesteps [B]: sigma in [0, 1], embedded as 1000 * sigma in float32.
        guidance [B]: the guidance scale, embedded as 1000 * g; required when the model has `guidance_in`
            ([dev]), ignored otherwise ([klein], whose pipeline passes None).
        Returns [B, L, in_channels] in compute_dtype.
        """
        dtype, cfg = self.compute_dtype, self.config
        if self.guidance_in is not None and guidance is None:
            raise ValueError("this FLUX.2 model has a guidance embedding ([dev]): pass guidance [B], e.g. 4.0")

        # Positions -> float32 cos/sin tables [B, T+L, head_dim/2], computed outside autocast.
        ids = torch.cat((_batched_ids(txt_ids, img_ids.dtype), _batched_ids(img_ids, img_ids.dtype)), dim=1)
        cos, sin = rope_tables(ids, cfg.axes_dim, cfg.theta)

        # Conditioning vector: float32 sinusoidal embeddings, cast to compute_dtype before the MLPs.
        vec = self.time_in(timestep_embedding(timesteps, cfg.time_dim).to(dtype))
        if self.guidance_in is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, cfg.time_dim).to(dtype))
        # The shared modulations: one projection each, used by every block of its kind.
        img_mod = self.double_stream_modulation_img.lin(F.silu(vec))
        txt_mod = self.double_stream_modulation_txt.lin(F.silu(vec))
        single_mod = self.single_stream_modulation.lin(F.silu(vec))

        img = self.img_in(img.to(dtype))
        txt = self.txt_in(txt.to(dtype))
        ckpt, swap, depth = self.gradient_checkpointing, self.block_swap, len(self.double_blocks)
        for i, block in enumerate(self.double_blocks):
            img, txt = run_block(block, ckpt, img, txt, img_mod, txt_mod, cos, sin, swap=swap, index=i)
        x = torch.cat((txt, img), dim=1)
        for i, block in enumerate(self.single_blocks):
            x = run_block(block, ckpt, x, single_mod, cos, sin, swap=swap, index=depth + i)
        return self.final_layer(x[:, txt.shape[1] :], vec)

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N of these: single blocks first)."""
        return [*self.double_blocks, *self.single_blocks]


def make_img_ids(batch: int, h: int, w: int, t: int = 0, device=None) -> torch.Tensor:
    """Image position ids [batch, h*w, 4] int64: (t, row, col, 0) for an h x w grid of 2x2 patches,
    as Flux2Pipeline._prepare_latent_ids (t = 0 for the generated image)."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    zeros = torch.zeros_like(rows)
    ids = torch.stack((zeros + t, rows, cols, zeros), dim=-1).reshape(h * w, 4)
    return ids[None].expand(batch, -1, -1).contiguous()


def make_txt_ids(batch: int, length: int, device=None) -> torch.Tensor:
    """Text position ids [batch, length, 4] int64: (0, 0, 0, index), as Flux2Pipeline._prepare_text_ids."""
    ids = torch.zeros(length, 4, dtype=torch.int64, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids[None].expand(batch, -1, -1).contiguous()


def random_inputs(config: Flux2Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    text embeddings N(0, 1), guidance 4.0 where the model embeds it ([dev])."""
    from library.models.spec import RandomInputs

    fixed = dict(img_ids=make_img_ids(1, h, w), txt=torch.randn(1, text_len, config.context_in_dim, generator=generator),
                 txt_ids=make_txt_ids(1, text_len), guidance=torch.full((1,), 4.0) if config.guidance_embed else None)
    positions = torch.cat([fixed["txt_ids"], fixed["img_ids"]], dim=1)
    return RandomInputs(fixed, positions, tuple(config.axes_dim), float(config.theta))
