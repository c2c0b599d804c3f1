"""Z-Image Omni: the Z-Image transformer in diffusers' "omni" mode (ZImageOmniPipeline), where a
prompt carries reference images: each as VAE latents (patch tokens beside the target's) and as SigLIP2
features (their own token stream), with the caption cut into segments around them.

One row of the batch, N references (diffusers' patchify_and_embed_omni / _build_unified_sequence):
- captions: N + 2 segments for N > 0 (the pipeline's template split at each image: `<|im_start|>user\\n
  <|vision_start|>`, N - 1 times `<|vision_end|><|vision_start|>`, `<|vision_end|>` + prompt + ...
  `<|vision_start|>`, `<|vision_end|><|im_end|>`), one for N = 0. Segment j's real tokens sit at
  positions cu_j, cu_j + 1, ... on axis 0, cu_0 = 1, cu_{j+1} = end_j + 2 with end_j = cu_j + n_j:
  each image j takes the two positions after its segment (end_j its latents, end_j + 1 its SigLIP).
- images: the N references then the target, each an h_j x w_j patch grid at (end_j, row, column).
- SigLIP: reference j's sH x sW grid at (end_j + 1, r', c'), r' = int(r / (sH - 1) * (H_j - 1)) with
  H_j the reference's latent height (2 h_j: the latent's, not the patch grid's), c' alike; then 32
  SigLIP pad tokens for the target. No SigLIP stream without references.
- Every piece is padded to a multiple of 32 with its stream's learned pad token at (0, 0, 0).
- The row: [caption segments | images | SigLIP], rows of a batch padded at the end and masked.
- Time: the target's tokens (its image, its SigLIP pads, the last two caption segments) are modulated
  with the timestep embedding of t = 1 - sigma, the references' (images, SigLIP, their caption
  segments) with that of t = 1 (clean): model.TokenTimes. Only the target's tokens are returned.

Two layouts are diffusers' as they are (it is the parity oracle; the Omni release was trained with
its authors' code, which we cannot read):
- caption positions: diffusers lists round_up(n_j) positions per segment followed by round_up(n_j) - n_j
  (0, 0, 0) ones and reads that concatenation against the segments' padded features, so after a
  segment with padding the next segments' positions shift (caption_positions below);
- SigLIP features [sH, sW, C] enter as `permute(2, 0, 1).reshape(sH * sW, C)`: token k holds the
  channel-major values k C .. k C + C - 1 (siglip_tokens below).

Dtypes: features cast to compute_dtype at entry; positions int64 -> float32 RoPE tables; timesteps
embedded in float32 and cast, as in model.py.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from library.models.core import rope_tables, run_block, timestep_embedding
from library.models.latents import pack_latents
from library.models.zimage.model import (
    SEQ_MULTIPLE, TIME_DIM, ZIMAGE_BASE, TokenTimes, ZImage, ZImageConfig, from_patch_order, round_up, to_patch_order,
)

# Z-Image Omni as ZImageOmniPipeline builds it: Z-Image (Base)'s transformer plus the SigLIP branch,
# siglip_feat_dim 1152 = the hidden size of SigLIP2 so400m (Siglip2VisionModel). diffusers ships no
# Omni config and the Omni weights were not published when this was written: the Base sizes with
# that width are what every description of the release (diffusers PR 12857) gives.
ZIMAGE_OMNI = dataclasses.replace(ZIMAGE_BASE, siglip_feat_dim=1152)


@dataclasses.dataclass
class Piece:
    """One piece of a row's stream before embedding and padding: its input features [n, in_dim] (real
    tokens only), positions [n or round_up(n), 3] int64 (missing pad rows are (0, 0, 0)), and whether
    it is the noisy target's."""

    feats: torch.Tensor
    positions: torch.Tensor
    noisy: bool


def caption_positions(lengths: list[int], device) -> torch.Tensor:
    """[sum round_up(n_j), 3] int64 positions of a row's caption segments, read as diffusers reads
    them: per segment round_up(n) positions from cu_j on axis 0, then round_up(n) - n (0, 0, 0) rows,
    all concatenated and cut to the features' length (see the module docstring)."""
    pieces, cu = [], 1
    for n in lengths:
        padded = round_up(n)
        pos = torch.zeros(2 * padded - n, 3, dtype=torch.int64, device=device)
        pos[:padded, 0] = torch.arange(cu, cu + padded, device=device)
        pieces.append(pos)
        cu += n + 2
    return torch.cat(pieces)[: sum(round_up(n) for n in lengths)]


