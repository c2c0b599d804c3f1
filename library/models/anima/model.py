"""Anima transformer on the shared core, with the released single file's module names (minus its "net." prefix).

What Anima is (CircleStone Labs; NVIDIA's Cosmos-Predict2 MiniTrainDIT plus an "LLM adapter"; sources: sd-scripts'
library/anima_models.py, the peer that trains it, and diffusers' CosmosTransformer3DModel
(models/transformers/transformer_cosmos.py) + AnimaTextConditioner (models/condition_embedders/
condition_embedder_anima.py), the parity oracles):
- The LLM adapter (`llm_adapter`) runs once per forward, before the DiT: learned T5-vocabulary embeddings of the
  prompt's T5 token ids (`embed`, 32128 x 1024) are the queries of 6 blocks of [self-attention over the T5 tokens,
  cross-attention to the Qwen3-0.6B hidden states (1024 wide), GELU(erf) MLP], each with a pre-RMSNorm (weights)
  and QK RMSNorm per head (16 heads of 64), 1-D RoPE (theta 10000, rotate-half pairing) on the queries at their
  T5 positions and on the keys at theirs (the Qwen positions in cross-attention); then `out_proj` (bias) and
  `norm`. Its output is zeroed at T5 padding and padded with zero tokens to at least 512 (diffusers'
  min_sequence_length; sd-scripts pads the T5 ids to 512): the DiT's cross-attention has no mask and attends to
  those zero tokens too, which changes the result, as in both references.
- The DiT: the 16-channel latent as 2x2 patches (64 features (c, ph, pw)) plus Cosmos' padding-mask channel (zero
  for images: 17 x 2 x 2 = 68 inputs of `x_embedder.proj.1`, no bias), 28 blocks of width 2048 (16 heads of 128):
  LayerNorm (no affine) + adaLN -> self-attention (3-D RoPE) -> the same -> cross-attention to the adapter's 1024-wide
  output (no RoPE, no mask) -> the same -> GELU(erf) MLP (x4, `layer1`/`layer2`), no biases, QK RMSNorm (eps 1e-6).
- adaLN-LoRA: the timestep's sinusoid (cos half first) of sigma itself (diffusers' pipeline passes t / 1000 =
  sigma) is both the RMSNorm'd condition `emb` (`t_embedding_norm`) and, through `t_embedder.1` (linear_1,
  SiLU, linear_2 to 3 x 2048, no biases), a shared `temb`; each modulation is SiLU(emb) -> Linear(2048, 256) ->
  Linear(256, 3 x 2048) plus `temb` = (shift, scale, gate); the final layer's takes temb's first 2 x 2048
  as (shift, scale).
- RoPE 3-D (t, h, w) over the head's 128 channels: 44 / 42 / 42 (h and w get head_dim // 6 * 2 each), per-axis
  theta 10000 * ratio ** (d / (d - 2)) with NTK ratios (t, h, w) = (1, 4, 4) (sd-scripts' load_anima_model
  config; diffusers' rope_scale), rotate-half pairing (the table is [t, h, w] twice). Images are one frame:
  t = 0 everywhere; patch (r, c) at (0, r, c).

Our forward takes sigma in [0, 1] and returns the network's output as it is: the flow velocity noise - x0 that
diffusers' pipeline hands to FlowMatchEulerDiscreteScheduler.step (no negation, no Cosmos preconditioning).
Tokens in and out are our packed layout (library/models/latents.py pack_latents: features (c, ph, pw)); the
patch embedding reads (c, pt, ph, pw) with pt = 1, the same order plus the padding channel last; the output
projection writes (ph, pw, pt, c), reordered here to (c, ph, pw).

Numerics (shared/DESIGN.md): positions are int64; RoPE tables are float32 from float64 angles outside autocast
(core.rope_tables, one call per theta), never module buffers; rotation in float32. The sinusoid is float32 and
cast to compute_dtype before `t_embedder` / `t_embedding_norm` (diffusers: type_as(hidden_states)). Modulation,
adaLN and gating run in float32 with one rounding to the activation dtype.

diffusers' Cosmos DiT builds its QK RMSNorms with Attention's default eps 1e-5; NVIDIA's, sd-scripts' and
ComfyUI's use 1e-6, which `qk_norm_eps` keeps (tests/test_anima_model.py sets diffusers' to 1e-6 for parity).

Parameter count of the released config (on `meta`; diffusers' CosmosTransformer3DModel + AnimaTextConditioner
at this config give the same): 1,956,405,248 in the DiT + 134,663,680 in the adapter (32,899,072 of them its T5
embedding) = 2,091,068,928.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    LayerNormNoAffine, Modulation, RMSNorm, apply_rope, attention, float32_gated, float32_modulated,
    residual_projection, rope_tables, run_block, timestep_embedding,
)

EPS = 1e-6  # every norm of both parts (LayerNorms, RMSNorms, the adapter's)
ROPE_THETA = 10000.0  # the DiT's base theta (scaled per axis) and the adapter's


@dataclass(frozen=True)
class AnimaConfig:
    """The released model's sizes (sd-scripts' load_anima_model config and LLMAdapter arguments)."""

    hidden_size: int = 2048  # model_channels
    num_heads: int = 16
    num_blocks: int = 28
    mlp_ratio: float = 4.0
    in_channels: int = 16  # latent channels
    out_channels: int = 16
    patch_size: int = 2  # spatial; the temporal patch is 1
    text_dim: int = 1024  # the cross-attention context width (crossattn_emb_channels = the adapter's target_dim)
    adaln_lora_dim: int = 256
    rope_extrapolation: tuple[float, float, float] = (1.0, 4.0, 4.0)  # NTK ratios (t, h, w)
    concat_padding_mask: bool = True  # the patch embedding reads a 17th (padding) channel, zero for images
    qk_norm_eps: float = 1e-6
    adapter_layers: int = 6
    adapter_dim: int = 1024  # the adapter's model_dim (an `in_proj` from text_dim exists where they differ)
    adapter_heads: int = 16
    adapter_source_dim: int = 1024  # the Qwen3 hidden states' width
    t5_vocab_size: int = 32128
    min_text_len: int = 512  # the adapter's output is zero-padded to at least this many tokens

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.adapter_dim % self.adapter_heads:
            raise ValueError(f"Anima: hidden_size {self.hidden_size} / num_heads {self.num_heads} and adapter_dim "
                             f"{self.adapter_dim} / adapter_heads {self.adapter_heads} must divide")
        if self.head_dim // 6 * 2 <= 2 or self.head_dim % 2:
            raise ValueError(f"Anima: head_dim {self.head_dim} too small for the 3-axis RoPE (at least 12, even)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def token_width(self) -> int:
        """Features of one packed image token (in_channels x patch x patch: 64)."""
        return self.in_channels * self.patch_size**2

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """RoPE widths of the (t, h, w) axes: (44, 42, 42) of 128."""
        spatial = self.head_dim // 6 * 2
        return self.head_dim - 2 * spatial, spatial, spatial

    @property
    def rope_thetas(self) -> tuple[float, float, float]:
        """Per-axis theta 10000 * ratio ** (d / (d - 2)) (NTK-aware extrapolation; Python float64)."""
        return tuple(ROPE_THETA * r ** (d / (d - 2)) for r, d in zip(self.rope_extrapolation, self.rope_dims))


ANIMA = AnimaConfig()


# ----------------------------------------------------------------------------------------------
# Positions and RoPE


def image_positions(h: int, w: int, device=None) -> torch.Tensor:
    """int64 [h*w, 3]: patch (r, c) of the h x w grid (row-major) at (t, r, c) = (0, r, c)."""
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).reshape(h * w, 3)


def image_rope_tables(config: AnimaConfig, h: int, w: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin [h*w, head_dim / 2] laid out [t, h, w] (the rotate-half table is this twice): one
    core.rope_tables call per distinct theta (float64 angles, outside autocast), h and w together when their
    ratios agree (as released)."""
    positions, dims, thetas = image_positions(h, w, device), config.rope_dims, config.rope_thetas
    groups = [[0]]  # runs of consecutive axes with one theta: [[t], [h, w]] as released
    for axis in (1, 2):
        if thetas[axis] == thetas[groups[-1][-1]]:
            groups[-1].append(axis)
        else:
            groups.append([axis])
    tables = [rope_tables(positions[:, g[0] : g[-1] + 1], tuple(dims[a] for a in g), thetas[g[0]]) for g in groups]
    return torch.cat([c for c, _ in tables], dim=-1), torch.cat([s for _, s in tables], dim=-1)


