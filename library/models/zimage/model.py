"""Z-Image (Turbo, Base) transformer on the shared core, with diffusers' module names.

What Z-Image is (diffusers' ZImageTransformer2DModel, models/transformers/transformer_z_image.py):
- One stack of identical single-stream blocks (`layers`) over [image tokens, caption tokens]. Before
  it each modality is refined on its own: the image by `noise_refiner` blocks (timestep-modulated),
  the caption by `context_refiner` blocks (not modulated).
- A block wraps both sub-layers in RMSNorms before and after ("sandwich" norms), uses a SwiGLU
  feed-forward (w1 gate, w3 up, w2 down, hidden int(dim / 3 * 8)) and QK RMSNorm (eps 1e-5), no biases.
- adaLN without shift: f's input is norm1(x) * (1 + scale), its output enters as tanh(gate) * norm2(f).
  The block's modulation Linear reads the 256-wide timestep embedding directly (no SiLU before it).
- Each modality is padded to a multiple of 32 tokens with a learned pad token (`x_pad_token`,
  `cap_pad_token`). The pad tokens are not masked: every block attends to them.
- 3-axis RoPE (32, 48, 48), theta 256, interleaved pairs. Caption token j sits at (1 + j, 0, 0),
  its pads continuing the count; image patch (r, c) at (Tc + 1, r, c) with Tc the caption's padded
  length (so it differs between prompts of a batch); image pad tokens at (0, 0, 0).
- Time runs the other way: the network is trained on t = 1 - sigma (1 = clean image), embedded as
  1000 t, and predicts x0 - noise (ZImagePipeline feeds (1000 - timestep) / 1000 and negates the output).

Our forward hides both conventions: sigma in, velocity (noise - x0) out, as every family's model.
It takes tokens in the shared packed layout (library/models/vae.py pack_latents: features (c, ph, pw))
and reorders them to Z-Image's (ph, pw, c) at entry and back at exit.

Precision (shared/DESIGN.md): inputs are cast to `compute_dtype` at entry; positions are int64 and
become float32 RoPE tables outside autocast (core.rope_tables); the timestep is embedded in float32
and only then cast. The Omni variant (SigLIP image features, several images per prompt) adds
`siglip_embedder` / `siglip_refiner` / `siglip_pad_token`, built when `siglip_feat_dim` is set; this
forward is diffusers' basic (text-to-image) mode, which ignores them; omni.py's ZImageOmni runs its
multi-image mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    LayerNormNoAffine, RMSNorm, TimestepMLP, apply_rope, attention, rope_tables, run_block, timestep_embedding,
)

SEQ_MULTIPLE = 32  # each modality's token count is padded to a multiple of this (diffusers' SEQ_MULTI_OF)
TIME_DIM = 256  # sinusoidal timestep embedding width (diffusers' frequency_embedding_size)
TIME_HIDDEN = 1024  # the timestep MLP's hidden width (fixed in diffusers, whatever `dim` is)


@dataclass(frozen=True)
class ZImageConfig:
    in_channels: int = 16  # latent channels (FLUX.1's VAE); tokens are 2x2 patches: 64 wide
    patch_size: int = 2
    dim: int = 3840
    n_layers: int = 30  # the main single-stream blocks
    n_refiner_layers: int = 2  # noise_refiner and context_refiner blocks (each)
    n_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560  # text hidden states: Qwen3-4B's width
    siglip_feat_dim: int | None = None  # Omni only: SigLIP image features
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)  # RoPE widths of the (sequence, row, column) axes; sum == head_dim
    axes_lens: tuple[int, ...] = (1536, 512, 512)  # positions each axis was built for (diffusers' table sizes)

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if sum(self.axes_dims) != self.head_dim or len(self.axes_lens) != len(self.axes_dims) != 3:
            raise ValueError(f"axes_dims {self.axes_dims} must be 3 axes summing to head_dim {self.head_dim}, "
                             f"axes_lens {self.axes_lens} one length per axis")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return int(self.dim / 3 * 8)  # diffusers' expression, rounding included (10240 for 3840)

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, TIME_DIM)  # the timestep embedding's output width, input of every modulation

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.in_channels

    @property
    def token_width(self) -> int:
        return self.patch_dim  # what the tools size a packed token by (in_channels counts latent channels here)

    @property
    def patch_key(self) -> str:
        return f"{self.patch_size}-1"  # diffusers' all_x_embedder / all_final_layer key: "<patch>-<frame patch>"


# The released sizes: Tongyi-MAI/Z-Image-Turbo and Z-Image (Base) publish the same transformer config
# (Base's adds "siglip_feat_dim": null); they differ in weights and in the scheduler's shift.
ZIMAGE_TURBO = ZImageConfig()
ZIMAGE_BASE = ZImageConfig()
ZIMAGE_CONFIGS = {"turbo": ZIMAGE_TURBO, "base": ZIMAGE_BASE}


def round_up(n: int, to: int = SEQ_MULTIPLE) -> int:
    return -(-n // to) * to


# ----------------------------------------------------------------------------------------------
# Layers


@dataclass
class ScaleGate:
    """One sub-layer's adaLN: f's input is x * (1 + scale), f's output enters as tanh(gate) * y."""

    scale: torch.Tensor  # [B, 1, dim]
    gate: torch.Tensor

    def modulate(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + self.scale)

    def gated(self, y: torch.Tensor) -> torch.Tensor:
        return self.gate.tanh() * y


