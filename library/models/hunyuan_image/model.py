"""HunyuanImage-2.1 (Tencent, 17 B) on the shared core, with TENCENT'S ORIGINAL module names: those of the released
dit/hunyuanimage2.1.safetensors, of sd-scripts' library/hunyuan_image_models.py / hunyuan_image_modules.py (which
loads that file with strict=True) and so of the LoRAs sd-scripts trains (`lora_unet_double_blocks_0_img_attn_qkv`).

What HunyuanImage-2.1 is (diffusers' HunyuanImageTransformer2DModel, models/transformers/transformer_hunyuanimage.py;
sd-scripts' HYImageDiffusionTransformer; diffusers' scripts/convert_hunyuan_image_to_diffusers.py for the names):
- BFL-style blocks: 20 double-stream (image and text keep their own weights, attend jointly) then 40
  single-stream ones (one fused `linear1` = [q | k | v | mlp in], `linear2` = [attention | mlp out] -> width),
  width 3584 = 28 heads of 128, MLP ratio 4 (GELU tanh), QK RMSNorm (eps 1e-6) per head, qkv biases; adaLN from
  one vector (`*_mod.linear`, 6 rows of width per double stream: shift, scale, gate x 2; `modulation.linear` 3).
- Patch 1 on a 64-channel, 32x-downsampling VAE: one token per latent pixel (`img_in.proj`, a 1x1 Conv2d).
- The attention runs over [image, text] (image first). 2-D RoPE (rows, columns: axes 64 + 64, theta 256,
  interleaved pairs) on the image tokens only; text tokens get no rotation.
- Text: Qwen2.5-VL-7B states (3584 wide) refined by `txt_in` (a SingleTokenRefiner: 2 self-attention blocks over
  the text alone, gated by SiLU(c) where c = t_embedder(t) + c_embedder(masked mean of the raw states)); glyph
  text: byT5-small states (1472 wide) of the prompt's quoted text through `byt5_in` (LayerNorm, fc1 -> GELU ->
  fc2 -> GELU -> fc3; hidden 2048). The text sequence is [real glyph, real Qwen, padded glyph, padded Qwen]
  (diffusers' reorder; sd-scripts' reorder_txt_token), padding masked as a key everywhere.
- Time: the pipeline feeds the scheduler's t = 1000 sigma, embedded as is (sinusoid of 256, cos half first,
  max period 10000); the output is the flow velocity noise - x0 (FlowMatchEulerDiscreteScheduler steps
  x + (sigma_next - sigma) v). The distilled release adds `guidance_in` (the guidance scale x 1000) and
  `time_r_in` (MeanFlow: the embedding of the next step's 1000 sigma_r, averaged with t's): config fields.

Our forward hides the convention: sigma in [0, 1] in, velocity out, tokens [B, h*w, 64] row-major in and out.

Precision (shared/DESIGN.md): inputs are cast to `compute_dtype` at entry; image positions are int64 and become
float32 RoPE tables outside autocast (core.rope_tables: float64 angles); timesteps / guidance are embedded in
float32 and only then cast to compute_dtype (diffusers' `.to(dtype)`); the masked mean of the text states is
summed in float32 (diffusers' mask.float()) and cast back. Modulation and gates run in compute_dtype, as in
diffusers and sd-scripts' `modulate` / `apply_gate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    FcMLP, LayerNormNoAffine, Modulation, RMSNorm, TimestepMLP, apply_rope, attention, rope_tables, run_block,
    split_modulation, timestep_embedding,
)
from library.models.flux1.model import split_heads

TIME_DIM = 256  # sinusoidal embedding width of timesteps and guidance (frequency_embedding_size)
TIME_FACTOR = 1000.0  # the network embeds t = 1000 sigma (the scheduler's timesteps), guidance x 1000
PATCH = 1  # one token per latent pixel: img_in is a 1x1 convolution


@dataclass(frozen=True)
class HunyuanImageConfig:
    """Defaults: the released HunyuanImage-2.1 (diffusers' HunyuanImageTransformer2DModel defaults with
    text_embed_2_dim 1472, as convert_hunyuan_image_to_diffusers.py writes it; sd-scripts' fixed sizes)."""

    in_channels: int = 64  # latent channels (patch 1)
    out_channels: int = 64
    hidden_size: int = 3584
    num_heads: int = 28
    depth: int = 20  # double-stream blocks
    depth_single: int = 40  # single-stream blocks
    mlp_ratio: float = 4.0
    text_dim: int = 3584  # Qwen2.5-VL-7B hidden states (a tiny text encoder is narrower)
    glyph_dim: int | None = 1472  # byT5-small hidden states; None: no `byt5_in` (no glyph text)
    glyph_hidden: int = 2048  # byt5_in's fc1 / fc2 width (diffusers fixes 2048)
    refiner_depth: int = 2  # txt_in's individual_token_refiner blocks
    axes_dim: tuple[int, ...] = (64, 64)  # RoPE widths of the (row, column) axes; sum == head_dim
    theta: float = 256.0
    qk_norm_eps: float = 1e-6
    guidance_embeds: bool = False  # the distilled release: `guidance_in`
    use_meanflow: bool = False  # the distilled release: `time_r_in`

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if len(self.axes_dim) != 2 or sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"axes_dim {self.axes_dim} must be 2 axes (rows, columns) summing to head_dim "
                             f"{self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def token_width(self) -> int:
        return self.in_channels  # what the tools size a packed token by (patch 1)


HUNYUAN_IMAGE = HunyuanImageConfig()


# ----------------------------------------------------------------------------------------------
# Layers


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class ModulateDiT(nn.Module):
    """`linear` of SiLU(vec) into `count` (shift, scale, gate) triples, each [B, 1, width]."""

    def __init__(self, dim: int, count: int):
        super().__init__()
        self.count = count
        self.linear = nn.Linear(dim, 3 * count * dim)

    def forward(self, vec: torch.Tensor) -> list[Modulation]:
        return split_modulation(self.linear(F.silu(vec)), self.count)


class PatchEmbed(nn.Module):
    """`proj`: the released 1x1 Conv2d (weight [width, C, 1, 1]), applied to tokens [B, L, C] as the Linear it is."""

    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, width, kernel_size=PATCH, stride=PATCH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens, self.proj.weight.flatten(1), self.proj.bias)


