"""The generic parts of the VAEs (diffusers models, not reimplemented): the loader and the wrapper
of a plain diffusers AutoencoderKL. Each family's own VAE wrapper, with its released config and its
normalisation, lives in its folder (library/models/<family>/vae.py) and builds on these. Latent
packing (pure torch, no diffusers) is in library/models/latents.py.

A wrapper takes images [B, 3, H, W] in [-1, 1] and returns normalised latents [B, C, H/8, W/8]
(C = the VAE's latent channels) as float32, whatever dtype the VAE runs in (`dtype`, float32 by
default, bfloat16 allowed); `decode` is the inverse. `vae` is the diffusers model, `latent_channels`
its C. A pixel-space model has no VAE and no file: PixelVAE passes the pixels through (C = 3, H x W).

Encoding returns the mode (mean) of the latent distribution unless a `generator` is given, in which
case it samples from it. Why the choice is offered: BFL's and sd-scripts' AutoEncoders sample
(`DiagonalGaussian(sample=True)`), diffusers' img2img pipelines sample by default and its edit
pipelines take the mode ("argmax"). The mode is deterministic, which is what latent caching wants;
the difference is the VAE's posterior std, which is small for the released VAEs.

Loaders read safetensors only: a diffusers folder (the model folder itself or a repo with `vae/`),
a single diffusers-keyed file, and a single file in the layout its family releases (LDM / BFL keys,
e.g. `ae.safetensors`, or Wan / ComfyUI keys), converted with diffusers' own converters
(`convert_ldm_vae_checkpoint` for an AutoencoderKL; a wrapper's `convert_single_file` for the others).
A checkpoint that bundles the VAE with other models (ComfyUI's full checkpoint: its VAE under `vae.`, as
an "all in one" file; an LDM checkpoint's `first_stage_model.`) is read under the prefix its
header shows (bundled_vae_prefix), the other tensors never read.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import torch
from accelerate import init_empty_weights
from diffusers import AutoencoderKL
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

from library.io import CheckpointError, CheckpointReader, PrefixedReader, component_folder, load_streaming

# ----------------------------------------------------------------------------------------------
# File checks


VIDEO_VAE_CONV_IN = ("encoder.conv_in.weight", "encoder.conv1.weight")  # diffusers' name, Wan / ComfyUI's


def vae_markers(latent_channels: int, video: bool = False, image_channels: int = 3) -> dict[str | tuple[str, ...], tuple | None]:
    """How a VAE checkpoint shows in its header (library/io.py check_model_file): the encoder's last
    convolution gives the latents' mean and log-variance, 2 x latent_channels outputs, 3x3 kernels
    (3x3x3 for a video VAE), under the same key in diffusers and LDM/BFL files; a video VAE's Wan /
    ComfyUI single file names it `encoder.head.2`. A video VAE's first convolution takes
    `image_channels` (a layered family's RGBA VAE shares the rest: given to an RGB family it failed
    at the first encode)."""
    if video:
        return {("encoder.conv_out.weight", "encoder.head.2.weight"): (2 * latent_channels, None, 3, 3, 3),
                VIDEO_VAE_CONV_IN: (None, image_channels, 3, 3, 3)}
    return {"encoder.conv_out.weight": (2 * latent_channels, None, 3, 3)}


# The encoder's last convolution (vae_markers' key), which every VAE file has once: diffusers' / LDM's / Wan's names
VAE_ENCODER_OUT = ("encoder.conv_out.weight", "encoder.head.2.weight")


def bundled_vae_prefix(keys: list[str], path: str = "checkpoint") -> str:
    """'' for a VAE's own file; for a checkpoint bundling one (ComfyUI's full checkpoint: `vae.`, comfy/
    supported_models.py's vae_key_prefix; an LDM checkpoint's `first_stage_model.`) what its encoder's last
    convolution's key has before it. Two VAEs in one file are refused, naming both prefixes."""
    prefixes = sorted({k[: len(k) - len(e)] for k in keys for e in VAE_ENCODER_OUT if k == e or k.endswith("." + e)})
    if len(prefixes) > 1:
        raise CheckpointError(f"{path}: VAE encoders under {' and '.join(repr(p) for p in prefixes)}: one VAE per file")
    return prefixes[0] if prefixes else ""