def grid_positions(h: int, w: int, first: int, device, rows_to: int | None = None, cols_to: int | None = None):
    """[h * w, 3] int64: (first, r, c) row-major; rows_to / cols_to: r and c rescaled to 0 .. rows_to - 1
    as diffusers scales SigLIP positions (float32 r / max(h - 1, 1) * (rows_to - 1), truncated)."""
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    if rows_to is not None:
        rows = (rows.float() / max(h - 1, 1) * (rows_to - 1)).long()
        cols = (cols.float() / max(w - 1, 1) * (cols_to - 1)).long()
    return torch.stack([torch.full_like(rows, first), rows, cols], dim=-1).reshape(-1, 3)


def siglip_tokens(features: torch.Tensor) -> torch.Tensor:
    """[sH, sW, C] -> [sH * sW, C] exactly as diffusers flattens them (channel-major memory read as
    rows of C: see the module docstring)."""
    h, w, c = features.shape
    return features.permute(2, 0, 1).reshape(h * w, c)


def padded_stream(rows: list[list[Piece]], embedder: nn.Module, pad_token: torch.Tensor, cfg: ZImageConfig):
    """Each row's pieces padded to multiples of 32 and embedded, the pads then replaced by pad_token;
    rows padded to the longest: (x [B, L, dim], cos, sin [B, L, head_dim / 2] float32, mask [B, L] bool
    or None (all as long), noisy [B, L, 1] bool, lengths: each row's token count). The whole batch is
    embedded in one call, pads included, as diffusers does: a GEMM's rounding depends on its row count."""
    raw, is_pad, positions, noisy = [], [], [], []
    for pieces in rows:
        row_pos, row_noisy = [], []
        for p in pieces:
            n = p.feats.shape[0]
            pads = round_up(n) - n if n else SEQ_MULTIPLE  # an empty piece (the target's SigLIP): one block of pads
            raw += [p.feats, p.feats.new_zeros(pads, p.feats.shape[1])]
            is_pad.append(torch.arange(n + pads, device=p.feats.device) >= n)
            row_pos += [p.positions, p.positions.new_zeros(n + pads - p.positions.shape[0], 3)]  # pads at (0, 0, 0)
            row_noisy.append(torch.full((n + pads,), p.noisy, device=p.feats.device))
        positions.append(torch.cat(row_pos))
        noisy.append(torch.cat(row_noisy))
    embedded = embedder(torch.cat(raw))
    embedded = torch.where(torch.cat(is_pad)[:, None], pad_token.to(embedded.dtype), embedded)
    return pad_rows(list(embedded.split([n.shape[0] for n in noisy])), positions, noisy, cfg)


def pad_rows(feats: list[torch.Tensor], positions: list[torch.Tensor], noisy: list[torch.Tensor], cfg: ZImageConfig):
    """Rows of different lengths -> padded batch tensors (see padded_stream); padding sits at (0, 0, 0)."""
    lengths = [f.shape[0] for f in feats]
    longest, b = max(lengths), len(feats)
    x = feats[0].new_zeros(b, longest, feats[0].shape[1])
    pos = torch.zeros(b, longest, 3, dtype=torch.int64, device=x.device)
    flags = torch.zeros(b, longest, 1, dtype=torch.bool, device=x.device)
    for i, (f, p, n) in enumerate(zip(feats, positions, noisy)):
        x[i, : f.shape[0]], pos[i, : f.shape[0]], flags[i, : f.shape[0], 0] = f, p, n
    mask = None
    if any(n != longest for n in lengths):
        mask = torch.arange(longest, device=x.device)[None] < torch.tensor(lengths, device=x.device)[:, None]
    cos, sin = rope_tables(pos, cfg.axes_dims, cfg.rope_theta)
    return x, cos, sin, mask, flags, lengths


