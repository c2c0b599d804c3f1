"""ERNIE-Image transformer on the shared core, with diffusers' module names (the released files' own).

What ERNIE-Image is (diffusers' ErnieImageTransformer2DModel, models/transformers/transformer_ernie_image.py):
- One stack of identical single-stream blocks (`layers`) over [image tokens, text tokens], image first.
  The image enters as patchified latents (FLUX.2's VAE, 32 channels x 2x2 = 128, BN-normalised by the
  pipeline) through a patch-size-1 Conv2d (`x_embedder.proj`); the text (Ministral-3 3B hidden states,
  3072 wide) through `text_proj` (no bias; absent when text_in_dim == hidden_size).
- adaLN shared by every block: one `adaLN_modulation` (SiLU, Linear) of the timestep embedding gives
  (shift, scale, gate) for attention and for the MLP, the same for all blocks. Pre-norms are RMSNorms
  with weights (`adaLN_sa_ln`, `adaLN_mlp_ln`); QK RMSNorm per head; the MLP is GELU(erf)-gated
  (`linear_fc2(up_proj(x) * gelu(gate_proj(x)))`); no biases inside the blocks.
- The timestep embedding is sinusoidal over hidden_size channels, sin half first (diffusers' Timesteps with
  flip_sin_to_cos=False) of 1000 * sigma, then `time_embedding.linear_1` / `linear_2`; `final_norm` (LayerNorm
  without affine, (scale, shift) from `final_norm.linear` of that embedding, no SiLU) and `final_linear`.
- 3-axis RoPE (32, 48, 48), theta 256. Text token j sits at (j, 0, 0); image patch (r, c) at (T, r, c),
  T = that prompt's real text length. Each angle is repeated for two adjacent channels ([a0, a0, a1, a1,
  ...]) but the rotation pairs the two halves of the head (Megatron's rotate_half, rotary_interleaved=False):
  channel j < D/2 turns with angle j // 2, its partner j + D/2 with angle (j + D/2) // 2. That is not a
  rotation of each pair; it is what the released weights were trained with (diffusers' processor computes
  the same), so core.apply_rope does not fit and `rotate_half_rope` below does it.
- Padded text keys are masked (key padding mask; the image tokens are never masked).

Our forward takes sigma in [0, 1] (1 = pure noise) and embeds 1000 * sigma, the network's own timestep
(the pipeline feeds the scheduler's timesteps, sigma * 1000). It predicts the flow velocity noise - x0: the
scheduler steps x + (sigma_next - sigma) * v and ai-toolkit's loss target is noise - latents, so the
family uses the output as it is (no negation, unlike Z-Image).

Tokens in and out are the packed layout (library/models/latents.py pack_latents: [B, h*w, 128], features
(c, ph, pw)), which is exactly the patchified latent [B, 128, h, w] the pipeline feeds, read row-major.

Precision (shared/DESIGN.md): img / txt are cast to `compute_dtype` at entry. Positions are int64 and become
float32 cos/sin tables from float64 angles outside autocast (core.rope_tables), never cast with the model
(diffusers computes the angles in float32 and casts the tables to the activation dtype). The timestep is
embedded in float32 and cast to compute_dtype before `time_embedding` (diffusers' pipeline first casts
sigma * 1000 to the activation dtype: in bf16 its timestep is off by up to 2 of 1000). Modulation and gating
run in float32 with one rounding to the activation dtype, as diffusers does; QK norm and RoPE run in float32
with one rounding (diffusers rounds after each). Output in compute_dtype.

Parameter count of the released config (baidu/ERNIE-Image and ERNIE-Image-Turbo's transformer/config.json,
on `meta`; diffusers' class with that config gives the same): 8,033,490,048, 0.9999 of them in Linear weights.
diffusers' constructor defaults (hidden 3072, 24 layers, text 2560) are not a released size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    LayerNormNoAffine, RMSNorm, attention, float32_gated, float32_modulated, rope_tables, run_block, split_modulation,
    timestep_embedding,
)


@dataclass(frozen=True)
class ErnieImageConfig:
    """diffusers' ErnieImageTransformer2DModel arguments (same names), defaults the released model's."""

    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_layers: int = 36
    ffn_hidden_size: int = 12288
    in_channels: int = 128  # the patchified latent: 32 VAE channels x 2x2; a packed token's width
    out_channels: int = 128
    patch_size: int = 1  # the model's own patch embedding over that latent (a per-token Conv2d at 1)
    text_in_dim: int = 3072  # the text encoder's hidden states (Ministral-3 3B)
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (32, 48, 48)  # RoPE widths of the (text index, row, column) axes
    eps: float = 1e-6  # every RMSNorm and the final LayerNorm

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}")
        if len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) != self.head_dim:
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} must be 3 axes summing to head_dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# The released sizes: baidu/ERNIE-Image and ERNIE-Image-Turbo publish the same transformer config (Turbo's adds
# "lora_rank" / "use_lora": false, which diffusers ignores); they differ in weights and sampling steps.
ERNIE_IMAGE = ErnieImageConfig()
ERNIE_IMAGE_TURBO = ErnieImageConfig()
ERNIE_IMAGE_CONFIGS = {"base": ERNIE_IMAGE, "turbo": ERNIE_IMAGE_TURBO}


# ----------------------------------------------------------------------------------------------
# Positions and RoPE


def joint_positions(text_lengths: torch.Tensor, h: int, w: int, text_len: int) -> torch.Tensor:
    """RoPE positions [B, h*w + text_len, 3] int64 of [image, text]: patch (r, c) of the h x w grid at
    (T_b, r, c) with T_b = text_lengths[b] (int64 [B], that row's real tokens), text token j at (j, 0, 0)
    (padding included: it is masked as a key)."""
    device, b = text_lengths.device, text_lengths.shape[0]
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    image = torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).reshape(1, h * w, 3).repeat(b, 1, 1)
    image[..., 0] = text_lengths[:, None]
    text = torch.zeros(b, text_len, 3, dtype=torch.int64, device=device)
    text[..., 0] = torch.arange(text_len, device=device)
    return torch.cat((image, text), dim=1)


def pair_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tables' float32 [B, L, D/2] (one column per angle) -> float32 [B, 1, L, D] with each angle
    repeated for two adjacent channels (ERNIE's layout), broadcast over the heads."""
    return cos.repeat_interleave(2, dim=-1)[:, None], sin.repeat_interleave(2, dim=-1)[:, None]


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1) for the halves (x1, x2) of the head:
    x [B, H, L, D] float32, cos/sin from pair_tables. Returns float32."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ----------------------------------------------------------------------------------------------
