"""Qwen-Image-2.1: the 32-block single-stream transformer, with diffusers' module names, on library/core.

What Qwen-Image-2.1 is (diffusers' QwenImage21Transformer2DModel, models/transformers/transformer_qwenimage21.py):
- One stack of single-stream blocks over one joint sequence: the prompt's tokens (Qwen3-VL hidden
  states, condition images' latents substituted at the `<|image_pad|>` slots the encoder reserved,
  four latent tokens per slot), then the target image's tokens. Latents enter unpatched (64 channels
  of a 16x VAE), so one token is one latent pixel.
- Block-causal attention: text is causal, each image block (every condition image, the target) is
  bidirectional within itself and sees everything before it; padded text keys are hidden.
- One shared modulation Linear(D -> 4D) for every block (scale, gate for attention; scale, gate for
  the MLP; no shift, gates through tanh). With `causal_condition` text and condition tokens are
  modulated from t = 0, the target from its sigma, so the prefix does not depend on the step.
- txt_in: zero-centred RMSNorm (weight + 1), Linear, GELU(tanh), Linear. No biases anywhere.
- RoPE (16, 56, 56), theta 10000, interleaved pairs: text token i sits at (p, p, p) with p counting
  text tokens (padding included); an image block freezes the frame axis at the count so far, centres
  its rows and columns on zero, and advances the count by max(h, w).
- The output is the velocity (noise - x0) of the target's tokens; diffusers returns every token's
  projection and the pipeline keeps the last h*w, the same values (norm_out is per token).

Module names mirror diffusers, so a diffusers folder loads with a plain state dict; ComfyUI's single
file adds `model.diffusion_model.` and fuses `img_mlp.gate_up` (checkpoint.py). Precision
(shared/DESIGN.md): positions are int64 ids turned into float32 cos/sin by core.rope_tables (angles in
float64; diffusers computes them in float32); sigma is embedded in float32 (diffusers rounds it to the
activation dtype first, which differs in bf16 only); activations in `compute_dtype`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models import core

SLOT_TOKENS = 4  # one vision-language image slot stands for a 2x2 group of latent tokens


@dataclass(frozen=True)
class QwenImage21Config:
    """Constructor arguments of diffusers' QwenImage21Transformer2DModel (defaults = Qwen/Qwen-Image-2.1)."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096  # Qwen3-VL-8B's width
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True
    rope_theta: float = 10000.0  # fixed in diffusers (QwenImage21Rope(theta=10000)), not in its config

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim or len(self.axes_dims_rope) != 3:
            raise ValueError(f"Qwen-Image-2.1: axes_dims_rope {self.axes_dims_rope} must be 3 axes summing to "
                             f"attention_head_dim {self.attention_head_dim}")
        if self.patch_size != 1:
            raise ValueError(f"Qwen-Image-2.1: patch_size {self.patch_size} (the released model is unpatched, 1)")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def token_width(self) -> int:
        return self.in_channels  # what the tools size a packed token by


QWEN_IMAGE21 = QwenImage21Config()


# ----------------------------------------------------------------------------------------------
# The joint sequence: where each token sits, its position ids, the attention segments


@dataclass
class JointLayout:
    """The layout of [prompt tokens with condition images at their slots, target image].

    text_at / image_at: int64 indices of the text and the image tokens in the joint sequence; prefix_len: tokens before the target (text, conditions);
    positions: int64 [J, 3] ([B, J, 3] for a padded batch: the target after each prompt's real tokens); segments: (start, end, is_text) runs of the prefix, each one text run or
    one condition image; key_valid: bool [B, J] (False = a padded text key) or None."""

    text_at: torch.Tensor
    image_at: torch.Tensor
    prefix_len: int
    positions: torch.Tensor
    segments: list[tuple[int, int, bool]]
    key_valid: torch.Tensor | None


