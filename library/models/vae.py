"""VAEs of FLUX.1, FLUX.2 and Qwen-Image (diffusers models, not reimplemented) and latent packing.

The wrappers take images [B, 3, H, W] in [-1, 1] and return normalised latents [B, C, H/8, W/8]
(C = 16 for FLUX.1 and Qwen-Image, 32 for FLUX.2) as float32, whatever dtype the VAE runs in
(`dtype`, float32 by default, bfloat16 allowed).

Encoding returns the mode (mean) of the latent distribution unless a `generator` is given, in which
case it samples from it. Why the choice is offered: BFL's and sd-scripts' FLUX AutoEncoder samples
(`DiagonalGaussian(sample=True)`), diffusers' img2img pipelines sample by default and its Qwen-Image
edit pipelines take the mode ("argmax"). The mode is deterministic, which is what latent caching
wants; the difference is the VAE's posterior std, which is small for both models.

Normalisation (checked against diffusers' pipelines):
- FLUX: latents = (z - shift_factor) * scaling_factor (0.1159, 0.3611 for the released VAE);
  decode uses z = latents / scaling_factor + shift_factor (pipeline_flux.py).
- Qwen-Image: latents = (z - latents_mean) / latents_std per channel; decode z = latents * std + mean
  (pipeline_qwenimage*.py). Its VAE is a video VAE: images get a time axis of 1 on the way in and
  lose it on the way out, so both wrappers speak 4-D tensors.
- FLUX.2: the pipeline patchifies z (2x2 -> 128 channels) and normalises each of those channels
  with the VAE's BatchNorm statistics, (p - running_mean) / sqrt(running_var + eps); decode is the
  inverse, then unpatchify (Flux2Pipeline._encode_vae_image and the end of __call__). Our latents
  are that normalised tensor unpatchified back to [B, 32, H/8, W/8]: patchify is a permutation, so
  pack_latents of them is bit for bit the pipeline's packed tokens, and the shared packing, masks
  and latent caches keep FLUX.1's shapes.

Loaders read safetensors only: a diffusers folder (the model folder itself or a repo with `vae/`),
a single diffusers-keyed file, and for FLUX.1 also BFL's single-file `ae.safetensors` (LDM key
names, converted with diffusers' own `convert_ldm_vae_checkpoint`). FLUX.2's VAE loads from a
diffusers folder or a diffusers-keyed file (diffusers has no single-file converter for it).
"""

from __future__ import annotations

import json
import os

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

from library.io import CheckpointError, CheckpointReader, component_folder, load_streaming

# ----------------------------------------------------------------------------------------------
# Latent packing (2x2 patches -> tokens), identical to FluxPipeline._pack_latents/_unpack_latents


def pack_latents(z: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)*(W/2), 4C]; feature order (c, ph, pw) as in diffusers/BFL."""
    b, c, h, w = z.shape
    if h % 2 or w % 2:
        raise ValueError(f"pack_latents: latent height and width must be even, got {h}x{w}")
    z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, (h/2)*(w/2), 4C] -> [B, C, h, w]; h, w are the latent (not pixel) height and width."""
    b, n, c4 = x.shape
    if n != (h // 2) * (w // 2) or c4 % 4:
        raise ValueError(f"unpack_latents: {n} tokens of width {c4} do not fit a {h}x{w} latent")
    x = x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h, w)


def patchify(z: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, 4C, H/2, W/2], channel order (c, ph, pw): Flux2Pipeline._patchify_latents."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(p: torch.Tensor) -> torch.Tensor:
    """[B, 4C, h, w] -> [B, C, 2h, 2w], the inverse of patchify."""
    b, c4, h, w = p.shape
    return p.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, h * 2, w * 2)


# ----------------------------------------------------------------------------------------------
# Configs of the released VAEs (used when a single file comes without a config.json)

FLUX_VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}

# AutoencoderKLQwenImage's and AutoencoderKLFlux2's constructor defaults follow the released VAEs (a
# config.json beside the weights, as in the released repositories, wins).
FLUX2_VAE_CONFIG: dict = {}
QWEN_IMAGE_VAE_CONFIG: dict = {}


def vae_markers(latent_channels: int, video: bool = False) -> dict[str, tuple | None]:
    """How a VAE checkpoint shows in its header (library/io.py check_model_file): the encoder's last
    convolution gives the latents' mean and log-variance, 2 x latent_channels outputs, 3x3 kernels
    (3x3x3 for a video VAE), under the same key in diffusers and LDM/BFL files."""
    return {"encoder.conv_out.weight": (2 * latent_channels, None, 3, 3) + ((3,) if video else ())}


# ----------------------------------------------------------------------------------------------
# Loading


