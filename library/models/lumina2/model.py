"""Lumina Image 2.0 (Alpha-VLLM's NextDiT, 2.6 B; its anime fine-tunes Neta Lumina / NetaYume Lumina) on the
shared core, with the ORIGINAL module names: those of the released single file (Comfy-Org's
lumina_2_model_bf16.safetensors), of sd-scripts' library/lumina_models.py and of ComfyUI, which their LoRAs use.

What Lumina 2 is (diffusers' Lumina2Transformer2DModel, models/transformers/transformer_lumina2.py; sd-scripts'
NextDiT_2B_GQA_patch2_Adaln_Refiner = LuminaParams.get_2b_config):
- One stack of single-stream blocks (`layers`, 26) over [caption tokens, image tokens]. Before it each modality is
  refined on its own: the caption by `context_refiner` blocks (not modulated, its padding masked), the image by
  `noise_refiner` blocks (timestep-modulated). Z-Image (zimage/model.py) is the same team's successor of this design.
- A block wraps both sub-layers in RMSNorms before and after ("sandwich" norms, eps 1e-5), SwiGLU feed-forward
  (w1 gate, w3 up, w2 down; hidden 4 dim rounded up to `multiple_of` 256: 9216), grouped-query attention with one
  fused `qkv` Linear (24 query heads, 8 key/value heads of 96; rows q | k | v) and QK RMSNorm over a head, no biases.
- adaLN without shift: `adaLN_modulation` = (SiLU, Linear) reads the 1024-wide timestep embedding (min(dim, 1024));
  f's input is norm1(x) * (1 + scale), its output enters as tanh(gate) * norm2(f).
- No pad tokens: a batch's captions of different real lengths are masked (the caption refiner's keys and the joint
  blocks' keys), so each sample sees only its own real tokens, as diffusers' per-sample sequences.
- 3-axis RoPE (32, 32, 32), theta 10000, interleaved (complex) pairs. Caption token j at (j, 0, 0); image patch
  (r, c) at (L, r, c) with L that sample's real caption length (Lumina2RotaryPosEmbed).
- Time runs the other way: the network is trained on t = 1 - sigma (1 = clean image), embedded unscaled (t in
  [0, 1], sinusoid of 256, cos half first), and predicts x0 - noise (Lumina2Pipeline feeds 1 - t / 1000 and
  negates the output; ComfyUI's NextDiT does `t = 1.0 - timesteps` ... `return -x`).

Our forward hides both conventions: sigma in, velocity (noise - x0) out, as every family's model. It takes tokens
in the shared packed layout (library/models/latents.py pack_latents: features (c, ph, pw)) and reorders them to
the reference's (ph, pw, c) at entry and back at exit.

Precision (shared/DESIGN.md): inputs are cast to `compute_dtype` at entry; positions are int64 and become float32
RoPE tables outside autocast (core.rope_tables: float64 angles); the timestep is embedded in float32 and only then
cast to compute_dtype (diffusers: `.type_as(hidden_states)`). Modulation and gates run in compute_dtype, as
sd-scripts' `modulate` and gates do. core.residual_projection does not apply: each sub-layer's output goes through
an RMSNorm (`attention_norm2` / `ffn_norm2`), which reads the projection's output before the gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from library.models.core import RMSNorm, TimestepMLP, apply_rope, attention, rope_tables, run_block, timestep_embedding
from library.models.zimage.model import FeedForward, FinalLayer, from_patch_order, split_scale_gate, to_patch_order

TIME_DIM = 256  # sinusoidal timestep embedding width (frequency_embedding_size)
ADALN_MAX = 1024  # the timestep embedding's width is min(dim, 1024) (sd-scripts' TimestepEmbedder(min(dim, 1024)))


@dataclass(frozen=True)
class Lumina2Config:
    """Defaults: the released Lumina-Image-2.0 (diffusers' Lumina2Transformer2DModel defaults with cap_feat_dim
    2304, as its transformer/config.json; sd-scripts' LuminaParams.get_2b_config)."""

    in_channels: int = 16  # latent channels (FLUX.1's AE); tokens are 2x2 patches: 64 wide
    patch_size: int = 2
    dim: int = 2304
    n_layers: int = 26  # the joint single-stream blocks
    n_refiner_layers: int = 2  # noise_refiner and context_refiner blocks (each)
    n_heads: int = 24
    n_kv_heads: int = 8  # grouped-query attention: 3 query heads share a key/value head
    multiple_of: int = 256  # the feed-forward's hidden width is rounded up to this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    qk_norm: bool = True
    # diffusers builds the QK RMSNorms with eps 1e-5 (its Attention(eps=1e-5)); sd-scripts' / the original
    # JointAttention RMSNorm(head_dim) 1e-6, ComfyUI's torch default (float eps). Over 96 channels of mean square
    # ~1 the three differ by < 1e-5 relative; we keep diffusers' (the parity oracle).
    qk_norm_eps: float = 1e-5
    cap_feat_dim: int = 2304  # caption hidden states: Gemma-2-2B's width (a tiny text encoder is narrower)
    rope_theta: float = 10000.0
    axes_dims: tuple[int, ...] = (32, 32, 32)  # RoPE widths of the (sequence, row, column) axes; sum == head_dim
    axes_lens: tuple[int, ...] = (300, 512, 512)  # positions each axis was built for (diffusers' table sizes)

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"dim {self.dim} must divide into n_heads {self.n_heads}, and those into "
                             f"n_kv_heads {self.n_kv_heads} groups")
        if sum(self.axes_dims) != self.head_dim or not len(self.axes_lens) == len(self.axes_dims) == 3:
            raise ValueError(f"axes_dims {self.axes_dims} must be 3 axes summing to head_dim {self.head_dim}, "
                             f"axes_lens {self.axes_lens} one length per axis")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """4 dim (times ffn_dim_multiplier), rounded up to multiple_of: 9216 released (no 2/3 as in Llama)."""
        hidden = 4 * self.dim if self.ffn_dim_multiplier is None else int(self.ffn_dim_multiplier * 4 * self.dim)
        return -(-hidden // self.multiple_of) * self.multiple_of

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_MAX)

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.in_channels

    @property
    def token_width(self) -> int:
        return self.patch_dim  # what the tools size a packed token by


