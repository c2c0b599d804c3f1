"""The HunyuanImage-2.1 VAE (diffusers AutoencoderKLHunyuanImage, not reimplemented): 32x spatial, 64 latent
channels, no 2x2 patchify after it (the transformer's patch is 1).

What it is (diffusers' models/autoencoders/autoencoder_kl_hunyuanimage.py; sd-scripts' library/hunyuan_image_vae.py
HunyuanVAE2D; ComfyUI's comfy/ldm/hunyuan_video/vae.py, picked in comfy/sd.py by decoder.conv_in's 64 inputs):
- Six levels of channels (128, 256, 512, 512, 1024, 1024), 2 resnets per encoder level, 3 per decoder level; the
  first five levels end in a 2x down/up-sampling (2^5 = 32) that is a 3x3 conv plus a pixel (un)shuffle with a
  channel-averaging / channel-repeating shortcut; one single-head attention in each mid block (1024 channels).
- The encoder's head adds a shortcut (the 1024 channels averaged in groups of 8 -> 128 = 2 x 64, mean and
  log-variance); the decoder's conv_in adds the 64 latents repeated 16x. No quant convs.

Released config (the diffusers repo hunyuanvideo-community/HunyuanImage-2.1-Diffusers vae/config.json, as written
by diffusers' scripts/convert_hunyuan_image_to_diffusers.py; the same sizes hard-coded in sd-scripts' HunyuanVAE2D
and ComfyUI's comfy/sd.py): HUNYUAN_IMAGE_VAE_CONFIG below. sample_size 384 is only diffusers' tile size.

Normalisation (diffusers' HunyuanImagePipeline.__call__: `latents / vae.config.scaling_factor` before decode; sd-
scripts' hunyuan_image_train_network.py: `latents * LATENT_SCALING_FACTOR` after encode, `x / scaling_factor` before
decode; ComfyUI's latent_formats.HunyuanImage21: scale_factor 0.75289, no shift): latents = z * 0.75289, scale
only, no shift, no per-channel statistics; decode z = latents / 0.75289. sd-scripts samples the posterior; we take
its mode unless a generator is given (library/models/vae.py).

Files: a diffusers folder (`vae/` or itself), a diffusers-keyed file, or the single file people download
(Comfy-Org/HunyuanImage_2.1_ComfyUI split_files/vae/hunyuan_image_2.1_vae_fp16.safetensors, Tencent's original
names, which sd-scripts' HunyuanVAE2D loads strictly): `encoder.down.{level}.block.{j}`, `.downsample.conv`,
`encoder.mid.block_1 / attn_1 (q, k, v, proj_out) / block_2`, `decoder.up.{level}.block.{j}`, `.upsample.conv`
(up.0 is the level right after the mid block: not reversed as in LDM files). diffusers numbers the blocks of all
levels in one list (`down_blocks.{n}`, `up_blocks.{n}`, samplers included): single_file_blocks is the table.

Tiling: diffusers' tiled decode works (library/models/vae.py decoding_in_tiles: 512 px tiles, 16 latents); its
tiled encode does not (tiled_encode unpacks a 5-D shape from the 4-D images), so encode never tiles here.
"""

from __future__ import annotations

import math

import torch
from diffusers import AutoencoderKLHunyuanImage

from library.io import CheckpointError, check_model_file, component_folder
from library.models.vae import frozen_in, load_vae, vae_markers

LATENT_CHANNELS = 64
SPATIAL_COMPRESSION = 32  # the release's: the family's vae_downsample unless the VAE's config says otherwise

# The released VAE's config (AutoencoderKLHunyuanImage's constructor has no defaults: a single file without a
# config.json beside it, or config metadata, gets this one).
HUNYUAN_IMAGE_VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": LATENT_CHANNELS,
    "block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "layers_per_block": 2,
    "spatial_compression_ratio": SPATIAL_COMPRESSION,
    "sample_size": 384,
    "scaling_factor": 0.75289,
    "downsample_match_channel": True,
    "upsample_match_channel": True,
}

