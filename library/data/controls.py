"""Paired data for edit models: a subset's `control_directory` (musubi-tuner's name) holds the
reference image(s) of each target image, matched by file stem:

    image_dir/cat.png  ->  control_directory/cat.png                        (one reference)
                       or  control_directory/cat_0.png, cat_1.png, ...     (several, in order)

A numbered name that is the stem of another target (photo_1.png beside photo.png) is that target's
reference. Any image extension works on either side. Targets may have different numbers of references,
as in musubi-tuner (a batch holds one count: batches group by the references' buckets), each no more
than the model takes. How large a reference is encoded is the family's rule
(DiffusionFamily.control_bucket: by default the target's bucket). The reference latents are cached in the
target's latent cache file, and its content hash covers the reference files, so changing a reference
re-encodes (library/data/caches.py).
"""

from __future__ import annotations

import os
import re

import torch

from library.data.images import images_by_stem, load_image, load_rgb, verified_image_size
from library.data.vlm_inputs import check_aspect_ratio


def target_stems(paths: list[str]) -> frozenset[str]:
    """The file stems of a subset's images (find_controls' targets)."""
    return frozenset(os.path.splitext(os.path.basename(p))[0] for p in paths)


class ControlFiles(dict):
    """stem -> file name of a control_directory's images, with the numbered ones (`cat_0`, `cat_01`) indexed
    by the stem before their number: find_controls looks one target's up instead of matching every file of
    the folder against it (4000 pairs took 4.3 s, a 20000-pair folder minutes, at every run's start)."""

    def numbered(self) -> dict[str, list[tuple[str, int]]]:
        """base stem -> [(stem, number)] in stem order: the split at the last '_' before digits is the one way
        `<base>_<digits>` reads, so each stem is listed under one base."""
        if not hasattr(self, "_numbered"):
            self._numbered: dict[str, list[tuple[str, int]]] = {}
            for stem in sorted(self):
                if m := re.fullmatch(r"(.*)_(\d+)", stem, re.DOTALL):
                    self._numbered.setdefault(m.group(1), []).append((stem, int(m.group(2))))
        return self._numbered


def control_files(folder: str) -> ControlFiles:
    """stem -> file name of every image in a control_directory (read once per subset; two of one stem: an error)."""
    return ControlFiles(images_by_stem(folder, os.listdir(folder), "control_directory images"))


def find_controls(image_path: str, folder: str, files: dict[str, str], targets: frozenset[str] = frozenset()) -> list[str]:
    """The reference images of `image_path` in `folder` (its files: control_files), in order.
    targets: the file stems of the subset's images: `photo_1.png` is the reference of a target
    `photo_1`, not the second of `photo`. Missing references, both naming forms at once, and gaps in
    the numbering are errors."""
    stem = os.path.splitext(os.path.basename(image_path))[0]
    expected = f"expected '{stem}.<ext>' or '{stem}_0.<ext>', '{stem}_1.<ext>', ..."
    files = files if isinstance(files, ControlFiles) else ControlFiles(files)
    numbered: dict[int, str] = {}
    for s, n in files.numbered().get(stem, ()):
        if s not in targets:
            f = files[s]
            if n in numbered:  # a_1 and a_01: one would silently replace the other
                raise ValueError(f"{image_path}: control_directory {folder} has '{numbered[n]}' and '{f}', both "
                                 f"reference {n}; {expected}")
            numbered[n] = f
    if stem in files and numbered:
        raise ValueError(f"{image_path}: control_directory {folder} has both '{files[stem]}' and numbered references "
                         f"'{numbered[min(numbered)]}'; {expected}, not both")
    if stem in files:
        names = [files[stem]]
    elif numbered:
        missing = sorted(set(range(max(numbered) + 1)) - set(numbered))
        if missing:
            raise ValueError(f"{image_path}: control_directory {folder} lacks reference '{stem}_{missing[0]}.<ext>' "
                             f"(references are numbered from 0 without gaps)")
        names = [numbered[k] for k in sorted(numbered)]
    else:
        raise ValueError(f"{image_path}: no reference image in control_directory {folder} ({expected})")
    return [os.path.join(folder, n) for n in names]