def rope_on_image(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_img: int) -> torch.Tensor:
    """x [B, H, L, D] over [image, text]: the first n_img tokens rotated (interleaved pairs, float32 rotation), the
    text as it is (the reference rotates the image tokens only)."""
    return torch.cat((apply_rope(x[:, :, :n_img], cos, sin), x[:, :, n_img:]), dim=2)


# ----------------------------------------------------------------------------------------------
# Text: the token refiner (txt_in) and the glyph mapper (byt5_in)


class IndividualTokenRefinerBlock(nn.Module):
    """Self-attention over the text (no QK norm, its padding masked as keys) and a SiLU MLP, each behind an affine
    LayerNorm (eps 1e-6), gated by adaLN_modulation(c) (gate_msa, gate_mlp; no shift or scale)."""

    def __init__(self, cfg: HunyuanImageConfig):
        super().__init__()
        h, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.norm1 = nn.LayerNorm(h, eps=1e-6)
        self.self_attn_qkv = nn.Linear(h, 3 * h)
        self.self_attn_proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, eps=1e-6)
        self.mlp = FcMLP(h, cfg.mlp_hidden, F.silu)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(h, 2 * h))

    def forward(self, x: torch.Tensor, c: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, S, width], c [B, width], mask [B, S] bool (True = real) or None."""
        gate_msa, gate_mlp = self.adaLN_modulation(c)[:, None].chunk(2, dim=-1)
        q, k, v = split_heads(self.self_attn_qkv(self.norm1(x)), self.num_heads)
        x = x + gate_msa * self.self_attn_proj(attention(q, k, v, mask=mask))
        return x + gate_mlp * self.mlp(self.norm2(x))


class IndividualTokenRefiner(nn.Module):
    def __init__(self, cfg: HunyuanImageConfig):
        super().__init__()
        self.blocks = nn.ModuleList(IndividualTokenRefinerBlock(cfg) for _ in range(cfg.refiner_depth))


class TextProjection(nn.Module):
    """c_embedder: linear_1 -> SiLU -> linear_2 of the masked mean of the raw text states."""

    def __init__(self, in_dim: int, width: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(in_dim, width), nn.Linear(width, width)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(pooled)))


class SingleTokenRefiner(nn.Module):
    """txt_in: the text states embedded (`input_embedder`) and refined, conditioned on c = t_embedder(t) +
    c_embedder(mean of the real raw states)."""

    def __init__(self, cfg: HunyuanImageConfig):
        super().__init__()
        self.input_embedder = nn.Linear(cfg.text_dim, cfg.hidden_size)
        self.t_embedder = TimestepMLP(cfg.hidden_size)
        self.c_embedder = TextProjection(cfg.text_dim, cfg.hidden_size)
        self.individual_token_refiner = IndividualTokenRefiner(cfg)

    def condition(self, txt: torch.Tensor, t_freq: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """c [B, width]: the mean over the real tokens summed in float32 (diffusers' mask.float()), cast back."""
        if mask is None:
            pooled = txt.float().mean(dim=1)
        else:
            weight = mask.float()[..., None]  # [B, S, 1]
            pooled = (txt.float() * weight).sum(dim=1) / weight.sum(dim=1)
        return self.t_embedder(t_freq.to(txt.dtype)) + self.c_embedder(pooled.to(txt.dtype))


class ByT5Mapper(nn.Module):
    """byt5_in: LayerNorm (affine, eps 1e-5) -> fc1 -> GELU -> fc2 -> GELU -> fc3 (exact GELU; no residual)."""

    def __init__(self, cfg: HunyuanImageConfig):
        super().__init__()
        self.layernorm = nn.LayerNorm(cfg.glyph_dim)
        self.fc1 = nn.Linear(cfg.glyph_dim, cfg.glyph_hidden)
        self.fc2 = nn.Linear(cfg.glyph_hidden, cfg.glyph_hidden)
        self.fc3 = nn.Linear(cfg.glyph_hidden, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(self.layernorm(x))))))


