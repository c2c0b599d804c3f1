"""FLUX.3 transformer on the shared core, with Black Forest Labs' module names.

Three token modes share one model: the noisy image tokens, the optional reference ("image_cond") tokens
and the text tokens. What changes against FLUX.2 (library/models/flux2/model.py):
- No double-stream blocks. Each mode first runs through its own per-mode blocks, attending within its
  own tokens only (`content_mode_blocks.image`, `content_mode_blocks.image_cond`, `txt_mode_blocks`);
  then the single blocks run over [txt, image, image_cond] jointly.
- Every block is "parallel": attention and the SwiGLU MLP read the same modulated input, and one gate
  scales the sum of their output projections. q, k and v are separate Linears (`q_proj`, ...).
- Modulation is per mode (one shift/scale/gate triple for the per-mode blocks, `early_stream_modulations`,
  and one for the single blocks, `single_stream_modulations`, each shared by all blocks of its kind). The
  image tokens are modulated by the timestep, the text and reference tokens by timestep 0.
- The step-distilled "flow map" model also embeds the timestep a step jumps to (`ref_time_in`) and adds
  it to both conditioning vectors.
- Image ids are (0, row / 2, col / 2, l), l = 0 for the image and -(1 + k) for reference k: fractional.
  They stay float32 (never bf16: halves are exact there only below 128; float8_e4m3fn only below 8) and
  become float32 RoPE tables from float64 angles outside autocast (core.rope_tables).
- RoPE theta 10000 over 4 axes (t, h, w, l); no biases anywhere.

Module paths mirror BFL's FLUX.3 single-file keys (`content_mode_blocks.image.0.q_proj`,
`early_stream_modulations.txt.lin`, `final_layer.image.adaLN_modulation.1`, ...; the names diffusers'
`convert_flux3_transformer_checkpoint_to_diffusers` reads), so a BFL file loads by plain key. Loading and
the diffusers name map live in library/models/flux3/checkpoint.py.

Numerics as diffusers' Flux3Transformer2DModel: QK RMSNorm and RoPE run in float32 with one cast back to
the activation dtype; timesteps are embedded as 1000 * t in float32 and only then cast (diffusers casts t
to the activation dtype first: in bf16 its t differs from ours by up to 2^-9 relative).

Parameter counts (the released config, on `meta`; diffusers' class gives the same): 5,538,458,368
(FLUX3_IMAGE), 5,548,681,984 with the flow map's `ref_time_in` (FLUX3_IMAGE_DISTILLED).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    LayerNormNoAffine, apply_rope, attention, residual_projection, rope_tables, run_block, split_modulation,
    timestep_embedding,
)
from library.models.flux1.model import LastLayer, MLPEmbedder, Modulator, QKNorm, _batched_ids
from library.models.flux2.model import swiglu

MODES = ("image", "image_cond")  # the content modes, each with its own input projection and per-mode blocks
STREAMS = ("txt", *MODES)  # every mode with a modulation, in the single blocks' order
IMAGE_ROPE_SCALE = 0.5  # row / col ids are scaled by this (diffusers' Flux3 pipeline: image_rope_scale)


@dataclass(frozen=True)
class Flux3Config:
    in_channels: int = 128  # image tokens: 32 latent channels x 2x2 patch; the output has the same width
    cond_in_channels: int = 128  # reference tokens
    context_in_dim: int = 20480  # text hidden states (stacked Qwen3-VL layers)
    hidden_size: int = 3072
    mlp_ratio: float = 3.0  # SwiGLU hidden width = hidden_size * mlp_ratio
    num_heads: int = 24
    depth: int = 5  # per-mode blocks (each of image, image_cond and txt has this many)
    depth_single: int = 28  # single blocks
    axes_dim: tuple[int, ...] = (32, 32, 32, 32)  # RoPE widths of the (t, h, w, l) axes; sum == head_dim
    theta: float = 10000.0
    time_dim: int = 256  # width of the sinusoidal timestep embedding
    flow_map: bool = False  # step-distilled: embeds the target timestep too (`ref_time_in`)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"axes_dim {self.axes_dim} must sum to head_dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


# The released sizes: diffusers' Flux3Transformer2DModel defaults, its single-file types "flux-3-image" and
# "flux-3-image-distilled" (the flow-map model, which alone has `ref_time_in`).
FLUX3_IMAGE = Flux3Config()
FLUX3_IMAGE_DISTILLED = Flux3Config(flow_map=True)
FLUX3_CONFIGS = {"image": FLUX3_IMAGE, "image_distilled": FLUX3_IMAGE_DISTILLED}


# ----------------------------------------------------------------------------------------------
# Blocks


class ParallelBlock(nn.Module):
    """The weights every FLUX.3 block has: attention (q/k/v, QK norm, `attn_out`) and a SwiGLU MLP
    (`mlp_in` = [gate | up], `mlp_out`), run in parallel from one modulated input."""

    def __init__(self, cfg: Flux3Config):
        super().__init__()
        h, self.num_heads = cfg.hidden_size, cfg.num_heads
        self.pre_norm = LayerNormNoAffine(h)  # no weights: BFL's files have no key for it
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.norm = QKNorm(cfg.head_dim)
        self.attn_out = nn.Linear(h, h, bias=False)
        self.mlp_in = nn.Linear(h, 2 * cfg.mlp_hidden, bias=False)
        self.mlp_out = nn.Linear(cfg.mlp_hidden, h, bias=False)

    def update(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, output_needed: bool) -> torch.Tensor:
        """attn_out(attention(y)) + mlp_out(swiglu(mlp_in(y))) for the modulated input y [B, L, h]; cos/sin
        float32 [B or 1, L, head_dim/2]. output_needed: the gate needs a gradient (core.residual_projection)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(y).unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for p in projections)  # [B, H, L, D]
        # QK norm and rotation both in float32 ([B, H, L, D]), then one rounding to the activation dtype
        q, k = self.norm(q.float(), k.float())
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        attn = attention(q, k, v)  # [B, L, h]
        mlp = swiglu(self.mlp_in(y))
        return (residual_projection(self.attn_out, attn, output_needed)
                + residual_projection(self.mlp_out, mlp, output_needed))