LUMINA2 = Lumina2Config()


# ----------------------------------------------------------------------------------------------
# Layers


class Attention(nn.Module):
    """Grouped-query self-attention with the original names: one fused `qkv` (rows: n_heads query heads, then
    n_kv_heads key heads, then as many value heads), `q_norm` / `k_norm` over a head, `out`; no biases."""

    def __init__(self, cfg: Lumina2Config):
        super().__init__()
        self.heads, self.kv_heads, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * d, bias=False)
        self.q_norm = RMSNorm(d, cfg.qk_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.qk_norm_eps) if cfg.qk_norm else None
        self.out = nn.Linear(cfg.n_heads * d, cfg.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        """x [B, L, dim]; cos/sin float32 [B, L, head_dim/2]; mask bool [B, L] (True = attend) or None."""
        d = self.qkv.out_features // (self.heads + 2 * self.kv_heads)
        q, k, v = self.qkv(x).split((self.heads * d, self.kv_heads * d, self.kv_heads * d), dim=-1)
        q, k, v = q.unflatten(-1, (self.heads, d)), k.unflatten(-1, (self.kv_heads, d)), v.unflatten(-1, (-1, d))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H or Hkv, L, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # interleaved pairs (diffusers' use_real=False)
        return self.out(attention(q, k, v, mask=mask))  # core.attention repeats k / v over each group (GQA)


class Lumina2Block(nn.Module):
    """The one block kind: modulated (noise_refiner, layers) or not (context_refiner: no adaLN_modulation)."""

    def __init__(self, cfg: Lumina2Config, modulation: bool):
        super().__init__()
        d = cfg.dim
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(d, cfg.ffn_hidden)  # w1 / w2 / w3, no biases (zimage's)
        self.attention_norm1, self.ffn_norm1 = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.attention_norm2, self.ffn_norm2 = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.adaln_dim, 4 * d)) if modulation else None

    def forward(self, x, cos, sin, mask=None, adaln=None):
        """x [B, L, dim]; adaln [B, adaln_dim] (the timestep embedding) for a modulated block."""
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), cos, sin, mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        attn, ffn = split_scale_gate(self.adaLN_modulation(adaln)[:, None])  # rows scale, gate, scale, gate
        x = x + attn.gated(self.attention_norm2(self.attention(attn.modulate(self.attention_norm1(x)), cos, sin, mask)))
        return x + ffn.gated(self.ffn_norm2(self.feed_forward(ffn.modulate(self.ffn_norm1(x)))))