# ----------------------------------------------------------------------------------------------
# Blocks


class MMDoubleStreamBlock(nn.Module):
    """Image and text keep their own weights (`img_*`, `txt_*`) and attend jointly over [image, text]."""

    def __init__(self, cfg: HunyuanImageConfig):
        super().__init__()
        h, self.num_heads = cfg.hidden_size, cfg.num_heads
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_mod", ModulateDiT(h, 2))
            setattr(self, f"{stream}_norm1", LayerNormNoAffine(h))
            setattr(self, f"{stream}_attn_qkv", nn.Linear(h, 3 * h))
            setattr(self, f"{stream}_attn_q_norm", RMSNorm(cfg.head_dim, cfg.qk_norm_eps))
            setattr(self, f"{stream}_attn_k_norm", RMSNorm(cfg.head_dim, cfg.qk_norm_eps))
            setattr(self, f"{stream}_attn_proj", nn.Linear(h, h))
            setattr(self, f"{stream}_norm2", LayerNormNoAffine(h))
            setattr(self, f"{stream}_mlp", FcMLP(h, cfg.mlp_hidden))

    def _heads(self, stream: str, x: torch.Tensor, mod: Modulation):
        """One stream's normalised q, k and v, each [B, H, L, D]."""
        q, k, v = split_heads(getattr(self, f"{stream}_attn_qkv")(mod.modulate(getattr(self, f"{stream}_norm1")(x))),
                              self.num_heads)
        return getattr(self, f"{stream}_attn_q_norm")(q), getattr(self, f"{stream}_attn_k_norm")(k), v

    def forward(self, img, txt, vec, cos, sin, mask):
        """img [B, L, width], txt [B, T, width], vec [B, width]; cos/sin float32 [1, L, D/2] (image only);
        mask [B, L+T] bool or None."""
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        img_q, img_k, img_v = self._heads("img", img, img_mod1)
        txt_q, txt_k, txt_v = self._heads("txt", txt, txt_mod1)
        img_q, img_k = apply_rope(img_q, cos, sin), apply_rope(img_k, cos, sin)
        q, k, v = (torch.cat(pair, dim=2) for pair in ((img_q, txt_q), (img_k, txt_k), (img_v, txt_v)))
        img_attn, txt_attn = attention(q, k, v, mask=mask).split((img.shape[1], txt.shape[1]), dim=1)

        img = img + img_mod1.gate * self.img_attn_proj(img_attn)
        img = img + self.img_mlp.gated(img_mod2, self.img_norm2(img))
        txt = txt + txt_mod1.gate * self.txt_attn_proj(txt_attn)
        txt = txt + self.txt_mlp.gated(txt_mod2, self.txt_norm2(txt))
        return img, txt


