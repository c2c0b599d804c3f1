"""HiDream-I1 (Full / Dev / Fast: one 17 B sparse DiT, HiDream-ai, April 2025) on the shared core, with the RELEASED
MODULE NAMES: those of diffusers' HiDreamImageTransformer2DModel (models/transformers/transformer_hidream_image.py)
and of ComfyUI's comfy/ldm/hidream/model.py, which are the same, so the released folders, ComfyUI's single files and
the LoRAs ai-toolkit / SimpleTuner train (`diffusion_model.double_stream_blocks.0.block.attn1.to_q.lora_A.weight`)
name our modules as they are.

What the model is (diffusers' class and ComfyUI's model_detection entry agree on every released size):
- width 2560 = 20 heads x 128; 16 double-stream blocks (`double_stream_blocks.N.block`) then 32 single-stream blocks
  (`single_stream_blocks.N.block`). Attention `attn1`: to_q / to_k / to_v / to_out (with biases), q / k RMSNorm over
  the whole width (`q_rms_norm`, `k_rms_norm`: nn.RMSNorm(2560, eps 1e-5) with a weight, before the head split); a
  double block has the text stream's own to_q_t / to_k_t / to_v_t / to_out_t / q_rms_norm_t / k_rms_norm_t.
- Feed-forwards are SwiGLU `w2(silu(w1 x) * w3 x)` (no biases) of width 256 ceil(2/3 hidden / 256)
  (swiglu_width): the image stream's `ff_i` a mixture of 4 routed experts of hidden 4 x 2560 (6912 wide), top-2 by a
  softmax gate (`ff_i.gate.weight`, a bare [experts, width] parameter), the picked probabilities NOT renormalised,
  plus `shared_experts` of hidden 2 x 2560 (3584 wide); the double blocks' text stream `ff_t` a dense SwiGLU of hidden
  4 x 2560. Single blocks run `ff_i` over every token of their sequence, text included.
- adaLN (`adaLN_modulation.1` after a SiLU) from temb = t_embedder(t) + p_embedder(pooled): double blocks 12 rows
  (shift, scale, gate of the image attention, the image MLP, the text attention, the text MLP), single blocks 6;
  LayerNorms without affine (eps 1e-6). `final_layer`: adaLN (shift, scale), LayerNorm, `linear` to 2 x 2 x 16.
- t_embedder.timestep_embedder.linear_1/2 over the 256-wide sinusoid of t (cos half first), p_embedder.pooled_
  embedder.linear_1/2 over pooled [B, 2048] (CLIP-L's 768 + CLIP-G's 1280 projected pooled outputs).
- Patch 2 on the 16-channel 8x VAE: `x_embedder.proj` is a Linear over a patch's 2 x 2 x 16 features in the order
  (row-in-patch, col-in-patch, channel) (diffusers' patchify permute(0, 2, 4, 3, 5, 1)); `final_layer.linear`'s rows
  are in that order too. Our tokens are pack_latents' (channel, row, col): reordered here, in and out.
- Text: `caption_projection.K.linear` (no bias), K = 0..47 over Llama-3.1-8B-Instruct's hidden state of layer
  llama_layers[K] (the pipeline's hidden_states[1:], 32 layers, 128 tokens each), K = 48 over T5-XXL's 128 tokens.
  Double block i attends over [image; T5 + llama_layers[47]'s projection (256 tokens, carried from block to block);
  projection i (128 tokens, dropped after the block)]; single block j over [image; the carried 256; projection
  16 + j], its output truncated to [image; the carried 256] again (the pipeline's and ComfyUI's forwards).
- RoPE: axes (64, 32, 32), theta 10000, over ids (0, row, col) of the image tokens and 0 for the 384 text tokens,
  interleaved pairs over the whole head (64 + 32 + 32 = 128), applied to q and k after their RMSNorm.
- Time: the pipeline feeds t = the scheduler's timestep (1000 sigma) and negates the output (`noise_pred =
  -noise_pred`, pipeline_hidream_image.py; ComfyUI's forward returns `-output`): the network predicts x0 - noise.
  Our forward takes sigma in [0, 1], embeds 1000 sigma and returns the flow velocity noise - x0.

Two differences between the references, both only on grids that are not square:
- diffusers pads the image tokens to max_seq = 128 x 128 / 4 = 4096 (max_resolution) and multiplies the padded
  tokens' keys by 0 after the RMSNorm; their values still take softmax weight (a key of 0 gives a logit of 0), so
  the real tokens' output depends on the padding. ai-toolkit trains through diffusers' class, so its LoRAs saw that.
- ComfyUI, where people run the LoRAs, runs the real tokens only. That is our default; forward(...,
  pad_like_diffusers=True) reproduces diffusers' padding (the parity test uses it).

What is ours: the queries of tokens whose output the reference drops (a double block's 128 Llama tokens, a single
block's) are not computed, nor those tokens' text MLP / MoE (every such step is per token, so the kept tokens'
values are unchanged). diffusers' MoEGate computes an auxiliary balance loss in training and MOEFeedForwardSwiGLU
never uses it (`# y = AddAuxiliaryLoss.apply(y, aux_loss)` is commented out); ours computes none.

Precision (shared/DESIGN.md): inputs are cast to compute_dtype at entry; the sinusoid is computed in float32 and cast
(diffusers' `.to(hidden_states_type)`); positions are float64 (exact integers), their RoPE tables float32 from
core.rope_tables (float64 angles), computed per forward, never a module buffer; the rotation runs in float32. The
MoE routing (logits, softmax, top-2) is decided in float32 from the activations and the gate weight as stored
(MoEGate), the picked probabilities then cast to the activation dtype to weigh the experts' outputs (diffusers
computes the logits in the activation dtype: in bf16, logits within a bf16 step of each other flip; see
MoEGate). Modulation and gates run in compute_dtype, as in both references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    LayerNormNoAffine, Modulation, RMSNorm, apply_rope, attention, rope_tables, run_block, split_modulation,
    timestep_embedding,
)

PATCH = 2
TIME_DIM = 256  # diffusers' Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
TIME_FACTOR = 1000.0  # the network embeds t = 1000 sigma, the scheduler's timesteps
QK_NORM_EPS = 1e-5  # HiDreamAttention's eps (nn.RMSNorm(inner_dim, 1e-5)), ComfyUI's the same
SWIGLU_MULTIPLE = 256  # HiDreamImageFeedForwardSwiGLU's multiple_of
LLAMA_HIDDEN_LAYERS = 32  # Llama-3.1-8B: hidden_states[1:] holds 32 layers


def released_llama_layers(blocks: int, available: int = LLAMA_HIDDEN_LAYERS) -> tuple[int, ...]:
    """The released block -> Llama layer pattern, block i reads layer min(i, available - 1): 0..31 then 31 x 16 for
    48 blocks and 32 layers (diffusers' config.json and ComfyUI's model_detection list exactly that)."""
    return tuple(min(i, available - 1) for i in range(blocks))


def swiglu_width(hidden: int) -> int:
    """The inner width of HiDreamImageFeedForwardSwiGLU(dim, hidden): int(2 hidden / 3) rounded up to a multiple of
    256 (4 x 2560 -> 6912, the shared expert's 2 x 2560 -> 3584)."""
    inner = int(2 * hidden / 3)
    return SWIGLU_MULTIPLE * ((inner + SWIGLU_MULTIPLE - 1) // SWIGLU_MULTIPLE)


@dataclass(frozen=True)
class HiDreamConfig:
    """Defaults: HiDream-I1 (Full, Dev and Fast share it; ComfyUI's model_detection HiDream entry and diffusers'
    HiDreamImageTransformer2DModel: patch_size 2, in / out_channels 16, num_layers 16, num_single_layers 32,
    attention_head_dim 128 x num_attention_heads 20, caption_channels [4096, 4096] (T5, Llama), text_emb_dim 2048,
    num_routed_experts 4, num_activated_experts 2, axes_dims_rope (64, 32, 32), max_resolution (128, 128),
    llama_layers 0..31 then 31 x 16). The RoPE theta is fixed at 10000 in both references."""

    num_layers: int = 16  # double-stream blocks
    num_single_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 20
    in_channels: int = 16  # latent channels (2 x 2 patches: 64 features per token)
    out_channels: int = 16
    axes_dims_rope: tuple[int, ...] = (64, 32, 32)  # (0, row, col); sums to the head width
    rope_theta: float = 10000.0
    t5_dim: int = 4096  # caption_channels[0]: T5-XXL's width (a tiny text encoder is narrower)
    llama_dim: int = 4096  # caption_channels[1]: Llama-3.1-8B's width
    text_emb_dim: int = 2048  # pooled: CLIP-L 768 + CLIP-G 1280
    num_routed_experts: int = 4
    num_activated_experts: int = 2
    llama_layers: tuple[int, ...] = released_llama_layers(48)
    max_resolution: tuple[int, int] = (128, 128)  # latent size diffusers pads non-square grids to (max_seq)

    def __post_init__(self):
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"HiDream axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                             f"{self.attention_head_dim} (RoPE over the whole head)")
        if len(self.llama_layers) != self.num_layers + self.num_single_layers:
            raise ValueError(f"HiDream llama_layers has {len(self.llama_layers)} entries, expected one per block: "
                             f"{self.num_layers} + {self.num_single_layers}")
        if min(self.llama_layers, default=0) < 0:
            raise ValueError(f"HiDream llama_layers {self.llama_layers}: a negative layer")
        if not 0 < self.num_activated_experts <= self.num_routed_experts:
            raise ValueError(f"HiDream num_activated_experts {self.num_activated_experts} must be in "
                             f"1..num_routed_experts ({self.num_routed_experts})")

    @property
    def width(self) -> int:
        return self.attention_head_dim * self.num_attention_heads

    @property
    def token_width(self) -> int:
        return self.in_channels * PATCH * PATCH  # what the tools size a packed token by

    @property
    def max_seq(self) -> int:
        """diffusers' max_seq: the image tokens a non-square grid is padded to (4096 as released)."""
        return self.max_resolution[0] * self.max_resolution[1] // (PATCH * PATCH)


HIDREAM_I1 = HiDreamConfig()


# ----------------------------------------------------------------------------------------------
# Positions


def image_positions(h: int, w: int, padded_to: int | None = None) -> torch.Tensor:
    """float64 [L, 3] ids (0, row, col) of an h x w patch grid, row-major (exact integers); padded_to: diffusers'
    padding tokens appended with ids 0."""
    rows = torch.arange(h, dtype=torch.float64)[:, None].expand(h, w)
    cols = torch.arange(w, dtype=torch.float64)[None, :].expand(h, w)
    ids = torch.stack((torch.zeros_like(rows), rows, cols), dim=-1).reshape(h * w, 3)
    if padded_to is not None:
        ids = torch.cat((ids, ids.new_zeros(padded_to - h * w, 3)))
    return ids


def joint_positions(h: int, w: int, text_len: int, padded_to: int | None = None) -> torch.Tensor:
    """float64 [text_len + L, 3]: the text's ids (all 0) then the image's, the order core.rope_tables is fed in
    (spec.RandomInputs); the model moves the text rows behind the image's, its attention order."""
    return torch.cat((torch.zeros(text_len, 3, dtype=torch.float64), image_positions(h, w, padded_to)))


# ----------------------------------------------------------------------------------------------
# Layers


class MLPEmbedder(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding names)."""

    def __init__(self, in_dim: int, width: int):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(in_dim, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepEmbed(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.timestep_embedder = MLPEmbedder(TIME_DIM, width)


class PooledEmbed(nn.Module):
    def __init__(self, pooled_dim: int, width: int):
        super().__init__()
        self.pooled_embedder = MLPEmbedder(pooled_dim, width)


class PatchEmbed(nn.Module):
    """`proj`: Linear over a patch's (row, col, channel) features."""

    def __init__(self, in_features: int, width: int):
        super().__init__()
        self.proj = nn.Linear(in_features, width)


class TextProjection(nn.Module):
    def __init__(self, in_dim: int, width: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, width, bias=False)


class FeedForwardSwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases, inner width swiglu_width(hidden)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        inner = swiglu_width(hidden)
        self.w1, self.w2, self.w3 = nn.Linear(dim, inner, bias=False), nn.Linear(inner, dim, bias=False), \
            nn.Linear(dim, inner, bias=False)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection w2 reads."""
        return F.silu(self.w1(x)) * self.w3(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.hidden(x))


class MoEGate(nn.Module):
    """The router: softmax over F.linear(token, weight) ([experts, width], a bare parameter as released), the top-k
    probabilities, not renormalised (diffusers' MoEGate: norm_topk_prob False).

    Routing is decided in float32 (the activations and the stored weight widened, exact for bf16 / fp16 inputs):
    diffusers computes the logits in the activation dtype, where experts whose logits lie within a bf16 step swap
    places by rounding alone; a bf16 and an fp8 base, or a forward and its checkpointed recompute under another
    kernel, then disagree on tokens that are near-ties. On the tiny model (tests/test_hidream_model.py,
    test_routing_is_decided_in_float32) bf16 logits pick another expert set than float32 ones for 11 of 4096
    N(0, 1) tokens (0.27 %), and inside the tiny writer's bf16 model (three forwards at 32 x 32 patches, its 4 MoE
    layers) for 25 of 13,824 routing decisions (0.18 %); in fp32 the two are the same computation."""

    def __init__(self, dim: int, experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(experts, dim))
        nn.init.normal_(self.weight, std=dim ** -0.5)  # diffusers' randn / sqrt(dim); released files overwrite it

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [N, width] -> (expert indices int64 [N, k], their probabilities float32 [N, k])."""
        scores = F.linear(tokens.float(), self.weight.float()).softmax(dim=-1)  # float32 [N, experts]
        probs, index = scores.topk(self.top_k, dim=-1, sorted=False)
        return index, probs


def even_split(pairs: int, experts: int) -> list[int]:
    """(token, expert) pairs per expert on `meta` (the memory planner: shapes without values, so no routing): an even
    split, the balance the gate was trained towards; a skewed one moves activation bytes between experts, not their
    sum (each pair is one expert row of the same width)."""
    return [pairs // experts + (i < pairs % experts) for i in range(experts)]


class MOEFeedForwardSwiGLU(nn.Module):
    """`gate`, `experts.E` (SwiGLU of hidden 4 x width each), `shared_experts` (hidden 2 x width). Each token's output:
    sum over its top-k experts of p_e * expert_e(token), plus shared_experts(token).

    One path for training and inference: the (token, expert) pairs sorted by expert, each expert run once on its
    gathered tokens, its outputs weighted by their probabilities (cast to the activation dtype, as diffusers weighs
    them) and index-added back onto their tokens. Gradients reach the chosen experts' Linears (each a module of its
    own, so LoRA adapts every expert) and the gate weight through the probabilities."""

    def __init__(self, dim: int, experts: int, top_k: int):
        super().__init__()
        self.shared_experts = FeedForwardSwiGLU(dim, 2 * dim)
        self.experts = nn.ModuleList(FeedForwardSwiGLU(dim, 4 * dim) for _ in range(experts))
        self.gate = MoEGate(dim, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, width] (activation dtype) -> [B, L, width]."""
        tokens = x.reshape(-1, x.shape[-1])
        index, probs = self.gate(tokens)  # [N, k]
        top_k = index.shape[1]
        pair_expert = index.reshape(-1)  # pair p = (token p // k, its choice p % k)
        order = pair_expert.argsort(stable=True)
        pair_token, pair_weight = order // top_k, probs.reshape(-1)[order].to(x.dtype)
        counts = even_split(pair_expert.numel(), len(self.experts)) if tokens.is_meta else \
            torch.bincount(pair_expert, minlength=len(self.experts)).tolist()  # one host sync per layer
        routed = torch.zeros_like(tokens)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = pair_token[start: start + count]
                out = expert(tokens[rows]) * pair_weight[start: start + count, None]
                routed = routed.index_add(0, rows, out)
            start += count
        return routed.view_as(x) + self.shared_experts(x)


class HiDreamAttention(nn.Module):
    """`attn1`: the image stream's projections and whole-width q / k RMSNorms, and a double block's text stream's
    (`_t`). Queries are taken for the tokens whose output is kept; keys and values for every token."""

    def __init__(self, cfg: HiDreamConfig, single: bool):
        super().__init__()
        width, self.heads = cfg.width, cfg.num_attention_heads
        self.single = single
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(width, width) for _ in range(4))
        self.q_rms_norm, self.k_rms_norm = RMSNorm(width, QK_NORM_EPS), RMSNorm(width, QK_NORM_EPS)
        if not single:
            self.to_q_t, self.to_k_t, self.to_v_t, self.to_out_t = (nn.Linear(width, width) for _ in range(4))
            self.q_rms_norm_t, self.k_rms_norm_t = RMSNorm(width, QK_NORM_EPS), RMSNorm(width, QK_NORM_EPS)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, L, H*D] -> [B, H, L, D]

    def image_qkv(self, x: torch.Tensor, queries: int):
        """q of x's first `queries` tokens, k and v of all, each normalised [B, L, width] (not yet split)."""
        return self.q_rms_norm(self.to_q(x[:, :queries])), self.k_rms_norm(self.to_k(x)), self.to_v(x)

    def text_qkv(self, x: torch.Tensor, queries: int):
        return self.q_rms_norm_t(self.to_q_t(x[:, :queries])), self.k_rms_norm_t(self.to_k_t(x)), self.to_v_t(x)

    def attend(self, q, k, v, cos, sin, key_mask):
        """q [B, Lq, width] (the first Lq tokens of k's sequence), k / v [B, L, width]; cos / sin float32 [L, D/2]
        tables of the whole sequence; key_mask [B, L] (1 keep, 0: diffusers' padding, its key zeroed) or None.
        Returns [B, Lq, width]."""
        q, k, v = self.split(q), self.split(k), self.split(v)
        if key_mask is not None:
            k = k * key_mask[:, None, :, None].to(k.dtype)
        lq = q.shape[2]
        q, k = apply_rope(q, cos[:lq], sin[:lq]), apply_rope(k, cos, sin)
        return attention(q, k, v)


# ----------------------------------------------------------------------------------------------
# Blocks


class DoubleStreamBlock(nn.Module):
    """The image stream and the text stream, attending jointly over [image; carried text; this block's Llama
    tokens]; returns (image, carried text): the Llama tokens' output is dropped, as the references drop it."""

    def __init__(self, cfg: HiDreamConfig):
        super().__init__()
        width = cfg.width
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 12 * width))
        self.norm1_i, self.norm1_t = LayerNormNoAffine(width), LayerNormNoAffine(width)
        self.attn1 = HiDreamAttention(cfg, single=False)
        self.norm3_i = LayerNormNoAffine(width)
        self.ff_i = MOEFeedForwardSwiGLU(width, cfg.num_routed_experts, cfg.num_activated_experts)
        self.norm3_t = LayerNormNoAffine(width)
        self.ff_t = FeedForwardSwiGLU(width, 4 * width)

    def forward(self, img, txt, llama, temb, cos, sin, key_mask):
        """img [B, L, width], txt [B, T, width] (T5 + the last Llama layer), llama [B, S, width] (this block's),
        temb [B, width]; cos / sin float32 [L + T + S, D/2]; key_mask [B, L + T + S] or None."""
        mods: list[Modulation] = split_modulation(self.adaLN_modulation(temb), 4)  # msa_i, mlp_i, msa_t, mlp_t
        n_img, n_txt = img.shape[1], txt.shape[1]
        img_in = mods[0].modulate(self.norm1_i(img))
        txt_in = mods[2].modulate(self.norm1_t(torch.cat((txt, llama), dim=1)))
        q_i, k_i, v_i = self.attn1.image_qkv(img_in, n_img)
        q_t, k_t, v_t = self.attn1.text_qkv(txt_in, n_txt)
        joint = (torch.cat(pair, dim=1) for pair in ((q_i, q_t), (k_i, k_t), (v_i, v_t)))
        out = self.attn1.attend(*joint, cos, sin, key_mask)  # [B, L + T, width]
        img = img + mods[0].gate * self.attn1.to_out(out[:, :n_img])
        txt = txt + mods[2].gate * self.attn1.to_out_t(out[:, n_img:])
        img = img + mods[1].gate * self.ff_i(mods[1].modulate(self.norm3_i(img)))
        txt = txt + mods[3].gated_projection(self.ff_t.w2, self.ff_t.hidden(mods[3].modulate(self.norm3_t(txt))))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over [image; carried text; this block's Llama tokens], its output for [image; carried text]."""

    def __init__(self, cfg: HiDreamConfig):
        super().__init__()
        width = cfg.width
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 6 * width))
        self.norm1_i = LayerNormNoAffine(width)
        self.attn1 = HiDreamAttention(cfg, single=True)
        self.norm3_i = LayerNormNoAffine(width)
        self.ff_i = MOEFeedForwardSwiGLU(width, cfg.num_routed_experts, cfg.num_activated_experts)

    def forward(self, x, llama, temb, cos, sin, key_mask):
        """x [B, L + T, width] (image then the carried text), llama [B, S, width]; -> [B, L + T, width]."""
        mods = split_modulation(self.adaLN_modulation(temb), 2)  # msa, mlp
        normed = mods[0].modulate(self.norm1_i(torch.cat((x, llama), dim=1)))
        out = self.attn1.attend(*self.attn1.image_qkv(normed, x.shape[1]), cos, sin, key_mask)
        x = x + mods[0].gate * self.attn1.to_out(out)
        return x + mods[1].gate * self.ff_i(mods[1].modulate(self.norm3_i(x)))


