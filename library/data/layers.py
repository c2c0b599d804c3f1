"""Layered targets (a layer-decomposition model: model_type names one), musubi-tuner's `multiple_target = true` layout: beside each
captioned image, its layers, numbered in the same folder:

    image_dir/poster.png  poster.txt           the image to decompose (the composite) and its caption
    image_dir/poster_1.png, poster_2.png, ...  its layers in order (RGBA; numbering may start at 0 or 1)

A training target is then the composite followed by its layers, every frame encoded on its own as
RGBA (an RGB image gets alpha 255, as musubi-tuner and the pipeline's `convert("RGBA")` give it),
cached as latents [C, 1 + layers, h, w]. The composite is also the sample's reference image (the
condition the pipeline decomposes), so the item's control_paths is the composite itself. Every
image of a dataset needs the same layer count (a batch stacks them).
"""

from __future__ import annotations

import os
import re

from library.data.images import verified_image_size

_NUMBERED = re.compile(r"(.+)_(\d+)")


def split_layers(paths: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(the composites, composite -> its layer files in numeric order) of a subset's image files:
    a file named <stem>_<n> beside an image named <stem> is one of its layers, unless it has layers
    of its own (<stem>_<n>_<k>): then it is a composite too (poster.png, poster_1.png, poster_1_1.png)."""
    by_stem: dict[str, list[str]] = {}
    for p in paths:  # two images of one stem (the check goes on past that error) are both beside its layers
        by_stem.setdefault(os.path.splitext(p)[0], []).append(p)
    matches = {p: m for p in paths if (m := _NUMBERED.fullmatch(os.path.splitext(p)[0])) and m.group(1) in by_stem}
    bases = {m.group(1) for m in matches.values()}  # the stems that have layers
    numbered: dict[str, list[tuple[int, str]]] = {}
    for p, m in matches.items():
        if os.path.splitext(p)[0] not in bases:
            for composite in by_stem[m.group(1)]:
                numbered.setdefault(composite, []).append((int(m.group(2)), p))
    layer_files = {p for group in numbered.values() for _, p in group}
    composites = [p for p in paths if p not in layer_files]
    return composites, {c: [p for _, p in sorted(group)] for c, group in numbered.items()}


def check_layers(path: str, layers: list[str] | None, first: tuple[str, int] | None,
                 size: tuple[int, int] | None = None) -> None:
    """A composite has layers numbered without gaps, as many as the first composite of its dataset
    (first: (path, count)),
    each readable and of the composite's `size` (w, h) when given: every frame is fitted to the
    composite's bucket on its own, so a layer of another size would be cropped out of register."""
    stem = os.path.splitext(os.path.basename(path))[0]
    if not layers:
        raise ValueError(f"{path}: no layer images beside it (multiple_target = true expects '{stem}_1.png', "
                         f"'{stem}_2.png', ... in the same folder)")
    check_layer_numbers(path, layers)
    if first is not None and len(layers) != first[1]:
        raise ValueError(f"{path}: {len(layers)} layer image(s), but {os.path.basename(first[0])} of the same dataset "
                         f"has {first[1]}; every image of a dataset needs the same number of layers")
    for layer in layers if size else ():
        layer_size = verified_image_size(layer)
        if layer_size != size:
            raise ValueError(f"{layer}: layer is {layer_size[0]}x{layer_size[1]}, its composite {os.path.basename(path)} "
                             f"is {size[0]}x{size[1]}; a layer is the composite's whole canvas (transparent where empty)")


def check_layer_numbers(path: str, layers: list[str]) -> None:
    """A composite's layers are numbered from 0 or 1 without gaps or repeats, as references are
    (controls.find_controls): poster_01.png beside poster_1.png, or poster_2.png missing, would train
    every later layer in another slot."""
    stem = os.path.splitext(os.path.basename(path))[0]
    numbered: dict[int, str] = {}
    for layer in layers:
        n = int(_NUMBERED.fullmatch(os.path.splitext(os.path.basename(layer))[0]).group(2))
        if n in numbered:
            raise ValueError(f"{path}: '{os.path.basename(numbered[n])}' and '{os.path.basename(layer)}' are both its "
                             f"layer {n}; keep one")
        numbered[n] = layer
    first = 0 if 0 in numbered else 1
    missing = sorted(set(range(first, max(numbered) + 1)) - set(numbered))
    if missing:
        last = os.path.basename(numbered[max(numbered)])
        raise ValueError(f"{path}: no layer '{stem}_{missing[0]}.<ext>' beside it, though it has '{last}' (layers are "
                         f"numbered from 0 or 1 without gaps)")