class MMSingleStreamBlock(nn.Module):
    """One stream over [image, text]: attention and MLP in parallel from `linear1`, joined by `linear2`."""

    def __init__(self, cfg: HunyuanImageConfig):
        super().__init__()
        h, self.mlp_hidden, self.num_heads = cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads
        self.linear1 = nn.Linear(h, 3 * h + self.mlp_hidden)  # [q | k | v | mlp in]
        self.linear2 = nn.Linear(h + self.mlp_hidden, h)  # [attention out | mlp out] -> width
        self.q_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.qk_norm_eps)
        self.pre_norm = LayerNormNoAffine(h)
        self.modulation = ModulateDiT(h, 1)

    def forward(self, x, vec, cos, sin, mask, n_img: int):
        """x [B, L+T, width] (image first), vec [B, width]; cos/sin float32 [1, L, D/2]; mask [B, L+T] or None."""
        (mod,) = self.modulation(vec)
        qkv, mlp = self.linear1(mod.modulate(self.pre_norm(x))).split((3 * x.shape[-1], self.mlp_hidden), dim=-1)
        q, k, v = split_heads(qkv, self.num_heads)
        q, k = rope_on_image(self.q_norm(q), cos, sin, n_img), rope_on_image(self.k_norm(k), cos, sin, n_img)
        h = torch.cat((attention(q, k, v, mask=mask), gelu_tanh(mlp)), dim=-1)
        return x + mod.gated_projection(self.linear2, h)


class FinalLayer(nn.Module):
    """adaLN (shift, scale: Tencent's order) over a LayerNorm without affine, then `linear` to the latent channels."""

    def __init__(self, cfg: HunyuanImageConfig):
        super().__init__()
        self.norm_final = LayerNormNoAffine(cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, PATCH * PATCH * cfg.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None].chunk(2, dim=-1)
        return self.linear((1 + scale) * self.norm_final(x) + shift)


# ----------------------------------------------------------------------------------------------
# Positions and the text sequence


def image_positions(h: int, w: int, device=None) -> torch.Tensor:
    """[1, h*w, 2] int64: latent pixel (r, c) of an h x w grid, row-major (the reference's meshgrid 'ij')."""
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack((rows.reshape(-1), cols.reshape(-1)), dim=-1)[None]


def real_lengths(mask: torch.Tensor, what: str) -> torch.Tensor:
    """[B] int64 real tokens of a [B, S] bool mask that marks each row's real tokens first (right padding, as the
    tokenizers pad); one host sync to check it."""
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]):
        raise ValueError(f"HunyuanImage: {what} must mark each row's real tokens first (right padding)")
    return lengths