def _centred(n: int) -> range:
    return range(-(n - n // 2), n // 2)


def joint_layout(text_len: int, h: int, w: int, image_slots: torch.Tensor | None = None,
                 control_shapes: tuple[tuple[int, int], ...] = (), txt_mask: torch.Tensor | None = None,
                 device=None) -> JointLayout:
    """The layout for a prompt of text_len tokens (image_slots bool [text_len]: True at a condition
    image's slots, SLOT_TOKENS latent tokens each; None: a plain prompt), condition images of
    control_shapes (h, w) in slot order, and an h x w target appended at the end (diffusers appends
    h*w/4 slots; appending the tokens themselves is the same where h*w % 4 == 0 and works for any grid)."""
    slots = [False] * text_len if image_slots is None else [bool(s) for s in image_slots.tolist()]
    sizes = [ch * cw for ch, cw in control_shapes]
    if SLOT_TOKENS * sum(slots) != sum(sizes):
        raise ValueError(f"Qwen-Image-2.1: {sum(slots)} image slots hold {SLOT_TOKENS * sum(slots)} latent tokens, "
                         f"the condition images {list(control_shapes)} have {sum(sizes)}")
    is_image = [flag for s in slots for flag in ([True] * SLOT_TOKENS if s else [False])] + [True] * (h * w)
    # Image blocks by token counts (two adjacent condition images are still two blocks), target last.
    blocks, start, image_index = [], 0, [i for i, f in enumerate(is_image) if f]
    for size in [*sizes, h * w]:
        blocks.append((image_index[start], image_index[start] + size))
        start += size
    frame, height, width, cursor, position, segments = [], [], [], 0, 0, []
    for (block_start, block_end), (bh, bw) in zip(blocks, [*control_shapes, (h, w)]):
        run = list(range(position, position + block_start - cursor))  # text before this image
        frame += run; height += run; width += run
        if block_start > cursor:
            segments.append((cursor, block_start, True))
        position += block_start - cursor
        frame += [position] * (bh * bw)
        height += [r for r in _centred(bh) for _ in range(bw)]
        width += [c for _ in range(bh) for c in _centred(bw)]
        position += max(bh, bw)
        segments.append((block_start, block_end, False))
        cursor = block_end
    prefix_len = blocks[-1][0]
    positions = torch.tensor([frame, height, width], dtype=torch.int64, device=device).T.contiguous()
    text_at = torch.tensor([i for i, f in enumerate(is_image) if not f], dtype=torch.int64, device=device)
    image_at = torch.tensor(image_index, dtype=torch.int64, device=device)
    key_valid = None
    if txt_mask is not None and (txt_mask.is_meta or not bool(txt_mask.all())):  # all real: no mask (flash kernels)
        prompt_text = torch.tensor([i for i, s in enumerate(slots) if not s], dtype=torch.int64, device=txt_mask.device)
        key_valid = torch.ones(txt_mask.shape[0], len(is_image), dtype=torch.bool, device=txt_mask.device)
        key_valid[:, text_at.to(txt_mask.device)] = txt_mask.bool()[:, prompt_text]
    if key_valid is not None:  # a padded batch: each target where its own prompt ends (pads: the last text run)
        # diffusers counts the pads, so a short caption's target sat later in a batch than alone (7e-3 apart);
        # the pipeline encodes one prompt unpadded: the batch trains what it samples
        pads = (~txt_mask.bool()).sum(1).to(positions.device)
        positions = positions.expand(len(pads), -1, -1).clone()
        positions[:, prefix_len:, 0] -= pads[:, None]
    return JointLayout(text_at, image_at, prefix_len, positions, segments[:-1], key_valid)


def block_causal_attention(q, k, v, layout: JointLayout) -> torch.Tensor:
    """q, k, v [B, H, J, D] -> [B, J, H*D]: each prefix segment sees the keys up to its end (a text run
    causally within itself), the target sees every key; padded keys hidden everywhere (diffusers'
    QwenImage21AttnProcessor, one SDPA call per segment)."""
    valid, outputs = layout.key_valid, []
    for start, end, is_text in layout.segments:
        q_seg, k_seg, v_seg = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
        if valid is None and is_text and start == 0:  # the prompt alone: plain causal (flash-eligible)
            outputs.append(core.attention(q_seg, k_seg, v_seg, causal=True))
            continue
        mask = None
        if is_text:
            n = end - start
            mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(start)[None, None]
        if valid is not None:
            keys = valid[:, None, None, :end]
            mask = keys if mask is None else mask & keys
        outputs.append(core.attention(q_seg, k_seg, v_seg, mask=mask))
    outputs.append(core.attention(q[:, :, layout.prefix_len:], k, v, mask=valid))
    return torch.cat(outputs, dim=1)


# ----------------------------------------------------------------------------------------------
# Layers (diffusers names)


class ZeroCenterRMSNorm(nn.Module):
    """RMSNorm whose stored weight is zero-centred: y = rms_norm(x) * (weight + 1), in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return core.rms_norm(x, self.weight.float() + 1.0, self.eps)


class TextProjection(nn.Module):
    def __init__(self, context_in_dim: int, dim: int, eps: float):
        super().__init__()
        self.text_norm = ZeroCenterRMSNorm(context_in_dim, eps)
        self.in_layer = nn.Linear(context_in_dim, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.gelu(self.in_layer(self.text_norm(x)), approximate="tanh"))


class TimestepEmbedder(nn.Module):
    """linear_2(silu(linear_1(sinusoid(1000 sigma)))), no biases (diffusers TimestepEmbedding names)."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = nn.Linear(freq_dim, dim, bias=False)
        self.linear_2 = nn.Linear(dim, dim, bias=False)

    def forward(self, sigma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        emb = core.timestep_embedding(sigma, self.freq_dim, time_factor=1000.0, scale_first=True)
        return self.linear_2(F.silu(self.linear_1(emb.to(dtype))))


class TimeTextEmbed(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_k = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_v = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim, bias=False)])
        self.norm_q, self.norm_k = core.RMSNorm(head_dim, eps), core.RMSNorm(head_dim, eps)

    def forward(self, x, cos, sin, layout: JointLayout):
        q = self.norm_q(self.to_q(x).unflatten(-1, (self.heads, -1))).transpose(1, 2)  # [B, H, J, D]
        k = self.norm_k(self.to_k(x).unflatten(-1, (self.heads, -1))).transpose(1, 2)
        v = self.to_v(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        q, k = core.apply_rope(q, cos, sin), core.apply_rope(k, cos, sin)
        return self.to_out[0](block_causal_attention(q, k, v, layout))


class SwiGLUFeedForward(nn.Module):
    """out(silu(gate_layer(x)) * proj(x)), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden, bias=False)
        self.out = nn.Linear(hidden, dim, bias=False)
        self.gate_layer = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activations the output projection `out` reads."""
        return F.silu(self.gate_layer(x)) * self.proj(x)


def _per_token(prefix: torch.Tensor, target: torch.Tensor, prefix_len: int, x: torch.Tensor) -> torch.Tensor:
    """x [B, J, D] times (1 + the modulation of its token): the prefix's row (t = 0) before prefix_len,
    the target's row (its sigma) after; both [B or 1, 1, D]."""
    return torch.cat((x[:, :prefix_len] * (1 + prefix), x[:, prefix_len:] * (1 + target)), dim=1)


class QwenImage21Block(nn.Module):
    def __init__(self, config: QwenImage21Config):
        super().__init__()
        dim = config.inner_dim
        self.img_norm1 = core.LayerNormNoAffine(dim, config.eps)
        self.attn = Attention(dim, config.num_attention_heads, config.attention_head_dim, config.eps)
        self.img_norm2 = core.LayerNormNoAffine(dim, config.eps)
        self.img_mlp = SwiGLUFeedForward(dim, dim * config.mlp_ratio)

    def forward(self, x, mod_prefix, mod_target, cos, sin, layout: JointLayout):
        """x [B, J, D]; mod_prefix / mod_target [B or 1, 1, 4D] (scale1, gate1, scale2, gate2)."""
        p, n = layout.prefix_len, x.shape[1] - layout.prefix_len
        s1p, g1p, s2p, g2p = mod_prefix.chunk(4, dim=-1)
        s1t, g1t, s2t, g2t = mod_target.chunk(4, dim=-1)
        gate1 = torch.cat((g1p.tanh().expand(x.shape[0], p, -1), g1t.tanh().expand(x.shape[0], n, -1)), dim=1)
        x = x + gate1 * self.attn(_per_token(s1p, s1t, p, self.img_norm1(x)), cos, sin, layout)
        gate2 = torch.cat((g2p.tanh().expand(x.shape[0], p, -1), g2t.tanh().expand(x.shape[0], n, -1)), dim=1)
        h = self.img_mlp.hidden(_per_token(s2p, s2t, p, self.img_norm2(x)))
        # The float16 clip below saves x for its backward: the projection's output is needed there.
        x = x + gate2 * core.residual_projection(self.img_mlp.out, h, gate2.requires_grad or x.dtype == torch.float16)
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


class OutputNorm(nn.Module):
    """LayerNorm(x) * (1 + linear(silu(temb))): scale only (diffusers' QwenImage21AdaLayerNormContinuous)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear(F.silu(temb))[:, None]
        return core.layer_norm(x, self.eps) * (1 + scale)


# ----------------------------------------------------------------------------------------------
# Model


class QwenImage21(nn.Module):
    def __init__(self, config: QwenImage21Config = QWEN_IMAGE21):
        super().__init__()
        self.config = cfg = config
        dim = cfg.inner_dim
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called
        self.time_text_embed = TimeTextEmbed(dim)
        self.txt_in = TextProjection(cfg.context_in_dim, dim, cfg.eps)
        self.img_in = nn.Linear(cfg.in_channels, dim, bias=False)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 4 * dim, bias=False))
        self.transformer_blocks = nn.ModuleList(QwenImage21Block(cfg) for _ in range(cfg.num_layers))
        self.norm_out = OutputNorm(dim, cfg.eps)
        self.proj_out = nn.Linear(dim, cfg.out_channels, bias=False)

    def forward(self, img, txt, timesteps, h, w, txt_mask=None, control=None, control_shapes=(), image_slots=None):
        """Predict the flow velocity (noise - x0) of the target image.

        img [B, h*w, in_channels]: the target's latents, row-major (unpatched); txt [B, T, context_in_dim]:
        the prompt's hidden states (values at image slots are unused); txt_mask [B, T] (True = real
        token) or None; timesteps [B] sigma in [0, 1], embedded in float32. Edit inputs: control
        [B, sum(h_i w_i), in_channels] the condition images' latents in slot order, control_shapes
        their (h_i, w_i), image_slots bool [T] the prompt's `<|image_pad|>` positions (one layout for
        the batch, as diffusers). Returns [B, h*w, out_channels] in compute_dtype."""
        cfg, dtype = self.config, self.compute_dtype
        batch = img.shape[0]
        if img.shape[1] != h * w:
            raise ValueError(f"Qwen-Image-2.1: {img.shape[1]} image tokens do not fit an {h} x {w} grid")
        layout = joint_layout(txt.shape[1], h, w, image_slots, tuple(control_shapes), txt_mask, img.device)
        cos, sin = core.rope_tables(layout.positions, cfg.axes_dims_rope, cfg.rope_theta)  # float32 [(B,) J, 64]

        sigma = timesteps.reshape(-1).expand(batch).float()
        if cfg.causal_condition:  # one more row: t = 0 for the prefix
            sigma = torch.cat((sigma, sigma.new_zeros(1)))
        temb = self.time_text_embed.timestep_embedder(sigma, dtype)
        mod = self.modulation(temb)[:, None]  # [B (+1), 1, 4D]
        mod_target, mod_prefix = (mod[:batch], mod[batch:]) if cfg.causal_condition else (mod, mod)

        images = self.img_in(torch.cat((control, img), dim=1).to(dtype) if control is not None else img.to(dtype))
        text = self.txt_in(txt.to(dtype))
        if image_slots is None:
            x = torch.cat((text, images), dim=1)
        else:  # text tokens where is_image is False, in order; image tokens (conditions, target) where True
            prompt_text = (~image_slots.bool()).nonzero().flatten().to(text.device)
            x = text.new_zeros(batch, layout.positions.shape[-2], text.shape[-1])
            x[:, layout.text_at] = text[:, prompt_text]
            x[:, layout.image_at] = images
        for i, block in enumerate(self.transformer_blocks):
            x = core.run_block(block, self.gradient_checkpointing, x, mod_prefix, mod_target, cos, sin, layout,
                               swap=self.block_swap, index=i)
        return self.proj_out(self.norm_out(x[:, layout.prefix_len:], temb[:batch]))

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N of these)."""
        return list(self.transformer_blocks)


def random_inputs(config: QwenImage21Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w latent grid with random text (tools/precision_doctor.py):
    prompt states N(0, 1) whose last quarter is padding (masked), as a short caption's in a batch."""
    from library.models.spec import RandomInputs

    real = max(1, (3 * text_len + 3) // 4)
    mask = torch.arange(text_len)[None] < real
    txt = torch.randn(1, text_len, config.context_in_dim, generator=generator)
    positions = joint_layout(text_len, h, w, txt_mask=mask).positions  # [1, J, 3]: the target after the real tokens
    fixed = dict(txt=txt, txt_mask=mask, h=h, w=w)
    return RandomInputs(fixed, positions, tuple(config.axes_dims_rope), float(config.rope_theta))
