"""Image folders -> ImageItems: every image of every subset with its caption, its aspect-ratio
bucket, its mask and reference images, checked once; and the validation hold-out.

`scan_images(blueprint)` verifies every image, reads its caption, gives it a bucket (the dataset's
bucket closest in aspect ratio, or with bucket_no_upscale its own size shrunk to the area budget)
and finds its mask and references; `split_validation` holds out each dataset's
validation_split share. library/data/dataset.py serves the items, library/data/caches.py caches
them.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

from library.data.controls import control_files, find_controls, scan_controls, target_stems
from library.data.dataset_config import DatasetBlueprint, DatasetSpec, SubsetSpec, make_buckets
from library.data.images import (IMAGE_EXTENSIONS, UNREAD_IMAGE_EXTENSIONS, header_size, images_by_stem,
                                 is_image_name, upscale_factor, verified_image_size)
from library.data.layers import check_layers, split_layers
from library.data.masks import find_mask, warn_missing_alpha
from library.io import read_utf8


@dataclass
class ImageItem:
    image_path: str
    caption: str  # from the caption file, or the subset's class_tokens
    subset: SubsetSpec
    dataset_index: int
    size: tuple[int, int]  # (width, height) as displayed (EXIF rotation applied)
    bucket: tuple[int, int]  # (width, height) it is trained at
    cache_dir: str | None = None
    latent_cache: str | dict | None = None  # file path, or tensors held in memory
    text_cache: str | dict | None = None
    caption_variants: list[str] = field(default_factory=list)  # augmented captions, cached beside the caption
    preservation_caption: str | None = None  # output preservation's second prompt, cached beside it (training/preservation.py)
    mask_path: str | None = None  # mask_dir's file for it (library/data/masks.py)
    control_paths: list[str] = field(default_factory=list)  # reference images (library/data/controls.py)
    control_buckets: list[tuple[int, int]] = field(default_factory=list)  # (w, h) each reference is encoded at
    controls_stretched: bool = False  # references resized to their bucket without a crop (fit_to_bucket's stretch)
    control_crops: list[tuple[int, int]] = field(default_factory=list)  # (w, h) each is resized to, then centre-
    # cropped to its bucket (fit_to_bucket's crop_from: the family's reference_resize); []: covered and cropped
    controls_mode: str = "RGB"  # the PIL mode its references load in for the VAE (the family's reference_mode)
    layer_paths: list[str] = field(default_factory=list)  # multiple_target: its layers (library/data/layers.py)
    subset_index: int = 0  # its subset's place in its dataset: one image in two subsets is two samples

    def control_crop(self, k: int) -> tuple[int, int] | None:
        """Reference k's crop_from (control_crops), None where its references are covered or stretched."""
        return self.control_crops[k] if self.control_crops else None

    @property
    def masked(self) -> bool:
        return self.mask_path is not None or self.subset.alpha_mask


# ----------------------------------------------------------------------------------------------
# Aspect-ratio buckets (the idea of sd-scripts' BucketManager; the bucket list itself: dataset_config.make_buckets)