def _resolve(path: str) -> tuple[str, dict | None]:
    """(weights path, config dict or None) for a folder, a repo folder with `vae/`, or a file.
    A single file's config: config.json beside it, else the `diffusers_config` JSON in its
    safetensors metadata (written by tools/make_tiny_models.py), else None (built-in)."""
    path = component_folder(path, "vae")
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config_file = os.path.join(folder, "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            return path, json.load(f)
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: VAE folder has no config.json")
    metadata = CheckpointReader(path).metadata
    return path, json.loads(metadata["diffusers_config"]) if "diffusers_config" in metadata else None


def _build(cls, config: dict):
    """The diffusers model on `meta` (parameters only; buffers stay real), from a config dict."""
    with init_empty_weights():
        return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def _is_ldm_layout(keys: list[str]) -> bool:
    return any(".down.0." in k or ".mid.block_1." in k for k in keys)


def _load_weights(model, reader: CheckpointReader, dtype: torch.dtype, config: dict):
    """Load diffusers-keyed or (FLUX) LDM/BFL-keyed weights into `model`, cast to `dtype`."""
    if not _is_ldm_layout(reader.keys()):
        load_streaming(model, reader, rename=lambda k: k, dtype=dtype)
        return
    # A VAE is small (84 M parameters for FLUX): convert the whole state dict at once.
    converted = convert_ldm_vae_checkpoint({k: reader.get(k) for k in reader.keys()}, config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = expected.keys() - converted.keys(), converted.keys() - expected.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"{reader.path}: LDM VAE keys do not fit the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for key, value in converted.items():
        if tuple(value.shape) != expected[key]:
            raise CheckpointError(
                f"{reader.path}: '{key}' has shape {tuple(value.shape)}, the model expects {expected[key]}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in converted.items()}, strict=True, assign=True)


def load_vae(cls, path: str, default_config: dict, dtype: torch.dtype = torch.float32, config: dict | None = None):
    """A diffusers VAE of class `cls` from `path` (see module docstring), in eval mode, in `dtype`."""
    weights, found = _resolve(path)
    config = {**default_config, **(found or {}), **(config or {})}
    model = _build(cls, config)
    _load_weights(model, CheckpointReader(weights), dtype, config)
    return _cast(model, dtype)


def _cast(model, dtype: torch.dtype):
    # nn.Module.to: diffusers' ModelMixin.to warns about fp32-kept modules these VAEs do not have.
    return torch.nn.Module.to(model, dtype).eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# FLUX.1


class FluxVAE:
    """FLUX.1 VAE (diffusers AutoencoderKL). encode: images [B,3,H,W] in [-1,1] -> float32 latents
    [B,16,H/8,W/8] = (z - shift) * scale; decode: the inverse, images float32 clamped to [-1,1]."""

    def __init__(self, vae: str | AutoencoderKL, dtype: torch.dtype = torch.float32, config: dict | None = None):
        if isinstance(vae, str):
            vae = load_vae(AutoencoderKL, vae, FLUX_VAE_CONFIG, dtype, config)
        self.vae = _cast(vae, dtype)
        self.dtype = dtype
        self.shift_factor = float(vae.config.shift_factor or 0.0)
        self.scaling_factor = float(vae.config.scaling_factor)
        self.latent_channels = int(vae.config.latent_channels)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        posterior = self.vae.encode(images.to(self.dtype)).latent_dist
        z = posterior.mode() if generator is None else posterior.sample(generator)
        return (z.float() - self.shift_factor) * self.scaling_factor  # float32

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.float() / self.scaling_factor + self.shift_factor  # float32, then VAE dtype
        images = self.vae.decode(z.to(self.dtype)).sample
        return images.float().clamp(-1, 1)


def load_flux_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> FluxVAE:
    """FluxVAE from BFL `ae.safetensors`, a diffusers folder (`vae/` or itself) or a diffusers file.
    config: AutoencoderKL config dict overriding the one found (default: the released FLUX VAE)."""
    return FluxVAE(path, dtype, config)


# BFL/LDM <-> diffusers names for AutoencoderKL, the reverse of diffusers' converter (used to write
# BFL-format files, e.g. the tiny test set). Attention projections are 1x1 convs in LDM files.
_LDM_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def flux_vae_to_ldm_state_dict(sd: dict[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKL state dict -> BFL `ae.safetensors` key layout."""
    out = {}
    for key, value in sd.items():
        new = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        new = new.replace(".down_blocks.", ".down.").replace(".resnets.", ".block.")
        new = new.replace(".downsamplers.0.", ".downsample.").replace(".upsamplers.0.", ".upsample.")
        if ".up_blocks." in new:
            i = int(new.split(".up_blocks.")[1].split(".")[0])
            new = new.replace(f".up_blocks.{i}.", f".up.{num_blocks - 1 - i}.")
        for k in (0, 1):
            new = new.replace(f"mid_block.block.{k}.", f"mid.block_{k + 1}.")
        if "mid_block.attentions.0." in new:
            new = new.replace("mid_block.attentions.0.", "mid.attn_1.")
            for a, b in _LDM_ATTN.items():
                new = new.replace(f"attn_1.{a}.", f"attn_1.{b}.")
            if value.dim() == 2:
                value = value[:, :, None, None]
        out[new] = value
    return out


# ----------------------------------------------------------------------------------------------
# FLUX.2


class Flux2VAE:
    """FLUX.2 VAE (diffusers AutoencoderKLFlux2). encode: images [B,3,H,W] in [-1,1] -> float32
    latents [B,32,H/8,W/8], normalised in patch space with the VAE's BatchNorm statistics (module
    docstring); decode: the inverse, images float32 clamped to [-1,1]."""

    def __init__(self, vae: str | AutoencoderKLFlux2, dtype: torch.dtype = torch.float32, config: dict | None = None):
        if isinstance(vae, str):
            vae = load_vae(AutoencoderKLFlux2, vae, FLUX2_VAE_CONFIG, dtype, config)
        if tuple(vae.config.patch_size) != (2, 2):
            raise ValueError(f"Flux2VAE: patch_size {tuple(vae.config.patch_size)} is not FLUX.2's (2, 2)")
        self.vae = _cast(vae, dtype)
        self.dtype = dtype
        self.latent_channels = int(vae.config.latent_channels)
        # float32 [1, 4C, 1, 1] per patch channel, as the VAE holds them (float32 for a float32 VAE).
        self.bn_mean = vae.bn.running_mean.float().view(1, -1, 1, 1)
        self.bn_std = torch.sqrt(vae.bn.running_var.float().view(1, -1, 1, 1) + vae.config.batch_norm_eps)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        posterior = self.vae.encode(images.to(self.dtype)).latent_dist
        z = posterior.mode() if generator is None else posterior.sample(generator)
        p = patchify(z.float())
        return unpatchify((p - self.bn_mean.to(p.device)) / self.bn_std.to(p.device))  # float32

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        p = patchify(latents.float())
        z = unpatchify(p * self.bn_std.to(p.device) + self.bn_mean.to(p.device))  # float32, then VAE dtype
        images = self.vae.decode(z.to(self.dtype)).sample
        return images.float().clamp(-1, 1)


def load_flux2_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> Flux2VAE:
    """Flux2VAE from a diffusers folder (`vae/` or itself) or its diffusion_pytorch_model.safetensors."""
    return Flux2VAE(path, dtype, config)


# ----------------------------------------------------------------------------------------------
# Qwen-Image


class QwenImageVAE:
    """Qwen-Image VAE (diffusers AutoencoderKLQwenImage). encode: images [B,3,H,W] in [-1,1] ->
    float32 latents [B,16,H/8,W/8] = (z - mean) / std per channel; decode: the inverse, images
    float32 in [-1,1] (the diffusers decoder clamps)."""

    def __init__(self, vae: str | AutoencoderKLQwenImage, dtype: torch.dtype = torch.float32, config: dict | None = None):
        if isinstance(vae, str):
            vae = load_vae(AutoencoderKLQwenImage, vae, QWEN_IMAGE_VAE_CONFIG, dtype, config)
        self.vae = _cast(vae, dtype)
        self.dtype = dtype
        self.latent_channels = int(vae.config.z_dim)
        # float32 [1, C, 1, 1]: per-channel statistics broadcast over the image.
        self.latents_mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.latents_std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(1, -1, 1, 1)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        posterior = self.vae.encode(images.to(self.dtype)[:, :, None]).latent_dist  # [B, 3, T=1, H, W]
        z = posterior.mode() if generator is None else posterior.sample(generator)
        z = z[:, :, 0].float()
        return (z - self.latents_mean.to(z.device)) / self.latents_std.to(z.device)  # float32

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() == 5:  # [B, C, 1, H, W] as diffusers' pipeline unpacks them
            latents = latents[:, :, 0]
        z = latents.float() * self.latents_std.to(latents.device) + self.latents_mean.to(latents.device)
        images = self.vae.decode(z.to(self.dtype)[:, :, None]).sample  # [B, 3, 1, H, W]
        return images[:, :, 0].float()


def load_qwen_image_vae(path: str, dtype: torch.dtype = torch.float32, config: dict | None = None) -> QwenImageVAE:
    """QwenImageVAE from a diffusers folder (`vae/` or itself) or its diffusion_pytorch_model.safetensors."""
    return QwenImageVAE(path, dtype, config)