# ----------------------------------------------------------------------------------------------
# Layers shared by both parts



def adaln_lora(dim: int, rank: int, chunks: int) -> nn.Sequential:
    """SiLU -> Linear(dim, rank) -> Linear(rank, chunks * dim), no biases (`.1`, `.2` as in the file)."""
    return nn.Sequential(nn.SiLU(), nn.Linear(dim, rank, bias=False), nn.Linear(rank, chunks * dim, bias=False))


def key_mask(mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """A [B, L] key padding mask as bool, or None where it masks nothing (one host sync; on `meta` kept)."""
    if mask is None:
        return None
    mask = mask.to(device=device, dtype=torch.bool)
    return None if device.type != "meta" and bool(mask.all()) else mask


# ----------------------------------------------------------------------------------------------
# LLM adapter (`llm_adapter`): Qwen3 hidden states -> T5-token context


class AdapterAttention(nn.Module):
    """q_proj / k_proj / v_proj / o_proj (no biases), per-head q_norm / k_norm, rotate-half RoPE on q and k."""

    def __init__(self, dim: int, context_dim: int, heads: int):
        super().__init__()
        self.heads, head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, EPS)
        self.k_proj = nn.Linear(context_dim, dim, bias=False)
        self.k_norm = RMSNorm(head_dim, EPS)
        self.v_proj = nn.Linear(context_dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, context, q_rope, k_rope, mask) -> torch.Tensor:
        """x [B, T, dim], context [B, S, context_dim]; q_rope / k_rope float32 (cos, sin) [T or S, head_dim / 2];
        mask bool [B, S] (key padding) or None."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, -1))).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(context).unflatten(-1, (self.heads, -1))).transpose(1, 2)
        v = self.v_proj(context).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        q, k = apply_rope(q, *q_rope, interleaved=False), apply_rope(k, *k_rope, interleaved=False)
        return self.o_proj(attention(q, k, v, mask=mask))


class AdapterBlock(nn.Module):
    """x + self_attn(norm(x)), x + cross_attn(norm(x), qwen), x + mlp(norm(x)); RMSNorms with weights."""

    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        d = cfg.adapter_dim
        self.norm_self_attn = RMSNorm(d, EPS)
        self.self_attn = AdapterAttention(d, d, cfg.adapter_heads)
        self.norm_cross_attn = RMSNorm(d, EPS)
        self.cross_attn = AdapterAttention(d, cfg.adapter_source_dim, cfg.adapter_heads)
        self.norm_mlp = RMSNorm(d, EPS)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))  # GELU(erf), biases

    def forward(self, x, source, target_rope, source_rope, target_mask, source_mask):
        y = self.norm_self_attn(x)
        x = x + self.self_attn(y, y, target_rope, target_rope, target_mask)
        x = x + self.cross_attn(self.norm_cross_attn(x), source, target_rope, source_rope, source_mask)
        hidden = self.mlp[1](self.mlp[0](self.norm_mlp(x)))
        return x + residual_projection(self.mlp[2], hidden, False)  # no gate: the output is never saved


class LLMAdapter(nn.Module):
    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.t5_vocab_size, cfg.text_dim)
        self.in_proj = nn.Linear(cfg.text_dim, cfg.adapter_dim) if cfg.adapter_dim != cfg.text_dim else None
        self.blocks = nn.ModuleList(AdapterBlock(cfg) for _ in range(cfg.adapter_layers))
        self.out_proj = nn.Linear(cfg.adapter_dim, cfg.text_dim)
        self.norm = RMSNorm(cfg.text_dim, EPS)

    def forward(self, source, t5_ids, source_mask=None, t5_mask=None, checkpointing=False) -> torch.Tensor:
        """source [B, S, source_dim] (the activation dtype), t5_ids int64 [B, T], masks bool [B, S] / [B, T] or None.
        Returns [B, max(T, min_text_len), text_dim]: zero at T5 padding and beyond T."""
        cfg, device = self.config, source.device
        x = self.embed(t5_ids).to(source.dtype)
        x = self.in_proj(x) if self.in_proj is not None else x
        head_dim = cfg.adapter_dim // cfg.adapter_heads
        # int64 positions -> float32 tables from float64 angles, outside autocast
        target_rope = rope_tables(torch.arange(x.shape[1], device=device), (head_dim,), ROPE_THETA)
        source_rope = rope_tables(torch.arange(source.shape[1], device=device), (head_dim,), ROPE_THETA)
        masks = key_mask(t5_mask, device), key_mask(source_mask, device)
        for block in self.blocks:
            x = run_block(block, checkpointing, x, source, target_rope, source_rope, *masks)
        x = self.norm(self.out_proj(x))
        if t5_mask is not None:
            x = x * t5_mask.to(device=device, dtype=x.dtype)[..., None]
        return F.pad(x, (0, 0, 0, max(0, cfg.min_text_len - x.shape[1])))


# ----------------------------------------------------------------------------------------------
# DiT


class SinusoidalTimesteps(nn.Module):
    """`t_embedder.0` (no weights): float32 [B, dim] sinusoid of sigma itself, cos half first."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        return timestep_embedding(sigma, self.dim, time_factor=1.0)