class ZImageOmni(ZImage):
    """ZImage with the omni forward (the text-to-image forward of model.py is not this model's)."""

    def __init__(self, config: ZImageConfig = ZIMAGE_OMNI):
        if config.siglip_feat_dim is None:
            raise ValueError("ZImageOmni needs a config with siglip_feat_dim (the SigLIP branch): an Omni checkpoint")
        super().__init__(config)

    def forward(
        self,
        img: torch.Tensor,
        timesteps: torch.Tensor,
        h: int,
        w: int,
        captions: list[list[torch.Tensor]],
        references: list[torch.Tensor] | tuple = (),
        siglip: list[list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """The flow velocity (noise - x0) of the target.

        img [B, h*w, 4C]: the noisy target, pack_latents' layout; timesteps [B]: sigma in [0, 1].
        captions: per row its caption segments [n_j, cap_feat_dim] (N + 2 with references, else 1).
        references: N clean reference latents [B, C, H_k, W_k] (unpacked, VAE-normalized, even sides).
        siglip: per row its N references' SigLIP features [sH_k, sW_k, siglip_feat_dim]; None without references.
        Returns [B, h*w, 4C] in compute_dtype.
        """
        cfg, dtype, device = self.config, self.compute_dtype, img.device
        b, n_ref = img.shape[0], len(references)
        self._check_inputs(img, h, w, captions, references, siglip)
        t = timestep_embedding(1.0 - timesteps.float(), TIME_DIM, time_factor=cfg.t_scale).to(dtype)
        clean = timestep_embedding(torch.ones_like(timesteps, dtype=torch.float32), TIME_DIM, time_factor=cfg.t_scale)
        t_noisy, t_clean = self.t_embedder(t), self.t_embedder(clean.to(dtype))

        grids = [(r.shape[2] // cfg.patch_size, r.shape[3] // cfg.patch_size) for r in references] + [(h, w)]
        tokens = [to_patch_order(pack_latents(r.to(device, dtype)), cfg.in_channels, cfg.patch_size) for r in references]
        tokens.append(to_patch_order(img.to(dtype), cfg.in_channels, cfg.patch_size))
        cap_rows, img_rows, sig_rows = [], [], []
        for i in range(b):
            lengths = [c.shape[0] for c in captions[i]]
            ends = [1 + sum(lengths[: j + 1]) + 2 * j for j in range(len(lengths))]  # end_j: after segment j
            positions = caption_positions(lengths, device).split([round_up(n) for n in lengths])
            # The references' segments are clean, the last two (the prompt's, the closing one) the target's.
            cap_rows.append([Piece(c.to(device, dtype), p, j >= n_ref) for j, (c, p) in enumerate(zip(captions[i], positions))])
            img_rows.append([Piece(tok[i], grid_positions(gh, gw, ends[j], device), j == n_ref)
                             for j, (tok, (gh, gw)) in enumerate(zip(tokens, grids))])
            if n_ref:
                sig_rows.append([Piece(siglip_tokens(s.to(device, dtype)),
                                       grid_positions(s.shape[0], s.shape[1], ends[j] + 1, device, *references[j].shape[2:]),
                                       False) for j, s in enumerate(siglip[i])])
                empty = Piece(img.new_zeros(0, cfg.siglip_feat_dim, dtype=dtype), torch.zeros(0, 3, dtype=torch.long, device=device), True)
                sig_rows[-1].append(empty)  # the target's: one block of pad tokens
        return self._run(img_rows, cap_rows, sig_rows, t_noisy, t_clean, grids)

    def _run(self, img_rows, cap_rows, sig_rows, t_noisy, t_clean, grids) -> torch.Tensor:
        """Refine each stream, join each row's [captions | images | SigLIP], run the main layers."""
        cfg, ckpt, swap = self.config, self.gradient_checkpointing, self.block_swap
        n_ref, n_refine = len(self.noise_refiner), len(self.context_refiner)
        x, x_cos, x_sin, x_mask, x_noisy, x_len = padded_stream(img_rows, self.all_x_embedder[cfg.patch_key], self.x_pad_token, cfg)
        times = TokenTimes(t_noisy, t_clean, x_noisy)
        for i, block in enumerate(self.noise_refiner):
            x = run_block(block, ckpt, x, x_cos, x_sin, x_mask, times, swap=swap, index=i)
        cap, c_cos, c_sin, c_mask, c_noisy, c_len = padded_stream(cap_rows, self.cap_embedder, self.cap_pad_token, cfg)
        for i, block in enumerate(self.context_refiner):
            cap = run_block(block, ckpt, cap, c_cos, c_sin, c_mask, swap=swap, index=n_ref + i)
        streams = [(cap, c_cos, c_sin, c_noisy, c_len), (x, x_cos, x_sin, x_noisy, x_len)]
        if sig_rows:
            sig, s_cos, s_sin, s_mask, s_noisy, s_len = padded_stream(sig_rows, self.siglip_embedder, self.siglip_pad_token, cfg)
            for i, block in enumerate(self.siglip_refiner):
                sig = run_block(block, ckpt, sig, s_cos, s_sin, s_mask, swap=swap, index=n_ref + n_refine + i)
            streams.append((sig, s_cos, s_sin, s_noisy, s_len))
        elif swap is not None:  # text to image: the SigLIP refiner does not run, its swapped weights are not wanted
            for i in range(len(self.siglip_refiner)):
                swap.skip(n_ref + n_refine + i)

        # Each row: its own tokens of every stream, in order; rows padded at the end (masked).
        rows = range(x.shape[0])
        joined = [[torch.cat([s[k][i, : s[4][i]] for s in streams]) for i in rows] for k in range(4)]
        u, cos, sin = (pad_batch(parts) for parts in joined[:3])
        noisy = pad_batch(joined[3])
        lengths = [p.shape[0] for p in joined[0]]
        mask = None
        if any(n != max(lengths) for n in lengths):
            mask = torch.arange(u.shape[1], device=u.device)[None] < torch.tensor(lengths, device=u.device)[:, None]
        times = TokenTimes(t_noisy, t_clean, noisy)
        first = n_ref + n_refine + len(self.siglip_refiner)  # swap indices: swappable_blocks' positions, always
        for i, block in enumerate(self.layers):
            u = run_block(block, ckpt, u, cos, sin, mask, times, swap=swap, index=first + i)

        # The target's tokens: after the row's captions and the references' padded grids.
        h, w = grids[-1]
        starts = [c_len[i] + sum(round_up(gh * gw) for gh, gw in grids[:-1]) for i in rows]
        u = torch.stack([u[i, s : s + h * w] for i, s in enumerate(starts)])
        out = self.all_final_layer[cfg.patch_key](u, t_noisy)  # x0 - noise, Z-Image's patch order (all noisy tokens)
        return -from_patch_order(out, cfg.in_channels, cfg.patch_size)

    def _check_inputs(self, img, h, w, captions, references, siglip):
        b, n_ref = img.shape[0], len(references)
        if img.shape[1] != h * w:
            raise ValueError(f"Z-Image Omni: {img.shape[1]} image tokens do not fit an {h} x {w} patch grid")
        segments = n_ref + 2 if n_ref else 1
        if len(captions) != b or any(len(c) != segments for c in captions):
            raise ValueError(f"Z-Image Omni: {n_ref} reference(s) need {segments} caption segment(s) per row "
                             f"(got {[len(c) for c in captions]} for {b} rows)")
        for k, r in enumerate(references):
            if r.dim() != 4 or r.shape[0] != b or r.shape[1] != self.config.in_channels or r.shape[2] % 2 or r.shape[3] % 2:
                raise ValueError(f"Z-Image Omni: reference latent {k} has shape {tuple(r.shape)}; expected "
                                 f"[{b}, {self.config.in_channels}, H, W] with even H and W")
        if n_ref and (siglip is None or len(siglip) != b or any(len(s) != n_ref for s in siglip)):
            raise ValueError(f"Z-Image Omni: {n_ref} reference(s) need {n_ref} SigLIP feature grids per row")

    def swappable_blocks(self) -> list[nn.Module]:
        """Run order: noise refiner, context refiner, SigLIP refiner, main layers."""
        return [*self.noise_refiner, *self.context_refiner, *self.siglip_refiner, *self.layers]


def pad_batch(rows: list[torch.Tensor]) -> torch.Tensor:
    """[L_i, ...] per row -> [B, max L_i, ...], zeros after each row's end."""
    out = rows[0].new_zeros(len(rows), max(r.shape[0] for r in rows), *rows[0].shape[1:])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def zimage_transformer(config: ZImageConfig) -> ZImage:
    """The class a config builds (the planner's presets): ZImageOmni with the SigLIP branch, else ZImage."""
    return ZImageOmni(config) if config.siglip_feat_dim is not None else ZImage(config)