# Layers



class PatchEmbed(nn.Module):
    """`proj`: Conv2d(in_channels, hidden, patch, stride patch) over the patchified latent grid."""

    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(cfg.in_channels, cfg.hidden_size, kernel_size=p, stride=p, bias=True)

    def forward(self, img: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """img [B, h*w, in_channels] (the grid row-major) -> [B, (h/p)*(w/p), hidden]."""
        grid = img.transpose(1, 2).unflatten(-1, (h, w))  # [B, C, h, w], a view (channels-last memory)
        return self.proj(grid).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Self-attention with diffusers' names (to_q, to_k, to_v, norm_q, norm_k, to_out.0); no biases."""

    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        d, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(cfg.head_dim, cfg.eps), RMSNorm(cfg.head_dim, cfg.eps)
        self.to_out = nn.ModuleList([nn.Linear(d, d, bias=False)])

    def forward(self, y: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        """Attention output before `to_out` [B, L, hidden] (the block projects it: residual_projection).
        y [B, L, hidden]; cos/sin float32 [B, 1, L, head_dim]; mask bool [B, 1, 1, L] (True = attend) or None."""
        q, k, v = (p(y).unflatten(-1, (self.heads, -1)).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        # QK norm and RoPE in float32 ([B, H, L, D]), then one rounding to the activation dtype
        q = rotate_half_rope(self.norm_q(q.float()), cos, sin).to(v.dtype)
        k = rotate_half_rope(self.norm_k(k.float()), cos, sin).to(v.dtype)
        return attention(q, k, v, mask=mask)


class FeedForward(nn.Module):
    """linear_fc2(up_proj(x) * gelu(gate_proj(x))), exact (erf) GELU, no biases."""

    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection `linear_fc2` reads."""
        return self.up_proj(x) * F.gelu(self.gate_proj(x))


class Block(nn.Module):
    """One layer: x + gate * attn(modulate(rms(x))), then x + gate * mlp(modulate(rms(x)))."""

    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.adaLN_sa_ln = RMSNorm(cfg.hidden_size, cfg.eps)
        self.self_attention = Attention(cfg)
        self.adaLN_mlp_ln = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x, mod, cos, sin, mask):
        """x [B, L, hidden]; mod [B, 6 hidden], the shared modulation (split here so that checkpointing sees a
        plain tensor); cos/sin float32 [B, 1, L, head_dim]; mask bool [B, 1, 1, L] or None."""
        attn, mlp = split_modulation(mod, 2)  # (shift, scale, gate) x (attention, MLP), each [B, 1, hidden]
        y = float32_modulated(self.adaLN_sa_ln(x), attn.shift, attn.scale)
        x = x + float32_gated(attn, self.self_attention.to_out[0], self.self_attention(y, cos, sin, mask), x.dtype)
        y = float32_modulated(self.adaLN_mlp_ln(x), mlp.shift, mlp.scale)
        return x + float32_gated(mlp, self.mlp.linear_fc2, self.mlp.hidden(y), x.dtype, last=True)


class TimeEmbedding(nn.Module):
    """linear_2(silu(linear_1(emb))) (diffusers' TimestepEmbedding names), hidden -> hidden."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(emb)))


def sinusoid(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 [B, dim]: sin half first (diffusers' Timesteps(flip_sin_to_cos=False)) of 1000 sigma."""
    cos_sin = timestep_embedding(sigma, dim, time_factor=1000.0)  # core's order: cos half first
    return torch.cat(cos_sin.chunk(2, dim=-1)[::-1], dim=-1)


class FinalNorm(nn.Module):
    """LayerNorm (no affine) then (1 + scale) * x + shift, (scale, shift) = `linear`(c) (no SiLU before it)."""

    def __init__(self, cfg: ErnieImageConfig):
        super().__init__()
        self.norm = LayerNormNoAffine(cfg.hidden_size, cfg.eps)
        self.linear = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(c)[:, None].chunk(2, dim=-1)
        return self.norm(x) * (1 + scale) + shift


# ----------------------------------------------------------------------------------------------
# Model


class ErnieImage(nn.Module):
    def __init__(self, config: ErnieImageConfig = ERNIE_IMAGE):
        super().__init__()
        self.config = cfg = config
        h = cfg.hidden_size
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.x_embedder = PatchEmbed(cfg)
        self.text_proj = nn.Linear(cfg.text_in_dim, h, bias=False) if cfg.text_in_dim != h else None
        self.time_embedding = TimeEmbedding(h)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 6 * h))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = FinalNorm(cfg)
        self.final_linear = nn.Linear(h, cfg.patch_size * cfg.patch_size * cfg.out_channels)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        timesteps: torch.Tensor,
        h: int,
        w: int,
        txt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) of the image tokens; the family uses it as it is.

        img [B, h*w, in_channels]: the patchified latent grid h x w row-major (pack_latents' tokens); cast
            to compute_dtype.
        txt [B, T, text_in_dim]: text hidden states, each row's real tokens first; cast likewise.
        txt_mask [B, T] bool (True = real token, real tokens first: diffusers' text_lens = its row sums), or
            None: every token real. A mask is dropped when it masks nothing (one host sync; on `meta` kept).
        timesteps [B]: sigma in [0, 1] (1 = noise); the network gets 1000 * sigma, embedded in float32.
        Returns [B, h*w, out_channels] in compute_dtype, the layout of img.
        """
        cfg, dtype, p = self.config, self.compute_dtype, self.config.patch_size
        b, n_img, _ = img.shape
        if n_img != h * w or h % p or w % p:
            raise ValueError(f"ERNIE-Image: {n_img} image tokens do not fit an {h} x {w} grid of patch size {p}")
        hp, wp, n_txt = h // p, w // p, txt.shape[1]

        lengths, mask = self._text_lengths_and_mask(txt_mask, b, n_txt, hp * wp, img.device)
        # Positions (int64) -> float32 tables from float64 angles, outside autocast (core.rope_tables)
        cos, sin = pair_tables(*rope_tables(joint_positions(lengths, hp, wp, n_txt), cfg.rope_axes_dim,
                                            cfg.rope_theta))

        c = self.time_embedding(sinusoid(timesteps, cfg.hidden_size).to(dtype))  # [B, hidden]
        mod = self.adaLN_modulation(c)  # [B, 6 hidden]: every block's (shift, scale, gate) x 2
        txt = txt.to(dtype)
        txt = self.text_proj(txt) if self.text_proj is not None else txt
        x = torch.cat((self.x_embedder(img.to(dtype), h, w), txt), dim=1)  # [B, hp*wp + T, hidden]
        ckpt, swap = self.gradient_checkpointing, self.block_swap
        for i, block in enumerate(self.layers):
            x = run_block(block, ckpt, x, mod, cos, sin, mask, swap=swap, index=i)
        patches = self.final_linear(self.final_norm(x[:, : hp * wp], c))  # [B, hp*wp, (p p C)]
        # patches (ph, pw, C) -> the h x w grid row-major (diffusers' unpatchify; a view at patch size 1)
        out = patches.unflatten(-1, (p, p, -1)).unflatten(1, (hp, wp)).permute(0, 1, 3, 2, 4, 5)
        return out.reshape(b, h * w, -1)

    @staticmethod
    def _text_lengths_and_mask(txt_mask, b: int, n_txt: int, n_img: int, device):
        """(real text tokens per row, int64 [B]; the key mask bool [B, 1, 1, n_img + n_txt] or None)."""
        if txt_mask is None:
            return torch.full((b,), n_txt, dtype=torch.int64, device=device), None
        txt_mask = txt_mask.to(device=device, dtype=torch.bool)
        lengths = txt_mask.sum(1)  # int64, on the device: no host sync
        if device.type != "meta" and bool(txt_mask.all()):  # nothing masked: SDPA's fastest kernels
            return lengths, None
        return lengths, torch.cat((txt_mask.new_ones(b, n_img), txt_mask), dim=1)[:, None, None, :]

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N)."""
        return list(self.layers)


def random_inputs(config: ErnieImageConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w token grid with random text (tools/precision_doctor.py):
    text hidden states N(0, 1) whose last quarter is padding (masked), as a short prompt's would be. The
    expected positions are the model's one rope_tables call: [image, text], the image at the real length."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] < real
    fixed = dict(txt=torch.randn(1, text_len, config.text_in_dim, generator=generator), txt_mask=mask, h=h, w=w)
    p = config.patch_size
    positions = joint_positions(torch.tensor([real]), h // p, w // p, text_len)
    return RandomInputs(fixed, positions, tuple(config.rope_axes_dim), float(config.rope_theta))
