"""Synthetic scenes of one coloured shape: the geometry, the drawing and the captions shared by the
tiny dataset writer (tools/make_tiny_dataset.py), the tiny-base pretrainer (tools/pretrain_tiny_base.py)
and the pixel-space concept detector (library/data/shape_detector.py), which matches against the
same outlines.

A scene is one shape (circle, square, triangle, star) of one colour at one of three horizontal
positions (left, centre, right), in one of two sizes, on a plain (white, black) or textured (grey
stripes) background. Its caption names all five, e.g. "a big red circle on the left, striped
background"; a trigger word may stand in for the colour and shape ("a big zxq on the left, ...").
Colours are saturated and backgrounds grey, so that saturation separates the shape from any
background. Everything is drawn with PIL, deterministically from the scene and its jitter.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
           "purple": (150, 50, 200)}
SHAPES = ("circle", "square", "triangle", "star")
POSITIONS = {"left": 0.25, "centre": 0.5, "right": 0.75}  # the shape's centre, as a share of the width
SIZES = {"small": 0.17, "big": 0.23}  # the outline's radius, as a share of the width
BACKGROUNDS = ("white", "black", "striped")
PLAIN = {"white": (245, 245, 245), "black": (15, 15, 15)}
STRIPES = ((95, 95, 95), (165, 165, 165))  # diagonal grey bands, width/8 wide

# The tiny base learns these; the demo's LoRA teaches a colour and a shape it never saw (purple star).
BASE_COLOURS = ("red", "green", "blue", "yellow")
BASE_SHAPES = ("circle", "square", "triangle")


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    position: str
    size: str
    background: str
    dx: float = 0.0  # jitter of the centre, as a share of the width
    dy: float = 0.0

    def caption(self, trigger: str | None = None) -> str:
        """"a big red circle on the left, striped background"; with a trigger word in place of the
        colour and the shape: "a big zxq on the left, striped background"."""
        what = trigger or f"{self.colour} {self.shape}"
        where = "in the centre" if self.position == "centre" else f"on the {self.position}"
        return f"a {self.size} {what} {where}, {self.background} background"


def outline(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | tuple[float, ...]:
    """The shape around (cx, cy) with outer radius r: a bounding box (circle, square) or polygon points."""
    if shape == "circle":
        return (cx - r, cy - r, cx + r, cy + r)
    if shape == "square":  # side 1.6 r: about a circle's area
        s = 0.8 * r
        return (cx - s, cy - s, cx + s, cy + s)
    if shape == "triangle":  # pointing up, inscribed in the circle of radius r, its centroid at (cx, cy)
        return [(cx + r * math.sin(a), cy - r * math.cos(a)) for a in (0.0, 2 * math.pi / 3, 4 * math.pi / 3)]
    if shape == "star":  # five points, inner radius 0.4 r
        return [(cx + rr * math.sin(k * math.pi / 5), cy - rr * math.cos(k * math.pi / 5))
                for k, rr in zip(range(10), itertools.cycle((r, 0.4 * r)))]
    raise ValueError(f"shape {shape!r} is not one of {', '.join(SHAPES)}")


def fill_shape(pen: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    points = outline(shape, cx, cy, r)
    if shape == "circle":
        pen.ellipse(points, fill=fill)
    elif shape == "square":
        pen.rectangle(points, fill=fill)
    else:
        pen.polygon(points, fill=fill)


def background_image(background: str, size: int) -> Image.Image:
    if background in PLAIN:
        return Image.new("RGB", (size, size), PLAIN[background])
    if background != "striped":
        raise ValueError(f"background {background!r} is not one of {', '.join(BACKGROUNDS)}")
    image = Image.new("RGB", (size, size), STRIPES[0])
    pen, band = ImageDraw.Draw(image), max(2, size // 8)
    for start in range(-size, size, 2 * band):  # diagonal bands of the lighter grey
        pen.polygon([(start, 0), (start + band, 0), (start + band + size, size), (start + size, size)], fill=STRIPES[1])
    return image


def draw_scene(scene: Scene, size: int = 64, fill=None) -> Image.Image:
    """The scene as a size x size RGB image; fill: the shape's RGB instead of its colour's (an edit
    pair's grey reference)."""
    image = background_image(scene.background, size)
    cx = (POSITIONS[scene.position] + scene.dx) * size
    cy = (0.5 + scene.dy) * size
    fill_shape(ImageDraw.Draw(image), scene.shape, cx, cy, SIZES[scene.size] * size, fill or COLOURS[scene.colour])
    return image


def all_scenes(shapes=BASE_SHAPES, colours=BASE_COLOURS, positions=tuple(POSITIONS), sizes=tuple(SIZES),
               backgrounds=BACKGROUNDS) -> list[Scene]:
    """Every combination (no jitter), in a fixed order."""
    return [Scene(*combo) for combo in itertools.product(shapes, colours, positions, sizes, backgrounds)]


def jittered(scene: Scene, rng: random.Random, amount: float = 0.04) -> Scene:
    """The scene moved by up to `amount` of the width on each axis (drawn from rng)."""
    return Scene(scene.shape, scene.colour, scene.position, scene.size, scene.background,
                 rng.uniform(-amount, amount), rng.uniform(-amount, amount))


def parse_caption(caption: str, trigger: str | None = None, meaning: tuple[str, str] | None = None) -> dict[str, str]:
    """The attributes a caption names ({"shape", "colour", "position", "size", "background"}, those it
    has); `trigger` stands for `meaning` (colour, shape)."""
    words = caption.replace(",", " ").split()
    found = {}
    for key, names in (("shape", SHAPES), ("colour", COLOURS), ("position", POSITIONS), ("size", SIZES),
                       ("background", BACKGROUNDS)):
        hit = [w for w in words if w in names]
        if hit:
            found[key] = hit[0]
    if trigger and meaning and trigger in words:
        found["colour"], found["shape"] = meaning
    return found