def trimmed(tokens: torch.Tensor, mask: torch.Tensor | None, what: str, least: int = 0):
    """(tokens, mask) cut to the batch's longest real row (an all-padding column changes nothing but the cost: the
    pipeline pads Qwen states to 1000 tokens, byT5 to 128); mask None where every kept token is real. `least`: the
    fewest real tokens a row may have. On `meta` (the planner) nothing can be read: as given."""
    if mask is None or tokens.device.type == "meta":
        return tokens, mask
    lengths = real_lengths(mask, what)
    if int(lengths.min()) < least:
        raise ValueError(f"HunyuanImage: every row of {what} needs at least {least} real token(s)")
    keep = int(lengths.max())
    tokens, mask = tokens[:, :keep], mask[:, :keep]
    return tokens, (None if bool(mask.all()) else mask)


def joint_text(txt: torch.Tensor, txt_mask: torch.Tensor | None, glyph: torch.Tensor, glyph_mask: torch.Tensor | None):
    """The text sequence [real glyph, real Qwen, padded glyph, padded Qwen] of each row (diffusers' reorder: a
    stable sort by group) and its mask, cut to the longest real row. txt [B, T, width], glyph [B, G, width]."""
    b, g, t = txt.shape[0], glyph.shape[1], txt.shape[1]
    real = torch.cat((_ones(glyph_mask, b, g, glyph.device), _ones(txt_mask, b, t, txt.device)), dim=1)  # [B, G+T]
    source = torch.cat((torch.zeros(g, dtype=torch.int64), torch.ones(t, dtype=torch.int64))).to(txt.device)
    order = torch.argsort(2 * (~real).long() + source, dim=1, stable=True)  # 0 real glyph ... 3 padded Qwen
    tokens = torch.gather(torch.cat((glyph, txt), dim=1), 1, order[..., None].expand(-1, -1, txt.shape[-1]))
    return trimmed(tokens, torch.gather(real, 1, order), "the text and glyph masks")


def _ones(mask: torch.Tensor | None, b: int, n: int, device) -> torch.Tensor:
    return torch.ones(b, n, dtype=torch.bool, device=device) if mask is None else mask


# ----------------------------------------------------------------------------------------------
# Model


