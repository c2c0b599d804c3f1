"""Krea 2 (Raw, Turbo) transformer on the shared core, with the original (krea-ai/krea-2) module names.

What Krea 2 is (diffusers' Krea2Transformer2DModel, models/transformers/transformer_krea2.py):
- One stack of identical single-stream blocks (`blocks`) over [text tokens, image tokens].
- Text conditioning is a stack of hidden states tapped from 12 layers of Qwen3-VL-4B per token
  [B, T, 12, 2560]. A small text-fusion transformer (`txtfusion`) first attends across the 12
  layers of each token (`layerwise_blocks`, no mask, no RoPE), collapses that axis with a
  Linear(12 -> 1) (`projector`), then attends across the tokens (`refiner_blocks`, padding masked);
  `txtmlp` (RMSNorm, Linear, GELU, Linear) projects the result to the model width.
- Every RMSNorm is zero-centred: its stored `scale` s multiplies as (1 + s), computed in float32.
- Attention: grouped-query (48 query / 12 key-value heads of 128), RMSNorm on q and k per head,
  3-axis RoPE (32, 48, 48) with theta 1000 on interleaved pairs, and a sigmoid output gate:
  wo(attention * sigmoid(gate(x))). Text tokens sit at (0, 0, 0), image patch (r, c) at (0, r, c).
- Time: sigma (1 = noise) embedded as 1000 sigma (cos half first), `tmlp` to the width; one shared
  `tproj` (GELU, Linear to 6 widths) gives every block its modulation, to which each block adds its
  own learned `mod.lin` [6 * width] (pre-scale, pre-shift, pre-gate, post-scale, post-shift,
  post-gate). The final layer adds its `modulation.lin` [2, width] (scale, shift) to tmlp's output.
- Edit (ai-toolkit's `edit: true`, ComfyUI-Krea2-Ostris-Edit): clean reference latents join the
  sequence after the target as [text, target, references], reference i's patches at (i + 1, r, c);
  every block modulates them with tproj(tmlp(t = 0)) (Kontext's "index_timestep_zero"); with
  kv_cache a reference query attends only to reference keys. The output is the target's tokens.
- The output is the velocity noise - x0 (the pipeline's scheduler steps x + (s' - s) v): no
  conversion. Tokens are 2 x 2 patches with features (c, ph, pw): the shared pack_latents layout.

Names mirror the released single files (raw.safetensors, turbo.safetensors): they load by plain key;
diffusers folders through the rename table of checkpoint.py. Precision (shared/DESIGN.md): inputs
are cast to `compute_dtype` at entry; positions are int64 and become float32 RoPE tables outside
autocast (core.rope_tables); the timestep is embedded in float32 and only then cast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    apply_rope, attention, residual_projection, rms_norm, rope_tables, run_block, timestep_embedding,
)

TIME_FACTOR = 1000.0  # sigma is embedded as 1000 sigma


@dataclass(frozen=True)
class Krea2Config:
    """diffusers' Krea2Transformer2DModel arguments (config.json names), defaults = the released
    model: diffusers' defaults and docstring, and ai-toolkit's KREA2_MMDIT_CONFIG ("oss_raw /
    oss_turbo share it": features 6144, heads 48, kvheads 12, layers 28, txtdim 2560, txtlayers 12,
    txtheads 20, multiplier 4, patch 2, channels 16)."""

    in_channels: int = 64  # 16 latent channels x 2 x 2 patches
    num_layers: int = 28
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    num_key_value_heads: int = 12
    intermediate_size: int = 16384
    timestep_embed_dim: int = 256
    text_hidden_dim: int = 2560  # Qwen3-VL-4B's width
    num_text_layers: int = 12  # tapped encoder layers per token
    text_num_attention_heads: int = 20
    text_num_key_value_heads: int = 20
    text_intermediate_size: int = 6912
    num_layerwise_text_blocks: int = 2
    num_refiner_text_blocks: int = 2
    axes_dims_rope: tuple[int, ...] = (32, 48, 48)
    rope_theta: float = 1000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim or len(self.axes_dims_rope) != 3:
            raise ValueError(f"Krea 2: axes_dims_rope {self.axes_dims_rope} must be 3 axes summing to "
                             f"attention_head_dim {self.attention_head_dim}")
        if self.num_attention_heads % self.num_key_value_heads or self.text_hidden_dim % self.text_num_attention_heads:
            raise ValueError(f"Krea 2: heads {self.num_attention_heads} / {self.num_key_value_heads}, text width "
                             f"{self.text_hidden_dim} / {self.text_num_attention_heads} heads do not divide")

    @property
    def hidden_size(self) -> int:
        return self.attention_head_dim * self.num_attention_heads

    @property
    def token_width(self) -> int:
        return self.in_channels  # what the tools size a packed token by


KREA2_RAW = Krea2Config()  # krea/Krea-2-Raw (the full-step model LoRAs train on)
KREA2_TURBO = Krea2Config()  # krea/Krea-2-Turbo: the same transformer, step-distilled weights
KREA2_CONFIGS = {"raw": KREA2_RAW, "turbo": KREA2_TURBO}


# ----------------------------------------------------------------------------------------------
# Layers


class ZeroRMSNorm(nn.Module):
    """RMSNorm whose stored `scale` is zero-centred: y = rms_norm(x) * (1 + scale), in float32,
    returned in x's dtype (the original RMSNorm and diffusers' Krea2RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale.float() + 1.0, self.eps)