WHAT = "a HunyuanImage-2.1 VAE (64 latent channels, 32x)"
# The encoder's last conv gives 2 x 64 outputs with 3x3 kernels (a 16- or 32-channel VAE's give 32 or 64, a video
# VAE's kernels are 3x3x3), its first takes RGB (a 64-channel RGBA VAE's takes 4), the decoder's first takes the 64
# latents (ComfyUI's test for this VAE). The same keys in both layouts.
HUNYUAN_IMAGE_VAE_MARKERS = {
    **vae_markers(LATENT_CHANNELS),
    "encoder.conv_in.weight": (None, 3, 3, 3),
    "decoder.conv_in.weight": (None, LATENT_CHANNELS, 3, 3),
}


# ----------------------------------------------------------------------------------------------
# The single file's names (Tencent's, sd-scripts', ComfyUI's) <-> diffusers'

# Leaf modules named differently (resnets' 1x1 shortcut, the attention's projections); the rest keep their names.
_LEAF_TO_ORIGINAL = {"conv_shortcut": "nin_shortcut", "to_q": "q", "to_k": "k", "to_v": "v", "proj": "proj_out"}
_LEAF_TO_DIFFUSERS = {v: k for k, v in _LEAF_TO_ORIGINAL.items()}


def _has_sampler(level: int, config: dict) -> bool:
    """Whether `level` ends in a 2x down/up-sampling: the first log2(ratio) levels but never the last (diffusers'
    rule; sd-scripts asserts the last has none)."""
    return level < math.log2(config["spatial_compression_ratio"]) and level != len(config["block_out_channels"]) - 1


def single_file_blocks(config: dict) -> dict[str, str]:
    """diffusers block -> the single file's block for the VAE of `config` (every block once: a bijection). A
    tensor's key is `block.leaf.param`: `encoder.down_blocks.3.conv1.weight` <-> `encoder.down.1.block.0.conv1.
    weight` (2 resnets and a downsampling per level); top-level convs and norms sit in the block `encoder` /
    `decoder`."""
    blocks = {"encoder": "encoder", "decoder": "decoder"}
    for side in ("encoder", "decoder"):
        blocks[f"{side}.mid_block.resnets.0"] = f"{side}.mid.block_1"
        blocks[f"{side}.mid_block.attentions.0"] = f"{side}.mid.attn_1"
        blocks[f"{side}.mid_block.resnets.1"] = f"{side}.mid.block_2"
    # The encoder has layers_per_block resnets per level, the decoder one more; levels in the order data runs.
    for side, stage, sampler, resnets in (("encoder", "down", "downsample", config["layers_per_block"]),
                                          ("decoder", "up", "upsample", config["layers_per_block"] + 1)):
        n = 0
        for level in range(len(config["block_out_channels"])):
            for j in range(resnets):
                blocks[f"{side}.{stage}_blocks.{n}"] = f"{side}.{stage}.{level}.block.{j}"
                n += 1
            if _has_sampler(level, config):
                blocks[f"{side}.{stage}_blocks.{n}"] = f"{side}.{stage}.{level}.{sampler}"
                n += 1
    return blocks


def _renamed(key: str, blocks: dict[str, str], leaves: dict[str, str]) -> str | None:
    """`key` (block.leaf.param) with its block and leaf renamed; None where its block is not in `blocks`."""
    block, leaf, param = key.rsplit(".", 2)
    return f"{blocks[block]}.{leaves.get(leaf, leaf)}.{param}" if block in blocks else None


