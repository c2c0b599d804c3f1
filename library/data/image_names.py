"""Which files of a dataset folder are images, by name alone: torch-free, so the web UI's gallery
lists the images training reads (library/data/images.py re-exports both)."""

from __future__ import annotations

from PIL import features

# AVIF where this Pillow decodes it (its wheels bundle libavif since 11.3; requirements.txt pins 12.3), as
# musubi-tuner reads it and sd-scripts does with pillow-avif-plugin; a Pillow built without it leaves it unread (said).
AVIF = (".avif",) if features.check("avif") else ()
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", *AVIF)


def is_image_name(name: str) -> bool:
    """An image file's name: one of IMAGE_EXTENSIONS, any case, and not hidden. A hidden '._photo.png'
    is macOS's resource fork of photo.png (a copy to a USB disk or a network share leaves one beside
    every file): not an image, and skipped by sd-scripts' and musubi-tuner's globs too."""
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")
