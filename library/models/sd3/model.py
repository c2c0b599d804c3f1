"""Stable Diffusion 3 / 3.5 (Stability AI's MMDiT) on the shared core, with SAI'S MODULE NAMES: those of the released
sd3.5_large.safetensors / sd3_medium*.safetensors under "model.diffusion_model.", which sd-scripts'
library/sd3_models.py (MMDiT) loads as they are and so the LoRAs it trains name (`lora_unet_joint_blocks_0_x_block_
attn_qkv`).

What the MMDiT is (diffusers' SD3Transformer2DModel, models/transformers/transformer_sd3.py with attention.py's
JointTransformerBlock; sd-scripts' create_sd3_mmdit; ComfyUI's comfy/ldm/modules/diffusionmodules/mmdit.py):
- `depth` joint blocks of width 64 x depth (sd-scripts' "magic": heads of 64, depth heads): SD3-Medium 24 x 1536,
  SD3.5-Medium 24 x 1536, SD3.5-Large 38 x 2432. MLP ratio 4 (GELU tanh), qkv biases, LayerNorms without affine
  (eps 1e-6). Each block has an image stream (`x_block`) and a text stream (`context_block`) with their own weights,
  attending jointly over [image, text] (diffusers' order; SAI's is [text, image]: the same attention, no mask).
- adaLN from c = t_embedder(1000 sigma) + y_embedder(pooled): 6 rows of width per stream (shift, scale, gate of
  the attention, then of the MLP). The last block's text stream is `pre_only`: it only feeds keys and values, so
  it has qkv (and ln_q / ln_k) but no proj or mlp, and 2 rows (shift, scale).
- SD3.5 adds qk RMSNorm per head (`ln_q`, `ln_k`, eps 1e-6, learned weight; sd-scripts' qk_norm "rms"); SD3.5-Medium
  (MMDiT-X) a second self-attention over the image tokens alone (`x_block.attn2`) in blocks 0-12, from the same
  norm with its own shift / scale / gate (9 modulation rows: msa, mlp, msa2).
- Patch 2 on the 16-channel 8x VAE (`x_embedder.proj`: a 2x2 stride-2 Conv2d in the file, applied here as the
  Linear it is on packed tokens); `final_layer` (adaLN shift, scale; `linear` to 2 x 2 x 16 rows ordered (p, q, c)).
- Positions: a fixed 2-D sin-cos table (`pos_embed` in the file, [1, N^2, width], N = pos_embed_max_size: 192 for
  SD3-Medium and SD3.5-Large, 384 for SD3.5-Medium), centre-cropped to the h x w patch grid (diffusers'
  PatchEmbed.cropped_pos_embed) and added to the embedded patches. Channels: [sin, cos] of the column position,
  then [sin, cos] of the row position, frequencies 10000^(-j / (width / 4)) (diffusers' get_2d_sincos_pos_embed:
  "w goes first"). See table_positions for the position grid (sd-scripts' note on SD3.5's; a file holding another
  keeps its own table: checkpoint.file_pos_embed).
- Time: the pipeline feeds the scheduler's t = 1000 sigma (FlowMatchEulerDiscreteScheduler, shift 3.0), embedded
  as is (sinusoid of 256, cos half first); the output is the flow velocity noise - x0 (the scheduler steps
  x + (sigma_next - sigma) v).
- Text: `context_embedder` (Linear context_dim -> width) over [CLIP-L | CLIP-G penultimate states joined by
  channels to 2048, zero-padded to 4096; T5-XXL's 256 tokens]: 77 + 256 = 333 tokens, no mask. pooled: CLIP-L's and
  CLIP-G's projected pooled outputs joined (768 + 1280 = 2048).

Our forward hides the conventions: sigma in [0, 1] in, velocity out, tokens in pack_latents' layout in and out.
Skip-layer guidance (SD3.5-Medium's sampling trick, diffusers' skip_layers) is not implemented: training never uses
it.

Precision (shared/DESIGN.md): inputs are cast to `compute_dtype` at entry; the timestep is embedded in float32 and
then cast (diffusers' `.to(pooled dtype)`); the position window is computed by core.rope_tables from float64
positions (exact quarters), kept float32 and never a module buffer (model.to(dtype) cannot round it; a file's own
table, where it differs, stays as stored on the CPU), and added in float32 to the embedded patches,
then rounded once to compute_dtype (diffusers keeps its buffer float32 - _skip_layerwise_casting_patterns - and adds
it to the bf16 patches in float32: `(latent + pos_embed).to(latent.dtype)`). Modulation and gates run in
compute_dtype, as in diffusers and sd-scripts' `modulate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    FcMLP, LayerNormNoAffine, Modulation, RMSNorm, TimestepMLP, angle_dtype, attention, rope_tables, run_block,
    split_modulation, timestep_embedding,
)
from library.precision.autocast import autocast_off

TIME_DIM = 256  # sinusoidal timestep width (diffusers' Timesteps(256), sd-scripts' freq_embed_size)
TIME_FACTOR = 1000.0  # the network embeds t = 1000 sigma, the scheduler's timesteps
PATCH = 2
HEAD_DIM = 64  # every released MMDiT: width = 64 x depth, heads = depth (sd-scripts' create_sd3_mmdit)
QK_NORM_EPS = 1e-6  # sd-scripts' / ComfyUI's RMSNorm(eps=1.0e-6); diffusers' Attention(eps=1e-6)
POS_EMBED_THETA = 10000.0


@dataclass(frozen=True)
class SD3Config:
    """Defaults: SD3.5-Large (diffusers' stabilityai/stable-diffusion-3.5-large transformer/config.json: num_layers
    38, num_attention_heads 38 x attention_head_dim 64, joint_attention_dim 4096, caption_projection_dim 2432,
    pooled_projection_dim 2048, pos_embed_max_size 192, qk_norm "rms_norm", dual_attention_layers (); sd-scripts'
    sd3_utils analyze_state_dict_state: depth 38, pos max 192, qk_norm "rms")."""

    depth: int = 38  # joint blocks; width = 64 x depth unless hidden_size says otherwise
    hidden_size: int = 2432
    in_channels: int = 16  # latent channels (patch 2: 64 features per token)
    out_channels: int = 16
    mlp_ratio: float = 4.0
    context_dim: int = 4096  # T5-XXL's width (CLIP's 2048 padded to it); a tiny text encoder is narrower
    pooled_dim: int = 2048  # CLIP-L 768 + CLIP-G 1280 projected pooled outputs
    pos_embed_max_size: int = 192  # the position table's side, in patches
    qk_norm: bool = True
    dual_attention_layers: tuple[int, ...] = ()  # MMDiT-X blocks with x_block.attn2

    def __post_init__(self):
        if self.hidden_size % HEAD_DIM:
            raise ValueError(f"SD3 hidden_size {self.hidden_size} is no multiple of the head width {HEAD_DIM}")
        if self.hidden_size % 4:
            raise ValueError(f"SD3 hidden_size {self.hidden_size}: the 2-D sin-cos table needs a multiple of 4")
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.depth - 1]
        if bad:
            raise ValueError(f"SD3 dual_attention_layers {bad} outside blocks 0..{self.depth - 2} (the last block's "
                             f"text stream is pre-only)")

    @property
    def num_heads(self) -> int:
        return self.hidden_size // HEAD_DIM

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def token_width(self) -> int:
        return self.in_channels * PATCH * PATCH  # what the tools size a packed token by


SD3_MEDIUM = SD3Config(depth=24, hidden_size=1536, qk_norm=False)  # SD3.0 Medium: no qk norm, pos max 192
SD35_MEDIUM = SD3Config(depth=24, hidden_size=1536, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)))
SD35_LARGE = SD3Config()


def max_patch_grid(config: SD3Config) -> int:
    """The largest patch-grid side the position table covers (pos_embed_max_size: 192 patches = 3072 px)."""
    return config.pos_embed_max_size


# ----------------------------------------------------------------------------------------------
# The position table


def table_positions(config: SD3Config) -> torch.Tensor:
    """float64 [N] grid position of each row (and column) of the N x N table, N = pos_embed_max_size.

    SAI's training grid, as sd-scripts' get_scaled_2d_sincos_pos_embed(width, N, sample_size=64, base_size=16) gives
    it ("This is what you get when you load SD3.5 state dict", its comment for SD3.5-Medium's N = 384): a step of
    16 / 64 = 1/4 per patch (the 256 px pretraining grid of 16 patches spread over the 1024 px grid of 64), and
    position 0 at the top-left patch of a centred 64 x 64 crop: position(i) = (i - (N - 64) / 2) / 4.
    diffusers' own PatchEmbed table (position i * 64 / N) is never used on a released file: its buffer is
    persistent and loaded from the file. Indices are int64, the arithmetic float64 (exact: quarters)."""
    n = config.pos_embed_max_size
    index = torch.arange(n, dtype=torch.int64)
    return (index - (n - 64) // 2).to(torch.float64) / 4.0


def sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """[len(positions), dim] float64: [sin(p w_j), cos(p w_j)], w_j = 10000^(-j / (dim / 2)) (diffusers'
    get_1d_sincos_pos_embed_from_grid, whose omega it computes in float64 as well)."""
    omega = 1.0 / POS_EMBED_THETA ** (torch.arange(dim // 2, dtype=torch.float64, device=positions.device) / (dim / 2))
    angles = positions.to(torch.float64)[:, None] * omega[None]
    return torch.cat((angles.sin(), angles.cos()), dim=1)


def pos_embed_table(config: SD3Config, device=None, top: int = 0, rows: int | None = None) -> torch.Tensor:
    """The full float32 [N * N, width] table (rows row-major over the N x N grid) as the file's `pos_embed` holds
    it, or its `rows` rows from `top` ([rows * N, width]): per token [column embedding | row embedding], each
    `sincos_1d` of width / 2, built from the two axes' tables (a whole 384^2 table without N^2 angles). float64 ->
    float32 once, outside autocast (MPS: float32 throughout)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    n = config.pos_embed_max_size
    rows = n - top if rows is None else min(rows, n - top)
    with autocast_off(device.type):
        positions = table_positions(config).to(device=device, dtype=angle_dtype(device))
        axis = sincos_1d(positions, config.hidden_size // 2)  # [N, width / 2]
        columns = axis[None, :, :].expand(rows, n, -1)  # token (r, c): column c's embedding
        row_part = axis[top: top + rows, None, :].expand(rows, n, -1)  # token (r, c): row r's embedding
        return torch.cat((columns, row_part), dim=-1).reshape(rows * n, -1).float()


def crop_offset(config: SD3Config, h: int, w: int) -> tuple[int, int]:
    """(top, left) of the centred h x w crop (diffusers' cropped_pos_embed); a grid past the table is refused."""
    n = config.pos_embed_max_size
    if h > n or w > n:
        raise ValueError(f"SD3: a patch grid of {h} x {w} exceeds pos_embed_max_size {n} (the position table's side, "
                         f"{n * PATCH * 8} px)")
    return (n - h) // 2, (n - w) // 2


def window_positions(config: SD3Config, top: int, left: int, h: int, w: int) -> torch.Tensor:
    """float64 [h*w, 2]: the (column, row) grid positions of the table's h x w window at (top, left), row-major."""
    grid = table_positions(config)
    rows, cols = grid[top: top + h], grid[left: left + w]
    return torch.stack((cols[None, :].expand(h, w), rows[:, None].expand(h, w)), dim=-1).reshape(h * w, 2)


def cropped_pos_embed(config: SD3Config, h: int, w: int, device=None, offset: tuple[int, int] | None = None,
                      table: torch.Tensor | None = None):
    """float32 [1, h*w, width]: the table's h x w window at `offset` (default the centred crop), row-major.
    Computed from the window's own positions (float64), not by slicing a cached N x N table; `table` [N^2, width]: a
    file's own table (SD3.stored_pos_embed), its window read as stored and widened to float32."""
    device = torch.device("cpu") if device is None else torch.device(device)
    top, left = crop_offset(config, h, w) if offset is None else offset
    if table is not None:
        n = config.pos_embed_max_size
        window = table.view(n, n, -1)[top: top + h, left: left + w]
        return window.reshape(1, h * w, -1).to(device=device, dtype=torch.float32)
    # core.rope_tables' cos / sin of the window's (column, row) positions, axes of width / 2 each: its frequencies
    # theta^(-2j / (width / 2)) are the sin-cos table's (sincos_1d), and the precision doctor audits its calls
    positions = window_positions(config, top, left, h, w).to(device)
    half = config.hidden_size // 2
    cos, sin = rope_tables(positions, (half, half), POS_EMBED_THETA)  # float32 [h*w, width / 2] each
    q = half // 2
    return torch.cat((sin[:, :q], cos[:, :q], sin[:, q:], cos[:, q:]), dim=-1)[None]


# ----------------------------------------------------------------------------------------------
# Layers


def split_heads(qkv: torch.Tensor, num_heads: int):
    """Fused projection [B, L, 3*H*D] -> q, k, v each [B, H, L, D] ("B L (K H D) -> K B H L D": SAI's
    qkv.reshape(B, L, -1, head_dim).chunk(3, dim=2) rows q | k | v)."""
    return qkv.unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)


class PatchEmbed(nn.Module):
    """`proj`: SAI's Conv2d(16, width, 2, stride 2) (weight [width, 16, 2, 2]); on pack_latents' tokens ((c, p, q)
    features) it is exactly the Linear of its flattened weight."""

    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, width, kernel_size=PATCH, stride=PATCH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens, self.proj.weight.flatten(1), self.proj.bias)