class TimestepEmbedding(nn.Module):
    """`t_embedder.1`: linear_2(silu(linear_1(x))), dim -> 3 dim (the adaLN-LoRA `temb`), no biases."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, dim, bias=False)
        self.linear_2 = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class PatchEmbed(nn.Module):
    """`proj.1`: Linear((C + 1) p p, hidden), no bias, over (c, ph, pw) features plus the padding channel's p p last.
    `proj.0` is the original's rearrange (no weights), kept so that the Linear has the file's name."""

    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        channels = cfg.in_channels + int(cfg.concat_padding_mask)
        self.pad = cfg.concat_padding_mask
        self.proj = nn.Sequential(nn.Identity(), nn.Linear(channels * cfg.patch_size**2, cfg.hidden_size, bias=False))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        """img [B, L, C p p] -> [B, L, hidden]; the padding channel is zero (an image has no padding)."""
        if self.pad:
            img = torch.cat((img, img.new_zeros(*img.shape[:-1], self.proj[1].in_features - img.shape[-1])), dim=-1)
        return self.proj(img)


class Attention(nn.Module):
    """q_proj / k_proj / v_proj / output_proj (no biases), per-head q_norm / k_norm; RoPE in self-attention only."""

    def __init__(self, cfg: AnimaConfig, context_dim: int):
        super().__init__()
        d, self.heads = cfg.hidden_size, cfg.num_heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps)
        self.k_proj = nn.Linear(context_dim, d, bias=False)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps)
        self.v_proj = nn.Linear(context_dim, d, bias=False)
        self.output_proj = nn.Linear(d, d, bias=False)

    def forward(self, y: torch.Tensor, context: torch.Tensor, rope=None) -> torch.Tensor:
        """Attention before `output_proj` [B, L, hidden] (the block projects: residual_projection). y [B, L, hidden],
        context [B, S, context_dim]; rope: float32 (cos, sin) [L, head_dim / 2] or None."""
        q = self.q_norm(self.q_proj(y).unflatten(-1, (self.heads, -1))).transpose(1, 2)  # [B, H, L, D]
        k = self.k_norm(self.k_proj(context).unflatten(-1, (self.heads, -1))).transpose(1, 2)
        v = self.v_proj(context).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        if rope is not None:  # rotate-half pairing, in float32, one rounding
            q, k = apply_rope(q, *rope, interleaved=False), apply_rope(k, *rope, interleaved=False)
        return attention(q, k, v)


class FeedForward(nn.Module):
    """layer2(gelu(layer1(x))), exact (erf) GELU, no biases."""

    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        inner = int(cfg.hidden_size * cfg.mlp_ratio)
        self.layer1 = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.layer2 = nn.Linear(inner, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection `layer2` reads."""
        return F.gelu(self.layer1(x))


