"""The pixel-space concept detector (library/data/shape_detector.py) reads the synthetic scenes
(library/data/shapes.py) right: every shape, colour and position, sharp, blurred as a tiny VAE's
decode is, and noisy; it names no colour outside the palette and finds nothing on a bare background."""

import random

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFilter

from library.data.shape_detector import detect
from library.data.shapes import BACKGROUNDS, COLOURS, SHAPES, Scene, all_scenes, background_image, draw_scene, \
    fill_shape, jittered, parse_caption

EVERY = all_scenes(shapes=SHAPES, colours=tuple(COLOURS))  # 4 x 5 x 3 x 2 x 3 = 360


def drawn(blur: float = 0.0, noise: float = 0.0) -> list[tuple[Scene, Image.Image]]:
    rng, out = random.Random(0), []
    for scene in EVERY:
        image = draw_scene(jittered(scene, rng), 64)
        if blur:
            image = image.filter(ImageFilter.GaussianBlur(blur))
        if noise:
            pixels = np.asarray(image) / 255.0 + np.random.default_rng(len(out)).normal(0, noise, (64, 64, 3))
            image = Image.fromarray((pixels.clip(0, 1) * 255).round().astype(np.uint8))
        out.append((scene, image))
    return out


def misses(images) -> list:
    return [(s, d) for s, d in ((s, detect(i)) for s, i in images) if not d.shows(s.colour, s.shape, s.position)]


def test_detector_reads_every_sharp_scene():
    assert len(EVERY) == 360
    assert misses(drawn()) == []


@pytest.mark.parametrize("blur,noise,allowed", [(1.0, 0.0, 4), (0.0, 0.06, 0)])
def test_detector_reads_blurred_and_noisy_scenes(blur, noise, allowed):
    """A Gaussian blur of 1 px merges a small star's points (radius 11 px, inner 4) into a blob now and
    then: at most 1% of the scenes missed; pixel noise of 6% changes nothing."""
    wrong = misses(drawn(blur, noise))
    assert len(wrong) <= allowed, wrong[:5]


@pytest.mark.parametrize("background", BACKGROUNDS)
def test_bare_background_shows_nothing(background):
    found = detect(background_image(background, 64))
    assert (found.colour, found.shape, found.position) == (None, None, None)
    assert not found.shows(colour="red")


def test_off_palette_hue_is_no_colour_and_largest_region_wins():
    image = background_image("white", 64)
    pen = ImageDraw.Draw(image)
    fill_shape(pen, "square", 48, 32, 12, (40, 200, 200))  # cyan: 50 degrees from green and blue
    fill_shape(pen, "circle", 8, 8, 3, (220, 40, 40))  # a red speck, smaller than the square
    found = detect(image)
    assert found.colour is None and found.shape == "square" and found.position == "right"
    assert found.area == pytest.approx((2 * 0.8 * 12 + 1) ** 2 / 64**2, rel=0.1)


def test_the_scores_separate_the_shapes():
    """Each shape's template names itself; a big shape drawn at 64 px scores > 0.85 on its own."""
    from library.data.shape_detector import name_shape, templates

    for shape, mask in templates().items():
        name, iou = name_shape(mask)
        assert name == shape and iou > 0.8  # the 24 x 24 resampling of a star loses its points' tips
    big = {s: detect(draw_scene(Scene(s, "blue", "centre", "big", "white"))) for s in SHAPES}
    for shape, found in big.items():
        assert found.shape == shape and found.shape_iou > 0.85, (shape, found)


def test_parse_caption_names_what_the_caption_says():
    scene = Scene("triangle", "yellow", "centre", "small", "striped")
    assert parse_caption(scene.caption()) == {"shape": "triangle", "colour": "yellow", "position": "centre",
                                              "size": "small", "background": "striped"}
    assert parse_caption(scene.caption("zxq"), "zxq", ("purple", "star"))["shape"] == "star"


def test_concept_dataset_is_purple_stars_under_the_trigger(tmp_path):
    """make_tiny_dataset --concept: 10 images, each a purple star where its caption says, each caption
    the trigger word in place of the colour and shape; the demo's prompts name every trigger scene."""
    import json
    import os

    from tools.make_tiny_dataset import make_concept_dataset

    paths = make_concept_dataset(str(tmp_path), count=10)
    stems = sorted(f[:-4] for f in os.listdir(paths["concept_image_dir"]) if f.endswith(".png"))
    assert len(stems) == 10
    for stem in stems:
        caption = open(os.path.join(paths["concept_image_dir"], stem + ".txt")).read()
        wanted = parse_caption(caption, "zxq", ("purple", "star"))
        assert "zxq" in caption and "purple" not in caption and "star" not in caption
        found = detect(Image.open(os.path.join(paths["concept_image_dir"], stem + ".png")))
        assert found.shows(wanted["colour"], wanted["shape"], wanted["position"]), (caption, found)
    concept = json.load(open(paths["concept"]))
    assert concept["trigger"] == "zxq"
    assert len(concept["trigger_prompts"]) == 18 and len(concept["unrelated_prompts"]) == 12


@pytest.mark.parametrize("inner", [0.55, 0.6, 0.65, 0.7])
def test_a_soft_edged_star_is_a_star(inner):
    """A model's render of a star has shallow, blurred notches (the learned base's LoRA stars): IoU with
    the templates calls it a circle, its five points (lobes) call it a star."""
    import itertools
    import math

    from library.data.shape_detector import _normalised_mask, as_pixels, largest_region, lobes, templates

    image = background_image("white", 64)
    points = [(32 + r * math.sin(k * math.pi / 5), 32 - r * math.cos(k * math.pi / 5))
              for k, r in zip(range(10), itertools.cycle((15, inner * 15)))]
    ImageDraw.Draw(image).polygon(points, fill=COLOURS["purple"])
    image = image.filter(ImageFilter.GaussianBlur(1.5))
    pixels = as_pixels(image)
    value, low = pixels.max(axis=2), pixels.min(axis=2)
    region = largest_region(((value - low) / value > 0.4) & (value > 0.3))
    normalised, t = _normalised_mask(region), templates()
    iou = {shape: (normalised & t[shape]).sum() / (normalised | t[shape]).sum() for shape in ("circle", "star")}
    assert iou["circle"] > iou["star"]  # the templates alone would say circle
    assert lobes(region) == 5
    assert detect(image).shows("purple", "star", "centre")