class SelfAttention(nn.Module):
    """`qkv` (rows q | k | v, heads of 64), per-head `ln_q` / `ln_k` RMSNorm where the model has qk norm, and `proj`
    unless the stream is pre-only."""

    def __init__(self, cfg: SD3Config, pre_only: bool = False):
        super().__init__()
        width, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = None if pre_only else nn.Linear(width, width)
        self.ln_q = RMSNorm(HEAD_DIM, QK_NORM_EPS) if cfg.qk_norm else nn.Identity()
        self.ln_k = RMSNorm(HEAD_DIM, QK_NORM_EPS) if cfg.qk_norm else nn.Identity()

    def heads(self, x: torch.Tensor):
        """q, k, v [B, H, L, 64] of the modulated stream x [B, L, width], q and k normalised."""
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        return self.ln_q(q), self.ln_k(k), v


class DismantledBlock(nn.Module):
    """One stream of a joint block (SAI's DismantledBlock; sd-scripts' SingleDiTBlock): norm1 + adaLN -> attention
    inputs; after the joint attention, the gated attention output, (MMDiT-X) the gated self-attention `attn2`, and the
    gated MLP. Modulation rows: pre_only 2 (shift, scale), plain 6, with attn2 9 (sd-scripts' n_mods)."""

    def __init__(self, cfg: SD3Config, pre_only: bool = False, dual: bool = False):
        super().__init__()
        width = cfg.hidden_size
        self.pre_only, self.dual = pre_only, dual
        self.norm1 = LayerNormNoAffine(width)
        self.attn = SelfAttention(cfg, pre_only)
        self.attn2 = SelfAttention(cfg) if dual else None
        self.norm2 = None if pre_only else LayerNormNoAffine(width)
        self.mlp = None if pre_only else FcMLP(width, cfg.mlp_hidden)  # GELU (tanh)
        rows = 2 if pre_only else 9 if dual else 6
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, rows * width))

    def modulations(self, c: torch.Tensor) -> list[Modulation]:
        """[attention, mlp(, attn2)] (shift, scale, gate) triples, each field [B, 1, width]; pre-only: the attention's
        shift and scale (no gate)."""
        params = self.adaLN_modulation(c)
        if self.pre_only:
            shift, scale = params[:, None].chunk(2, dim=-1)
            return [Modulation(shift, scale, None)]
        return split_modulation(params, 3 if self.dual else 2)

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor, mods: list[Modulation], x2: torch.Tensor | None = None):
        """x + gate * proj(attn) (+ gate2 * attn2(x2)) + gate_mlp * mlp(...): diffusers' JointTransformerBlock order."""
        x = x + mods[0].gate * self.attn.proj(attn_out)
        if self.dual:
            q, k, v = self.attn2.heads(x2)
            x = x + mods[2].gate * self.attn2.proj(attention(q, k, v))
        return x + self.mlp.gated(mods[1], self.norm2(x))