def split_scale_gate(params: torch.Tensor) -> tuple[ScaleGate, ScaleGate]:
    """[B, 1 or L, 4 dim] -> (attention, feed-forward) ScaleGates, rows (scale, gate, scale, gate)."""
    s1, g1, s2, g2 = params.chunk(4, dim=-1)
    return ScaleGate(s1, g1), ScaleGate(s2, g2)


@dataclass
class TokenTimes:
    """Omni's conditioning of a modulated layer: two timestep embeddings, the noisy target's and the
    clean references' (t = 1), and which tokens take the noisy one (diffusers' noise_mask)."""

    noisy: torch.Tensor  # [B, adaln_dim]
    clean: torch.Tensor  # [B, adaln_dim]
    noisy_tokens: torch.Tensor  # [B, L, 1] bool


def per_token(layer: nn.Module, adaln: torch.Tensor | TokenTimes) -> torch.Tensor:
    """layer(adaln) as [B, 1, out] (one timestep for every token), or per token [B, L, out] for
    TokenTimes: the noisy embedding's output where noisy_tokens, the clean one's elsewhere."""
    if isinstance(adaln, TokenTimes):
        return torch.where(adaln.noisy_tokens, layer(adaln.noisy)[:, None], layer(adaln.clean)[:, None])
    return layer(adaln)[:, None]


class Attention(nn.Module):
    """Self-attention, diffusers' names (to_q, to_k, to_v, norm_q, norm_k, to_out.0); no biases."""

    def __init__(self, dim: int, heads: int, qk_norm: bool):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.norm_q = RMSNorm(dim // heads, eps=1e-5) if qk_norm else None  # diffusers fixes this eps
        self.norm_k = RMSNorm(dim // heads, eps=1e-5) if qk_norm else None
        self.to_out = nn.ModuleList([nn.Linear(dim, dim, bias=False)])

    def forward(self, x, cos, sin, mask):
        """x [B, L, dim]; cos/sin fp32 [B, L, head_dim/2]; mask bool [B, L] (True = attend) or None."""
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.to_q, self.to_k, self.to_v))  # [B, L, H, D]
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.to_out[0](attention(q, k, v, mask=mask))


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x): SwiGLU with Z-Image's (LLaMA reference) names, no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ZImageBlock(nn.Module):
    """The one block kind: modulated (noise_refiner, layers) or not (context_refiner, siglip_refiner)."""

    def __init__(self, cfg: ZImageConfig, modulation: bool):
        super().__init__()
        d = cfg.dim
        self.attention = Attention(d, cfg.n_heads, cfg.qk_norm)
        self.feed_forward = FeedForward(d, cfg.ffn_hidden)
        self.attention_norm1, self.ffn_norm1 = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.attention_norm2, self.ffn_norm2 = RMSNorm(d, cfg.norm_eps), RMSNorm(d, cfg.norm_eps)
        self.adaLN_modulation = nn.Sequential(nn.Linear(cfg.adaln_dim, 4 * d)) if modulation else None

    def forward(self, x, cos, sin, mask=None, adaln=None):
        """x [B, L, dim]; adaln for a modulated block: [B, adaln_dim] (the timestep embedding) or
        Omni's TokenTimes (one of two embeddings per token)."""
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), cos, sin, mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        attn, ffn = split_scale_gate(per_token(self.adaLN_modulation, adaln))
        x = x + attn.gated(self.attention_norm2(self.attention(attn.modulate(self.attention_norm1(x)), cos, sin, mask)))
        return x + ffn.gated(self.ffn_norm2(self.feed_forward(ffn.modulate(self.ffn_norm1(x)))))


class FinalLayer(nn.Module):
    """LayerNorm (no affine, eps 1e-6) scaled by 1 + adaLN(SiLU(t)), then the patch projection."""

    def __init__(self, cfg: ZImageConfig):
        super().__init__()
        self.norm_final = LayerNormNoAffine(cfg.dim)
        self.linear = nn.Linear(cfg.dim, cfg.patch_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.adaln_dim, cfg.dim))

    def forward(self, x, adaln):
        return self.linear(self.norm_final(x) * (1.0 + per_token(self.adaLN_modulation, adaln)))