class Block(nn.Module):
    """x + gate * self_attn(adaLN(x)), x + gate * cross_attn(adaLN(x), context), x + gate * mlp(adaLN(x))."""

    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        d, r = cfg.hidden_size, cfg.adaln_lora_dim
        self.layer_norm_self_attn = LayerNormNoAffine(d, EPS)
        self.self_attn = Attention(cfg, d)
        self.layer_norm_cross_attn = LayerNormNoAffine(d, EPS)
        self.cross_attn = Attention(cfg, cfg.text_dim)
        self.layer_norm_mlp = LayerNormNoAffine(d, EPS)
        self.mlp = FeedForward(cfg)
        self.adaln_modulation_self_attn = adaln_lora(d, r, 3)
        self.adaln_modulation_cross_attn = adaln_lora(d, r, 3)
        self.adaln_modulation_mlp = adaln_lora(d, r, 3)

    @staticmethod
    def _modulation(adaln: nn.Sequential, emb: torch.Tensor, temb: torch.Tensor) -> Modulation:
        """(shift, scale, gate), each float32 [B, 1, D]: adaln(emb) + temb in float32."""
        return Modulation(*(adaln(emb).float() + temb.float())[:, None].chunk(3, dim=-1))

    def forward(self, x, emb, temb, context, cos, sin):
        """x [B, L, hidden]; emb [B, hidden] (t_embedding_norm's), temb [B, 3 hidden]; context [B, S, text_dim];
        cos / sin float32 [L, head_dim / 2] (a pair, so that checkpointing sees plain tensors)."""
        attn = self._modulation(self.adaln_modulation_self_attn, emb, temb)
        y = float32_modulated(self.layer_norm_self_attn(x), attn.shift, attn.scale)
        x = x + float32_gated(attn, self.self_attn.output_proj, self.self_attn(y, y, (cos, sin)), x.dtype)
        cross = self._modulation(self.adaln_modulation_cross_attn, emb, temb)
        y = float32_modulated(self.layer_norm_cross_attn(x), cross.shift, cross.scale)
        x = x + float32_gated(cross, self.cross_attn.output_proj, self.cross_attn(y, context), x.dtype)
        mlp = self._modulation(self.adaln_modulation_mlp, emb, temb)
        y = float32_modulated(self.layer_norm_mlp(x), mlp.shift, mlp.scale)
        return x + float32_gated(mlp, self.mlp.layer2, self.mlp.hidden(y), x.dtype, last=True)