class JointBlock(nn.Module):
    """`x_block` (image) and `context_block` (text) attending jointly over [image, text]."""

    def __init__(self, cfg: SD3Config, pre_only: bool, dual: bool):
        super().__init__()
        self.pre_only = pre_only
        self.context_block = DismantledBlock(cfg, pre_only=pre_only)
        self.x_block = DismantledBlock(cfg, dual=dual)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, c: torch.Tensor):
        """img [B, L, width], txt [B, T, width], c [B, width] -> (img, txt); the pre-only last block: img alone (its
        text stream's queries, qkv's first rows and ln_q, attend but their output is dropped, as in every reference:
        zero gradients; one block in 24 / 38, T / (L + T) of its attention)."""
        img_mods, txt_mods = self.x_block.modulations(c), self.context_block.modulations(c)
        img_normed = self.x_block.norm1(img)
        img_q, img_k, img_v = self.x_block.attn.heads(img_mods[0].modulate(img_normed))
        txt_q, txt_k, txt_v = self.context_block.attn.heads(txt_mods[0].modulate(self.context_block.norm1(txt)))
        q, k, v = (torch.cat(pair, dim=2) for pair in ((img_q, txt_q), (img_k, txt_k), (img_v, txt_v)))
        img_attn, txt_attn = attention(q, k, v).split((img.shape[1], txt.shape[1]), dim=1)
        img2 = img_mods[2].modulate(img_normed) if self.x_block.dual else None  # attn2: the same norm, own shift/scale
        img = self.x_block.finish(img, img_attn, img_mods, img2)
        if self.pre_only:
            return img
        return img, self.context_block.finish(txt, txt_attn, txt_mods)


