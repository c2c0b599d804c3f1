"""Reading images as 8-bit pixels (16-bit PNGs scaled, not clipped), image geometry shared by
training images and their loss masks (resize to cover the bucket, centre crop, mirror), and
writing sample images: tensors in [-1, 1] -> PNG, side by side with
labels, settings in the PNG's text chunks, written atomically."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageOps, PngImagePlugin

from library.data.image_names import AVIF, IMAGE_EXTENSIONS, is_image_name  # noqa: F401 (re-exported: the UI's too)
from library.io import atomic_path

# Image types a dataset folder may hold that are not read (a phone's HEIC, a scan's TIFF): said, not skipped silently.
UNREAD_IMAGE_EXTENSIONS = tuple(e for e in (".heic", ".heif", ".avif", ".jxl", ".tif", ".tiff", ".gif", ".jfif", ".psd")
                                if e not in AVIF)
# Pillow opens 16-bit grey PNGs in the I;16 modes ("I": 32-bit integers). Its convert("RGB") /
# convert("L") clips those values to 255 instead of scaling them: nearly every pixel turns white.
WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def images_by_stem(folder: str, names, what: str = "images") -> dict[str, str]:
    """File stem -> name of the images among `names` (sorted) in `folder`. Two of one stem (a.png and
    a.jpg) are an error naming both: an image's caption, cache, reference or mask is found by its stem,
    and which of the two is meant is unknown (a mask folder kept the last one sorted, silently). A name that is
    no UTF-8 is an error naming it (undecodable_names)."""
    if collisions := stem_collisions(folder, names, what) + undecodable_names(folder, names, what):
        raise ValueError(collisions[0])
    return {os.path.splitext(name)[0]: name for name in sorted(n for n in names if is_image_name(n))}


def undecodable_names(folder: str, names, what: str = "images") -> list[str]:
    """The error line for every image among `names` whose name is no UTF-8 (Python holds its bytes as surrogates:
    a folder copied from an older system in Latin-1 or cp1252): its digests, cache keys and the LoRA's metadata
    cannot hold it, and training stopped after caching on a line naming no file."""
    lines = []
    for name in sorted(n for n in names if is_image_name(n)):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            shown = name.encode("utf-8", "surrogateescape")
            lines.append(f"{folder}: {shown!r} ({what}) is not a UTF-8 file name (another system's encoding, e.g. "
                         f"Latin-1): rename it (convmv -f latin1 -t utf8 --notest <folder>/*)")
    return lines


def stem_collisions(folder: str, names, what: str = "images") -> list[str]:
    """images_by_stem's error line for every image among `names` whose stem an earlier one (sorted) has:
    all of them, for the dataset check (training stops at the first)."""
    stems: dict[str, str] = {}
    lines = []
    for name in sorted(n for n in names if is_image_name(n)):
        stem = os.path.splitext(name)[0]
        if stem in stems:
            lines.append(f"{folder}: {what} '{stems[stem]}' and '{name}' share the name '{stem}'")
        else:
            stems[stem] = name
    return lines


def to_8_bit(img: Image.Image, path: str) -> Image.Image:
    """16-bit grey pixels scaled to 8-bit grey ("L", round(value / 257)); other modes unchanged
    (Pillow opens 16-bit RGB(A) PNGs as 8-bit RGB(A) itself, keeping the high byte). Values beyond
    16 bits and float pixels are one ValueError naming the file. A 16-bit grey PNG's transparent value (its tRNS
    key) becomes alpha ("LA"): a new image dropped it, and its RGBA view (the check's transparency note, an RGBA
    family's references) read it opaque."""
    if img.mode == "F":
        raise ValueError(f"{path}: floating-point pixels (mode F); expected an 8- or 16-bit image")
    if img.mode not in WIDE_GREY_MODES:
        return img
    values = np.asarray(img).astype(np.int64)
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi > 65535:
        raise ValueError(f"{path}: pixel values {lo}..{hi} do not fit 16 bits; expected an 8- or 16-bit image")
    grey = Image.fromarray(((values + 128) // 257).astype(np.uint8))
    if (key := img.info.get("transparency")) is None:
        return grey
    alpha = Image.fromarray(np.where(values == key, 0, 255).astype(np.uint8))
    return Image.merge("LA", (grey, alpha))


def load_rgb(path: str, mode: str = "RGB") -> Image.Image:
    """The image at `path` as displayed (EXIF rotation applied), as 8-bit RGB (mode "RGBA": with its
    alpha, 255 where it has none). Pixels that do not decode (a truncated file, whose header still
    verifies) and an animated file (animated_frames) are one ValueError naming the file."""
    try:
        with Image.open(path) as img:
            if frames := animated_frames(img):
                raise animation_error(path, frames)
            return to_8_bit(ImageOps.exif_transpose(img), path).convert(mode)
    except ValueError:  # to_8_bit's, naming the file already
        raise
    except Exception as e:  # PIL raises many kinds for broken files
        raise ValueError(f"{path}: cannot be decoded as an image ({type(e).__name__}: {e})") from None


def fit_to_bucket(img: Image.Image, bucket: tuple[int, int], flip: bool = False, stretch: bool = False,
                  crop_from: tuple[int, int] | None = None) -> Image.Image:
    """`img` resized to cover `bucket` (w, h) (box filter when shrinking, Lanczos when enlarging),
    centre-cropped to it, optionally mirrored: the same pixels for an image and its mask. stretch:
    resized to exactly `bucket` (Lanczos, no crop), as diffusers' VaeImageProcessor.resize fits an
    edit pipeline's reference to a size of nearly its own aspect ratio. crop_from: resized (Lanczos) to that
    (w, h) where it is another size, then centre-cropped to `bucket` without a resize to it, as some edit pipelines'
    image processors prepare a condition image (DiffusionFamily.reference_resize)."""
    if stretch:
        img = img if img.size == tuple(bucket) else img.resize(tuple(bucket), Image.Resampling.LANCZOS)
        return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img
    (bw, bh), (w, h) = bucket, img.size
    scale = upscale_factor(img.size, bucket)
    rw, rh = tuple(crop_from) if crop_from else (max(bw, round(w * scale)), max(bh, round(h * scale)))
    if (rw, rh) != (w, h):
        img = img.resize((rw, rh), Image.Resampling.LANCZOS if crop_from or scale >= 1 else Image.Resampling.BOX)
    left, top = (rw - bw) // 2, (rh - bh) // 2
    img = img.crop((left, top, left + bw, top + bh))
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img


def upscale_factor(size: tuple[int, int], bucket: tuple[int, int]) -> float:
    """How much fit_to_bucket scales an image of `size` (w, h) to cover `bucket` (w, h): above 1 it
    is enlarged (a 512 px image in a 1024 px bucket: 2.0), up to 1 it is shrunk or kept."""
    return max(bucket[0] / size[0], bucket[1] / size[1])


def header_size(path: str) -> tuple[int, int]:
    """(width, height) as stored, from the file's header alone (no check of the pixels, no EXIF rotation): a
    quick look at many files (the memory plans' largest reference); an unreadable file is one error naming it."""
    try:
        with Image.open(path) as img:
            return img.size
    except Exception as e:  # PIL raises many kinds for broken files
        raise ValueError(f"{path}: cannot be read as an image ({type(e).__name__}: {e})") from None


def verified_image_size(path: str) -> tuple[int, int]:
    """(width, height) as displayed (EXIF rotation applied); an unreadable or animated file is one error naming it."""
    try:
        with Image.open(path) as img:
            img.verify()
        with Image.open(path) as img:
            w, h = img.size
            rotated = exif_orientation(img, path) in (5, 6, 7, 8)  # 90/270 degrees
            frames = animated_frames(img)
    except Exception as e:  # PIL raises many kinds for broken files
        raise ValueError(f"{path}: cannot be read as an image ({type(e).__name__}: {e})") from None
    if frames:
        raise animation_error(path, frames)
    return (h, w) if rotated else (w, h)


# Formats whose several frames are an animation. A JPEG of several pictures (MPO: a phone's Ultra HDR gain map, a
# preview, a stereo pair) opens with n_frames 2 and is a photo whose first picture is the one meant.
ANIMATED_FORMATS = ("WEBP", "PNG")


def animated_frames(img: Image.Image) -> int:
    """The frames of an open animated WebP or APNG (0 for any other image): Pillow reads its first frame alone, and
    it trained on that without a word, where a GIF is said not read (not trained)."""
    return img.n_frames if img.format in ANIMATED_FORMATS and getattr(img, "is_animated", False) else 0


def animation_error(path: str, frames: int) -> ValueError:
    return ValueError(f"{path}: an animated image ({frames} frames): only its first frame would be read; "
                      "save the frame meant as a still image (.png)")


def exif_orientation(img: Image.Image, path: str) -> int:
    """The EXIF orientation load_rgb turns the open image `img` (the file `path`) upright by (1: as stored; 2-8:
    flipped or turned)."""
    exif = img.getexif() if _metadata_after_pixels(img, path) else Image.Image.getexif(img)
    return exif.get(0x0112, 1)


# PNG chunks the orientation may come from (EXIF, a text chunk's raw EXIF profile, XMP).
_PNG_METADATA = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


def _metadata_after_pixels(img: Image.Image, path: str) -> bool:
    """Whether a PNG holds a metadata chunk after its first IDAT: only then must Pillow's getexif decode
    the whole image to reach it (it loads every PNG that has no EXIF before the pixels, 40 ms for a
    1024 px one, where reading the size takes 1 ms). The chunk headers are walked, the data skipped."""
    if img.format != "PNG":
        return False
    seen_pixels = False
    with open(path, "rb") as f:
        f.seek(8)  # the signature
        while len(header := f.read(8)) == 8:
            length, kind = int.from_bytes(header[:4], "big"), header[4:]
            if kind == b"IEND":
                return False
            if seen_pixels and kind in _PNG_METADATA:
                return True
            seen_pixels = seen_pixels or kind == b"IDAT"
            f.seek(length + 4, 1)  # the data and its CRC
    return False


def load_image(path: str, bucket: tuple[int, int], flip: bool = False, mode: str = "RGB",
               stretch: bool = False, crop_from: tuple[int, int] | None = None) -> torch.Tensor:
    """The image fitted to `bucket` (fit_to_bucket: covered, stretched, or cropped from crop_from). Returns float32
    [3, H, W] in [-1, 1] ([4, H, W] for mode "RGBA": layered targets, library/data/layers.py)."""
    return to_pixels(fit_to_bucket(load_rgb(path, mode), bucket, flip, stretch, crop_from))


def to_pixels(img: Image.Image) -> torch.Tensor:
    """An 8-bit RGB (RGBA) PIL image -> float32 [3 (4), H, W] in [-1, 1]."""
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())  # [H, W, 3 or 4] uint8
    return pixels.permute(2, 0, 1).float() / 127.5 - 1.0


def to_pil(image: torch.Tensor) -> Image.Image:
    """[3, H, W] float in [-1, 1] -> RGB PIL image ([4, H, W] -> RGBA)."""
    array = ((image.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(np.ascontiguousarray(array.permute(1, 2, 0).numpy()))


def save_png(image: Image.Image, path: str, info: dict[str, str] | None = None):
    meta = PngImagePlugin.PngInfo()
    for key, value in (info or {}).items():
        meta.add_text(key, str(value))
    with atomic_path(path) as tmp:
        image.save(tmp, format="PNG", pnginfo=meta)


def save_side_by_side(images: list[tuple[str, torch.Tensor]], path: str, prompt: str, info: dict | None = None):
    """Panels left to right, each labelled (e.g. 'bf16', 'fp8_scaled') in a strip above it."""
    panels = [to_pil(t) for _, t in images]
    strip = 14
    w, h = sum(p.width for p in panels), max(p.height for p in panels) + strip
    canvas = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(canvas)
    x = 0
    for (label, _), panel in zip(images, panels):
        canvas.paste(panel, (x, strip))
        draw.text((x + 2, 1), label, fill="black")
        x += panel.width
    save_png(canvas, path, {"prompt": prompt, "panels": ",".join(l for l, _ in images), **(info or {})})