class ModeBlock(ParallelBlock):
    """A per-mode block: the tokens of one mode attend among themselves."""

    def forward(self, x, mod, cos, sin):
        """x [B, L, h]; mod [B, 3h] (the mode's early modulation, split here so that checkpointing sees
        plain tensors); cos/sin float32 [B or 1, L, head_dim/2]."""
        (mod,) = split_modulation(mod, 1)
        return x + mod.gate * self.update(mod.modulate(self.pre_norm(x)), cos, sin, mod.gate.requires_grad)


class SingleBlock(ParallelBlock):
    """A single block: the streams attend jointly, each modulated by its own mode's triple."""

    def forward(self, streams: tuple[torch.Tensor, ...], mods: tuple[torch.Tensor, ...], cos, sin):
        """streams: (txt, image[, image_cond]), each [B, L_i, h]; mods: their single-stream modulations, each
        [B, 3h]; cos/sin float32 [B or 1, sum L_i, head_dim/2] in the same order. Returns the streams updated."""
        mods = [split_modulation(m, 1)[0] for m in mods]
        y = torch.cat([m.modulate(self.pre_norm(s)) for m, s in zip(mods, streams)], dim=1)
        out = self.update(y, cos, sin, any(m.gate.requires_grad for m in mods))
        parts = out.split([s.shape[1] for s in streams], dim=1)
        return tuple(s + m.gate * u for s, m, u in zip(streams, mods, parts))


# ----------------------------------------------------------------------------------------------
# Model


