"""Nucleus-Image transformer on the shared core, with diffusers' module names (the released files' own).

What Nucleus-Image is (diffusers' NucleusMoEImageTransformer2DModel, models/transformers/
transformer_nucleusmoe_image.py): a 17 B sparse mixture-of-experts DiT, ~2 B parameters active per token.
- Only the image tokens run through the blocks: packed latents (Qwen-Image's VAE, 16 channels x 2x2 = 64)
  through `img_in`. The text (Qwen3-VL-8B hidden states, 4096 wide) is RMS-normed once (`txt_norm`) and never
  updated: each block projects it with its own `encoder_proj`, then to keys and values (`attn.add_k_proj`,
  `attn.add_v_proj`, QK norm `attn.norm_added_k`); the image queries attend to [image keys, text keys].
  There is no text query: `attn.norm_added_q` exists in diffusers' module (and the released file) but no
  forward reads it; we hold it so that every file loads by plain key.
- Grouped-query attention: 16 query heads over 4 key/value heads of 128 (query head i reads kv head
  i // 4, diffusers' repeat_interleave and SDPA's enable_gqa alike).
- RoPE as Qwen-Image's (scale_rope): theta 10000 over (frame, row, col) widths (16, 56, 56); the image at
  (0, r, c) with rows and columns centred (-(h - h//2) .. h//2 - 1), text token j at max(h//2, w//2) + j on
  all three axes. Pairs are interleaved (core.apply_rope). A masked text key takes no weight.
- Per-block modulation `img_mod` (SiLU, Linear) of the timestep embedding -> (scale1, gate1, scale2, gate2),
  no shift; the gates are clamped to [-2, 2] and go through tanh. Pre-norms are LayerNorms without affine
  (eps 1e-6): x += tanh(gate1) * attn(LN(x) * (1 + scale1)); x += tanh(gate2) * mlp(LN(x) * (1 + scale2)).
- The MLP: the first blocks (dense_moe_strategy) a SwiGLU of inner int(dim * mlp_ratio * 2/3) // 128 * 128
  (`img_mlp.net.0.proj` holds [up | gate], diffusers' SwiGLU order); the others an expert-choice mixture
  (`img_mlp.gate`, `img_mlp.experts`, `img_mlp.shared_expert`), see ExpertChoiceMoE.
- The timestep: a sinusoid of 1000 sigma as wide as the model (cos half first), an MLP (dim -> 4 dim -> dim)
  and an RMSNorm (`time_text_embed.norm`). Final: AdaLayerNormContinuous (`norm_out.linear` of SiLU(temb) ->
  (scale, shift)) and `proj_out` (no bias).

Our forward takes sigma in [0, 1] (1 = noise), as diffusers' does (its Timesteps scales by 1000). The network
predicts the NEGATED flow velocity x0 - noise: the pipeline negates its output before the scheduler step and
ai-toolkit negates its prediction before the loss against noise - latents. The forward returns the raw output;
the family negates it.

Tokens in and out are the packed layout (library/models/latents.py pack_latents: [B, h*w, 64], features (c, ph,
pw)), which is diffusers' _pack_latents; h, w is the token grid (latent size / 2).

Precision (shared/DESIGN.md): img / txt are cast to `compute_dtype` at entry. Positions are int64 and become
float32 cos/sin tables from float64 angles outside autocast (core.rope_tables), never cast with the model
(diffusers computes the angles in float32). The sinusoid is float32 and cast to compute_dtype before
`linear_1` (diffusers first casts sigma to the activation dtype: in bf16 its sigma is off by up to 2^-9
relative). QK norm and RoPE run in float32 with one rounding. Modulation, gating, residual adds and the MLPs
run in the activation dtype, as diffusers' do. The router: logits in the activation dtype, softmax (or
sigmoid) in float32, its scores rounded back to the activation dtype before the top-k, the per-token sums and
the gating (diffusers' roundings, so that in bf16 the same tokens are picked); routed outputs are weighted in
float32 and rounded once.

Parameter count of the released config (NucleusAI/Nucleus-Image transformer/config.json, on `meta`; diffusers'
class with that config gives the same): 16,922,679,296, of which 15,325,986,816 (0.906) in the packed experts
and 1,596,325,888 in Linear weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    LayerNormNoAffine, RMSNorm, apply_rope, attention, residual_projection, rope_tables, run_block, timestep_embedding,
)
from library.models.flux2.model import swiglu
from library.models.qwen_image.model import OutputNorm, image_positions
from library.precision.fp8_packed import PackedWeights

# Which blocks hold a mixture of experts (diffusers' _is_moe_layer), by the config's dense_moe_strategy. diffusers
# takes any other name as "every block"; we refuse it (a typo would silently build another model).
DENSE_MOE_STRATEGIES = {
    "leave_first_three_and_last_block_dense": lambda i, n: 3 <= i < n - 1,
    "leave_first_three_blocks_dense": lambda i, n: i >= 3,
    "leave_first_block_dense": lambda i, n: i >= 1,
    "all_moe": lambda i, n: True,
    "all_dense": lambda i, n: False,
}
RELEASED_CAPACITY_FACTORS = (0.0, 0.0, 0.0, 4.0, 4.0) + (2.0,) * 27  # per block; the dense blocks' 0 is unused
ROUTER_EPS = 1e-12  # added to a token's summed scores before its gates are normalised (diffusers')


@dataclass(frozen=True)
class NucleusImageConfig:
    """diffusers' NucleusMoEImageTransformer2DModel arguments (same names), defaults the released model's.
    Not here: diffusers' use_grouped_mm (how it runs the experts; ours run as one batched matmul)."""

    patch_size: int = 2
    in_channels: int = 64  # a packed token: 16 latent channels x 2x2
    out_channels: int = 16  # per pixel of the patch: proj_out gives patch_size^2 * out_channels
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    joint_attention_dim: int = 4096  # the text hidden states (Qwen3-VL-8B)
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)  # RoPE widths of the (frame, row, col) axes
    mlp_ratio: float = 4.0  # the dense blocks' SwiGLU
    moe_enabled: bool = True
    dense_moe_strategy: str = "leave_first_three_blocks_dense"
    num_experts: int = 64
    moe_intermediate_dim: int = 1344  # each expert's and the shared expert's inner width
    capacity_factors: tuple[float, ...] = RELEASED_CAPACITY_FACTORS
    use_sigmoid: bool = False  # router scores: softmax over the experts (False) or a sigmoid each
    route_scale: float = 2.5
    rope_theta: float = 10000.0  # fixed in diffusers (NucleusMoEEmbedRope(theta=10000)), not in its config

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        object.__setattr__(self, "capacity_factors", tuple(float(c) for c in self.capacity_factors))
        if sum(self.axes_dims_rope) != self.attention_head_dim or len(self.axes_dims_rope) != 3:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must be 3 axes summing to attention_head_dim "
                             f"{self.attention_head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.dense_moe_strategy not in DENSE_MOE_STRATEGIES:
            raise ValueError(f"dense_moe_strategy {self.dense_moe_strategy!r} is none of "
                             f"{sorted(DENSE_MOE_STRATEGIES)}")
        if len(self.capacity_factors) != self.num_layers:
            raise ValueError(f"capacity_factors has {len(self.capacity_factors)} entries for {self.num_layers} layers")
        for i in self.moe_blocks:  # C = ceil(f S / E) <= S tokens exactly when f <= E
            if not 0 <= self.capacity_factors[i] <= self.num_experts:
                raise ValueError(f"capacity_factors[{i}] = {self.capacity_factors[i]} is outside [0, num_experts = "
                                 f"{self.num_experts}]: above it an expert would pick more tokens than there are")
        if len(self.moe_blocks) < self.num_layers and self.dense_inner_dim <= 0:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} gives the dense blocks no SwiGLU width at dim "
                             f"{self.inner_dim}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def dense_inner_dim(self) -> int:
        """The dense blocks' SwiGLU width (diffusers' rounding down to a multiple of 128)."""
        return int(self.inner_dim * self.mlp_ratio * 2 / 3) // 128 * 128

    @property
    def moe_blocks(self) -> tuple[int, ...]:
        """The indices of the blocks whose MLP is a mixture of experts."""
        if not self.moe_enabled:
            return ()
        routed = DENSE_MOE_STRATEGIES[self.dense_moe_strategy]
        return tuple(i for i in range(self.num_layers) if routed(i, self.num_layers))


