"""A deterministic pixel-space detector for the synthetic scenes of library/data/shapes.py: what a
rendered sample shows (colour, shape, position), with no learned model, so that "the LoRA taught the
concept" is a measurement, not a look.

    detect(image) -> Detection(colour, shape, position, ...)   image: PIL, or uint8/float array [H, W, 3]

How, on float64 pixels in [0, 1]:
- the shape is the largest 4-connected region of saturated pixels (saturation (max - min) / max >
  0.4 and value > 0.3): the scenes' colours are saturated and their backgrounds grey, plain or striped;
- colour: the peak of the region's hue histogram (10-degree bins), named after the nearest of the
  scene colours' hues (circular distance), if within 30 degrees; `colour_share` is the region's
  share of pixels within 30 degrees of that hue;
- shape: a star if the outline has 5 or 6 points (peaks of the radius from the centroid over the
  angle: `lobes`); else the region's mask cropped to its bounding box and resized to 24 x 24 against
  the same of the circle's, square's and triangle's outlines drawn large (templates): the best
  intersection-over-union names it. (IoU alone calls the soft-edged stars a model renders circles:
  their halo fills the star's notches, star IoU 0.52-0.65 against circle IoU 0.62-0.75. Counted
  points: the drawn scenes, sharp, blurred or noisy, give stars 5-6 and the other shapes 0, 3, 4 or 8;
  the learned base's renders of circles, squares and triangles 0-4, the stars a LoRA taught it 5.)
- position: the region's centroid in the left, centre or right third of the width.
A region smaller than 1% of the image is "nothing" (every field None).
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

from library.data.shapes import COLOURS, SHAPES, fill_shape

GRID = 24  # the side of the masks compared with the templates
MIN_AREA = 0.01  # the smallest region that counts as a shape, as a share of the image
HUE_TOLERANCE = 30.0  # degrees


@dataclass(frozen=True)
class Detection:
    colour: str | None
    shape: str | None
    position: str | None
    colour_share: float = 0.0  # share of the region's pixels near the named hue
    shape_iou: float = 0.0  # IoU with the named shape's template
    area: float = 0.0  # the region's share of the image

    def shows(self, colour: str | None = None, shape: str | None = None, position: str | None = None) -> bool:
        """Whether the detection has every attribute given (None: not checked)."""
        return all(want is None or got == want for want, got in
                   ((colour, self.colour), (shape, self.shape), (position, self.position)))


def as_pixels(image) -> np.ndarray:
    """float64 [H, W, 3] in [0, 1] from a PIL image or a uint8 / float [H, W, 3] array."""
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"detect: expected an RGB image [H, W, 3], got shape {array.shape}")
    return array.astype(np.float64) / 255.0 if array.dtype == np.uint8 else array.astype(np.float64).clip(0, 1)


def largest_region(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask [H, W] (same shape; all False if none)."""
    h, w = mask.shape
    flat = mask.ravel().tolist()  # plain Python values: a flood fill over numpy scalars is ~5x slower
    labels = [0] * (h * w)
    best, best_size, label = 0, 0, 0
    for seed in (i for i, on in enumerate(flat) if on):
        if labels[seed]:
            continue
        label += 1
        labels[seed], stack, size = label, [seed], 0
        while stack:
            i = stack.pop()
            size += 1
            y, x = divmod(i, w)
            for j, inside in ((i - w, y > 0), (i + w, y < h - 1), (i - 1, x > 0), (i + 1, x < w - 1)):
                if inside and flat[j] and not labels[j]:
                    labels[j] = label
                    stack.append(j)
        if size > best_size:
            best, best_size = label, size
    return (np.array(labels).reshape(h, w) == best) if best else np.zeros_like(mask)


def hue_degrees(rgb: tuple[int, int, int]) -> float:
    return colorsys.rgb_to_hsv(*(c / 255.0 for c in rgb))[0] * 360.0


def hues(rgb: np.ndarray) -> np.ndarray:
    """Hue in degrees [0, 360) of float pixels [N, 3] (colorsys's formula, vectorised)."""
    high, low = rgb.max(axis=1), rgb.min(axis=1)
    span = np.maximum(high - low, 1e-12)
    r, g, b = ((high - rgb[:, i]) / span for i in range(3))
    h = np.where(rgb[:, 0] == high, b - g, np.where(rgb[:, 1] == high, 2.0 + r - b, 4.0 + g - r))
    return (h / 6.0 % 1.0) * 360.0