def single_file_to_diffusers(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The single file's tensors under diffusers' names (`config`: the model's). A key outside the table keeps its
    name, so that load_vae names it as unexpected."""
    blocks = {v: k for k, v in single_file_blocks(config).items()}
    out = {}
    for key, value in sd.items():
        new = _renamed(key, blocks, _LEAF_TO_DIFFUSERS) if key.count(".") >= 2 else None
        out[new or key] = value
    return out


def diffusers_to_single_file(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKLHunyuanImage state dict under the single file's names (the tiny writer's)."""
    blocks = single_file_blocks(config)
    out = {}
    for key, value in sd.items():
        new = _renamed(key, blocks, _LEAF_TO_ORIGINAL)
        if new is None:
            raise ValueError(f"diffusers_to_single_file: '{key}' is in no block of the table")
        out[new] = value
    return out


# ----------------------------------------------------------------------------------------------
# The wrapper


class HunyuanImageVAE:
    """HunyuanImage-2.1 VAE (diffusers AutoencoderKLHunyuanImage). encode: images [B, 3, H, W] in [-1, 1] (H, W
    multiples of 32) -> float32 latents [B, 64, H/32, W/32] = z * scaling_factor (0.75289 released); decode: the
    inverse, images float32 clamped to [-1, 1]."""

    diffusers_class = AutoencoderKLHunyuanImage
    default_config = HUNYUAN_IMAGE_VAE_CONFIG
    convert_single_file = staticmethod(single_file_to_diffusers)

    def __init__(self, vae: str | AutoencoderKLHunyuanImage, dtype: torch.dtype = torch.float32,
                 config: dict | None = None):
        if isinstance(vae, str):
            check_model_file(component_folder(vae, "vae"), "ae", WHAT, HUNYUAN_IMAGE_VAE_MARKERS)
            vae = load_vae(self.diffusers_class, vae, self.default_config, dtype, config, self.convert_single_file)
        self.vae = frozen_in(vae, dtype)
        self.dtype = dtype
        self.latent_channels = int(vae.config.latent_channels)
        self.downsample = int(vae.config.spatial_compression_ratio)
        if vae.config.scaling_factor is None:
            raise CheckpointError(f"{WHAT}: its config has no scaling_factor (the released one is 0.75289)")
        self.scaling_factor = float(vae.config.scaling_factor)

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        height, width = images.shape[-2:]
        if height % self.downsample or width % self.downsample:
            raise ValueError(f"HunyuanImageVAE.encode: images of {height}x{width} px; height and width must be "
                             f"multiples of {self.downsample} (its 2x pixel-unshuffles)")
        posterior = self.vae.encode(images.to(self.dtype)).latent_dist
        z = posterior.mode() if generator is None else posterior.sample(generator)
        return z.float() * self.scaling_factor  # float32

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.float() / self.scaling_factor  # float32, then the VAE's dtype
        images = self.vae.decode(z.to(self.dtype)).sample
        return images.float().clamp(-1, 1)  # (diffusers' decode does not clamp; its image processor does)


def hunyuan_image_vae_downsample(path: str | None) -> int:
    """The VAE's spatial_compression_ratio as its config says (diffusers' AutoencoderKLHunyuanImage takes any power of
    2: the learned tiny base's is 16, learned.py), else the release's 32."""
    from library.models.vae import found_vae_config

    return int((found_vae_config(path) or {}).get("spatial_compression_ratio", SPATIAL_COMPRESSION))


def hunyuan_image_vae_file(path: str | None):
    """What the `ae` file of the family must be (DiffusionFamily.model_files)."""
    from library.models.family import ModelFile

    return ModelFile("ae", path, WHAT, "vae", HUNYUAN_IMAGE_VAE_MARKERS)


def load_hunyuan_image_vae(path: str, dtype: torch.dtype = torch.float32,
                           config: dict | None = None) -> HunyuanImageVAE:
    """HunyuanImageVAE from a diffusers folder (`vae/` or itself), its diffusion_pytorch_model.safetensors or the
    ComfyUI / sd-scripts single file (hunyuan_image_2.1_vae_fp16.safetensors)."""
    return HunyuanImageVAE(path, dtype, config)