class FinalLayer(nn.Module):
    """LayerNorm (no affine) then (1 + scale) x + shift, (shift, scale) = adaln_modulation(emb) + temb[:, :2 D];
    `linear` to p p C features ordered (ph, pw, c)."""

    def __init__(self, cfg: AnimaConfig):
        super().__init__()
        d = cfg.hidden_size
        self.layer_norm = LayerNormNoAffine(d, EPS)
        self.linear = nn.Linear(d, cfg.patch_size**2 * cfg.out_channels, bias=False)
        self.adaln_modulation = adaln_lora(d, cfg.adaln_lora_dim, 2)

    def forward(self, x: torch.Tensor, emb: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        mod = self.adaln_modulation(emb).float() + temb[:, : 2 * x.shape[-1]].float()  # float32 [B, 2 D]
        shift, scale = mod[:, None].chunk(2, dim=-1)
        return self.linear(float32_modulated(self.layer_norm(x), shift, scale))


# ----------------------------------------------------------------------------------------------
# Model


class Anima(nn.Module):
    def __init__(self, config: AnimaConfig = ANIMA):
        super().__init__()
        self.config = cfg = config
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.llm_adapter = LLMAdapter(cfg)
        self.x_embedder = PatchEmbed(cfg)
        self.t_embedder = nn.Sequential(SinusoidalTimesteps(cfg.hidden_size), TimestepEmbedding(cfg.hidden_size))
        self.t_embedding_norm = RMSNorm(cfg.hidden_size, EPS)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_blocks))
        self.final_layer = FinalLayer(cfg)

    def forward(
        self,
        img: torch.Tensor,
        qwen: torch.Tensor,
        t5_ids: torch.Tensor,
        timesteps: torch.Tensor,
        h: int,
        w: int,
        qwen_mask: torch.Tensor | None = None,
        t5_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) of the image tokens; the family uses it as it is.

        img [B, h*w, C p p]: packed latent tokens of the h x w patch grid (row-major, features (c, ph, pw)); cast
            to compute_dtype.
        qwen [B, S, adapter_source_dim]: Qwen3 hidden states (zero at padding), cast likewise; qwen_mask [B, S]
            bool (True = real) or None. t5_ids int64 [B, T], t5_mask [B, T] bool or None: the adapter's queries.
        timesteps [B]: sigma in [0, 1] (1 = noise), embedded as it is in float32.
        Returns [B, h*w, out_channels p p] in compute_dtype, features (c, ph, pw).
        """
        cfg, dtype, p = self.config, self.compute_dtype, self.config.patch_size
        b, n_img, width = img.shape
        if n_img != h * w or width != cfg.token_width:
            raise ValueError(f"Anima: image tokens {tuple(img.shape)} do not fit an {h} x {w} grid of "
                             f"{cfg.token_width} features")
        ckpt, swap = self.gradient_checkpointing, self.block_swap
        context = self.llm_adapter(qwen.to(dtype), t5_ids, qwen_mask, t5_mask, ckpt)  # [B, >= 512, text_dim]
        cos, sin = image_rope_tables(cfg, h, w, img.device)  # float32 [h*w, head_dim / 2]

        sinusoid = self.t_embedder[0](timesteps).to(dtype)  # float32 -> the activation dtype, as diffusers
        temb = self.t_embedder[1](sinusoid)  # [B, 3 hidden]: added to every modulation
        emb = self.t_embedding_norm(sinusoid)  # [B, hidden]
        x = self.x_embedder(img.to(dtype))
        for i, block in enumerate(self.blocks):
            x = run_block(block, ckpt, x, emb, temb, context, cos, sin, swap=swap, index=i)
        out = self.final_layer(x, emb, temb)  # [B, h*w, p p C] features (ph, pw, c)
        return out.unflatten(-1, (p * p, -1)).transpose(-1, -2).reshape(b, n_img, -1)  # -> (c, ph, pw)

    def swappable_blocks(self) -> list[nn.Module]:
        """The DiT blocks in run order (block swap moves the last N); the adapter runs once before them."""
        return list(self.blocks)


def random_inputs(config: AnimaConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py): Qwen3
    states N(0, 1) and random T5 ids, each with its last quarter padding (zero states / id 0, masked).

    RandomInputs holds one theta; Anima's RoPE has one per axis. Images put every patch at t = 0 (exact in any
    dtype), and h and w share one theta as released, which the model computes in one rope_tables call: the
    expected positions are that call's, the (row, column) grid [1, h*w, 2] with its axes and theta. The t call and
    the adapter's 1-D calls have other shapes, which the audit does not compare."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] < real
    qwen = torch.randn(1, text_len, config.adapter_source_dim, generator=generator) * mask[..., None]
    t5_ids = torch.randint(1, config.t5_vocab_size, (1, text_len), generator=generator) * mask
    fixed = dict(qwen=qwen, qwen_mask=mask, t5_ids=t5_ids, t5_mask=mask, h=h, w=w)
    _, dim_h, dim_w = config.rope_dims
    return RandomInputs(fixed, image_positions(h, w)[None, :, 1:], (dim_h, dim_w), config.rope_thetas[1])