class HiDreamBlock(nn.Module):
    """The released wrapper level (`double_stream_blocks.N.block.*`): run_block's unit."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return self.block(*args)


class FinalLayer(nn.Module):
    """adaLN (shift, scale) over a LayerNorm without affine, then `linear` to (row, col, channel) features."""

    def __init__(self, cfg: HiDreamConfig):
        super().__init__()
        self.norm_final = LayerNormNoAffine(cfg.width)
        self.linear = nn.Linear(cfg.width, PATCH * PATCH * cfg.out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(cfg.width, 2 * cfg.width))

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(temb)[:, None].chunk(2, dim=-1)
        return self.linear(Modulation(shift, scale, None).modulate(self.norm_final(x)))


# ----------------------------------------------------------------------------------------------
# Model


def to_patch_order(tokens: torch.Tensor) -> torch.Tensor:
    """pack_latents' (channel, row, col) features -> the released (row, col, channel)."""
    b, n, f = tokens.shape
    return tokens.view(b, n, f // (PATCH * PATCH), PATCH, PATCH).permute(0, 1, 3, 4, 2).reshape(b, n, f)


def from_patch_order(tokens: torch.Tensor) -> torch.Tensor:
    """The released (row, col, channel) features -> pack_latents' (channel, row, col)."""
    b, n, f = tokens.shape
    return tokens.view(b, n, PATCH, PATCH, f // (PATCH * PATCH)).permute(0, 1, 4, 2, 3).reshape(b, n, f)


class HiDream(nn.Module):
    def __init__(self, config: HiDreamConfig = HIDREAM_I1):
        super().__init__()
        self.config = cfg = config
        width = cfg.width
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        self.t_embedder = TimestepEmbed(width)
        self.p_embedder = PooledEmbed(cfg.text_emb_dim, width)
        self.x_embedder = PatchEmbed(cfg.token_width, width)
        self.double_stream_blocks = nn.ModuleList(HiDreamBlock(DoubleStreamBlock(cfg)) for _ in range(cfg.num_layers))
        self.single_stream_blocks = nn.ModuleList(
            HiDreamBlock(SingleStreamBlock(cfg)) for _ in range(cfg.num_single_layers))
        self.final_layer = FinalLayer(cfg)
        blocks = cfg.num_layers + cfg.num_single_layers
        self.caption_projection = nn.ModuleList(
            [TextProjection(cfg.llama_dim, width) for _ in range(blocks)] + [TextProjection(cfg.t5_dim, width)])

    def llama_layer_indices(self, available: int) -> list[int]:
        """Which of the `available` Llama layers each block reads: config.llama_layers, clipped to the last one a
        smaller text encoder gives (a tiny one: the released rule "layer i for block i, then the last", as
        released_llama_layers would list it for that encoder; the released encoder gives all 32)."""
        if available < 1:
            raise ValueError("HiDream: the Llama hidden states hold no layer (expected [layers, B, tokens, width])")
        return [min(k, available - 1) for k in self.config.llama_layers]

    def text_tokens(self, t5: torch.Tensor, llama: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the carried text [B, T5 + S, width]: T5's projection then the last block's Llama layer's, every block's
        Llama projection [B, S, width]), in compute_dtype."""
        dtype = self.compute_dtype
        layers = self.llama_layer_indices(llama.shape[0])
        per_block = [proj.linear(llama[k].to(dtype)) for proj, k in zip(self.caption_projection, layers)]
        t5_tokens = self.caption_projection[-1].linear(t5.to(dtype))
        return torch.cat((t5_tokens, per_block[-1]), dim=1), per_block

    def rope(self, h: int, w: int, text_len: int, padded_to: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos / sin [L + text_len, head_dim / 2] in attention order (image, then text)."""
        positions = joint_positions(h, w, text_len, padded_to).to(device)
        cos, sin = rope_tables(positions, self.config.axes_dims_rope, self.config.rope_theta)  # text rows first
        return (torch.cat((t[text_len:], t[:text_len])) for t in (cos, sin))

    def forward(self, img: torch.Tensor, t5: torch.Tensor, llama: torch.Tensor, pooled: torch.Tensor,
                timesteps: torch.Tensor, h: int, w: int, pad_like_diffusers: bool = False) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for packed latent tokens.

        img [B, h*w, 64]: pack_latents' tokens ((channel, row, col) features) of an h x w patch grid.
        t5 [B, T, t5_dim]: T5-XXL's hidden states (128 tokens as the pipeline encodes them).
        llama [layers, B, S, llama_dim]: Llama's hidden states of every layer (the pipeline's stacked
        hidden_states[1:]); each block reads config.llama_layers' (llama_layer_indices).
        pooled [B, text_emb_dim]. timesteps [B]: sigma in [0, 1] (1 = pure noise); the network embeds 1000 sigma.
        pad_like_diffusers: on a non-square grid, pad the image tokens to config.max_seq as diffusers does (module
        docstring); default: the real tokens only, as ComfyUI.
        Returns [B, h*w, 64] in compute_dtype, pack_latents' order.
        """
        cfg, dtype = self.config, self.compute_dtype
        b, n = img.shape[:2]
        if n != h * w:
            raise ValueError(f"HiDream: {n} image tokens do not fit a {h} x {w} patch grid")
        tokens = to_patch_order(img.to(dtype))
        padded_to = cfg.max_seq if pad_like_diffusers and h != w else None
        if padded_to is not None:
            if n > padded_to:
                raise ValueError(f"HiDream: {n} image tokens exceed max_seq {padded_to} (max_resolution "
                                 f"{cfg.max_resolution}) that diffusers pads non-square grids to")
            tokens = torch.cat((tokens, tokens.new_zeros(b, padded_to - n, tokens.shape[-1])), dim=1)
        x = self.x_embedder.proj(tokens)
        t_freq = timestep_embedding(timesteps, TIME_DIM, time_factor=TIME_FACTOR)  # float32 [B, 256], cos first
        temb = self.t_embedder.timestep_embedder(t_freq.to(dtype)) + self.p_embedder.pooled_embedder(pooled.to(dtype))
        txt, per_block = self.text_tokens(t5, llama)
        text_len = txt.shape[1] + per_block[0].shape[1]
        cos, sin = self.rope(h, w, text_len, padded_to, img.device)
        key_mask = None
        if padded_to is not None:  # 1 for the real image tokens and every text token, 0 for the padding
            key_mask = torch.ones(b, padded_to + text_len, dtype=dtype, device=img.device)
            key_mask[:, n:padded_to] = 0

        ckpt, swap = self.gradient_checkpointing, self.block_swap
        for i, block in enumerate(self.double_stream_blocks):
            x, txt = run_block(block, ckpt, x, txt, per_block[i], temb, cos, sin, key_mask, swap=swap, index=i)
        x = torch.cat((x, txt), dim=1)
        for j, block in enumerate(self.single_stream_blocks):
            i = cfg.num_layers + j
            x = run_block(block, ckpt, x, per_block[i], temb, cos, sin, key_mask, swap=swap, index=i)
        out = self.final_layer(x[:, :n], temb)  # [B, h*w, (row, col, channel)]
        return -from_patch_order(out)  # the network's x0 - noise, negated as the pipeline does: noise - x0

    def swappable_blocks(self) -> list[nn.Module]:
        """The double-stream then the single-stream blocks, in run order."""
        return [*self.double_stream_blocks, *self.single_stream_blocks]


def random_inputs(config: HiDreamConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py): T5 and
    every Llama layer's states (text_len tokens each) and the pooled vector N(0, 1). The expected positions are the
    ids rope_tables gets: the 2 text_len + text_len text tokens' zeros, then the image's (0, row, col), float64
    [1, L, 3]."""
    from library.models.spec import RandomInputs

    layers = max(config.llama_layers) + 1
    fixed = dict(t5=torch.randn(1, text_len, config.t5_dim, generator=generator),
                 llama=torch.randn(layers, 1, text_len, config.llama_dim, generator=generator),
                 pooled=torch.randn(1, config.text_emb_dim, generator=generator), h=h, w=w)
    positions = joint_positions(h, w, 3 * text_len)[None]
    return RandomInputs(fixed, positions, tuple(config.axes_dims_rope), config.rope_theta)
