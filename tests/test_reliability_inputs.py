"""Bad input data and model files (issue 24, round 2), in tests/test_reliability.py's style: a bad
file is one `error: ...` line naming it and what was expected, exit status 2, found before any
model is loaded or any cache written; odd but usable data (16-bit PNGs, images far from the
buckets' sizes) is read correctly or warned about per image."""

import os
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

import train_lora
from library.data import dataset as D
from library.data.controls import reference_views
from library.data.masks import load_mask
from tests.test_dataset import blueprint, make_image
from tests.test_reliability import copy_dataset, files_under, flux_args, one_error_line
from tests.test_train_llm import llm_args

MID_GREY_16 = 0x8080  # 32896 = 128 * 257: mid grey in 16 bits, 128 in 8


# ----------------------------------------------------------------------------------------------
# 16-bit PNGs


def png16(path, pixels: np.ndarray) -> str:
    """A 16-bit PNG of `pixels` (uint16 [H, W] grey or [H, W, 3] RGB), written byte by byte: Pillow
    writes 16-bit grey but not 16-bit RGB."""
    h, w = pixels.shape[:2]
    colour_type = 0 if pixels.ndim == 2 else 2
    rows = pixels.astype(">u2").reshape(h, -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return str(path)


def test_16_bit_grey_and_rgb_pngs_load_as_mid_grey_8_bit(tmp_path):
    grey = png16(tmp_path / "grey16.png", np.full((32, 32), MID_GREY_16, dtype=np.uint16))
    rgb = png16(tmp_path / "rgb16.png", np.full((32, 32, 3), MID_GREY_16, dtype=np.uint16))
    with Image.open(grey) as img:
        assert img.mode == "I;16"  # what Pillow 13 opens it as; convert("RGB") would clip it to 255
    mid = 128 / 127.5 - 1.0
    for path in (grey, rgb):  # Pillow opens 16-bit RGB as 8-bit RGB (the high byte) itself
        x = D.load_image(path, (32, 32))
        assert x.shape == (3, 32, 32) and float((x - mid).abs().max()) < 1e-6, (path, float(x.mean()))
        assert np.asarray(reference_views([path])[0]).tolist() == np.full((32, 32, 3), 128).tolist()
    mask = load_mask(str(tmp_path / "image.png"), grey, (32, 32), flip=False)  # a 16-bit grey mask file
    assert float((mask - 128 / 255).abs().max()) < 1e-6


def test_32_bit_integer_pixels_beyond_16_bits_are_refused_naming_the_file():
    from library.data.images import to_8_bit

    img = Image.fromarray(np.array([[0, 70000]], dtype=np.int32))
    assert img.mode == "I"
    with pytest.raises(ValueError) as e:
        to_8_bit(img, "deep.png")
    assert str(e.value) == "deep.png: pixel values 0..70000 do not fit 16 bits; expected an 8- or 16-bit image"