class QKNorm(nn.Module):
    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.qnorm, self.knorm = ZeroRMSNorm(head_dim, eps), ZeroRMSNorm(head_dim, eps)


class Attention(nn.Module):
    """Grouped-query self-attention with q/k RMSNorm, optional RoPE and a sigmoid output gate."""

    def __init__(self, dim: int, heads: int, kv_heads: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.gate = nn.Linear(dim, dim, bias=False)
        self.qknorm = QKNorm(head_dim, eps)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos=None, sin=None, mask=None):
        """x [B, L, dim]; cos/sin float32 [L, head_dim/2] or None (no RoPE); mask bool [B, L]
        (True = a real key), [B or 1, L, L] (query, key; True = attend) or None (all attend all)."""
        q = self.qknorm.qnorm(self.wq(x).unflatten(-1, (self.heads, -1))).transpose(1, 2)  # [B, H, L, D]
        k = self.qknorm.knorm(self.wk(x).unflatten(-1, (self.kv_heads, -1))).transpose(1, 2)  # [B, Hkv, L, D]
        v = self.wv(x).unflatten(-1, (self.kv_heads, -1)).transpose(1, 2)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is not None:
            # [B, 1, 1, L]: padded keys hidden from every query; [B, 1, L, L]: per query (references)
            mask = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None]
            # With a mask SDPA's efficient kernels refuse enable_gqa (math would build [B, H, L, L]):
            # repeat the key / value heads instead, as diffusers does (the same values).
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        out = attention(q, k, v, mask=mask)  # [B, L, H * D]
        return self.wo(out * torch.sigmoid(self.gate(x)))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(self.hidden(x))

    def hidden(self, x):
        """The activations the output projection `down` reads."""
        return F.silu(self.gate(x)) * self.up(x)


class TextFusionBlock(nn.Module):
    """Pre-norm block without modulation or RoPE: x += attn(prenorm(x)); x += mlp(postnorm(x))."""

    def __init__(self, cfg: Krea2Config):
        super().__init__()
        d = cfg.text_hidden_dim
        self.prenorm, self.postnorm = ZeroRMSNorm(d, cfg.norm_eps), ZeroRMSNorm(d, cfg.norm_eps)
        self.attn = Attention(d, cfg.text_num_attention_heads, cfg.text_num_key_value_heads, cfg.norm_eps)
        self.mlp = SwiGLU(d, cfg.text_intermediate_size)

    def forward(self, x, key_mask=None):
        x = x + self.attn(self.prenorm(x), mask=key_mask)
        return x + self.mlp(self.postnorm(x))


