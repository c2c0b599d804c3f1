"""Loss masks and regularization images (sd-scripts' masked loss and DreamBooth regularization).

Masks: white trains, black is ignored, grey weighs in between. `alpha_mask = true` takes the
image's alpha channel (an image without one counts as all white, with one warning per subset, as
sd-scripts treats it); `mask_dir = "..."` holds one grayscale image per training image with the
same file stem and size (sd-scripts' conditioning_data_dir with --masked_loss; a mask in colour is
refused: sd-scripts reads its R channel, this trainer its grey, musubi-tuner has no masks; so is one with
transparent pixels, whose alpha the grey drops). The mask
goes through the image's own fit_to_bucket (resize, crop, mirror), is area-averaged to the latent grid
(8x8 pixels per latent element), cached with the latents (the latent cache hash covers the mask
file), and multiplies the per-element flow-matching loss before its mean, as sd-scripts'
apply_masked_loss does: masked elements count as zeros in the mean, so a half-masked image
contributes half its loss (the learning rate means the same with and without masks).

Regularization: `is_reg = true` subsets hold prior-preservation images. Their loss is multiplied
by the training key `prior_loss_weight`; within each [[datasets]] their repeats are balanced to
the training images' count exactly as sd-scripts' DreamBoothDataset does (balance_reg_repeats).
Validation never holds them out.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from library.data.dataset_config import SubsetSpec
from library.data.images import WIDE_GREY_MODES, fit_to_bucket, images_by_stem, to_8_bit

LATENT_DOWNSAMPLE = 8  # VAE pixels per latent element, per side
# A mask's R, G and B may differ by this much (of 255) and still count as grey: a grey mask saved as
# an RGB JPEG comes back with a few levels of colour noise.
GREY_TOLERANCE = 8


@functools.lru_cache(maxsize=64)
def _listed_mask_files(folder: str, changed_ns: int) -> dict[str, str]:
    return images_by_stem(folder, os.listdir(folder), "masks")


def _mask_files(folder: str) -> dict[str, str]:
    """File stem -> file name of the images in a mask folder (two of one stem: an error), listed once per
    state of the folder: the web UI's checks run in one long-lived process, and a mask added between two
    checks must be seen (a file added, removed or renamed changes the folder's mtime)."""
    return _listed_mask_files(folder, os.stat(folder).st_mtime_ns)


def find_mask(image_path: str, subset: SubsetSpec, size: tuple[int, int]) -> str | None:
    """The mask file of an image in a subset with mask_dir (None without): same stem, same size."""
    if not subset.mask_dir:
        return None
    stem = os.path.splitext(os.path.basename(image_path))[0]
    name = _mask_files(subset.mask_dir).get(stem)
    if name is None:
        raise ValueError(f"{image_path}: no mask '{stem}.png' (or another image type) in mask_dir {subset.mask_dir}")
    path = os.path.join(subset.mask_dir, name)
    try:
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img)
            mask_size, colour, see_through = img.size, _coloured_pixel(img), _transparent_pixel(img)
    except Exception as e:  # PIL raises many kinds for broken files
        raise ValueError(f"{path}: cannot be read as a mask image ({type(e).__name__}: {e})") from None
    if see_through:  # its grey is read, its alpha dropped: a mask painted as transparency read all black
        raise ValueError(f"{path}: mask has transparent pixels (alpha {see_through[1]} at pixel {see_through[0]}); "
                         f"a mask is read by its grey alone, white trains and black is ignored: flatten it to an "
                         f"opaque grayscale image (or set alpha_mask = true to mask by the training image's alpha)")
    if colour:
        raise ValueError(f"{path}: mask is in colour (R, G, B = {colour[1]} at pixel {colour[0]}); expected a grayscale "
                         f"mask, white trains and black is ignored (sd-scripts would weigh a colour mask by its R "
                         f"channel, this trainer by its grey): save it as grayscale")
    if mask_size != size:
        raise ValueError(f"{path}: mask is {mask_size[0]}x{mask_size[1]}, its image {image_path} is {size[0]}x{size[1]}")
    return path


def _coloured_pixel(img: Image.Image) -> tuple[tuple[int, int], tuple[int, ...]] | None:
    """((x, y), its RGB) of the first pixel whose channels differ by more than GREY_TOLERANCE, or
    None for a grey image (any mode without colour, or RGB with R = G = B up to JPEG's noise)."""
    if img.getbands() in (("L",), ("L", "A"), ("1",), ("I",), ("F",)) or img.mode in WIDE_GREY_MODES:
        return None
    rgb = np.asarray(img.convert("RGB"), dtype=np.int16)
    spread = rgb.max(axis=2) - rgb.min(axis=2)
    if int(spread.max()) <= GREY_TOLERANCE:
        return None
    y, x = (int(v) for v in np.argwhere(spread > GREY_TOLERANCE)[0])
    return (x, y), tuple(int(v) for v in rgb[y, x])