# ----------------------------------------------------------------------------------------------
# Token order and positions


def to_patch_order(tokens: torch.Tensor, channels: int, patch: int) -> torch.Tensor:
    """[B, L, (c ph pw)] (the shared pack_latents layout) -> [B, L, (ph pw c)] (Z-Image's patchify)."""
    b, n, _ = tokens.shape
    return tokens.view(b, n, channels, patch, patch).permute(0, 1, 3, 4, 2).reshape(b, n, -1)


def from_patch_order(tokens: torch.Tensor, channels: int, patch: int) -> torch.Tensor:
    """[B, L, (ph pw c)] -> [B, L, (c ph pw)]: the inverse of to_patch_order."""
    b, n, _ = tokens.shape
    return tokens.view(b, n, patch, patch, channels).permute(0, 1, 4, 2, 3).reshape(b, n, -1)


def caption_positions(batch: int, length: int, device=None) -> torch.Tensor:
    """[B, length, 3] int64: caption token j at (1 + j, 0, 0), pads included."""
    pos = torch.zeros(batch, length, 3, dtype=torch.int64, device=device)
    pos[..., 0] = torch.arange(1, length + 1, device=device)
    return pos


def image_positions(caption_lengths: torch.Tensor, h: int, w: int, padded: int) -> torch.Tensor:
    """[B, padded, 3] int64: patch (r, c) of an h x w grid at (Tc + 1, r, c), Tc = that row's padded
    caption length (caption_lengths [B] int64); the pad tokens after the h * w patches at (0, 0, 0)."""
    device = caption_lengths.device
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    pos = torch.zeros(caption_lengths.shape[0], padded, 3, dtype=torch.int64, device=device)
    pos[:, : h * w, 0] = caption_lengths[:, None] + 1
    pos[:, : h * w, 1] = rows.reshape(-1)
    pos[:, : h * w, 2] = cols.reshape(-1)
    return pos


# ----------------------------------------------------------------------------------------------
# Model