class FinalLayer(nn.Module):
    """adaLN (shift, scale: SAI's order; diffusers' norm_out stores scale, shift) over a LayerNorm without affine, then
    `linear` to 2 x 2 x out_channels rows ordered (p, q, c)."""

    def __init__(self, cfg: SD3Config):
        super().__init__()
        self.norm_final = LayerNormNoAffine(cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, PATCH * PATCH * cfg.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c)[:, None].chunk(2, dim=-1)
        return self.linear((1 + scale) * self.norm_final(x) + shift)


# ----------------------------------------------------------------------------------------------
# Model


class SD3(nn.Module):
    def __init__(self, config: SD3Config = SD35_LARGE):
        super().__init__()
        self.config = cfg = config
        width = cfg.hidden_size
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called
        # A file's own position table [N^2, width] where it holds another grid than ours (checkpoint.file_pos_embed):
        # a plain attribute, not a buffer, so model.to(dtype / device) leaves it as stored on the CPU
        self.stored_pos_embed: torch.Tensor | None = None

        self.x_embedder = PatchEmbed(cfg.in_channels, width)
        self.t_embedder = TimestepMLP(width)
        self.y_embedder = TimestepMLP(width, freq_dim=cfg.pooled_dim)  # mlp.0 / SiLU / mlp.2 over the pooled text
        self.context_embedder = nn.Linear(cfg.context_dim, width)
        self.joint_blocks = nn.ModuleList(
            JointBlock(cfg, pre_only=i == cfg.depth - 1, dual=i in cfg.dual_attention_layers) for i in range(cfg.depth))
        self.final_layer = FinalLayer(cfg)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, pooled: torch.Tensor, timesteps: torch.Tensor, h: int,
                w: int) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for packed latent tokens.

        img [B, h*w, 64]: pack_latents' tokens ((c, p, q) features) of an h x w patch grid (latent H/2 x W/2).
        txt [B, S, context_dim]: the joint CLIP + T5 context (no mask). pooled [B, pooled_dim].
        timesteps [B]: sigma in [0, 1] (1 = pure noise); the network embeds 1000 sigma in float32.
        Returns [B, h*w, 64] in compute_dtype, in pack_latents' (c, p, q) order.
        """
        cfg, dtype = self.config, self.compute_dtype
        if img.shape[1] != h * w:
            raise ValueError(f"SD3: {img.shape[1]} image tokens do not fit a {h} x {w} patch grid")
        # float32 [1, h*w, width]; checks the grid size
        pos = cropped_pos_embed(cfg, h, w, img.device, table=self.stored_pos_embed)

        # Patches + positions: the embedding rounded to compute_dtype, the sum in float32, one rounding back.
        x = (self.x_embedder(img.to(dtype)).float() + pos).to(dtype)
        # c = t_embedder(float32 sinusoid of 1000 sigma, cast) + y_embedder(pooled)
        t_freq = timestep_embedding(timesteps, TIME_DIM, time_factor=TIME_FACTOR)
        c = self.t_embedder(t_freq.to(dtype)) + self.y_embedder(pooled.to(dtype))
        txt = self.context_embedder(txt.to(dtype))

        ckpt, swap = self.gradient_checkpointing, self.block_swap
        for i, block in enumerate(self.joint_blocks):
            if block.pre_only:
                x = run_block(block, ckpt, x, txt, c, swap=swap, index=i)
            else:
                x, txt = run_block(block, ckpt, x, txt, c, swap=swap, index=i)
        out = self.final_layer(x, c)  # [B, L, (p, q, c)]
        b, n = out.shape[:2]
        return out.view(b, n, PATCH, PATCH, -1).permute(0, 1, 4, 2, 3).reshape(b, n, -1)  # -> (c, p, q)

    def swappable_blocks(self) -> list[nn.Module]:
        """The joint blocks in run order."""
        return list(self.joint_blocks)


def random_inputs(config: SD3Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py): context
    and pooled states N(0, 1). The expected positions are the centred crop's (column, row) grid positions, float64
    quarters [1, h*w, 2], which cropped_pos_embed hands core.rope_tables with axes (width / 2, width / 2)."""
    from library.models.spec import RandomInputs

    fixed = dict(txt=torch.randn(1, text_len, config.context_dim, generator=generator),
                 pooled=torch.randn(1, config.pooled_dim, generator=generator), h=h, w=w)
    positions = window_positions(config, *crop_offset(config, h, w), h, w)[None]
    half = config.hidden_size // 2
    return RandomInputs(fixed, positions, (half, half), POS_EMBED_THETA)
