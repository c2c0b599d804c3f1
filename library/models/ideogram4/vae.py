"""The Ideogram 4 VAE: FLUX.2's (diffusers AutoencoderKLFlux2, 32 latent channels, not reimplemented),
normalised as Ideogram4Pipeline normalises it, which is not FLUX.2's way.

The pipeline's decode (end of Ideogram4Pipeline.__call__): the packed tokens [B, N, 128] are
denormalised with the VAE's BatchNorm statistics per token feature, z * sqrt(running_var + eps) +
running_mean, then unpacked as view(B, gh, gw, 2, 2, C).permute(0, 5, 1, 3, 2, 4): a token's 128
features are ordered (ph, pw, c), channel innermost. FLUX.2 orders them (c, ph, pw) and applies the
statistics in that order, so the same file's statistics land on other features here. Our latents are
[B, 32, H/8, W/8] such that the shared pack_latents (c, ph, pw) followed by `to_ideogram_tokens`
gives the pipeline's normalised tokens bit for bit; the family permutes on the way in and out of the
transformer (a permutation: exact).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2

from library.models.flux2.vae import bfl_to_diffusers
from library.models.latents import pack_latents, unpack_latents
from library.models.vae import frozen_in, load_vae


def to_ideogram_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, N, 4C] features (c, ph, pw) (pack_latents) -> (ph, pw, c) (Ideogram4Pipeline)."""
    b, n, c4 = x.shape
    return x.view(b, n, c4 // 4, 2, 2).permute(0, 1, 3, 4, 2).reshape(b, n, c4)


def from_ideogram_tokens(x: torch.Tensor) -> torch.Tensor:
    """The inverse of to_ideogram_tokens."""
    b, n, c4 = x.shape
    return x.view(b, n, 2, 2, c4 // 4).permute(0, 1, 4, 2, 3).reshape(b, n, c4)


class Ideogram4VAE:
    """encode: images [B, 3, H, W] in [-1, 1] -> float32 latents [B, 32, H/8, W/8] (normalised as above);
    decode: the inverse, images float32 clamped to [-1, 1]."""

    diffusers_class = AutoencoderKLFlux2
    default_config: dict = {}  # AutoencoderKLFlux2's defaults are the released VAE's (a config.json beside it wins)
    convert_single_file = staticmethod(bfl_to_diffusers)  # FLUX.2's ae.safetensors

    def __init__(self, vae: str | AutoencoderKLFlux2, dtype: torch.dtype = torch.float32, config: dict | None = None):
        if isinstance(vae, str):
            vae = load_vae(self.diffusers_class, vae, self.default_config, dtype, config, self.convert_single_file)
        self.vae, self.dtype = frozen_in(vae, dtype), dtype
        self.latent_channels = int(vae.config.latent_channels)
        self.bn_mean = vae.bn.running_mean.float()  # [4C] float32, per token feature in (ph, pw, c) order
        self.bn_std = torch.sqrt(vae.bn.running_var.float() + vae.config.batch_norm_eps)

    def _tokens(self, z: torch.Tensor) -> torch.Tensor:
        return to_ideogram_tokens(pack_latents(z.float()))

    def _latents(self, tokens: torch.Tensor, lh: int, lw: int) -> torch.Tensor:
        return unpack_latents(from_ideogram_tokens(tokens), lh, lw)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        posterior = self.vae.encode(images.to(self.dtype)).latent_dist
        z = posterior.mode() if generator is None else posterior.sample(generator)
        t = self._tokens(z)
        return self._latents((t - self.bn_mean.to(t.device)) / self.bn_std.to(t.device), *z.shape[2:])

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        t = self._tokens(latents) * self.bn_std.to(latents.device) + self.bn_mean.to(latents.device)
        z = self._latents(t, *latents.shape[2:])  # float32, then the VAE's dtype
        return self.vae.decode(z.to(self.dtype)).sample.float().clamp(-1, 1)


def load_ideogram4_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> Ideogram4VAE:
    """From a diffusers folder (`vae/` or itself), its diffusion_pytorch_model.safetensors or FLUX.2's
    ae.safetensors."""
    return Ideogram4VAE(path, dtype, config)