def bucket_for(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket closest in aspect ratio (compared in log space, so 2:1 and 1:2 are treated
    alike); ties go to the larger bucket."""
    log_ar = math.log(size[0] / size[1])
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - log_ar), -b[0] * b[1]))


def bucket_without_upscale(size: tuple[int, int], max_area: int, step: int) -> tuple[int, int]:
    """bucket_no_upscale: never enlarge; an image over the area budget is shrunk to it, then one side is
    rounded to `step` (to nearest) and the other follows from the image's aspect ratio, whichever side
    keeps the ratio closer (sd-scripts' BucketManager.select_bucket); both sides then rounded down to
    `step`, the rest cropped. Rounding each side down on its own (until 2026-11-30) put 1187 of 3009
    random sizes in another bucket than sd-scripts at 1024 (3558x1677: 1472x640, a 92% crop, not
    1344x640, 99%)."""
    w, h = size
    if w * h > max_area:
        ratio = w / h

        def to_step(x: float) -> int:
            return int(x + 0.5) // step * step

        by_width = to_step(math.sqrt(max_area * ratio))  # the shrunk width, rounded; its height follows
        by_height = to_step(math.sqrt(max_area / ratio))  # the shrunk height, rounded; its width follows
        width_error = abs(by_width / max(to_step(by_width / ratio), 1) - ratio)  # (max: a side under one step)
        height_error = abs(to_step(by_height * ratio) / max(by_height, 1) - ratio)
        w, h = ((by_width, int(by_width / ratio + 0.5)) if width_error < height_error else
                (int(by_height * ratio + 0.5), by_height))
    return int(w) // step * step, int(h) // step * step


def size_limits(ds: DatasetSpec) -> tuple[int, str, float, str]:
    """(smallest image side, the key that sets it, largest aspect ratio, what sets that) of images
    dataset `ds` trains without upscaling them from below that side or cropping them beyond that
    ratio. With buckets the ratio is the widest bucket's: the resolution's area may keep it below
    max_bucket_reso / min_bucket_reso (resolution 512 with 256..2048: 1024x256, 4:1, not 8:1)."""
    if not ds.enable_bucket:
        return min(ds.resolution), "resolution", ds.max_bucket_reso / ds.min_bucket_reso, "max_bucket_reso / min_bucket_reso"
    w, h = max(make_buckets(ds.resolution, ds.min_bucket_reso, ds.max_bucket_reso, ds.bucket_reso_steps),
               key=lambda b: (max(b) / min(b), b[0]))  # the landscape one of a pair
    return ds.min_bucket_reso, "min_bucket_reso", max(w, h) / min(w, h), f"the widest bucket, {w}x{h}"


def bad_size(size: tuple[int, int], ds: DatasetSpec) -> str | None:
    """Why an image of `size` (w, h) trains badly in dataset `ds`, or None. A 1x1 image would be
    upscaled to a whole bucket, a 4000x16 strip cropped to its middle 2%: both silently."""
    if not ds.enable_bucket:
        return _bad_for_resolution(size, ds)
    (w, h), (min_side, name, max_aspect, widest) = size, size_limits(ds)
    problems, own_shape = [], ds.bucket_no_upscale  # a bucket of the image's own shape
    if min(w, h) < min_side and not own_shape:  # that never upscales
        problems.append(f"is smaller than {name} {min_side} (it is upscaled)")
    if max(w, h) / min(w, h) > max_aspect and not own_shape:  # nor crops beyond rounding to bucket_reso_steps
        problems.append(f"has aspect ratio {max(w, h) / min(w, h):.1f}, beyond {widest} = {max_aspect:.1f} (it is cropped)")
    if own_shape and min(bucket_without_upscale(size, ds.resolution[0] * ds.resolution[1], ds.bucket_reso_steps)) == 0:
        problems.append(f"has a side below bucket_reso_steps {ds.bucket_reso_steps} at the area budget (no bucket "
                        f"holds it without upscaling: an error, unless skip_bad_size_images leaves it out)")
    return f"{w}x{h} " + " and ".join(problems) if problems else None


def _bad_for_resolution(size: tuple[int, int], ds: DatasetSpec) -> str | None:
    """bad_size without buckets: every image is resized to cover the resolution (w, h) and centre-cropped, so
    an image is upscaled where one side falls short of the resolution's, and cropped beyond max_bucket_reso /
    min_bucket_reso in aspect ratio against the resolution's own (a 256x1024 image at 1024x256 keeps 6%: the
    old check compared the short side with min(resolution) and the image's ratio with 1:1)."""
    (w, h), (rw, rh) = size, ds.resolution
    square = rw == rh
    named = f"resolution {rw}" if square else f"resolution {rw}x{rh}"
    relative = max((w / h) / (rw / rh), (rw / rh) / (w / h))
    limit = ds.max_bucket_reso / ds.min_bucket_reso
    problems = []
    if upscale_factor(size, (rw, rh)) > 1:
        problems.append(f"is smaller than {named} (it is upscaled)")
    if relative > limit:
        against = "" if square else f" against {named}'s {rw / rh:.2f} (x{relative:.1f})"
        problems.append(f"has aspect ratio {w / h if w >= h else h / w:.1f}{against}, beyond max_bucket_reso / "
                        f"min_bucket_reso = {limit:.1f} (it is cropped)")
    return f"{w}x{h} " + " and ".join(problems) if problems else None


# ----------------------------------------------------------------------------------------------
# Scanning folders


def scan_images(blueprint: DatasetBlueprint, held_out_sets: bool = False, control_bucket=None,
                stretch_controls: bool = False, control_mode: str = "RGB", control_resize=None) -> list[ImageItem]:
    """Every image of every subset with its caption, bucket and reference images (a subset's
    control_directory). Unreadable images, missing or empty captions, colliding file stems and
    missing references are errors naming the file; images of a bad size for the buckets (bad_size)
    are warnings, and skipped with skip_bad_size_images. held_out_sets: the [[validation_datasets]]
    instead, numbered after the training datasets. control_bucket(target bucket, reference size, the
    dataset's resolution) -> (w, h): the family's reference size rule (DiffusionFamily.control_bucket;
    default: the target's bucket); stretch_controls: the family's references are stretched to that size,
    not cropped (DiffusionFamily.stretches_references); control_mode: the PIL mode they load in for the
    VAE (DiffusionFamily.reference_mode); control_resize(target bucket, reference size) -> (w, h) or None: the
    size a reference is resized to before a plain centre crop (DiffusionFamily.reference_resize)."""
    items, read = [], folders_read(blueprint)
    datasets = blueprint.validation_datasets if held_out_sets else blueprint.datasets
    first = len(blueprint.datasets) if held_out_sets else 0
    for di, ds in enumerate(datasets, start=first):
        buckets, first_item = dataset_buckets(ds), len(items)
        first_layered = None  # (path, layer count) of the dataset's first layered image
        for si, subset in enumerate(ds.subsets):
            try:
                paths, layers = subset_images(subset, read)
            except ValueError as e:  # the folder's own problem: said with the dataset config that names it
                raise ValueError(f"{blueprint.source}: {e}") from None
            if subset.alpha_mask:
                warn_missing_alpha(paths, subset)
            if unread := unread_caption_files(paths, subset):
                warnings.warn(unread, stacklevel=2)
            controls = control_files(subset.control_directory) if subset.control_directory else None
            targets = target_stems(paths)
            for path, size in _usable_images(paths, ds, subset):
                bucket = image_bucket(path, size, ds, buckets)
                item = ImageItem(path, read_caption(path, subset), subset, di, size, bucket, ds.cache_dir,
                                 mask_path=find_mask(path, subset, size), subset_index=si)
                if controls is not None:
                    item.control_paths, item.control_buckets, item.control_crops = scan_controls(
                        path, subset.control_directory, controls, bucket, control_bucket or (lambda b, *_: b),
                        ds.resolution, targets, control_resize)
                    item.controls_stretched, item.controls_mode = stretch_controls, control_mode
                if subset.multiple_target:  # the composite is its own reference (the condition image)
                    check_layers(path, layers.get(path), first_layered, size)
                    first_layered = first_layered or (path, len(layers[path]))
                    item.layer_paths, item.control_paths, item.control_buckets = layers[path], [path], [bucket]
                    item.controls_mode = control_mode
                items.append(item)
        if split := split_by_references(items[first_item:], ds.batch_size):
            section = "validation_datasets" if held_out_sets else "datasets"
            warnings.warn(f"{blueprint.source}: [[{section}]] #{di - first + 1}: {split}", stacklevel=2)
    return items


def split_by_references(items: list[ImageItem], batch_size: int) -> str:
    """The line for one dataset's images whose references' sizes split their batches ("" where they split none): a
    batch holds one bucket and one size of each reference, and a family that keeps references at their own size
    (as some pipelines do) put a dataset of references of assorted sizes into batches of one, without a word."""
    def batches(key) -> int:
        groups: dict = {}
        for item in items:
            groups[key(item)] = groups.get(key(item), 0) + item.subset.num_repeats
        return sum(-(-n // batch_size) for n in groups.values())

    if batch_size < 2 or not any(item.control_buckets for item in items):
        return ""
    shaped = batches(lambda item: (item.bucket, tuple(item.control_buckets)))
    counted = batches(lambda item: (item.bucket, len(item.control_buckets)))
    if shaped <= counted:
        return ""
    sizes = len({size for item in items for size in item.control_buckets})
    return (f"its reference images come in {sizes} sizes and a batch holds one size of each, so an epoch is {shaped} "
            f"batches where {counted} of batch_size {batch_size} would hold its images (smaller batches, more "
            f"steps): give the references of one target bucket one size to batch them fully")


def reference_count(blueprint: DatasetBlueprint) -> int:
    """The most reference images a training image of `blueprint` has, from the file names alone (no image
    opened). A layered (multiple_target) image has one: its composite is its own reference (scan_images)."""
    counts = [0]
    for ds in blueprint.datasets:
        for subset in ds.subsets:
            if subset.multiple_target:
                counts.append(1)
            elif subset.control_directory:
                paths = _image_files(subset.image_dir, (subset.control_directory, subset.mask_dir), warn=False)
                files, targets = control_files(subset.control_directory), target_stems(paths)
                counts += [len(find_controls(path, subset.control_directory, files, targets)) for path in paths]
    return max(counts)


def largest_reference(blueprint: DatasetBlueprint) -> tuple[int, int] | None:
    """(w, h) of the largest image by area in any subset's control_directory, from the files' headers (as
    stored: a rotation keeps the area); None where no subset has references. An edit family may encode a
    reference at its own size, not its target's (DiffusionFamily.control_bucket): the plans size it so."""
    sizes = [header_size(os.path.join(s.control_directory, name)) for ds in blueprint.datasets for s in ds.subsets
             if s.control_directory for name in control_files(s.control_directory).values()]
    return max(sizes, key=lambda wh: wh[0] * wh[1], default=None)


def layer_count(blueprint: DatasetBlueprint) -> int | None:
    """The most layer files a layered (multiple_target) image of `blueprint` has (its target is the composite
    and these: library/data/layers.py), from the file names; None where no subset is layered."""
    counts = []
    for ds in blueprint.datasets:
        for subset in ds.subsets:
            if subset.multiple_target:
                paths = _image_files(subset.image_dir, warn=False)
                counts += [len(layers) for layers in split_layers(paths)[1].values()]
    return max(counts, default=None)


class LargestStep(NamedTuple):
    width: int
    height: int
    batch: int
    references: int | None  # per training image; None: the family's own count (family.plan_controls)
    reference_size: tuple[int, int] | None = None  # the largest reference image (w, h); None: not read
    layers: int | None = None  # a layered target's layers; None: none, or not read


def largest_step(blueprint: DatasetBlueprint, references: int | None = None) -> LargestStep:
    """The largest training step `blueprint` asks for, as the memory plans size it (train_lora.py's
    settle_keeping_keys, tools/plan_memory.py): the datasets' largest bucket by area (largest_bucket), their
    largest batch_size, reference_count, largest_reference and layer_count; the held-out
    validation_datasets take no training step. references: a count given instead (plan_memory's
    --references): the folders are not read, so a plan needs no references on disk yet."""
    width, height = max((largest_bucket(d) for d in blueprint.datasets), key=lambda r: r[0] * r[1])
    batch = max(d.batch_size for d in blueprint.datasets)
    if references is not None:
        return LargestStep(width, height, batch, references)
    return LargestStep(width, height, batch, reference_count(blueprint), largest_reference(blueprint),
                       layer_count(blueprint))


def largest_bucket(ds: DatasetSpec) -> tuple[int, int]:
    """The largest (w, h) by area that a step of `ds` trains at: with buckets the largest of its grid (a
    resolution off the 16-pixel grid, e.g. 72, is a bucketed dataset's area, not a size it trains at: the
    plans sized 72 x 72, which no latent packs), else its resolution. bucket_no_upscale's sizes lie on the
    same grid within the same area."""
    if not ds.enable_bucket:
        return ds.resolution
    buckets = make_buckets(ds.resolution, ds.min_bucket_reso, ds.max_bucket_reso, ds.bucket_reso_steps)
    return max(buckets, key=lambda b: (b[0] * b[1], -abs(b[0] - b[1]), b[0]))  # of equal areas the squarest


def dataset_buckets(ds: DatasetSpec) -> list[tuple[int, int]]:
    """The (w, h) buckets of dataset `ds`: [resolution] without bucketing; with bucket_no_upscale
    every image is sized on its own (image_bucket), the list is not used."""
    if ds.enable_bucket and not ds.bucket_no_upscale:
        return make_buckets(ds.resolution, ds.min_bucket_reso, ds.max_bucket_reso, ds.bucket_reso_steps)
    return [ds.resolution]


def image_bucket(path: str, size: tuple[int, int], ds: DatasetSpec, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The (w, h) bucket an image of `size` trains at in dataset `ds` (buckets: dataset_buckets(ds))."""
    if not (ds.enable_bucket and ds.bucket_no_upscale):
        return bucket_for(size, buckets)
    bucket = bucket_without_upscale(size, ds.resolution[0] * ds.resolution[1], ds.bucket_reso_steps)
    if min(bucket) == 0:
        raise ValueError(f"{path}: image is {size[0]}x{size[1]}, smaller than "
                         f"bucket_reso_steps {ds.bucket_reso_steps} (bucket_no_upscale is on)")
    return bucket


def refuse_large_buckets(items, largest: tuple[int, int] | None, source: str) -> None:
    """ValueError naming the first ImageItem whose bucket is over the family's largest image (width, height;
    DiffusionFamily.largest_image; None: any size): the forward refused it at its first step, after caching.
    Without buckets that is the resolution; with them max_bucket_reso bounds a bucket's side, and bucket_no_upscale
    keeps a wide image's own aspect (any side, within the resolution's area)."""
    if largest is None:
        return
    for item in items:
        (w, h), (max_w, max_h) = item.bucket, largest
        if w > max_w or h > max_h:
            raise ValueError(f"{item.image_path}: its bucket {w}x{h} is over the largest image the model takes, {max_w} "
                             f"wide by {max_h} high (the positions its RoPE was built for); {source}'s resolution, "
                             f"max_bucket_reso or bucket_no_upscale set it")


def held_out_count(images: int, spec: DatasetSpec) -> int:
    """How many of a subset's `images` split_validation holds out: floor(images x validation_split),
    robust to 0.1 * 30 = 3.0000000000000004."""
    return int(images * spec.validation_split + 1e-9)


def held_out_paths(paths: list[str], subset: SubsetSpec, spec: DatasetSpec) -> list[str]:
    """The images of one subset (its trained ones) that split_validation holds out: the
    held_out_count(len(paths), spec) whose sha256(validation_seed | path inside the subset) ranks lowest."""
    def rank(path: str) -> str:  # a name that is no UTF-8 (a Latin-1 copy) as its bytes on disk, not an error
        name = f"{spec.validation_seed}|{os.path.relpath(path, subset.image_dir)}"
        return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()

    count = held_out_count(len(paths), spec)
    return sorted(paths, key=rank)[:count] if count else []


def no_held_out(source: str, index: int, spec: DatasetSpec) -> str:
    """The line for a dataset whose validation_split holds out no image (index from 0)."""
    return (f"{source}: [[datasets]] #{index + 1}: validation_split {spec.validation_split} holds out no image "
            f"(floor(images of a subset x validation_split) is 0 for every subset); raise it, add images, or use "
            f"[[validation_datasets]]")


def split_validation(items: list[ImageItem], blueprint: DatasetBlueprint) -> tuple[list[ImageItem], list[ImageItem]]:
    """(training items, validation items). A dataset with validation_split > 0 holds out
    floor(n * validation_split) images of each of its subsets (as sd-scripts; held_out_paths): those
    whose sha256(validation_seed | path inside the subset) ranks lowest. The choice depends on neither
    the training seed nor the file order nor where the dataset lives, and adding an image moves
    at most one other."""
    by_subset: dict[int, list[ImageItem]] = {}
    for item in items:
        by_subset.setdefault(id(item.subset), []).append(item)
    held_out: set[int] = set()
    for group in by_subset.values():
        if group[0].subset.is_reg:  # regularization images are never validation images
            continue
        spec = blueprint.datasets[group[0].dataset_index]
        chosen = set(held_out_paths([item.image_path for item in group], group[0].subset, spec))
        held_out.update(id(item) for item in group if item.image_path in chosen)
    for di, spec in enumerate(blueprint.datasets):
        if spec.validation_split and not any(id(it) in held_out for it in items if it.dataset_index == di):
            raise ValueError(no_held_out(blueprint.source, di, spec))
    return [it for it in items if id(it) not in held_out], [it for it in items if id(it) in held_out]


def _usable_images(paths: list[str], ds: DatasetSpec, subset: SubsetSpec) -> list[tuple[str, tuple[int, int]]]:
    """(path, size) of a subset's images, each verified readable. Every image of a bad size (bad_size)
    is one warning, and left out with skip_bad_size_images; then one count for the subset."""
    skip, usable, bad = subset.skip_bad_size_images, [], 0
    for path in paths:
        size = verified_image_size(path)
        problem = bad_size(size, ds)
        if problem:
            bad += 1
            warnings.warn(f"{path}: {problem}" + ("; skipped (skip_bad_size_images)" if skip else ""), stacklevel=2)
        if not (problem and skip):
            usable.append((path, size))
    min_side, name, max_aspect, widest = size_limits(ds)
    limits = f"smaller than {name} or beyond {widest.split(',')[0]} in aspect ratio"
    good = f"at least {name} {min_side} per side within {widest} = {max_aspect:.1f}"
    trained = "they are trained as they are"
    if ds.enable_bucket and ds.bucket_no_upscale:  # bad_size's one problem there: no bucket holds them
        bucket = f"a bucket_reso_steps {ds.bucket_reso_steps} bucket without upscaling"
        limits, good, trained = f"too small for {bucket}", f"large enough for {bucket}", "the first of them stops the scan"
    if bad:
        outcome = ("skipped (skip_bad_size_images)" if skip
                   else f"{trained} (skip_bad_size_images = true leaves them out)")
        warnings.warn(f"{subset.image_dir}: {bad} of {len(paths)} images are {limits}; {outcome}", stacklevel=2)
    if not usable:
        raise ValueError(f"{subset.image_dir}: every image was skipped (skip_bad_size_images): none is {good}")
    return usable


def subset_images(subset: SubsetSpec, folders_read=()) -> tuple[list[str], dict[str, list[str]]]:
    """(the subset's training images, image -> its layer files): with multiple_target the numbered
    layer files beside an image are its layers, not images of their own (library/data/layers.py).
    folders_read: the folders other subsets read (folders_read(blueprint)), whose images are not said
    'not trained' where they lie below image_dir."""
    paths = _image_files(subset.image_dir, (subset.control_directory, subset.mask_dir, *folders_read),
                         caption_extension=subset.caption_extension)
    return split_layers(paths) if subset.multiple_target else (paths, {})


def folders_read(blueprint: DatasetBlueprint) -> set[str]:
    """Every folder a subset of `blueprint` reads, training or validation: its image_dir, control_directory
    and mask_dir. A subset's folder inside another's image_dir is read there, not left untrained."""
    return {folder for ds in (*blueprint.datasets, *blueprint.validation_datasets) for s in ds.subsets
            for folder in (s.image_dir, s.control_directory, s.mask_dir) if folder}


def check_image_dir(folder: str) -> None:
    """ValueError naming `folder` where it is not a folder (the web UI refuses such a dataset before queuing)."""
    if not os.path.isdir(folder):
        relative = "" if os.path.isabs(folder) else f" (a relative image_dir is read from the current folder, {os.getcwd()})"
        raise ValueError(f"{folder}: image_dir does not exist or is not a folder{relative}")


def _image_files(folder: str, other_folders=(), warn: bool = True, caption_extension: str = "") -> list[str]:
    """The images at the top of `folder` (image_dir is not searched recursively, as in sd-scripts and
    musubi-tuner); images in its subfolders other than `other_folders` (the folders the config reads:
    subset_images) are said: with none at the top an error, else (`warn`) a warning (they are not trained),
    as are caption files of `caption_extension` that no file's name pairs (_unpaired_captions)."""
    check_image_dir(folder)
    names = sorted(os.listdir(folder))
    files, unread = [f for f in names if is_image_name(f)], _unread_images(names)
    # The subfolders are walked only where their count is said (reference_count's early look does not).
    below, example = _images_in_subfolders(folder, other_folders) if warn or not files else (0, "")
    not_searched = (f"its subfolders hold {below} (e.g. {example}), and image_dir is not searched recursively: give "
                    "each folder its own [[datasets.subsets]] (sd-scripts' '<repeats>_<name>' folder: that folder "
                    "as image_dir, <repeats> as num_repeats)")
    if not files:
        raise ValueError(f"{folder}: image_dir holds no images ({', '.join(IMAGE_EXTENSIONS)})"
                         + (f"; {not_searched}" if below else "") + (f"; {unread}" if unread else ""))
    if below and warn:
        warnings.warn(f"{folder}: {below} images are not trained: {not_searched}", stacklevel=2)
    if unread and warn:
        warnings.warn(f"{folder}: {unread}", stacklevel=2)
    if (unpaired := _unpaired_captions(names, files, caption_extension)) and warn:
        warnings.warn(f"{folder}: {unpaired}", stacklevel=2)
    images_by_stem(folder, files)  # two of one name would share one caption file and one cache file
    return [os.path.join(folder, f) for f in files]


def _unread_images(names: list[str]) -> str:
    """What a folder's files of an image type this trainer does not read are ("" without any)."""
    unread = [n for n in names if n.lower().endswith(UNREAD_IMAGE_EXTENSIONS) and not n.startswith(".")]
    if not unread:
        return ""
    kinds = sorted({os.path.splitext(n)[1].lower() for n in unread})
    return (f"{len(unread)} files of a type not read ({', '.join(kinds)}; e.g. {unread[0]}) are not trained: convert "
            f"them to {', '.join(IMAGE_EXTENSIONS)}")


def _unpaired_captions(names: list[str], images: list[str], extension: str) -> str:
    """What a folder's caption files of `extension` (in any case) that no file's name pairs are ("" without any): a
    renamed or deleted image, or a name that differs only in case (Photo.JPG, photo.txt or photo.JPG, photo.TXT
    pair on Windows, not here), whose image trains without its caption."""
    if not extension:
        return ""
    cut = len(extension)
    stems = {os.path.splitext(n)[0] for n in names if not n.lower().endswith(extension.lower())}
    unpaired = [n for n in names if n.lower().endswith(extension.lower()) and not n.startswith(".")
                and not (n.endswith(extension) and n[:-cut] in stems)]
    if not unpaired:
        return ""
    by_lower = {os.path.splitext(n)[0].lower(): n for n in images}
    cased = [(n, by_lower[n[:-cut].lower()]) for n in unpaired if n[:-cut].lower() in by_lower]
    case = (f"; {cased[0][0]} is not read as {cased[0][1]}'s caption (file names are case-sensitive here; it reads "
            f"{os.path.splitext(cased[0][1])[0]}{extension}): rename it" if cased else "")
    return f"{len(unpaired)} {extension} caption files have no image of their name (e.g. {unpaired[0]}){case}"


def _images_in_subfolders(folder: str, other_folders) -> tuple[int, str]:
    """(how many images the subfolders of `folder` hold, one of them relative to it); hidden folders
    and `other_folders` (with what is under them) are not counted."""
    skip = {os.path.realpath(f) for f in other_folders if f}
    count, example = 0, ""
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and os.path.realpath(os.path.join(root, d)) not in skip)
        if root == folder:
            continue
        images = sorted(n for n in names if is_image_name(n))
        count += len(images)
        example = example or (os.path.relpath(os.path.join(root, images[0]), folder) if images else "")
    return count, example


# The caption extensions datasets ship: sd-scripts' default and ours (dataset_config.DEFAULTS).
COMMON_CAPTION_EXTENSIONS = (".caption", ".txt")


def other_caption_file(image_path: str, subset: SubsetSpec) -> str | None:
    """The extension of a caption file beside an image that falls back to class_tokens (no file of the
    subset's caption_extension), written with another common caption extension; None when there is none.
    An sd-scripts dataset's `.caption` files (its default) would else be passed over without a word."""
    if not subset.class_tokens:
        return None
    return _other_extension(image_path, subset.caption_extension)


def _other_extension(image_path: str, extension: str) -> str | None:
    """The first of COMMON_CAPTION_EXTENSIONS other than `extension` with a file beside the image, where
    none of `extension` is there; else None."""
    stem = os.path.splitext(image_path)[0]
    if os.path.exists(stem + extension):
        return None
    return next((ext for ext in COMMON_CAPTION_EXTENSIONS if ext != extension and os.path.exists(stem + ext)), None)


def unread_caption_files(paths: list[str], subset: SubsetSpec) -> str | None:
    """One line on the images of a subset trained on class_tokens though a caption file of another
    extension (other_caption_file) sits beside them; None if there are none."""
    found = [(path, ext) for path in paths if (ext := other_caption_file(path, subset))]
    if not found:
        return None
    path, ext = found[0]
    return (f"{subset.image_dir}: {len(found)} images have no {subset.caption_extension} caption file but a {ext} one "
            f"(first {os.path.basename(path)}), so they train on class_tokens {subset.class_tokens!r}; set "
            f'caption_extension = "{ext}" in this subset to train on those captions')


def read_caption(image_path: str, subset: SubsetSpec) -> str:
    """The image's caption file's text (or its subset's class_tokens), with the subset's caption_prefix
    and caption_suffix joined by a space as sd-scripts joins them (before shuffling: keep_tokens counts them)."""
    caption_path = os.path.splitext(image_path)[0] + subset.caption_extension
    if os.path.exists(caption_path):
        caption = read_utf8(caption_path, "caption file").strip()
        if not caption:
            raise ValueError(f"{caption_path}: caption file is empty")
    elif subset.class_tokens:
        caption = subset.class_tokens
    else:  # an sd-scripts dataset's .caption files (its default extension) get the key that reads them
        other = _other_extension(image_path, subset.caption_extension)
        hint = f"; a {other} one is beside it: set caption_extension = \"{other}\" in its subset" if other else ""
        if cased := _other_case(caption_path):
            hint = f"; '{cased}' is beside it, and file names are case-sensitive here: rename it"
        raise ValueError(f"{image_path}: no caption file '{os.path.basename(caption_path)}' "
                         f"and no class_tokens for its subset{hint}")
    return " ".join(part for part in (subset.caption_prefix, caption, subset.caption_suffix) if part)


def _other_case(path: str) -> str | None:
    """The name of a file beside `path` that differs from its name only in case (k.TXT for k.txt); None if none."""
    folder, name = os.path.split(path)
    return next((n for n in sorted(os.listdir(folder or ".")) if n.lower() == name.lower() and n != name), None)


def caption_as_written(caption: str, subset: SubsetSpec) -> str:
    """read_caption's text without the subset's caption_prefix / caption_suffix: the caption file's (or
    class_tokens), which sd-scripts' ss_tag_frequency counts (its prefix joins later, in process_caption)."""
    if subset.caption_prefix and caption.startswith(subset.caption_prefix + " "):
        caption = caption[len(subset.caption_prefix) + 1:]
    if subset.caption_suffix and caption.endswith(" " + subset.caption_suffix):
        caption = caption[: -len(subset.caption_suffix) - 1]
    return caption