def scan_controls(image_path: str, folder: str, files: dict[str, str], bucket: tuple[int, int],
                  control_bucket, resolution: tuple[int, int], targets: frozenset[str] = frozenset(),
                  resize=None) -> tuple[list[str], list[tuple[int, int]], list[tuple[int, int]]]:
    """(reference paths, the bucket each is encoded at, the size each is resized to before a centre crop to it:
    [] where the family covers and crops): every reference verified readable; control_bucket(target bucket,
    reference size, the dataset's resolution) -> (w, h) is the family's rule (DiffusionFamily.control_bucket),
    resize(target bucket, reference size) its reference_resize; targets: find_controls'."""
    paths = find_controls(image_path, folder, files, targets)
    sizes = [verified_image_size(p) for p in paths]
    crops = [resize(bucket, s) for s in sizes] if resize else []
    crops = [] if None in crops else [tuple(c) for c in crops]
    return paths, [tuple(control_bucket(bucket, s, resolution)) for s in sizes], crops


def references_missing(subsets, model_type: str) -> str | None:
    """One line where an edit model type trains on subsets none of which sets control_directory (where one does,
    each of its images has its references or the scan stops: find_controls): the LoRA then learns the model's
    text-to-image mode alone (DiffusionFamily.edits_without_references_warn). Training and check_dataset ask."""
    if not subsets or any(subset.control_directory for subset in subsets):
        return None
    return (f"model_type {model_type} is an edit model, but no training image has a reference image (no subset "
            f"sets control_directory): this LoRA learns text-to-image; set control_directory for an edit LoRA")


def check_family_takes(items, model_type: str, max_controls: int, min_controls: int = 0,
                       takes_layers: bool = False, vl_size=None) -> None:
    """The training family takes this many references per image (0: it is no edit model), layered
    targets only if it trains layers (takes_layers), and references its Qwen-VL image processor takes
    (vl_size: check_vl_views')."""
    for item in items:
        if item.subset.multiple_target and not takes_layers:  # its composite counted as a reference: the
            # refusal named a control_directory never set, or an edit model's VAE met RGBA after caching text
            raise ValueError(f"{item.image_path}: its subset sets multiple_target = true (layered targets), but "
                             f"model_type {model_type} trains no layers (a layer-decomposition model_type does)")
        if takes_layers and not item.subset.multiple_target:  # a control_directory reference met the count of
            # one condition image: the run trained one frame onto another image, no layer (samples still decompose)
            raise ValueError(f"{item.image_path}: model_type {model_type} trains layer decompositions: its subsets set "
                             f"multiple_target = true, each image's layers beside it (name_1.png, name_2.png, ...), "
                             f"not a control_directory")
        n = len(item.control_paths)
        if n < min_controls:
            raise ValueError(f"{item.image_path}: {n} reference image(s), but model_type {model_type} needs at least "
                             f"{min_controls} per image (set the subset's control_directory: library/data/controls.py)")
        if n > max_controls:
            what = (f"takes no reference images (control_directory is for the edit model types)"
                    if not max_controls else f"takes at most {max_controls} reference image(s)")
            raise ValueError(f"{item.image_path}: {n} reference image(s) in {item.subset.control_directory}, "
                             f"but model_type {model_type} {what}")
        check_vl_views(item.control_paths, vl_size)


def check_vl_views(paths, vl_size) -> None:
    """Each reference at `paths` as the text encoder shows it to its Qwen-VL image processor: vl_size(w, h) ->
    its resized (w, h), or None where none sees it (DiffusionFamily.reference_vl_size). One the processor
    refuses (check_aspect_ratio) stopped text caching, after every latent, naming no file."""
    for path in paths if vl_size else ():
        size = verified_image_size(path)
        if (seen := vl_size(*size)) is not None:
            check_aspect_ratio(path, size, seen)