def vae_reader(path: str) -> CheckpointReader | PrefixedReader:
    """The VAE's tensors of the file or folder at `path`, under their own names (bundled_vae_prefix dropped)."""
    reader = CheckpointReader(path)
    prefix = bundled_vae_prefix(reader.keys(), path)
    return PrefixedReader(reader, prefix) if prefix else reader


# ----------------------------------------------------------------------------------------------
# Tiled decoding

# A tile's side in pixels where the diffusers VAE tiles at one size (AutoencoderKL-style: its config's
# sample_size, 1024 for the released image VAEs, so nothing tiles at 1024 px). VAEs with their own tile
# sizes (tile_sample_min_height / _width: the video-style VAEs, 256 px) keep diffusers' defaults.
TILE_PIXELS = 512


@contextmanager
def decoding_in_tiles(vae: torch.nn.Module, on: bool = True, tile_pixels: int | None = None):
    """diffusers' tiled decode for the VAE calls inside the block (on: false, the block changes nothing),
    to enter around a decode only (diffusers tiles encodes too): tiles decoded one at a time and blended
    over their overlap, as ComfyUI's tiled VAE decode and ai-toolkit's low_vram do. The decode's peak
    memory falls to about a tile's (a 1024 px float32 decode of the released VAEs: 3.3 -> 1.1 GiB for the
    AutoencoderKL-style ones, 7.2 -> 0.9 for the video-style one); the image differs from the whole
    decode near the seams."""
    if not on:
        yield
        return
    names = ("use_tiling", "tile_sample_min_size", "tile_latent_min_size")
    saved = {k: getattr(vae, k) for k in names if hasattr(vae, k)}
    if isinstance(saved.get("tile_latent_min_size"), int):  # the latent tile scales by the VAE's downsampling
        down = vae.tile_sample_min_size // vae.tile_latent_min_size
        tile = tile_pixels or TILE_PIXELS
        vae.tile_sample_min_size, vae.tile_latent_min_size = tile, tile // down
    vae.use_tiling = True
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(vae, key, value)


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


def found_vae_config(path: str | None) -> dict | None:
    """The config found with the VAE at `path` (as load_vae reads it), or None: no path, nothing there yet, a
    folder without config.json (the file checks name that), a single file without config metadata."""
    if not path or not os.path.exists(path):
        return None
    try:
        return _resolve(path)[1]
    except CheckpointError:
        return None


def _build(cls, config: dict):
    """The diffusers model on `meta` (parameters only; buffers stay real), from a config dict."""
    with init_empty_weights():
        return cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})


def _is_single_file_layout(keys: list[str]) -> bool:
    """LDM / BFL keys (`down.0`, `mid.block_1`) or Wan / ComfyUI keys (`downsamples.0`, `middle.0`), not diffusers'."""
    return any(part in k for k in keys for part in (".down.0.", ".mid.block_1.", ".downsamples.0.", ".middle.0."))