class Flux3Transformer(nn.Module):
    def __init__(self, config: Flux3Config = FLUX3_IMAGE):
        super().__init__()
        self.config = cfg = config
        h = cfg.hidden_size
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called

        channels = {"image": cfg.in_channels, "image_cond": cfg.cond_in_channels}
        self.emb_in = nn.ModuleDict({mode: nn.Linear(channels[mode], h, bias=False) for mode in MODES})
        self.txt_in = nn.Linear(cfg.context_in_dim, h, bias=False)
        self.time_in = MLPEmbedder(cfg.time_dim, h, bias=False)
        self.ref_time_in = MLPEmbedder(cfg.time_dim, h, bias=False) if cfg.flow_map else None
        self.early_stream_modulations = nn.ModuleDict({s: Modulator(h, 1, bias=False) for s in STREAMS})
        self.single_stream_modulations = nn.ModuleDict({s: Modulator(h, 1, bias=False) for s in STREAMS})
        self.content_mode_blocks = nn.ModuleDict(
            {mode: nn.ModuleList(ModeBlock(cfg) for _ in range(cfg.depth)) for mode in MODES})
        self.txt_mode_blocks = nn.ModuleList(ModeBlock(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(SingleBlock(cfg) for _ in range(cfg.depth_single))
        self.final_layer = nn.ModuleDict({"image": LastLayer(h, cfg.in_channels, bias=False)})

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        img_cond: torch.Tensor | None = None,
        img_cond_ids: torch.Tensor | None = None,
        target_timesteps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) of the image tokens.

        img [B, L, in_channels], txt [B, T, context_in_dim], img_cond [B, R, cond_in_channels] (the references'
            packed clean latents, optional): cast to compute_dtype.
        img_ids [B, L, 4], txt_ids [B, T, 4], img_cond_ids [B, R, 4] (or without the batch axis): (t, h, w, l)
            positions, float32 (the image ids are fractional: make_img_ids) or int64; never bf16.
        timesteps [B]: sigma in [0, 1] of the image tokens, embedded as 1000 * sigma in float32.
        target_timesteps [B]: the sigma this step jumps to; required by, and only by, a flow-map model.
        Returns [B, L, in_channels] in compute_dtype.
        """
        cfg, dtype = self.config, self.compute_dtype
        if (img_cond is None) != (img_cond_ids is None):
            raise ValueError("FLUX.3 reference tokens need both img_cond and img_cond_ids")
        if (target_timesteps is not None) != cfg.flow_map:
            raise ValueError("target_timesteps is required by, and only by, a flow-map FLUX.3 model "
                             f"(this one: flow_map={cfg.flow_map})")

        # Positions -> one float32 cos/sin table [B, T+L+R, head_dim/2] over [txt, image, image_cond],
        # computed outside autocast; each mode's blocks read their slice of it.
        ids = [txt_ids, img_ids] + ([img_cond_ids] if img_cond is not None else [])
        cos, sin = rope_tables(joint_ids(ids), cfg.axes_dim, cfg.theta)

        # Conditioning vectors [B, h]: the image tokens' at `timesteps`, the text's and references' at 0.
        vec = self.time_in(timestep_embedding(timesteps, cfg.time_dim).to(dtype))
        vec_zero = self.time_in(timestep_embedding(torch.zeros_like(timesteps), cfg.time_dim).to(dtype))
        if self.ref_time_in is not None:  # the flow map: the target step's embedding reaches every mode
            target = self.ref_time_in(timestep_embedding(target_timesteps, cfg.time_dim).to(dtype))
            vec, vec_zero = vec + target, vec_zero + target
        act = {"image": F.silu(vec), "image_cond": F.silu(vec_zero), "txt": F.silu(vec_zero)}

        streams = {"txt": self.txt_in(txt.to(dtype)), "image": self.emb_in["image"](img.to(dtype))}
        if img_cond is not None:
            streams["image_cond"] = self.emb_in["image_cond"](img_cond.to(dtype))
        streams = self._mode_blocks(streams, act, cos, sin)
        mods = tuple(self.single_stream_modulations[s].lin(act[s]) for s in streams)
        x = tuple(streams.values())
        ckpt, swap, first = self.gradient_checkpointing, self.block_swap, self._single_index()
        for i, block in enumerate(self.single_blocks):
            x = run_block(block, ckpt, x, mods, cos, sin, swap=swap, index=first + i)
        return self.final_layer["image"](x[1], vec)  # x: (txt, image[, image_cond]); only the image is predicted

    def _mode_blocks(self, streams: dict, act: dict, cos, sin) -> dict:
        """Each stream through its own per-mode blocks, in swappable_blocks' order; a mode without tokens
        (no references) is skipped."""
        ckpt, swap, index, start = self.gradient_checkpointing, self.block_swap, 0, 0
        for name, blocks in (("txt", self.txt_mode_blocks), *self.content_mode_blocks.items()):
            if name not in streams:
                for _ in blocks:
                    if swap is not None:  # its swapped weights are not wanted in this forward
                        swap.skip(index)
                    index += 1
                continue
            x, mod = streams[name], self.early_stream_modulations[name].lin(act[name])
            span = slice(start, start + x.shape[1])
            for block in blocks:
                x = run_block(block, ckpt, x, mod, cos[:, span], sin[:, span], swap=swap, index=index)
                index += 1
            streams[name], start = x, span.stop
        return streams

    def _single_index(self) -> int:
        return len(self.txt_mode_blocks) + sum(len(blocks) for blocks in self.content_mode_blocks.values())

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order: text, image, reference per-mode blocks, then the single blocks (block
        swap moves the last N of these: single blocks first)."""
        return [*self.txt_mode_blocks, *(b for blocks in self.content_mode_blocks.values() for b in blocks),
                *self.single_blocks]


def joint_ids(ids: list[torch.Tensor]) -> torch.Tensor:
    """Position ids of the streams ([L_i, 4] or [B, L_i, 4] each) -> one [B or 1, sum L_i, 4] tensor, in
    the widest dtype among them (float32 when any is: int64 ids are exact there, fractional ones stay)."""
    dtype = ids[0].dtype
    for i in ids[1:]:
        dtype = torch.promote_types(dtype, i.dtype)
    batched = [_batched_ids(i, dtype) for i in ids]
    batch = max(i.shape[0] for i in batched)
    return torch.cat([i.expand(batch, -1, -1) for i in batched], dim=1)


def make_img_ids(batch: int, h: int, w: int, l: int = 0, device=None) -> torch.Tensor:  # noqa: E741
    """Image position ids [batch, h*w, 4] float32: (0, row / 2, col / 2, l) for an h x w grid of 2x2
    patches; l = 0 for the generated image, -(1 + k) for reference k (the Flux3 pipeline's _prepare_image_ids)."""
    rows = torch.arange(h, device=device, dtype=torch.float32)[:, None].expand(h, w)
    cols = torch.arange(w, device=device, dtype=torch.float32)[None, :].expand(h, w)
    zeros = torch.zeros_like(rows)
    ids = torch.stack((zeros, rows * IMAGE_ROPE_SCALE, cols * IMAGE_ROPE_SCALE, zeros + l), dim=-1)
    return ids.reshape(h * w, 4)[None].expand(batch, -1, -1).contiguous()


def make_txt_ids(batch: int, length: int, device=None) -> torch.Tensor:
    """Text position ids [batch, length, 4] float32: (0, 0, 0, index), as the Flux3 pipeline's _prepare_text_ids."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids[None].expand(batch, -1, -1).contiguous()


def random_inputs(config: Flux3Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    text embeddings N(0, 1), no references; a flow-map model jumps to sigma 0."""
    from library.models.spec import RandomInputs

    txt = torch.randn(1, text_len, config.context_in_dim, generator=generator)
    fixed = dict(img_ids=make_img_ids(1, h, w), txt=txt, txt_ids=make_txt_ids(1, text_len),
                 target_timesteps=torch.zeros(1) if config.flow_map else None)
    positions = torch.cat([fixed["txt_ids"], fixed["img_ids"]], dim=1)
    return RandomInputs(fixed, positions, tuple(config.axes_dim), float(config.theta))