class HunyuanImage(nn.Module):
    def __init__(self, config: HunyuanImageConfig = HUNYUAN_IMAGE):
        super().__init__()
        self.config = cfg = config
        h = cfg.hidden_size
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.byt5_in = ByT5Mapper(cfg) if cfg.glyph_dim else None
        self.img_in = PatchEmbed(cfg.in_channels, h)
        self.txt_in = SingleTokenRefiner(cfg)
        self.time_in = TimestepMLP(h)
        self.time_r_in = TimestepMLP(h) if cfg.use_meanflow else None
        self.guidance_in = TimestepMLP(h) if cfg.guidance_embeds else None
        self.double_blocks = nn.ModuleList(MMDoubleStreamBlock(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(MMSingleStreamBlock(cfg) for _ in range(cfg.depth_single))
        self.final_layer = FinalLayer(cfg)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        timesteps: torch.Tensor,
        h: int,
        w: int,
        txt_mask: torch.Tensor | None = None,
        glyph: torch.Tensor | None = None,
        glyph_mask: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        sigma_r: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for latent tokens.

        img [B, h*w, in_channels]: one token per latent pixel, row-major ([B, C, H, W] -> [B, H*W, C]).
        txt [B, S, text_dim]: Qwen2.5-VL states; txt_mask [B, S] bool (True = real, real tokens first) or None.
        glyph [B, G, glyph_dim]: byT5 states of the prompt's quoted text, glyph_mask [B, G] (real first) or None (all
            real); glyph=None (no quoted text) gives what the pipeline's zeros with an all-False mask give.
        timesteps [B]: sigma in [0, 1] (1 = pure noise); the network embeds 1000 sigma in float32.
        guidance [B]: the distilled release's guidance scale (embedded x 1000); sigma_r [B]: its MeanFlow target sigma.
        Returns [B, h*w, out_channels] in compute_dtype.
        """
        cfg, dtype = self.config, self.compute_dtype
        n_img = img.shape[1]
        if n_img != h * w:
            raise ValueError(f"HunyuanImage: {n_img} image tokens do not fit an {h} x {w} latent grid")
        txt_mask = None if txt_mask is None else txt_mask.to(device=txt.device, dtype=torch.bool)
        txt, txt_mask = trimmed(txt.to(dtype), txt_mask, "txt_mask", least=1)

        # Timestep (and guidance): float32 sinusoids of 1000 sigma, cast to compute_dtype before the MLPs.
        t_freq = timestep_embedding(timesteps, TIME_DIM, time_factor=TIME_FACTOR)
        vec = self.time_in(t_freq.to(dtype))
        if self.time_r_in is not None and sigma_r is not None:
            vec = (vec + self.time_r_in(timestep_embedding(sigma_r, TIME_DIM, time_factor=TIME_FACTOR).to(dtype))) / 2
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("this HunyuanImage model embeds guidance (the distilled release): pass guidance [B]")
            vec = vec + self.guidance_in(timestep_embedding(guidance, TIME_DIM, time_factor=TIME_FACTOR).to(dtype))

        txt, txt_mask = self._text(txt, txt_mask, t_freq, glyph, glyph_mask)
        mask = None if txt_mask is None else torch.cat((txt_mask.new_ones(txt.shape[0], n_img), txt_mask), dim=1)

        # Positions (int64) -> float32 cos/sin tables [1, h*w, head_dim/2], computed outside autocast.
        cos, sin = rope_tables(image_positions(h, w, img.device), cfg.axes_dim, cfg.theta)

        img = self.img_in(img.to(dtype))
        ckpt, swap, depth = self.gradient_checkpointing, self.block_swap, len(self.double_blocks)
        for i, block in enumerate(self.double_blocks):
            img, txt = run_block(block, ckpt, img, txt, vec, cos, sin, mask, swap=swap, index=i)
        x = torch.cat((img, txt), dim=1)
        for i, block in enumerate(self.single_blocks):
            x = run_block(block, ckpt, x, vec, cos, sin, mask, n_img, swap=swap, index=depth + i)
        return self.final_layer(x[:, :n_img], vec)

    def _text(self, txt, txt_mask, t_freq, glyph, glyph_mask):
        """(the text sequence [B, T', width], its mask or None): the refined Qwen states with the glyph states."""
        c = self.txt_in.condition(txt, t_freq, txt_mask)
        txt = self.txt_in.input_embedder(txt)
        for block in self.txt_in.individual_token_refiner.blocks:
            txt = run_block(block, self.gradient_checkpointing, txt, c, txt_mask)
        if glyph is None:
            return txt, txt_mask
        if self.byt5_in is None:
            raise ValueError("this HunyuanImage model has no byt5_in: it takes no glyph states")
        glyph_mask = None if glyph_mask is None else glyph_mask.to(device=glyph.device, dtype=torch.bool)
        glyph, glyph_mask = trimmed(glyph.to(self.compute_dtype), glyph_mask, "glyph_mask")
        if glyph.shape[1] == 0:  # no row has quoted text: the pipeline's zeros are all masked
            return txt, txt_mask
        glyph = self.byt5_in(glyph)
        if glyph_mask is None and txt_mask is None:
            return torch.cat((glyph, txt), dim=1), None
        return joint_text(txt, txt_mask, glyph, glyph_mask)

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N of these: single blocks first)."""
        return [*self.double_blocks, *self.single_blocks]


def random_inputs(config: HunyuanImageConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w latent grid with random text (tools/precision_doctor.py): Qwen
    states N(0, 1) whose last quarter is padding (masked), no glyph text (a prompt without quotes), guidance 1.0
    where the model embeds it. The expected positions are the image's (the one rope_tables call)."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] < real
    fixed = dict(txt=torch.randn(1, text_len, config.text_dim, generator=generator), txt_mask=mask, h=h, w=w)
    if config.guidance_embeds:
        fixed["guidance"] = torch.ones(1)
    return RandomInputs(fixed, image_positions(h, w), tuple(config.axes_dim), float(config.theta))