def _load_weights(model, reader: CheckpointReader, dtype: torch.dtype, convert):
    """Load diffusers-keyed weights, or a single file's converted by `convert`, into `model`, cast to `dtype`."""
    if not _is_single_file_layout(reader.keys()):
        load_streaming(model, reader, rename=lambda k: k, dtype=dtype)
        return
    # A VAE is small (84 M parameters for a 16-channel AutoencoderKL): convert the whole state dict at once.
    # The built model's config names every constructor argument (the LDM converter reads its block types).
    converted = convert({k: reader.get(k) for k in reader.keys()}, dict(model.config))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing, unexpected = expected.keys() - converted.keys(), converted.keys() - expected.keys()
    if missing or unexpected:
        raise CheckpointError(
            f"{reader.path}: single-file VAE keys do not fit the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for key, value in converted.items():
        if tuple(value.shape) != expected[key]:
            raise CheckpointError(
                f"{reader.path}: '{key}' has shape {tuple(value.shape)}, the model expects {expected[key]}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in converted.items()}, strict=True, assign=True)


def load_vae(cls, path: str, default_config: dict, dtype: torch.dtype = torch.float32, config: dict | None = None,
             convert=convert_ldm_vae_checkpoint):
    """A diffusers VAE of class `cls` from `path` (see module docstring), in eval mode, in `dtype`.
    Config: `config` > the one found with the weights > `default_config` (the released VAE's).
    `convert(state_dict, config)`: a single file's keys -> `cls`'s diffusers keys."""
    weights, found = _resolve(path)
    config = {**default_config, **(found or {}), **(config or {})}
    model = _build(cls, config)
    _load_weights(model, vae_reader(weights), dtype, convert)
    return frozen_in(model, dtype)


def frozen_in(model, dtype: torch.dtype):
    """`model` in `dtype`, eval mode, no gradients."""
    # nn.Module.to: diffusers' ModelMixin.to warns about fp32-kept modules these VAEs do not have.
    return torch.nn.Module.to(model, dtype).eval().requires_grad_(False)


def vae_on_meta(wrapper: type, path: str | None = None):
    """`wrapper` (a VAE wrapper class) around its diffusers model built on meta, no weights read: the
    config found at `path` over the wrapper's default (the memory planner measures it)."""
    found = _resolve(path)[1] if path else None
    return wrapper(_build(wrapper.diffusers_class, {**wrapper.default_config, **(found or {})}))


# ----------------------------------------------------------------------------------------------
# A plain AutoencoderKL (the 16-channel VAE several families share, each with its own config)


class KLVAE:
    """diffusers AutoencoderKL. encode: images [B,3,H,W] in [-1,1] -> float32 latents
    [B,C,H/8,W/8] = (z - shift_factor) * scaling_factor (the config's; decode uses z = latents /
    scaling_factor + shift_factor, as diffusers' pipelines do); decode: the inverse, images float32
    clamped to [-1,1]. A family's subclass sets default_config to its released VAE's config (used
    when a single file comes without one); here it is AutoencoderKL's constructor defaults."""

    diffusers_class = AutoencoderKL
    default_config: dict = {}

    def __init__(self, vae: str | AutoencoderKL, dtype: torch.dtype = torch.float32, config: dict | None = None):
        if isinstance(vae, str):
            vae = load_vae(self.diffusers_class, vae, self.default_config, dtype, config)
        self.vae = frozen_in(vae, dtype)
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


# ----------------------------------------------------------------------------------------------
# No VAE: a pixel-space model denoises the image's pixels


class PixelVAE:
    """The wrapper of a family whose transformer takes the pixels themselves (its `vae_file` is False, its
    vae_downsample 1, latent_channels 3): encode gives the images [B, 3, H, W] in [-1, 1] as they are, float32
    (no scale, no shift: a family that wants its pixels or noise scaled says so in pack_target / model_noise);
    decode clamps them to [-1, 1], as the VAE wrappers' decodes do. Nothing is read and nothing is computed, so the
    same wrapper serves on meta (the memory planner: 0 bytes of weights) and on a device. `vae` is an empty module:
    callers move it, count its weights and tile its decode as any wrapper's."""

    latent_channels = 3

    def __init__(self, path: str | None = None, dtype: torch.dtype = torch.float32):
        if path is not None:  # a config's `ae` (refused before as a key the model never reads)
            raise CheckpointError(f"{path}: this model takes pixels and reads no VAE file; leave ae unset")
        self.vae = torch.nn.Module()
        self.dtype = dtype  # unused: the pixels stay float32

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return images.float()  # nothing to sample: the generator is unused

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.float().clamp(-1, 1)


# BFL/LDM <-> diffusers names for AutoencoderKL, the reverse of diffusers' converter (used to write
# LDM-format single files, e.g. the tiny test set's). Attention projections are 1x1 convs in LDM files.
_LDM_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def autoencoder_kl_to_ldm_state_dict(sd: dict[str, torch.Tensor], num_blocks: int) -> dict[str, torch.Tensor]:
    """diffusers AutoencoderKL state dict -> the LDM single-file key layout (BFL's `ae.safetensors`)."""
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