class ZImage(nn.Module):
    def __init__(self, config: ZImageConfig = ZIMAGE_TURBO):
        super().__init__()
        self.config = cfg = config
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.all_x_embedder = nn.ModuleDict({cfg.patch_key: nn.Linear(cfg.patch_dim, cfg.dim)})
        self.t_embedder = TimestepMLP(cfg.adaln_dim, TIME_HIDDEN, TIME_DIM)  # 256 -> 1024 -> adaln_dim
        self.cap_embedder = nn.Sequential(RMSNorm(cfg.cap_feat_dim, cfg.norm_eps), nn.Linear(cfg.cap_feat_dim, cfg.dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.noise_refiner = nn.ModuleList(ZImageBlock(cfg, modulation=True) for _ in range(cfg.n_refiner_layers))
        self.context_refiner = nn.ModuleList(ZImageBlock(cfg, modulation=False) for _ in range(cfg.n_refiner_layers))
        if cfg.siglip_feat_dim is not None:  # Omni: used by omni.py's forward, not by the one below
            self.siglip_embedder = nn.Sequential(RMSNorm(cfg.siglip_feat_dim, cfg.norm_eps),
                                                 nn.Linear(cfg.siglip_feat_dim, cfg.dim))
            self.siglip_refiner = nn.ModuleList(ZImageBlock(cfg, modulation=False) for _ in range(cfg.n_refiner_layers))
            self.siglip_pad_token = nn.Parameter(torch.zeros(1, cfg.dim))
        self.layers = nn.ModuleList(ZImageBlock(cfg, modulation=True) for _ in range(cfg.n_layers))
        self.all_final_layer = nn.ModuleDict({cfg.patch_key: FinalLayer(cfg)})

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
        txt [B, T, cap_feat_dim]: caption hidden states, each row's real tokens first; cast likewise.
        txt_mask [B, T] bool (True = real token; real tokens first in every row), None: all real.
            Only the real tokens count: ZImagePipeline passes each prompt's real tokens alone.
        timesteps [B]: sigma in [0, 1] (1 = pure noise); the network gets 1 - sigma, embedded in float32.
        Returns [B, h*w, 4C] in compute_dtype, the layout of img.
        """
        cfg, dtype, device = self.config, self.compute_dtype, img.device
        b, n_img, _ = img.shape
        if n_img != h * w:
            raise ValueError(f"Z-Image: {n_img} image tokens do not fit an {h} x {w} patch grid")

        # Sequence lengths: each modality padded to a multiple of 32 (pads attended to, not masked).
        # With a mask, one host sync for the per-prompt lengths (diffusers works per prompt throughout);
        # without one nothing is read, so the forward also runs on `meta` (the memory planner).
        n_x, n_tok = round_up(n_img), txt.shape[1]
        if txt_mask is None:
            n_txt, n_cap = torch.full((b,), n_tok, device=device), round_up(n_tok)  # int64
            cap_lens, cap_mask, mask = torch.full((b,), n_cap, device=device), None, None
        else:
            n_txt = txt_mask.sum(1)  # [B] int64
            if not torch.equal(txt_mask.bool(), torch.arange(n_tok, device=device) < n_txt[:, None]):
                raise ValueError("Z-Image: txt_mask must mark each row's real tokens first (right padding)")
            if int(n_txt.min()) < 1:
                raise ValueError("Z-Image: every caption needs at least one token")
            cap_lens = (n_txt + SEQ_MULTIPLE - 1) // SEQ_MULTIPLE * SEQ_MULTIPLE
            n_cap = int(cap_lens.max())
            cap_keys = torch.arange(n_cap, device=device)[None] < cap_lens[:, None]  # [B, n_cap]: tokens + pads
            ragged = not bool(cap_keys.all())  # as diffusers: no mask at all when every row is as long
            cap_mask = cap_keys if ragged else None
            mask = torch.cat((cap_keys.new_ones(b, n_x), cap_keys), dim=1) if ragged else None

        # Positions -> float32 cos/sin tables, computed outside autocast (core.rope_tables).
        x_pos, cap_pos = image_positions(cap_lens, h, w, n_x), caption_positions(b, n_cap, device)
        for axis, (need, limit) in enumerate(zip((n_cap + 2, h, w), cfg.axes_lens)):  # image axis 0 reaches n_cap + 1
            if need > limit:
                raise ValueError(f"Z-Image: RoPE axis {axis} needs {need} positions, the model was built for {limit} "
                                 f"(a longer caption or a larger image than it takes)")
        x_cos, x_sin = rope_tables(x_pos, cfg.axes_dims, cfg.rope_theta)
        cap_cos, cap_sin = rope_tables(cap_pos, cfg.axes_dims, cfg.rope_theta)

        # Timestep: Z-Image's t = 1 - sigma, embedded in float32 (as 1000 t), cast before the MLP.
        t = 1.0 - timesteps.float()
        adaln = self.t_embedder(timestep_embedding(t, TIME_DIM, time_factor=cfg.t_scale).to(dtype))

        # Image tokens: embed the h*w patches, then the learned pad token up to n_x.
        x = self.all_x_embedder[cfg.patch_key](to_patch_order(img.to(dtype), cfg.in_channels, cfg.patch_size))
        x = torch.cat((x, self.x_pad_token.to(dtype).expand(b, n_x - n_img, -1)), dim=1)
        # Caption tokens: n_txt real ones, then the learned pad token (beyond a row's cap_lens: masked filler).
        txt = F.pad(txt.to(dtype)[:, :n_cap], (0, 0, 0, max(0, n_cap - txt.shape[1])))
        real = (torch.arange(n_cap, device=device)[None] < n_txt[:, None])[..., None]
        cap = torch.where(real, self.cap_embedder(txt), self.cap_pad_token.to(dtype))

        ckpt, swap, n_ref = self.gradient_checkpointing, self.block_swap, len(self.noise_refiner)
        for i, block in enumerate(self.noise_refiner):
            x = run_block(block, ckpt, x, x_cos, x_sin, None, adaln, swap=swap, index=i)
        for i, block in enumerate(self.context_refiner):
            cap = run_block(block, ckpt, cap, cap_cos, cap_sin, cap_mask, swap=swap, index=n_ref + i)
        u = torch.cat((x, cap), dim=1)  # [image, caption]: a row's masked caption filler sits at its end
        cos, sin = torch.cat((x_cos, cap_cos), dim=1), torch.cat((x_sin, cap_sin), dim=1)
        for i, block in enumerate(self.layers):
            u = run_block(block, ckpt, u, cos, sin, mask, adaln, swap=swap, index=2 * n_ref + i)
        out = self.all_final_layer[cfg.patch_key](u[:, :n_img], adaln)  # x0 - noise, Z-Image's patch order
        return -from_patch_order(out, cfg.in_channels, cfg.patch_size)

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order: noise refiner, context refiner, main layers (block swap moves the last N)."""
        return [*self.noise_refiner, *self.context_refiner, *self.layers]


def random_inputs(config: ZImageConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    caption hidden states N(0, 1) whose last quarter is padding (masked), as a short caption's would be.
    The expected positions are the image tokens' (the rope_tables call of the image, whose axes 1 and 2
    hold the grid: where rounded positions show)."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] < real
    fixed = dict(txt=torch.randn(1, text_len, config.cap_feat_dim, generator=generator), txt_mask=mask, h=h, w=w)
    positions = image_positions(torch.tensor([round_up(real)]), h, w, round_up(h * w))
    return RandomInputs(fixed, positions, tuple(config.axes_dims), float(config.rope_theta))