class TextFusion(nn.Module):
    """[B, T, layers, text_dim] tapped hidden states -> [B, T, text_dim] text features."""

    def __init__(self, cfg: Krea2Config):
        super().__init__()
        self.layerwise_blocks = nn.ModuleList(TextFusionBlock(cfg) for _ in range(cfg.num_layerwise_text_blocks))
        self.projector = nn.Linear(cfg.num_text_layers, 1, bias=False)
        self.refiner_blocks = nn.ModuleList(TextFusionBlock(cfg) for _ in range(cfg.num_refiner_text_blocks))


@dataclass
class BlockModulation:
    """A block's six modulation vectors, each [B, 1, dim]: f's input (1 + scale) norm(x) + shift,
    its output entering as x + gate * f."""

    prescale: torch.Tensor
    preshift: torch.Tensor
    pregate: torch.Tensor
    postscale: torch.Tensor
    postshift: torch.Tensor
    postgate: torch.Tensor


class SingleStreamBlock(nn.Module):
    def __init__(self, cfg: Krea2Config):
        super().__init__()
        d = cfg.hidden_size
        self.mod = nn.Module()
        self.mod.lin = nn.Parameter(torch.zeros(6 * d))  # this block's learned offset of the shared modulation
        self.prenorm, self.postnorm = ZeroRMSNorm(d, cfg.norm_eps), ZeroRMSNorm(d, cfg.norm_eps)
        self.attn = Attention(d, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size)

    def modulation(self, tvec: torch.Tensor) -> BlockModulation:
        return BlockModulation(*(tvec + self.mod.lin.to(tvec.dtype)).chunk(6, dim=-1))

    def forward(self, x, tvec, cos, sin, mask=None, ref_tvec=None, n_refs: int = 0):
        """x [B, L, dim]; tvec [B, 1, 6 dim] (tproj's output, shared by every block). With n_refs > 0
        the last n_refs tokens are clean references, modulated by ref_tvec (tproj at t = 0) instead."""
        m = self.modulation(tvec)
        if n_refs == 0:
            x = x + m.pregate * self.attn((1 + m.prescale) * self.prenorm(x) + m.preshift, cos, sin, mask)
            h = self.mlp.hidden((1 + m.postscale) * self.postnorm(x) + m.postshift)
            return x + m.postgate * residual_projection(self.mlp.down, h, m.postgate.requires_grad)
        r, split = self.modulation(ref_tvec), x.shape[1] - n_refs

        def spans(h, f):  # f(modulation, tokens) on [text, target] with m and on the references with r
            return torch.cat((f(m, h[:, :split]), f(r, h[:, split:])), dim=1)

        y = spans(self.prenorm(x), lambda s, h: (1 + s.prescale) * h + s.preshift)
        x = x + spans(self.attn(y, cos, sin, mask), lambda s, h: s.pregate * h)
        y = spans(self.postnorm(x), lambda s, h: (1 + s.postscale) * h + s.postshift)
        needed = m.postgate.requires_grad or r.postgate.requires_grad
        return x + spans(residual_projection(self.mlp.down, self.mlp.hidden(y), needed), lambda s, h: s.postgate * h)


class LastLayer(nn.Module):
    """(1 + scale) norm(x) + shift, then the patch projection; (scale, shift) = tmlp(t) + modulation.lin."""

    def __init__(self, cfg: Krea2Config):
        super().__init__()
        self.norm = ZeroRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.linear = nn.Linear(cfg.hidden_size, cfg.in_channels, bias=True)
        self.modulation = nn.Module()
        self.modulation.lin = nn.Parameter(torch.zeros(2, cfg.hidden_size))

    def forward(self, x, t):
        """x [B, N, dim]; t [B, 1, dim] (tmlp's output)."""
        scale, shift = (t + self.modulation.lin.to(t.dtype)).chunk(2, dim=1)  # [B, 2, dim] -> 2 x [B, 1, dim]
        return self.linear((1 + scale) * self.norm(x) + shift)


# ----------------------------------------------------------------------------------------------
# Positions


