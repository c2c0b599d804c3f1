"""Qwen-Image-Edit versions and their condition-image sizes, as diffusers' edit pipelines set them.

Versions (the transformer is Qwen-Image's MMDiT; the condition images' latents are appended to the
target's tokens and `img_shapes` lists every image, target first):
- qwen-image-edit (QwenImageEditPipeline): one condition image, resized to ~1024x1024 area for both
  the VAE and the Qwen2.5-VL prompt encoder; the output size follows that image.
- qwen-image-edit-2509 / -2511 (QwenImageEditPlusPipeline): 1..n condition images, each at ~384x384
  area for the VL encoder (CONDITION_IMAGE_SIZE) and ~1024x1024 area for the VAE (VAE_IMAGE_SIZE);
  the output size follows the last image. 2511's transformer sets zero_cond_t (condition tokens are
  modulated with t = 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EDIT = "qwen-image-edit"
EDIT_2509 = "qwen-image-edit-2509"
EDIT_2511 = "qwen-image-edit-2511"
EDIT_VERSIONS = (EDIT, EDIT_2509, EDIT_2511)

# The transformer config.json flags each release sets (the rest equals Qwen-Image's config).
TRANSFORMER_FLAGS = {
    EDIT: {"zero_cond_t": False, "use_additional_t_cond": False},
    EDIT_2509: {"zero_cond_t": False, "use_additional_t_cond": False},
    EDIT_2511: {"zero_cond_t": True, "use_additional_t_cond": False},
}

CONDITION_IMAGE_AREA = 384 * 384  # Plus pipelines: the VL encoder's view of each condition image
VAE_IMAGE_AREA = 1024 * 1024  # the VAE's view (and the default output area)
SIZE_MULTIPLE = 32  # calculate_dimensions rounds both sides to a multiple of 32
LATENT_MULTIPLE = 16  # VAE factor 8 x patch 2: the output size is floored to a multiple of 16
VL_TOKEN_PIXELS = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2, one text token per 28x28 pixels


def check_version(version: str) -> str:
    if version not in EDIT_VERSIONS:
        raise ValueError(f"Qwen-Image-Edit version {version!r}: expected one of {', '.join(EDIT_VERSIONS)}")
    return version


def version_from_flags(config: dict) -> str:
    """The version a transformer config.json implies: zero_cond_t means 2511. Edit and 2509 share
    their config, so without zero_cond_t this says 2509 (the Plus prompt template); pass
    model_version = "qwen-image-edit" for the first release."""
    return EDIT_2511 if config.get("zero_cond_t") else EDIT_2509


def area_size(width: int, height: int, area: int) -> tuple[int, int]:
    """(width, height) with the aspect ratio of width x height and about `area` pixels, each a
    multiple of 32, as diffusers' calculate_dimensions(area, width / height) (Python round: halves
    go to even)."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return round(w / SIZE_MULTIPLE) * SIZE_MULTIPLE, round(h / SIZE_MULTIPLE) * SIZE_MULTIPLE


@dataclass(frozen=True)
class EditSizes:
    """Pixel sizes, each (width, height): the output image, and per condition image its size for
    the VL encoder and for the VAE."""

    output: tuple[int, int]
    encoder: list[tuple[int, int]]
    vae: list[tuple[int, int]]

    def img_shapes(self, vae_factor: int = 8, patch: int = 2) -> list[tuple[int, int, int]]:
        """One sample's transformer img_shapes: (1, h, w) in patches, target first."""
        sizes = [self.output, *self.vae]
        return [(1, h // vae_factor // patch, w // vae_factor // patch) for w, h in sizes]


def edit_sizes(version: str, images: list[tuple[int, int]], output: tuple[int, int] | None = None) -> EditSizes:
    """Sizes for condition images of pixel sizes `images` [(width, height), ...]; output (width,
    height) defaults to the pipeline's (~1024x1024 area at the ratio of the first image for Edit,
    of the last for 2509/2511), floored to a multiple of 16 as the pipelines do."""
    check_version(version)
    if not images:
        raise ValueError("edit_sizes: at least one condition image is needed")
    if version == EDIT:
        if len(images) != 1:
            raise ValueError(f"{EDIT} takes one condition image, got {len(images)}")
        size = area_size(*images[0], VAE_IMAGE_AREA)
        encoder, vae, ratio_source = [size], [size], images[0]
    else:
        encoder = [area_size(w, h, CONDITION_IMAGE_AREA) for w, h in images]
        vae = [area_size(w, h, VAE_IMAGE_AREA) for w, h in images]
        ratio_source = images[-1]
    out_w, out_h = output or area_size(*ratio_source, VAE_IMAGE_AREA)
    output = (out_w // LATENT_MULTIPLE * LATENT_MULTIPLE, out_h // LATENT_MULTIPLE * LATENT_MULTIPLE)
    return EditSizes(output, encoder, vae)


def resize_condition(image, size: tuple[int, int]):
    """A PIL image resized to size (width, height) as the pipelines' VaeImageProcessor.resize does
    (Lanczos, no reducing gap)."""
    from PIL import Image

    return image.convert("RGB").resize(size, resample=Image.LANCZOS)
