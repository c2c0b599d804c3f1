"""How diffusers' FLUX.2 pipelines (Flux2Pipeline, Flux2KleinPipeline) and ZImageOmniPipeline, which shares
their Flux2ImageProcessor, prepare a condition (reference) image for the VAE:

    over 1024 x 1024 pixels: resized (Lanczos) to `area` pixels, int() of each side (_resize_to_target_area;
                             area: 1024 x 1024 for FLUX.2, the output's for Z-Image Omni); else its own size;
    then:                    centre-cropped, never resized, to each side floored to a multiple of 16.

A reference thus keeps its own size and aspect ratio (up to ~1 MP), whatever the target's.
"""

from __future__ import annotations

import math

KEEP_AREA = 1024 * 1024  # a condition image of at most this many pixels keeps its size
SIDE_MULTIPLE = 16  # sides floored to vae_scale_factor * 2 (a 2x2 patch of 8x latents)


def resized_size(size: tuple[int, int], area: int = KEEP_AREA) -> tuple[int, int]:
    """(w, h) a condition image of `size` is resized to before the crop: over KEEP_AREA pixels scaled to `area`
    pixels, int() of each side (Flux2ImageProcessor._resize_to_target_area); else its own size."""
    if size[0] * size[1] <= KEEP_AREA:
        return size
    scale = math.sqrt(area / (size[0] * size[1]))
    return int(size[0] * scale), int(size[1] * scale)


def condition_size(size: tuple[int, int], area: int = KEEP_AREA) -> tuple[int, int]:
    """(w, h) the VAE encodes a condition image of `size` at: resized_size's sides floored to 16."""
    return tuple(max(SIDE_MULTIPLE, side // SIDE_MULTIPLE * SIDE_MULTIPLE) for side in resized_size(size, area))