# ----------------------------------------------------------------------------------------------
# Positions


def caption_positions(batch: int, length: int, device=None) -> torch.Tensor:
    """[B, length, 3] int64: caption token j at (j, 0, 0) (padding too: masked, its position is never seen)."""
    pos = torch.zeros(batch, length, 3, dtype=torch.int64, device=device)
    pos[..., 0] = torch.arange(length, device=device)
    return pos


def image_positions(caption_lengths: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h*w, 3] int64: patch (r, c) of an h x w grid at (L, r, c), L = that sample's real caption length
    (caption_lengths [B] int64)."""
    device = caption_lengths.device
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    pos = torch.empty(caption_lengths.shape[0], h * w, 3, dtype=torch.int64, device=device)
    pos[..., 0] = caption_lengths[:, None]
    pos[..., 1], pos[..., 2] = rows.reshape(-1), cols.reshape(-1)
    return pos


# ----------------------------------------------------------------------------------------------
# Model


class Lumina2(nn.Module):
    def __init__(self, config: Lumina2Config = LUMINA2):
        super().__init__()
        self.config = cfg = config
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.x_embedder = nn.Linear(cfg.patch_dim, cfg.dim)
        self.t_embedder = TimestepMLP(cfg.adaln_dim, freq_dim=TIME_DIM)  # 256 -> width -> width = min(dim, 1024)
        self.cap_embedder = nn.Sequential(RMSNorm(cfg.cap_feat_dim, cfg.norm_eps), nn.Linear(cfg.cap_feat_dim, cfg.dim))
        self.noise_refiner = nn.ModuleList(Lumina2Block(cfg, modulation=True) for _ in range(cfg.n_refiner_layers))
        self.context_refiner = nn.ModuleList(Lumina2Block(cfg, modulation=False) for _ in range(cfg.n_refiner_layers))
        self.layers = nn.ModuleList(Lumina2Block(cfg, modulation=True) for _ in range(cfg.n_layers))
        # LayerNorm (no affine, eps 1e-6) * (1 + adaLN_modulation.1(SiLU(t))), then `linear`: zimage's FinalLayer
        self.final_layer = FinalLayer(cfg)

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

        img [B, h*w, 4C]: an h x w grid of 2x2 patches in pack_latents' layout; cast to compute_dtype.
        txt [B, S, cap_feat_dim]: Gemma hidden states, each row's real tokens first; cast likewise.
        txt_mask [B, S] bool (True = real token, real tokens first), None: all real. Padding gets zero attention
            weight as a key everywhere; the image sits after each sample's real tokens in RoPE (diffusers).
        timesteps [B]: sigma in [0, 1] (1 = pure noise); the network gets t = 1 - sigma, embedded in float32.
        Returns [B, h*w, 4C] in compute_dtype, the layout of img.
        """
        cfg, dtype, device = self.config, self.compute_dtype, img.device
        b, n_img, _ = img.shape
        n_tok = txt.shape[1]
        if n_img != h * w:
            raise ValueError(f"Lumina 2: {n_img} image tokens do not fit an {h} x {w} patch grid")

        # Caption lengths: with a mask, one check of its layout (a host sync); without one nothing is read,
        # so the forward also runs on `meta` (the memory planner).
        if txt_mask is None:
            n_txt, cap_mask = torch.full((b,), n_tok, dtype=torch.int64, device=device), None
        else:
            txt_mask = txt_mask.to(device=device, dtype=torch.bool)
            n_txt = txt_mask.sum(1)  # [B] int64
            if not torch.equal(txt_mask, torch.arange(n_tok, device=device) < n_txt[:, None]):
                raise ValueError("Lumina 2: txt_mask must mark each row's real tokens first (right padding)")
            if int(n_txt.min()) < 1:
                raise ValueError("Lumina 2: every caption needs at least one token")
            cap_mask = None if bool(txt_mask.all()) else txt_mask
        mask = None if cap_mask is None else torch.cat((cap_mask, cap_mask.new_ones(b, n_img)), dim=1)

        # Positions (int64) -> float32 cos/sin tables, computed outside autocast (core.rope_tables).
        for axis, (need, limit) in enumerate(zip((n_tok + 1, h, w), cfg.axes_lens)):  # image axis 0 reaches n_tok
            if need > limit:
                raise ValueError(f"Lumina 2: RoPE axis {axis} needs {need} positions, the model was built for {limit} "
                                 f"(a longer caption or a larger image than it takes)")
        cap_cos, cap_sin = rope_tables(caption_positions(b, n_tok, device), cfg.axes_dims, cfg.rope_theta)
        x_cos, x_sin = rope_tables(image_positions(n_txt, h, w), cfg.axes_dims, cfg.rope_theta)

        # Timestep: Lumina's t = 1 - sigma, embedded unscaled in float32, cast before the MLP.
        t = 1.0 - timesteps.float()
        adaln = self.t_embedder(timestep_embedding(t, TIME_DIM, time_factor=1.0).to(dtype))

        x = self.x_embedder(to_patch_order(img.to(dtype), cfg.in_channels, cfg.patch_size))
        cap = self.cap_embedder(txt.to(dtype))

        ckpt, swap, n_ref = self.gradient_checkpointing, self.block_swap, len(self.context_refiner)
        for i, block in enumerate(self.context_refiner):
            cap = run_block(block, ckpt, cap, cap_cos, cap_sin, cap_mask, swap=swap, index=i)
        for i, block in enumerate(self.noise_refiner):
            x = run_block(block, ckpt, x, x_cos, x_sin, None, adaln, swap=swap, index=n_ref + i)
        # [caption, image]: a row's masked caption padding sits inside it (a key of zero weight), not at its end
        u = torch.cat((cap, x), dim=1)
        cos, sin = torch.cat((cap_cos, x_cos), dim=1), torch.cat((cap_sin, x_sin), dim=1)
        for i, block in enumerate(self.layers):
            u = run_block(block, ckpt, u, cos, sin, mask, adaln, swap=swap, index=2 * n_ref + i)
        out = self.final_layer(u[:, n_tok:], adaln)  # x0 - noise, the reference's patch order
        return -from_patch_order(out, cfg.in_channels, cfg.patch_size)

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order: context refiner, noise refiner, joint layers (block swap moves the last N)."""
        return [*self.context_refiner, *self.noise_refiner, *self.layers]


def random_inputs(config: Lumina2Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    caption hidden states N(0, 1) whose last quarter is padding (masked), as a short caption's would be. The
    expected positions are the image tokens' (the rope_tables call of the image, whose axes 1 and 2 hold the grid:
    where rounded positions show)."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] < real
    fixed = dict(txt=torch.randn(1, text_len, config.cap_feat_dim, generator=generator), txt_mask=mask, h=h, w=w)
    positions = image_positions(torch.tensor([real]), h, w)
    return RandomInputs(fixed, positions, tuple(config.axes_dims), float(config.rope_theta))
