"""Latent packing: 2x2 latent patches (or p x p ones: a pixel-space model's 32 px patches) <-> transformer tokens
(pack_latents / unpack_latents) and <-> channels (patchify / unpatchify), identical to diffusers' pipelines'
_pack_latents / _unpack_latents and _patchify_latents; latent pixels <-> tokens (to_tokens / from_tokens) for a
transformer of patch 1, whose VAE downsamples 16x or 32x itself. Pure torch: the LoRA tools, the planner and the
families import these without loading diffusers (library/models/vae.py, the VAE loaders, does).
"""

from __future__ import annotations

import torch


def pack_latents(z: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)*(W/p), p*p*C] for p x p patches (p = `patch`, 2: a 2x2 latent patch; a pixel-space
    model's 32: 32 px patches of the pixels); feature order (c, ph, pw) as in diffusers/BFL."""
    b, c, h, w = z.shape
    p = patch
    if h % p or w % p:
        raise ValueError(f"pack_latents: latent height and width must be multiples of {p}, got {h}x{w}")
    z = z.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // p) * (w // p), c * p * p)


def unpack_latents(x: torch.Tensor, h: int, w: int, patch: int = 2) -> torch.Tensor:
    """[B, (h/p)*(w/p), p*p*C] -> [B, C, h, w]; h, w are the latent (not pixel) height and width, p = `patch`."""
    b, n, cpp = x.shape
    p = patch
    if n != (h // p) * (w // p) or cpp % (p * p):
        raise ValueError(f"unpack_latents: {n} tokens of width {cpp} do not fit a {h}x{w} latent in {p}x{p} patches")
    x = x.view(b, h // p, w // p, cpp // (p * p), p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, cpp // (p * p), h, w)


def patchify(z: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2], channel order (c, ph, pw), as diffusers' _patchify_latents."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(p: torch.Tensor) -> torch.Tensor:
    """[B, 4C, h, w] -> [B, C, 2h, 2w], the inverse of patchify."""
    b, c4, h, w = p.shape
    return p.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


def to_tokens(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H*W, C], one token per latent pixel, row-major (a patch-1 pipeline's _pack_latents)."""
    return latents.flatten(2).transpose(1, 2)


def from_tokens(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of to_tokens: [B, h*w, C] -> [B, C, h, w]."""
    if tokens.shape[1] != h * w:
        raise ValueError(f"from_tokens: {tokens.shape[1]} tokens do not fit a {h}x{w} latent")
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)
