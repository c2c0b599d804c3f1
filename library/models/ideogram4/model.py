"""Ideogram 4 transformer on the shared core, with diffusers' module names.

What Ideogram 4 is (diffusers' Ideogram4Transformer2DModel, models/transformers/transformer_ideogram4.py):
- One stack of identical single-stream blocks (`layers`) over one packed sequence [text, image].
- Text conditioning is a concatenation of hidden states tapped from several layers of the text
  encoder per token (`llm_features_dim`, 53248 released); `llm_cond_norm` (RMSNorm eps 1e-6) and
  `llm_cond_proj` take it to the width. Image tokens are 2 x 2 patches of the FLUX.2 VAE's 32
  channels (128 features), `input_proj` to the width. `embed_image_indicator` adds a learned
  vector per role (row 0 text, row 1 image).
- Time: model time t in [0, 1] with 0 = noise, 1 = clean (t = 1 - sigma), embedded as
  sin/cos (sin first) of 1e4 t with frequencies exp(-j log(1e4) / (half - 1)) (`t_embedding`);
  `adaln_proj` + SiLU gives every block and the final layer its conditioning.
- Block: adaLN with 4 chunks (scale_msa, gate_msa, scale_mlp, gate_mlp), tanh gates, sandwich
  RMSNorms: x += tanh(g1) norm2(attn(norm1(x) (1 + s1))); x += tanh(g2) norm4(mlp(norm3(x) (1 + s2))).
  Attention: 18 heads of 256, RMSNorm on q and k per head, SwiGLU w2(silu(w1 x) * w3 x).
- RoPE: Qwen3-VL's interleaved multi-axis RoPE, sections (24, 20, 20) over 128 frequencies of
  theta 5e6 (frequencies 60..127 turn with the t axis), applied to the two halves (rotate_half).
  Text tokens sit at (i, i, i) for their i-th real token, image patch (r, c) at 65536 + (0, r, c).
- Output: velocity toward the data, x0 - noise (the pipeline steps the scheduler with -v). Our
  trainer's target is noise - x0, so `forward` returns the negated output; nothing else differs.

Precision (shared/DESIGN.md): inputs are cast to `compute_dtype` at entry; the timestep is
embedded in float32 and only then cast. The RoPE angles are computed in float32, as diffusers and
the released training code compute them: at positions 65536 + r, float32 products round by up to
4e-3 rad, and a float64 table would differ from what the model learned by that much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import RMSNorm, LayerNormNoAffine, apply_rope, attention, run_block
from library.precision.autocast import autocast_off

IMAGE_POSITION_OFFSET = 65536  # image grid ids start here so they never meet text ids


@dataclass(frozen=True)
class Ideogram4Config:
    """diffusers' Ideogram4Transformer2DModel arguments (config.json names); defaults = the released
    model (diffusers' defaults and docstring)."""

    in_channels: int = 128  # 32 FLUX.2 VAE channels x 2 x 2 patches
    num_layers: int = 34
    attention_head_dim: int = 256
    num_attention_heads: int = 18
    intermediate_size: int = 12288
    adaln_dim: int = 512
    llm_features_dim: int = 53248
    rope_theta: float = 5_000_000
    mrope_section: tuple[int, ...] = (24, 20, 20)
    norm_eps: float = 1e-5

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if len(self.mrope_section) != 3 or 3 * max(self.mrope_section) > self.attention_head_dim // 2:
            raise ValueError(f"Ideogram 4: mrope_section {self.mrope_section} must be 3 axes whose interleave "
                             f"fits head_dim / 2 = {self.attention_head_dim // 2}")

    @property
    def hidden_size(self) -> int:
        return self.attention_head_dim * self.num_attention_heads

    @property
    def token_width(self) -> int:
        return self.in_channels


IDEOGRAM4 = Ideogram4Config()
IDEOGRAM4_CONFIGS = {"ideogram4": IDEOGRAM4}


# ----------------------------------------------------------------------------------------------
# Positions and RoPE


def joint_positions(txt_mask: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, T + h*w, 3] int64 (Ideogram4Pipeline._prepare_ids): the i-th real text token at (i, i, i),
    padding at 0, image patch (r, c) at 65536 + (0, r, c). txt_mask [B, T] bool (True = real)."""
    b, device = txt_mask.shape[0], txt_mask.device
    text = (txt_mask.long().cumsum(1) - 1).clamp(min=0) * txt_mask.long()  # [B, T]
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    image = torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).reshape(h * w, 3) + IMAGE_POSITION_OFFSET
    return torch.cat((text[..., None].expand(-1, -1, 3), image[None].expand(b, -1, -1)), dim=1)


def mrope_tables_f32(positions: torch.Tensor, head_dim: int, theta: float, sections: tuple[int, ...]):
    """Interleaved M-RoPE cos/sin [B, L, head_dim / 2] float32, angles in float32 outside autocast
    (see the module docstring): frequency j turns with h when j % 3 == 1 and j < 3 sections[1], with
    w when j % 3 == 2 and j < 3 sections[2], else with t."""
    with autocast_off(positions.device.type):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
        j = torch.arange(head_dim // 2, device=positions.device)
        axis = torch.zeros_like(j)
        for a in (1, 2):
            axis[(j % 3 == a) & (j < 3 * sections[a])] = a
        angles = positions.float()[..., axis] * inv_freq
        return angles.cos(), angles.sin()


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[B, dim] float32: [sin, cos] of 1e4 t at frequencies exp(-j log(1e4) / (dim/2 - 1))
    (diffusers' _sinusoidal_embedding with Ideogram4EmbedScalar's range (0, 1))."""
    with autocast_off(t.device.type):
        half = dim // 2
        freq = torch.exp(torch.arange(half, dtype=torch.float32, device=t.device) * -(math.log(1e4) / (half - 1)))
        args = (1e4 * t.float())[:, None] * freq
        emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
        return F.pad(emb, (0, 1)) if dim % 2 else emb


# ----------------------------------------------------------------------------------------------
# Layers


class Attention(nn.Module):
    """Self-attention: split q/k/v without bias, RMSNorm on q and k per head, M-RoPE on halves."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.norm_q = RMSNorm(dim // heads, eps=1e-5)
        self.norm_k = RMSNorm(dim // heads, eps=1e-5)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(self, x, cos, sin, key_mask=None):
        """x [B, L, dim]; cos/sin float32 [B, L, head_dim/2]; key_mask bool [B, L] or None."""
        q = self.norm_q(self.to_q(x).unflatten(-1, (self.heads, -1))).transpose(1, 2)  # [B, H, L, D]
        k = self.norm_k(self.to_k(x).unflatten(-1, (self.heads, -1))).transpose(1, 2)
        v = self.to_v(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, interleaved=False), apply_rope(k, cos, sin, interleaved=False)
        return self.to_out[0](attention(q, k, v, mask=key_mask))


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases (diffusers' Ideogram4MLP names)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Ideogram4Config):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.norm_eps
        self.attention = Attention(d, cfg.num_attention_heads)
        self.feed_forward = FeedForward(d, cfg.intermediate_size)
        self.attention_norm1, self.ffn_norm1 = RMSNorm(d, eps), RMSNorm(d, eps)
        self.attention_norm2, self.ffn_norm2 = RMSNorm(d, eps), RMSNorm(d, eps)
        self.adaln_modulation = nn.Linear(cfg.adaln_dim, 4 * d, bias=True)

    def forward(self, x, adaln, cos, sin, key_mask=None):
        """x [B, L, dim]; adaln [B, 1, adaln_dim] (silu(adaln_proj(t)), shared by every block)."""
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaln_modulation(adaln).chunk(4, dim=-1)
        attn = self.attention(self.attention_norm1(x) * (1.0 + scale_msa), cos, sin, key_mask)
        x = x + torch.tanh(gate_msa) * self.attention_norm2(attn)
        mlp = self.feed_forward(self.ffn_norm1(x) * (1.0 + scale_mlp))
        return x + torch.tanh(gate_mlp) * self.ffn_norm2(mlp)


class TimeEmbedding(nn.Module):
    """mlp_out(silu(mlp_in(time_embedding(t)))) (diffusers' Ideogram4EmbedScalar names)."""

    def __init__(self, dim: int):
        super().__init__()
        self.mlp_in = nn.Linear(dim, dim, bias=True)
        self.mlp_out = nn.Linear(dim, dim, bias=True)


class FinalLayer(nn.Module):
    def __init__(self, cfg: Ideogram4Config):
        super().__init__()
        self.norm_final = LayerNormNoAffine(cfg.hidden_size, eps=1e-6)
        self.linear = nn.Linear(cfg.hidden_size, cfg.in_channels, bias=True)
        self.adaln_modulation = nn.Linear(cfg.adaln_dim, cfg.hidden_size, bias=True)

    def forward(self, x, adaln):
        # adaln is already silu(adaln_proj(t)); the reference applies SiLU a second time here.
        return self.linear(self.norm_final(x) * (1.0 + self.adaln_modulation(F.silu(adaln))))


# ----------------------------------------------------------------------------------------------
# Model


class Ideogram4(nn.Module):
    def __init__(self, config: Ideogram4Config = IDEOGRAM4):
        super().__init__()
        self.config = cfg = config
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called
        d = cfg.hidden_size
        self.input_proj = nn.Linear(cfg.in_channels, d, bias=True)
        self.llm_cond_norm = RMSNorm(cfg.llm_features_dim, eps=1e-6)
        self.llm_cond_proj = nn.Linear(cfg.llm_features_dim, d, bias=True)
        self.t_embedding = TimeEmbedding(d)
        self.adaln_proj = nn.Linear(d, cfg.adaln_dim, bias=True)
        self.embed_image_indicator = nn.Embedding(2, d)  # row 0: text token, row 1: image token
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(cfg)

    def conditioning(self, sigma: torch.Tensor) -> torch.Tensor:
        """[B] sigma (1 = noise) -> [B, 1, adaln_dim]: model time t = 1 - sigma, embedded in float32."""
        te = self.t_embedding
        emb = time_embedding(1.0 - sigma.float(), self.config.hidden_size).to(self.compute_dtype)
        t = te.mlp_out(F.silu(te.mlp_in(emb)))
        return F.silu(self.adaln_proj(t))[:, None]

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        timesteps: torch.Tensor,
        h: int,
        w: int,
        txt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for packed latents.

        img [B, h*w, 128]: an h x w grid of 2x2 patches; cast to compute_dtype.
        txt [B, T, llm_features_dim]: the tapped text-encoder states (T may be 0: the unconditional
            transformer's image-only call); cast likewise.
        txt_mask [B, T] bool (True = real token), None: every token real. Padded tokens are hidden as
            keys everywhere (the reference's segment mask) and sit at position 0.
        timesteps [B]: sigma in [0, 1] (1 = pure noise).
        Returns [B, h*w, 128] in compute_dtype.
        """
        cfg, dtype = self.config, self.compute_dtype
        b, n_img, _ = img.shape
        if n_img != h * w:
            raise ValueError(f"Ideogram 4: {n_img} image tokens do not fit an {h} x {w} patch grid")
        n_txt = txt.shape[1]
        key_mask = None  # None: every token real, nothing read on the host (the planner runs this on meta)
        if txt_mask is not None and n_txt and not bool(txt_mask.all()):  # one host sync; all real: fused kernels
            key_mask = torch.cat((txt_mask.bool(), txt_mask.new_ones(b, n_img, dtype=torch.bool)), dim=1)
        mask = torch.ones(b, n_txt, dtype=torch.bool, device=img.device) if txt_mask is None else txt_mask.bool()

        adaln = self.conditioning(timesteps)
        text = txt.to(dtype) if key_mask is None else txt.to(dtype) * mask[..., None].to(dtype)
        text = self.llm_cond_proj(self.llm_cond_norm(text))
        if key_mask is not None:
            text = text * mask[..., None].to(dtype)
        text = text + self.embed_image_indicator.weight[0].to(dtype)
        image = self.input_proj(img.to(dtype)) + self.embed_image_indicator.weight[1].to(dtype)
        x = torch.cat((text, image), dim=1)
        cos, sin = mrope_tables_f32(joint_positions(mask, h, w), cfg.attention_head_dim, cfg.rope_theta,
                                    cfg.mrope_section)

        ckpt, swap = self.gradient_checkpointing, self.block_swap
        for i, block in enumerate(self.layers):
            x = run_block(block, ckpt, x, adaln, cos, sin, key_mask, swap=swap, index=i)
        return -self.final_layer(x[:, n_txt:], adaln)

    def swappable_blocks(self) -> list[nn.Module]:
        return list(self.layers)


def random_inputs(config: Ideogram4Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    tapped text states N(0, 1) whose first quarter is left padding (masked), as the pipeline pads."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] >= text_len - real
    txt = torch.randn(1, text_len, config.llm_features_dim, generator=generator)
    fixed = dict(txt=txt, txt_mask=mask, h=h, w=w)
    # The doctor records core.rope_tables calls; this model computes its M-RoPE tables itself (float32 from
    # int64 positions outside autocast, mrope_tables_f32), so it sees none: axes_dim names the sections' widths.
    axes = tuple(2 * s for s in config.mrope_section)
    return RandomInputs(fixed, joint_positions(mask, h, w), axes, float(config.rope_theta))