def reference_views(paths: list[str] | tuple[str, ...]) -> list:
    """The reference images as PIL RGBA images at their own size (EXIF rotation applied; alpha 255 where the
    file has none): what a text encoder that sees them (an edit family's text_sees_controls) is given; it
    resizes them by its own rule and takes their colour its pipeline's way (RGB: alpha dropped, as diffusers'
    load_image; or composited over white where its pipeline does so)."""
    return [load_rgb(p, "RGBA") for p in paths]


def encode_prompts(encode, captions: list[str], references: list, sees_references: bool,
                   sample_size: tuple[int, int] | None = None) -> list[dict]:
    """encode(captions), or encode(captions, their reference views) for a family whose text
    encoder sees the references (references: per caption, its reference image paths); with
    sample_size (the family's sample_text_size) encode(captions, views, sample_size)."""
    if not sees_references:
        return finite_encodings(encode(captions), captions)
    views = [reference_views(paths) for paths in references]
    outputs = encode(captions, views) if sample_size is None else encode(captions, views, sample_size)
    return finite_encodings(outputs, captions)


def finite_encodings(outputs: list[dict], captions: list[str]) -> list[dict]:
    """The encoder's outputs, refused where one holds inf / NaN: an encoder run in fp16 (an LLM encoder's
    activations pass fp16's 65504 where bf16's range holds them) gave NaN embeddings that were cached without a
    word, to meet the run as a NaN loss or black samples, minutes or hours later."""
    for caption, out in zip(captions, outputs):
        for name, value in out.items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad = int((~torch.isfinite(value)).sum())
                raise ValueError(f"the text encoder's output '{name}' for the text {caption[:60]!r} holds {bad} inf / "
                                 f"NaN values of {value.numel()}: the encoder overflowed its precision (fp16 does "
                                 f"where bf16 does not): set text_encoder_precision = 'bf16' (or 'fp32')")
    return outputs


def reference_images(paths: list[str] | tuple[str, ...], control_bucket, width: int, height: int,
                     stretch: bool = False, mode: str = "RGB", resize=None) -> list[torch.Tensor]:
    """A sample prompt's references (--ci) fitted by the family's rule (its sample_control_bucket; stretched
    to it where the family stretches references, cropped from resize(target, size) where it gives one) to a
    width x height target, each float32 [1, 3, H, W] in [-1, 1] (what the VAE encodes; [1, 4, H, W] in mode
    "RGBA": the family's reference_mode, as training's)."""
    images = []
    for p in paths:
        size = verified_image_size(p)
        crop_from = resize((width, height), size) if resize else None
        images.append(load_image(p, tuple(control_bucket((width, height), size)), mode=mode, stretch=stretch,
                                 crop_from=crop_from)[None])
    return images


def check_prompt_controls(prompts, where: str, model_type: str, max_controls: int, min_controls: int = 0,
                          vl_size=None) -> None:
    """Sample prompts give no more --ci than the family takes, as many as it needs, and ones its Qwen-VL
    image processor takes (vl_size: check_vl_views')."""
    for p in prompts:
        if len(p.control_images) < min_controls:
            raise ValueError(f"{where}: prompt {p.prompt!r} has {len(p.control_images)} --ci image(s), but model_type "
                             f"{model_type} needs at least {min_controls} (--ci path)")
        if len(p.control_images) > max_controls:
            what = "takes no reference images" if not max_controls else f"takes at most {max_controls}"
            raise ValueError(f"{where}: prompt {p.prompt!r} has {len(p.control_images)} --ci image(s), but "
                             f"model_type {model_type} {what}")
        try:
            check_vl_views(p.control_images, vl_size)
        except ValueError as e:
            raise ValueError(f"{where}: prompt {p.prompt!r}: --ci {e}") from None
