"""Chroma transformer: FLUX.1-schnell's blocks with the per-block modulation pruned, on the shared core.

Chroma keeps FLUX.1's double- and single-stream blocks but deletes every adaLN Linear (`img_mod`,
`txt_mod`, `modulation`, the final layer's `adaLN_modulation`) together with `time_in` and
`vector_in`. One distilled MLP, the approximator (`distilled_guidance_layer`), produces all the
modulation vectors at once: its input has one row per vector, the timestep embedding next to an
embedding of the row's index, so each row comes out as that block's own shift, scale or gate.
There is no CLIP and no guidance embedding; T5's padding is masked in attention (`txt_mask`).

Module paths mirror the BFL-style single file Chroma is released as (chroma-unlocked-v*.safetensors,
Chroma1-HD.safetensors), so it loads with a plain `load_state_dict`; loading and the diffusers names
live in library/models/chroma/checkpoint.py. The oracle is diffusers' ChromaTransformer2DModel.

Precision, as FLUX.1 (see shared/DESIGN.md): the model carries an explicit `compute_dtype`; image
and text inputs are cast to it at entry. Position ids stay int64/float32 and become float32 RoPE
tables outside autocast; the approximator's sinusoidal input is computed in float32 per forward
(not a buffer that `model.to(dtype)` could cast) and only then cast to compute_dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from library.models.core import (
    GeluMLP,
    LayerNormNoAffine,
    Modulation,
    apply_rope,
    attention,
    rms_norm,
    rope_tables,
    run_block,
    timestep_embedding,
)
from library.models.flux1.model import (  # the layers Chroma shares with FLUX.1, unchanged
    MLPEmbedder,
    QKNorm,
    SelfAttention,
    _batched_ids,
    make_img_ids,
    make_txt_ids,
    split_heads,
)

__all__ = ["ChromaConfig", "CHROMA", "Chroma", "make_img_ids", "make_txt_ids", "modulation_rows", "random_inputs"]


@dataclass(frozen=True)
class ChromaConfig:
    in_channels: int = 64  # 16 latent channels x 2x2 patch; the output has the same width
    context_in_dim: int = 4096  # T5-XXL hidden states
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single: int = 38  # single-stream blocks
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE widths of the (index, row, col) axes; sum == head_dim
    theta: float = 10000.0
    approximator_in_dim: int = 64  # [timestep 16 | guidance 16 | row index 32] sinusoids
    approximator_hidden: int = 5120
    approximator_layers: int = 5

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"axes_dim {self.axes_dim} must sum to head_dim {self.head_dim}")
        if self.approximator_in_dim % 8:
            raise ValueError(f"approximator_in_dim {self.approximator_in_dim} must be a multiple of 8")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def modulation_rows(self) -> int:
        """Vectors the approximator makes: 3 per single block, 2 x 6 per double block, 2 final (344)."""
        return 3 * self.depth_single + 12 * self.depth + 2


CHROMA = ChromaConfig()  # Chroma1-HD / Chroma1-Base / chroma-unlocked-v*: one size


def modulation_rows(config: ChromaConfig) -> dict[str, tuple[int, int]]:
    """Where each block's vectors lie in the approximator output [B, rows, h]: name -> (start, count).

    The order is Chroma's (and diffusers'): single blocks first (shift, scale, gate each), then the
    double blocks' image triples (attention, MLP), then their text triples, then the final
    (shift, scale)."""
    s, d = config.depth_single, config.depth
    rows = {f"single_blocks.{i}": (3 * i, 3) for i in range(s)}
    rows |= {f"double_blocks.{i}.img": (3 * s + 6 * i, 6) for i in range(d)}
    rows |= {f"double_blocks.{i}.txt": (3 * s + 6 * d + 6 * i, 6) for i in range(d)}
    rows["final_layer"] = (3 * s + 12 * d, 2)
    return rows


def split_rows(mods: torch.Tensor) -> list[Modulation]:
    """[B, 3k, h] -> k Modulations (shift, scale, gate), each field [B, 1, h] (broadcast over tokens)."""
    triples = mods[:, :, None, :].unflatten(1, (-1, 3))  # [B, k, 3, 1, h]
    return [Modulation(*t.unbind(1)) for t in triples.unbind(1)]


# ----------------------------------------------------------------------------------------------
# The approximator


class ApproximatorNorm(nn.Module):
    """RMSNorm with BFL's `scale` name. eps is float32's machine epsilon (1.19e-7), what diffusers'
    nn.RMSNorm(eps=None) uses on fp32 input (our statistics are always fp32); BFL's code used 1e-6,
    a 4e-7 relative difference at unit mean square."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale, torch.finfo(torch.float32).eps)