def joint_positions(text_len: int, h: int, w: int, device=None) -> torch.Tensor:
    """[text_len + h*w, 3] int64: text tokens at (0, 0, 0), image patch (r, c) at (0, r, c)
    (Krea2Pipeline.prepare_position_ids)."""
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    image = torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).reshape(h * w, 3)
    return torch.cat((torch.zeros(text_len, 3, dtype=torch.int64, device=device), image))


def reference_positions(grids: list[tuple[int, int]], device=None) -> torch.Tensor:
    """[sum of h*w, 3] int64: patch (r, c) of the i-th reference's h x w grid at (i + 1, r, c), the
    references in order. ai-toolkit's Krea 2 edit (pack_ref_latents) places references on the first
    axis, which the text and the target keep at 0 (ComfyUI's Kontext "index" placement)."""
    parts = []
    for i, (h, w) in enumerate(grids):
        grid = joint_positions(0, h, w, device)
        grid[:, 0] = i + 1
        parts.append(grid)
    return torch.cat(parts) if parts else torch.zeros(0, 3, dtype=torch.int64, device=device)


@dataclass
class References:
    """Clean reference latents riding after the target's tokens (ai-toolkit's Krea 2 edit scheme,
    model_kwargs edit: true). Every sample of a batch has the same references' grids (one layout per
    bucket), so the positions are shared.

    tokens [B, R, in_channels]: each reference packed as pack_latents packs the target, concatenated.
    positions [R, 3] int64: reference_positions of their grids.
    isolate: ai-toolkit's kv_cache (isolate_refs): reference queries attend only to reference keys, so
        their states never depend on the target or the timestep (cacheable across sampling steps); the
        text and target still attend to everything. A LoRA trained with it should sample with it.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    isolate: bool = False


def joint_attention_mask(key_mask: torch.Tensor | None, n_txt: int, n_img: int, n_refs: int, isolate: bool,
                         device) -> torch.Tensor | None:
    """The blocks' mask over [text, target, references]: None (all attend all), the key mask [B, L]
    (padded text keys hidden), or with `isolate` [B or 1, L, L] (query, key) where a reference query
    sees only reference keys."""
    if key_mask is not None:
        key_mask = torch.cat((key_mask, key_mask.new_ones(key_mask.shape[0], n_img + n_refs)), dim=1)
    if not (isolate and n_refs):
        return key_mask
    is_ref = torch.arange(n_txt + n_img + n_refs, device=device) >= n_txt + n_img
    allowed = (~is_ref[:, None] | is_ref[None, :])[None]  # [1, L, L]
    return allowed if key_mask is None else allowed & key_mask[:, None, :]

# ----------------------------------------------------------------------------------------------
# Model


class Krea2(nn.Module):
    def __init__(self, config: Krea2Config = KREA2_RAW):
        super().__init__()
        self.config = cfg = config
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called
        d = cfg.hidden_size

        self.first = nn.Linear(cfg.in_channels, d, bias=True)
        self.tmlp = nn.Sequential(nn.Linear(cfg.timestep_embed_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.tproj = nn.Sequential(nn.GELU(approximate="tanh"), nn.Linear(d, 6 * d))
        self.txtfusion = TextFusion(cfg)
        self.txtmlp = nn.Sequential(ZeroRMSNorm(cfg.text_hidden_dim, cfg.norm_eps), nn.Linear(cfg.text_hidden_dim, d),
                                    nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.num_layers))
        self.last = LastLayer(cfg)

    def text_features(self, txt: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, T, layers, text_dim] -> [B, T, dim]: the text-fusion transformer and txtmlp."""
        b, n, layers, d = txt.shape
        ckpt, swap, fusion = self.gradient_checkpointing, self.block_swap, self.txtfusion
        x = txt.reshape(b * n, layers, d)  # each token's layers attend to each other, nothing else
        for i, block in enumerate(fusion.layerwise_blocks):
            x = run_block(block, ckpt, x, swap=swap, index=i)
        x = fusion.projector(x.reshape(b, n, layers, d).transpose(2, 3)).squeeze(-1)  # [B, T, text_dim]
        first = len(fusion.layerwise_blocks)
        for i, block in enumerate(fusion.refiner_blocks):
            x = run_block(block, ckpt, x, key_mask, swap=swap, index=first + i)
        return self.txtmlp(x)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        timesteps: torch.Tensor,
        h: int,
        w: int,
        txt_mask: torch.Tensor | None = None,
        refs: References | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for packed latents.

        img [B, h*w, 64]: an h x w grid of 2x2 patches in pack_latents' layout; cast to compute_dtype.
        txt [B, T, num_text_layers, text_dim]: the tapped text-encoder states; cast likewise.
        txt_mask [B, T] bool (True = real token), None: every token real. Padded tokens are hidden
            as keys everywhere and dropped at the output, so only the real tokens count.
        timesteps [B]: sigma in [0, 1] (1 = pure noise), embedded in float32.
        refs: clean reference tokens (the edit scheme) or None. They join the sequence after the
            target, modulated in every block as at t = 0 (the final layer never sees them: the output
            is the target's only).
        Returns [B, h*w, 64] in compute_dtype.
        """
        cfg, dtype = self.config, self.compute_dtype
        b, n_img, _ = img.shape
        if n_img != h * w:
            raise ValueError(f"Krea 2: {n_img} image tokens do not fit an {h} x {w} patch grid")
        n_txt = txt.shape[1]
        key_mask = None
        if txt_mask is not None and not bool(txt_mask.all()):  # one host sync; all real: no mask (fused kernels)
            key_mask = txt_mask.bool()

        t = self.tmlp(timestep_embedding(timesteps, cfg.timestep_embed_dim, time_factor=TIME_FACTOR).to(dtype))[:, None]
        tvec = self.tproj(t)  # [B, 1, 6 dim]
        text = self.text_features(txt.to(dtype), key_mask)
        x = torch.cat((text, self.first(img.to(dtype))), dim=1)  # [text, image]
        positions = joint_positions(n_txt, h, w, img.device)
        n_refs, ref_tvec = 0, None
        if refs is not None and refs.tokens.shape[1]:
            n_refs = refs.tokens.shape[1]
            x = torch.cat((x, self.first(refs.tokens.to(dtype))), dim=1)  # [text, image, references]
            positions = torch.cat((positions, refs.positions.to(img.device)))
            t0 = timestep_embedding(torch.zeros_like(timesteps), cfg.timestep_embed_dim, time_factor=TIME_FACTOR)
            ref_tvec = self.tproj(self.tmlp(t0.to(dtype))[:, None])  # the references' clean time
        cos, sin = rope_tables(positions, cfg.axes_dims_rope, cfg.rope_theta)  # float32
        isolate = refs is not None and refs.isolate
        joint_mask = joint_attention_mask(key_mask, n_txt, n_img, n_refs, isolate, img.device)

        ckpt, swap, first = self.gradient_checkpointing, self.block_swap, self.n_text_blocks
        for i, block in enumerate(self.blocks):
            x = run_block(block, ckpt, x, tvec, cos, sin, joint_mask, ref_tvec, n_refs, swap=swap, index=first + i)
        return self.last(x[:, n_txt : n_txt + n_img], t)

    @property
    def n_text_blocks(self) -> int:
        return len(self.txtfusion.layerwise_blocks) + len(self.txtfusion.refiner_blocks)

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order: text fusion (layerwise, refiner), then the main blocks."""
        return [*self.txtfusion.layerwise_blocks, *self.txtfusion.refiner_blocks, *self.blocks]


def random_inputs(config: Krea2Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    tapped text states N(0, 1) whose last quarter is padding (masked), as a short caption's in a batch."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] < real
    txt = torch.randn(1, text_len, config.num_text_layers, config.text_hidden_dim, generator=generator)
    fixed = dict(txt=txt, txt_mask=mask, h=h, w=w)
    return RandomInputs(fixed, joint_positions(text_len, h, w)[None], tuple(config.axes_dims_rope), float(config.rope_theta))