def _transparent_pixel(img: Image.Image) -> tuple[tuple[int, int], int] | None:
    """((x, y), its alpha) of the first pixel not fully opaque, or None (no alpha, or all of it 255)."""
    if "A" not in img.getbands() and "transparency" not in img.info:
        return None
    alpha = np.asarray(img.convert("RGBA").getchannel("A"))
    if int(alpha.min()) == 255:
        return None
    y, x = (int(v) for v in np.argwhere(alpha < 255)[0])
    return (x, y), int(alpha[y, x])


def has_alpha(image_path: str) -> bool:
    with Image.open(image_path) as img:
        return "A" in img.getbands() or "transparency" in img.info


def warn_missing_alpha(paths: list[str], subset: SubsetSpec) -> None:
    without = [p for p in paths if not has_alpha(p)]
    if without:
        warnings.warn(f"{subset.image_dir}: alpha_mask is on but {len(without)} images have no alpha channel (first "
                      f"{os.path.basename(without[0])}); they train everywhere (an all-white mask)", stacklevel=2)


def mask_source_hash(mask_path: str | None, alpha: bool) -> str:
    """Part of the latent cache hash: the mask file's bytes (the alpha channel is in the image's)."""
    if mask_path:
        with open(mask_path, "rb") as f:
            return "mask=" + hashlib.sha256(f.read()).hexdigest()
    return "mask=alpha" if alpha else ""


def load_mask(image_path: str, mask_path: str | None, bucket: tuple[int, int], flip: bool) -> torch.Tensor:
    """float32 [1, H/8, W/8] in [0, 1]: the mask fitted to the bucket like its image, area-averaged
    to the latent grid. mask_path None: the image's alpha channel (all ones without one)."""
    with Image.open(mask_path or image_path) as img:
        img = ImageOps.exif_transpose(img)
        if mask_path:
            gray = to_8_bit(img, mask_path).convert("L")
        elif img.mode.startswith("I") and "transparency" in img.info:  # Pillow's RGBA drops a 16-bit grey key
            gray = Image.fromarray(np.where(np.asarray(img) == img.info["transparency"], 0, 255).astype(np.uint8))
        elif "A" in img.getbands() or "transparency" in img.info:
            gray = img.convert("RGBA").getchannel("A")
        else:
            gray = Image.new("L", img.size, 255)
    fitted = fit_to_bucket(gray, bucket, flip)
    mask = torch.from_numpy(np.asarray(fitted, dtype=np.float32) / 255.0).clamp_(0.0, 1.0)  # Lanczos may overshoot
    return F.avg_pool2d(mask[None, None], LATENT_DOWNSAMPLE)[0]


def on_latent_grid(masks: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Loss masks [B, 1, H/8, W/8] (load_mask's grid) on a latent grid of `size` (h, w): area-averaged to the
    coarser grid a VAE with a larger downsampling gives (a 16x VAE: each element the mean of 2 x 2), repeated onto
    a finer one (nearest: a pixel-space model's latents are the pixels, each mask element covers 8 x 8 of them)."""
    (mh, mw), (h, w) = masks.shape[-2:], size
    if (mh, mw) == (h, w):
        return masks
    if h > mh or w > mw:
        if h % mh or w % mw:
            raise ValueError(f"loss masks of {mh} x {mw} do not repeat onto the {h} x {w} latent grid")
        return masks.repeat_interleave(h // mh, dim=-2).repeat_interleave(w // mw, dim=-1)
    if mh % h or mw % w:
        raise ValueError(f"loss masks of {mh} x {mw} do not pool to the {h} x {w} latent grid")
    return F.avg_pool2d(masks, (mh // h, mw // w))


def balance_reg_repeats(train_images: int, reg_items: list) -> dict[int, int]:
    """id(item) -> repeats of each regularization item of one dataset, as sd-scripts balances them:
    items in order, each with its subset's num_repeats until their total reaches the training
    images' (with repeats); if one pass is not enough, +1 per item in further passes. Items the
    first pass does not reach get 0 (sd-scripts: 'some of reg images are not used')."""
    repeats = {id(item): 0 for item in reg_items}
    count, first = 0, True
    while reg_items and count < train_images:
        for item in reg_items:
            step = item.subset.num_repeats if first else 1
            repeats[id(item)] += step
            count += step
            if count >= train_images:
                break
        first = False
    return repeats