def _hue_distance(a, b):
    d = np.abs(np.asarray(a) - b) % 360.0
    return np.minimum(d, 360.0 - d)


def name_colour(hues: np.ndarray) -> tuple[str | None, float]:
    """(the scene colour nearest the histogram's peak, or None beyond HUE_TOLERANCE; the share of
    hues within HUE_TOLERANCE of it)."""
    counts, edges = np.histogram(hues, bins=36, range=(0.0, 360.0))
    peak = (edges[np.argmax(counts)] + 5.0) % 360.0
    name, distance = min(((n, float(_hue_distance(hue_degrees(rgb), peak))) for n, rgb in COLOURS.items()),
                         key=lambda pair: pair[1])
    if distance > HUE_TOLERANCE:
        return None, 0.0
    return name, float(np.mean(_hue_distance(hues, hue_degrees(COLOURS[name])) <= HUE_TOLERANCE))


def _normalised_mask(mask: np.ndarray) -> np.ndarray:
    """The mask's bounding box resized to GRID x GRID, boolean."""
    ys, xs = np.nonzero(mask)
    crop = mask[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]
    small = Image.fromarray(crop.astype(np.uint8) * 255).resize((GRID, GRID), Image.BILINEAR)
    return np.asarray(small) >= 128


@lru_cache(maxsize=None)
def templates() -> dict[str, np.ndarray]:
    """Each shape's outline drawn at radius 100 px, as a normalised mask."""
    out = {}
    for shape in SHAPES:
        canvas = Image.new("L", (240, 240), 0)
        fill_shape(ImageDraw.Draw(canvas), shape, 120, 120, 100, 255)
        out[shape] = _normalised_mask(np.asarray(canvas) >= 128)
    return out


def lobes(mask: np.ndarray, bins: int = 72, prominence: float = 0.12) -> int:
    """How many points the outline has: peaks of the region's radius from its centroid over the angle
    (5-degree bins, smoothed), each the highest within +-30 degrees and standing out of that window
    by `prominence` of the mean radius. Drawn circles have 0, squares 4 (8 when blurred), triangles
    3 (4 now and then), stars 5 (6 now and then)."""
    ys, xs = np.nonzero(mask)
    cy, cx = ys.mean(), xs.mean()
    angle_bin = (np.degrees(np.arctan2(ys - cy, xs - cx)) % 360.0 // (360.0 / bins)).astype(int)
    profile = np.zeros(bins)
    np.maximum.at(profile, angle_bin, np.hypot(ys - cy, xs - cx) + 0.5)
    for i in np.nonzero(profile == 0)[0]:  # a small region leaves bins empty: its neighbours' radius
        profile[i] = max(profile[i - 1], profile[(i + 1) % bins])
    kernel = np.array([1.0, 2.0, 3.0, 2.0, 1.0]) / 9.0
    smooth = sum(k * np.roll(profile, 2 - j) for j, k in enumerate(kernel))
    windows = np.stack([np.roll(smooth, d) for d in range(-(bins // 12), bins // 12 + 1)])
    is_peak = (smooth >= windows.max(axis=0)) & (smooth - windows.min(axis=0) > prominence * smooth.mean())
    return int(is_peak.sum())


def name_shape(mask: np.ndarray) -> tuple[str, float]:
    """(the shape, its template's IoU): a star if its outline has 5 or 6 points, else the best of the
    other templates."""
    normalised = _normalised_mask(mask)
    scores = {shape: float((normalised & t).sum() / max(1, (normalised | t).sum())) for shape, t in templates().items()}
    if lobes(mask) in (5, 6):
        return "star", scores["star"]
    best = max((shape for shape in scores if shape != "star"), key=scores.get)
    return best, scores[best]


def detect(image) -> Detection:
    """What the image shows (module docstring)."""
    pixels = as_pixels(image)
    value, low = pixels.max(axis=2), pixels.min(axis=2)
    saturation = np.where(value > 0, (value - low) / np.maximum(value, 1e-9), 0.0)
    region = largest_region((saturation > 0.4) & (value > 0.3))
    area = float(region.mean())
    if area < MIN_AREA:
        return Detection(None, None, None, area=area)
    colour, share = name_colour(hues(pixels[region]))
    shape, iou = name_shape(region)
    centre_x = (np.nonzero(region)[1].mean() + 0.5) / pixels.shape[1]
    position = "left" if centre_x < 1 / 3 else "right" if centre_x > 2 / 3 else "centre"
    return Detection(colour, shape, position, share, iou, area)