NUCLEUS_IMAGE = NucleusImageConfig()


def expert_capacity(factor: float, tokens: int, experts: int) -> int:
    """Tokens each expert picks per sample: max(1, ceil(factor * tokens / experts)) (diffusers' Python floats)."""
    return max(1, math.ceil(factor * tokens / experts))


# ----------------------------------------------------------------------------------------------
# Positions (int64 ids; angles are computed by core.rope_tables)


def joint_positions(h: int, w: int, text_len: int) -> torch.Tensor:
    """int64 [h*w + text_len, 3] RoPE ids of [image, text]: patch (r, c) at (0, r', c') centred as Qwen-Image's
    (image_positions), text token j at max(h//2, w//2) + j on every axis (padding included: it is masked)."""
    start = max(h // 2, w // 2)
    text = (start + torch.arange(text_len, dtype=torch.int64))[:, None].expand(text_len, 3)
    return torch.cat((image_positions(1, h, w), text))


# ----------------------------------------------------------------------------------------------
# Layers


class TimestepEmbedder(nn.Module):
    """linear_2(silu(linear_1(sinusoid))), diffusers' TimestepEmbedding names: dim -> 4 dim -> dim."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim, 4 * dim)
        self.linear_2 = nn.Linear(4 * dim, dim)

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(emb)))


class TimeTextEmbed(nn.Module):
    """`timestep_embedder` of the sinusoid of 1000 sigma (float32, cos half first), then the RMSNorm `norm`."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.timestep_embedder = TimestepEmbedder(dim)
        self.norm = RMSNorm(dim, eps=1e-6)

    def forward(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """sigma float [B] -> temb [B, dim] in dtype."""
        emb = timestep_embedding(sigma, self.dim, time_factor=1000.0, scale_first=False)  # float32, diffusers' order
        return self.norm(self.timestep_embedder(emb.to(dtype)))


class ImageToTextAttention(nn.Module):
    """Image queries over [image keys, text keys], GQA; diffusers' Attention names (no biases)."""

    def __init__(self, cfg: NucleusImageConfig):
        super().__init__()
        d, hd = cfg.inner_dim, cfg.attention_head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        kv = self.kv_heads * hd
        self.to_q = nn.Linear(d, d, bias=False)
        self.to_k, self.to_v = nn.Linear(d, kv, bias=False), nn.Linear(d, kv, bias=False)
        self.add_k_proj, self.add_v_proj = nn.Linear(d, kv, bias=False), nn.Linear(d, kv, bias=False)
        self.norm_q, self.norm_k = RMSNorm(hd), RMSNorm(hd)
        self.norm_added_q = RMSNorm(hd)  # unused (no text query): held for the files' key
        self.norm_added_k = RMSNorm(hd)
        self.to_out = nn.ModuleList([nn.Linear(d, d, bias=False)])

    @staticmethod
    def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)  # [B, L, (H D)] -> [B, H, L, D]

    def _rotated(self, x: torch.Tensor, norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """QK norm, then RoPE in float32 with one rounding to x.dtype: [B, H, L, D]."""
        return apply_rope(norm(x.float()), cos, sin, interleaved=True).to(x.dtype)

    def forward(self, y, context, img_rope, txt_rope, mask) -> torch.Tensor:
        """The attention output before `to_out` [B, S, inner]. y [B, S, inner] (modulated image), context
        [B, T, inner] (this block's projected text); img_rope / txt_rope: float32 (cos, sin) [S or T, head_dim/2];
        mask bool [B, 1, 1, S + T] (True = attend) or None."""
        q = self._rotated(self._heads(self.to_q(y), self.heads), self.norm_q, *img_rope)
        k_img = self._rotated(self._heads(self.to_k(y), self.kv_heads), self.norm_k, *img_rope)
        k_txt = self._rotated(self._heads(self.add_k_proj(context), self.kv_heads), self.norm_added_k, *txt_rope)
        v = torch.cat((self._heads(self.to_v(y), self.kv_heads), self._heads(self.add_v_proj(context), self.kv_heads)),
                      dim=2)
        return attention(q, torch.cat((k_img, k_txt), dim=2), v, mask=mask)  # [B, S, H * D]


class _Proj(nn.Module):
    def __init__(self, dim: int, out: int):
        super().__init__()
        self.proj = nn.Linear(dim, out, bias=False)

    def forward(self, x):
        return self.proj(x)


class SwiGLUFeedForward(nn.Module):
    """diffusers' FeedForward(activation_fn="swiglu", bias=False): `net.0.proj` -> [up | gate] (that order),
    up * silu(gate), `net.2`. The dense blocks' MLP and the mixture's shared expert."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.net = nn.ModuleList([_Proj(dim, 2 * inner), nn.Identity(), nn.Linear(inner, dim, bias=False)])

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection `net.2` reads."""
        up, gate = self.net[0](x).chunk(2, dim=-1)
        return up * F.silu(gate)

    def forward(self, x: torch.Tensor, output_needed: bool = True) -> torch.Tensor:
        """output_needed: whether anything saves the output for backward (core.residual_projection)."""
        return residual_projection(self.net[2], self.hidden(x), output_needed)


class SwiGLUExperts(PackedWeights):
    """The routed experts as diffusers packs them: `gate_up_proj` [E, dim, 2 inner] ([gate | up] columns) and
    `down_proj` [E, inner, dim], stored as x @ W (no transpose). Expert e: (silu(x W_gu[e][:, :I]) * x W_gu[e][:, I:])
    @ W_d[e]. Every expert picks the same number of tokens (expert choice), so all of them run as one batched
    matmul (torch.bmm, on every device and dtype): no grouped GEMM is needed. The weights are packed weights
    (precision/fp8_packed.py): an fp8 base stores them as fp8 codes + scales, read only through `matrices` (the
    reference loop's) and packed_bmm; then the forward runs by chunks of experts, each chunk's weights
    dequantized in forward and again in backward, never kept."""

    packed_weights = ("gate_up_proj", "down_proj")

    def __init__(self, dim: int, inner: int, experts: int):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, dim, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(experts, inner, dim))

    def matrices(self, dtype: torch.dtype, experts: slice | int = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [.., dim, 2 inner], down [.., inner, dim]) of `experts` (an index or a slice) in `dtype`."""
        return self.packed_weight("gate_up_proj", dtype, experts), self.packed_weight("down_proj", dtype, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [E, N, dim]: expert e's N tokens in row e (activation dtype) -> [E, N, dim] in x.dtype (autocast's
        for fp8 weights under autocast). High-precision weights: one chunk of all experts."""
        out = []
        for experts in self.expert_chunks(x.dtype):
            hidden = swiglu(self.packed_bmm(x[experts], "gate_up_proj", experts))
            out.append(self.packed_bmm(hidden, "down_proj", experts))
        return out[0] if len(out) == 1 else torch.cat(out)

    def forward_loop(self, x: torch.Tensor) -> torch.Tensor:
        """The same, one expert at a time (diffusers' for-loop path): the reference the batched one is tested on."""
        out = []
        for e in range(self.num_experts):
            gate_up, down = self.matrices(x.dtype, e)
            out.append(swiglu(x[e] @ gate_up) @ down)
        return torch.stack(out)


class ExpertChoiceMoE(nn.Module):
    """diffusers' NucleusMoELayer: the router `gate`, the packed `experts`, the `shared_expert`.

    Expert choice: the router scores each token for each expert from cat([temb, the token normed but not
    modulated]) (timestep first); per sample, each expert takes its C best-scoring tokens, C =
    expert_capacity(capacity_factor, S, E) with S the image tokens. A token's gate from expert e is e's score
    over the sum of the scores of the experts that took it (+ ROUTER_EPS), times route_scale; a token no expert
    took gets the shared expert's output alone. Routed outputs are scatter-added onto the shared expert's."""

    def __init__(self, cfg: NucleusImageConfig, capacity_factor: float):
        super().__init__()
        d, self.num_experts = cfg.inner_dim, cfg.num_experts
        self.capacity_factor, self.use_sigmoid, self.route_scale = capacity_factor, cfg.use_sigmoid, cfg.route_scale
        self.gate = nn.Linear(2 * d, cfg.num_experts, bias=False)
        self.experts = SwiGLUExperts(d, cfg.moe_intermediate_dim, cfg.num_experts)
        self.shared_expert = SwiGLUFeedForward(d, cfg.moe_intermediate_dim)

    def expert_choice(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logits [B, S, E] -> (scores, tokens) [B, E, C]: each expert's C best tokens of each sample,
        best first, and their scores in the logits' dtype. The precision doctor reads the choice through this (its
        routing audit hooks `gate`), so a low-precision base's flipped choices are counted as the model makes them."""
        capacity = expert_capacity(self.capacity_factor, logits.shape[1], self.num_experts)
        scores = torch.sigmoid(logits.float()) if self.use_sigmoid else F.softmax(logits.float(), dim=-1)  # float32
        scores = scores.to(logits.dtype)  # rounded as diffusers' (its top-k sees these values)
        return scores.transpose(1, 2).topk(capacity, dim=-1)  # [B, E, C]: expert e's best tokens of b

    def route(self, y_unmodulated: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, gates): int64 [E * B * C] rows of the flattened [B * S] tokens, expert-major (expert e's B * C
        tokens, sample by sample, best first), and their gates [E * B * C] in the activation dtype."""
        b, s, _ = y_unmodulated.shape
        logits = self.gate(torch.cat((temb[:, None].expand(b, s, -1), y_unmodulated), dim=-1))  # [B, S, E]
        picked, tokens = self.expert_choice(logits)
        rows = (tokens + s * torch.arange(b, device=tokens.device)[:, None, None]).transpose(0, 1).reshape(-1)
        gates = picked.transpose(0, 1).reshape(-1)  # [E * B * C], activation dtype
        totals = gates.new_zeros(b * s).scatter_add(0, rows, gates)  # each token's summed scores
        return rows, gates / (totals.index_select(0, rows) + ROUTER_EPS) * self.route_scale

    def forward(self, y: torch.Tensor, y_unmodulated: torch.Tensor, temb: torch.Tensor,
                output_needed: bool = True) -> torch.Tensor:
        """y [B, S, dim] modulated (what the experts read), y_unmodulated [B, S, dim] (the router's), temb [B, dim]
        -> [B, S, dim] in y.dtype."""
        b, s, d = y.shape
        rows, gates = self.route(y_unmodulated, temb)
        # index_select: its backward (index_add) sums a token's gradients in a fixed order on the CPU, where
        # advanced indexing's (index_put with accumulate) gave run-to-run different sums
        tokens = y.reshape(b * s, d).index_select(0, rows).unflatten(0, (self.num_experts, -1))  # [E, B * C, dim]
        routed = (self.experts(tokens).flatten(0, 1).float() * gates.float()[:, None]).to(y.dtype)  # [E B C, dim]
        shared = self.shared_expert(y, output_needed).reshape(b * s, d)
        return shared.scatter_add(0, rows[:, None].expand(-1, d), routed).view(b, s, d)


class NucleusImageBlock(nn.Module):
    """One block: image tokens only, the text as this block's keys and values."""

    def __init__(self, cfg: NucleusImageConfig, index: int):
        super().__init__()
        d = cfg.inner_dim
        self.moe_enabled = index in cfg.moe_blocks
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(d, 4 * d))
        self.encoder_proj = nn.Linear(cfg.joint_attention_dim, d)
        self.pre_attn_norm = LayerNormNoAffine(d)
        self.attn = ImageToTextAttention(cfg)
        self.pre_mlp_norm = LayerNormNoAffine(d)
        if self.moe_enabled:
            self.img_mlp = ExpertChoiceMoE(cfg, cfg.capacity_factors[index])
        else:
            self.img_mlp = SwiGLUFeedForward(d, cfg.dense_inner_dim)

    def forward(self, x, txt, temb, cos, sin, mask):
        """x [B, S, inner] image tokens; txt [B, T, joint_attention_dim] (normed once by the model); temb [B, inner];
        cos/sin float32 [S + T, head_dim/2] of [image, text]; mask bool [B, 1, 1, S + T] or None. All but the tables in
        the activation dtype; returns x's update in it."""
        s = x.shape[1]
        img_rope, txt_rope = (cos[:s], sin[:s]), (cos[s:], sin[s:])
        scale1, gate1, scale2, gate2 = self.img_mod(temb)[:, None].chunk(4, dim=-1)  # each [B, 1, inner]
        gate1, gate2 = gate1.clamp(-2.0, 2.0).tanh(), gate2.clamp(-2.0, 2.0).tanh()
        context = self.encoder_proj(txt)  # [B, T, inner]
        y = self.pre_attn_norm(x) * (1 + scale1)
        x = x + gate1 * self.attn.to_out[0](self.attn(y, context, img_rope, txt_rope, mask))
        normed = self.pre_mlp_norm(x)
        y = normed * (1 + scale2)
        # the MLP's last projection feeds only the gate's product: core.residual_projection may skip its GEMM
        # in checkpointing's recompute when the gate needs no gradient
        if self.moe_enabled:
            update = self.img_mlp(y, normed, temb, output_needed=gate2.requires_grad)
        else:
            update = self.img_mlp(y, output_needed=gate2.requires_grad)
        x = x + gate2 * update
        if x.dtype == torch.float16:  # diffusers' clip: keep fp16 activations finite
            x = x.clip(torch.finfo(torch.float16).min, torch.finfo(torch.float16).max)
        return x


# ----------------------------------------------------------------------------------------------
# Model


class NucleusImage(nn.Module):
    def __init__(self, config: NucleusImageConfig = NUCLEUS_IMAGE):
        super().__init__()
        self.config = cfg = config
        d = cfg.inner_dim
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.time_text_embed = TimeTextEmbed(d)
        self.txt_norm = RMSNorm(cfg.joint_attention_dim, eps=1e-6)
        self.img_in = nn.Linear(cfg.in_channels, d)
        self.transformer_blocks = nn.ModuleList(NucleusImageBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm_out = OutputNorm(d)
        self.proj_out = nn.Linear(d, cfg.patch_size * cfg.patch_size * cfg.out_channels, bias=False)

    def forward(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        timesteps: torch.Tensor,
        h: int,
        w: int,
        txt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The network's raw output for the image tokens: the NEGATED flow velocity (x0 - noise); the family negates.

        img [B, h*w, in_channels]: the packed token grid h x w row-major (pack_latents' tokens); cast to compute_dtype.
        txt [B, T, joint_attention_dim]: text hidden states, each row's real tokens first; cast likewise.
        txt_mask [B, T] bool (True = real token), or None: every token real. A mask is dropped when it masks
            nothing (one host sync; on `meta` kept).
        timesteps [B] (or one value): sigma in [0, 1] (1 = noise); the network gets 1000 * sigma, embedded in float32.
        Returns [B, h*w, patch_size^2 * out_channels] in compute_dtype, the layout of img.
        """
        cfg, dtype = self.config, self.compute_dtype
        b, n_img, _ = img.shape
        if n_img != h * w:
            raise ValueError(f"Nucleus-Image: {n_img} image tokens do not fit an {h} x {w} token grid")
        n_txt = txt.shape[1]
        mask = self._key_mask(txt_mask, b, n_img, n_txt, img.device)
        # Positions (int64) -> float32 tables from float64 angles, outside autocast (core.rope_tables)
        cos, sin = rope_tables(joint_positions(h, w, n_txt).to(img.device), cfg.axes_dims_rope, cfg.rope_theta)

        temb = self.time_text_embed(timesteps.reshape(-1).expand(b), dtype)  # [B, inner]
        txt = self.txt_norm(txt.to(dtype))  # [B, T, joint_attention_dim], normed once for every block
        x = self.img_in(img.to(dtype))  # [B, h*w, inner]
        ckpt, swap = self.gradient_checkpointing, self.block_swap
        for i, block in enumerate(self.transformer_blocks):
            x = run_block(block, ckpt, x, txt, temb, cos, sin, mask, swap=swap, index=i)
        return self.proj_out(self.norm_out(x, temb))

    @staticmethod
    def _key_mask(txt_mask, b: int, n_img: int, n_txt: int, device) -> torch.Tensor | None:
        """The key mask bool [B, 1, 1, n_img + n_txt] over [image, text] (image keys always visible: no query row is
        fully masked, so SDPA takes it as it is), or None."""
        if txt_mask is None:
            return None
        if txt_mask.shape != (b, n_txt):
            raise ValueError(f"Nucleus-Image: txt_mask of shape {tuple(txt_mask.shape)} for text of {b} x {n_txt}")
        txt_mask = txt_mask.to(device=device, dtype=torch.bool)
        if device.type != "meta" and bool(txt_mask.all()):  # nothing masked: SDPA's fastest kernels
            return None
        return torch.cat((txt_mask.new_ones(b, n_img), txt_mask), dim=1)[:, None, None, :]

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N)."""
        return list(self.transformer_blocks)


def random_inputs(config: NucleusImageConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w token grid with random text (tools/precision_doctor.py):
    text hidden states N(0, 1) whose last quarter is padding (masked), as a short prompt's would be. The
    expected positions are the model's one rope_tables call: [image, text]."""
    from library.models.spec import RandomInputs

    mask = torch.arange(text_len)[None] < max(1, (3 * text_len + 3) // 4)
    fixed = dict(txt=torch.randn(1, text_len, config.joint_attention_dim, generator=generator), txt_mask=mask, h=h, w=w)
    return RandomInputs(fixed, joint_positions(h, w, text_len)[None], tuple(config.axes_dims_rope),
                        float(config.rope_theta))