class Approximator(nn.Module):
    """in_proj -> `layers` pre-norm residual MLPs -> out_proj: [B, rows, in_dim] -> [B, rows, hidden_size]."""

    def __init__(self, cfg: ChromaConfig):
        super().__init__()
        a = cfg.approximator_hidden
        self.in_proj = nn.Linear(cfg.approximator_in_dim, a)
        self.layers = nn.ModuleList(MLPEmbedder(a, a) for _ in range(cfg.approximator_layers))
        self.norms = nn.ModuleList(ApproximatorNorm(a) for _ in range(cfg.approximator_layers))
        self.out_proj = nn.Linear(a, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.in_proj(x)
        for layer, norm in zip(self.layers, self.norms):
            x = x + layer(norm(x))
        return self.out_proj(x)


def approximator_input(timesteps: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """float32 [B, rows, width]: per row [emb(1000 sigma) | emb(guidance 0) | emb(1000 row)], with
    width/4, width/4 and width/2 sinusoids (cos half first). Chroma was distilled with the guidance
    input fixed at 0 (all rows alike), so only the timestep and the row index vary."""
    quarter = width // 4
    t = timestep_embedding(timesteps, quarter)  # [B, w/4], 1000 * sigma as the pipeline's timestep
    g = timestep_embedding(torch.zeros_like(timesteps, dtype=torch.float32), quarter)
    index = timestep_embedding(torch.arange(rows, dtype=torch.float32, device=timesteps.device), 2 * quarter)
    b = timesteps.shape[0]
    return torch.cat((torch.cat((t, g), dim=-1)[:, None].expand(b, rows, -1), index[None].expand(b, -1, -1)), dim=-1)


# ----------------------------------------------------------------------------------------------
# Blocks: FLUX.1's, reading their modulation from the approximator rows and masking the text padding


def masked_rope_attention(q, k, v, cos, sin, mask) -> torch.Tensor:
    """Rotate q/k (interleaved pairs, fp32 rotation) and attend; mask: bool [B, 1, 1, T+L] or None
    (True = attend: valid text, one padding token, every image token). Returns [B, L, H*D].

    A key mask, not diffusers' query x key outer product: masked text queries then attend to the
    valid keys instead of to nothing, and no query ever sees a masked key, so every image and valid
    text output is the same, and the masked rows (never read by anyone) stay finite."""
    return attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask=mask)


class DoubleStreamBlock(nn.Module):
    """Image and text keep their own weights and attend jointly over [txt, img]."""

    def __init__(self, cfg: ChromaConfig):
        super().__init__()
        h = cfg.hidden_size
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_norm1", LayerNormNoAffine(h))
            setattr(self, f"{stream}_attn", SelfAttention(h, cfg.num_heads, qkv_bias=True))
            setattr(self, f"{stream}_norm2", LayerNormNoAffine(h))
            setattr(self, f"{stream}_mlp", GeluMLP(h, cfg.mlp_hidden))

    def forward(self, img, txt, img_mods, txt_mods, cos, sin, mask):
        """img [B, L, h], txt [B, T, h]; img_mods / txt_mods [B, 6, h] (attention, MLP triples);
        cos/sin fp32 [B, T+L, D/2] (text first); mask bool [B, 1, 1, T+L] or None."""
        img_mod1, img_mod2 = split_rows(img_mods)
        txt_mod1, txt_mod2 = split_rows(txt_mods)
        img_q, img_k, img_v = self.img_attn.heads(img_mod1.modulate(self.img_norm1(img)))
        txt_q, txt_k, txt_v = self.txt_attn.heads(txt_mod1.modulate(self.txt_norm1(txt)))

        q, k, v = (torch.cat(pair, dim=2) for pair in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v)))
        out = masked_rope_attention(q, k, v, cos, sin, mask)
        txt_attn, img_attn = out.split((txt.shape[1], img.shape[1]), dim=1)

        img = img + img_mod1.gate * self.img_attn.proj(img_attn)
        img = img + img_mod2.gated_mlp(self.img_mlp, img_mod2.modulate(self.img_norm2(img)))
        txt = txt + txt_mod1.gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt_mod2.gated_mlp(self.txt_mlp, txt_mod2.modulate(self.txt_norm2(txt)))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One stream over [txt, img]: attention and MLP run in parallel from one fused `linear1`."""

    def __init__(self, cfg: ChromaConfig):
        super().__init__()
        h, self.mlp_hidden, self.num_heads = cfg.hidden_size, cfg.mlp_hidden, cfg.num_heads
        self.linear1 = nn.Linear(h, 3 * h + self.mlp_hidden)  # [q | k | v | mlp in]
        self.linear2 = nn.Linear(h + self.mlp_hidden, h)  # [attention out | mlp out] -> h
        self.norm = QKNorm(cfg.head_dim)
        self.pre_norm = LayerNormNoAffine(h)

    def forward(self, x, mods, cos, sin, mask):
        """x [B, T+L, h], mods [B, 3, h]; cos/sin fp32 [B, T+L, D/2]; mask bool [B, 1, 1, T+L] or None."""
        (mod,) = split_rows(mods)
        qkv, mlp = self.linear1(mod.modulate(self.pre_norm(x))).split((3 * x.shape[-1], self.mlp_hidden), dim=-1)
        q, k, v = split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k)
        attn = masked_rope_attention(q, k, v, cos, sin, mask)
        return x + mod.gated_projection(self.linear2, torch.cat((attn, F.gelu(mlp, approximate="tanh")), dim=-1))


class LastLayer(nn.Module):
    """Final adaLN from the approximator's last two rows (shift, scale), projection to patch channels."""

    def __init__(self, hidden: int, out_channels: int):
        super().__init__()
        self.norm_final = LayerNormNoAffine(hidden)
        self.linear = nn.Linear(hidden, out_channels)

    def forward(self, x: torch.Tensor, mods: torch.Tensor) -> torch.Tensor:
        shift, scale = mods[:, :, None, :].unbind(1)  # each [B, 1, h]
        return self.linear((1 + scale) * self.norm_final(x) + shift)


# ----------------------------------------------------------------------------------------------
# Model


class Chroma(nn.Module):
    def __init__(self, config: ChromaConfig = CHROMA):
        super().__init__()
        self.config = cfg = config
        h = cfg.hidden_size
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called
        self.rows = modulation_rows(cfg)

        self.img_in = nn.Linear(cfg.in_channels, h)
        self.txt_in = nn.Linear(cfg.context_in_dim, h)
        self.distilled_guidance_layer = Approximator(cfg)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.depth_single))
        self.final_layer = LastLayer(h, cfg.in_channels)

    def forward(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        txt_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow velocity (noise - x0) for packed latents.

        img [B, L, in_channels], txt [B, T, context_in_dim]: cast to compute_dtype.
        img_ids [B, L, 3], txt_ids [B, T, 3] (or [L, 3] / [T, 3]): int64 or float32 positions.
        timesteps [B]: sigma in [0, 1] (ChromaPipeline's timestep / 1000), embedded as 1000 * sigma in float32.
        txt_mask [B, T]: True (or 1) where text is attended: the prompt's tokens, its EOS and the first
            padding token (library/models/chroma/text_encoder.py). None attends to every text token.
        Returns [B, L, in_channels] in compute_dtype.
        """
        dtype, cfg = self.compute_dtype, self.config

        # Positions -> float32 cos/sin tables [B, T+L, head_dim/2], computed outside autocast.
        ids = torch.cat((_batched_ids(txt_ids, img_ids.dtype), _batched_ids(img_ids, img_ids.dtype)), dim=1)
        cos, sin = rope_tables(ids, cfg.axes_dim, cfg.theta)
        mask = _key_mask(txt_mask, img.shape[0], img.shape[1], txt.shape[1], img.device)

        # Every modulation vector at once: float32 sinusoids, cast to compute_dtype before the MLP.
        sinusoids = approximator_input(timesteps, cfg.modulation_rows, cfg.approximator_in_dim)
        mods = self.distilled_guidance_layer(sinusoids.to(dtype))  # [B, rows, h]

        img = self.img_in(img.to(dtype))
        txt = self.txt_in(txt.to(dtype))
        ckpt, swap, depth = self.gradient_checkpointing, self.block_swap, len(self.double_blocks)
        for i, block in enumerate(self.double_blocks):
            img_mods, txt_mods = self._rows(mods, f"double_blocks.{i}.img"), self._rows(mods, f"double_blocks.{i}.txt")
            img, txt = run_block(block, ckpt, img, txt, img_mods, txt_mods, cos, sin, mask, swap=swap, index=i)
        x = torch.cat((txt, img), dim=1)
        for i, block in enumerate(self.single_blocks):
            single_mods = self._rows(mods, f"single_blocks.{i}")
            x = run_block(block, ckpt, x, single_mods, cos, sin, mask, swap=swap, index=depth + i)
        return self.final_layer(x[:, txt.shape[1] :], self._rows(mods, "final_layer"))

    def _rows(self, mods: torch.Tensor, name: str) -> torch.Tensor:
        start, count = self.rows[name]
        return mods[:, start : start + count]

    def swappable_blocks(self) -> list[nn.Module]:
        """The blocks in run order (block swap moves the last N of these: single blocks first)."""
        return [*self.double_blocks, *self.single_blocks]


def _key_mask(txt_mask: torch.Tensor | None, batch: int, img_len: int, txt_len: int, device) -> torch.Tensor | None:
    """[B, T] text mask -> bool key mask [B, 1, 1, T+L] (image keys always attended), or None.

    A float mask counts as 0 = masked, nonzero = attended (T5's convention). diffusers 0.42.1's
    ChromaPipeline hands its transformer such a float 0/1 mask, which SDPA then adds to the scores
    as a bias instead of masking (diffusers issue #12116); the released model and diffusers given a
    boolean mask mask the padding, as here."""
    if txt_mask is None:
        return None
    if tuple(txt_mask.shape) != (batch, txt_len):
        raise ValueError(f"txt_mask must be [B, T] = {(batch, txt_len)}, got {tuple(txt_mask.shape)}")
    keys = torch.cat((txt_mask.to(device) != 0, torch.ones(batch, img_len, dtype=torch.bool, device=device)), dim=1)
    return keys[:, None, None, :]


def random_inputs(config: ChromaConfig, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py):
    text embeddings N(0, 1), every text token attended (no padding), positions as the pipeline's."""
    from library.models.spec import RandomInputs

    fixed = dict(img_ids=make_img_ids(1, h, w), txt=torch.randn(1, text_len, config.context_in_dim, generator=generator),
                 txt_ids=make_txt_ids(1, text_len), txt_mask=torch.ones(1, text_len, dtype=torch.bool))
    positions = torch.cat([fixed["txt_ids"], fixed["img_ids"]], dim=1)
    return RandomInputs(fixed, positions, tuple(config.axes_dim), float(config.theta))
