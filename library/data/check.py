"""What a dataset TOML will train, found before anything is cached: per subset its images, their
sizes and buckets, and every problem, each one line naming the file and what was expected.

Severities:
- error: training stops on it (scan_images, or caching for pixels it refuses, raises that message
  at the first such file; the check lists them all): an unreadable or undecodable image, a missing,
  empty, unreadable or non-UTF-8 caption, a missing or mis-sized mask, a missing reference of an edit dataset (with
  the training family known: a reference count its model_type does not take, a bucket over its largest image),
  a layered image's missing, unreadable or mis-sized layers or another layer count, two images of one name,
  a caption longer than a text encoder takes that refuses it (TokenLimit.refuses; training raises it before caching);
- warning: training goes on with data that is not what it seems: an image of a bad size for the
  buckets (dataset.bad_size: upscaled or cropped, or skipped with skip_bad_size_images), a caption
  longer than the text encoder keeps (TokenLimit: the rest is cut; not one it encodes whole with its
  references, TokenLimit.cuts_with_references), the same file twice (content
  hash, across subsets and validation sets: a duplicate in a validation set is a leak), an image both
  trained and held out for validation (one line for all of them), regularization images past the
  training images' count (dataset.reg_repeats' line: never drawn, counted as not drawn, not as trained),
  caption files of another extension beside images trained on class_tokens (image_folders.unread_caption_files);
- note: handled, counted per subset: images turned upright by their EXIF orientation (the peers train them as
  stored), CMYK converted to RGB, 16-bit grey scaled to 8 bits
  (images.to_8_bit), no caption file of any common extension (trains on class_tokens), no alpha channel with alpha_mask,
  transparent pixels without it (trained as stored), captions of several lines (trained whole);
  and one line for the images enlarged to their bucket (upscaled: how many, by up to how much),
  which training prints once too.

tools/check_dataset.py prints the whole report. train_lora.py (DiffusionTask) scans the dataset
itself, which raises the errors and warns about sizes; before caching it raises on captions the text
encoder refuses (refuse_long_captions) and warns, once, about what that scan does not look at
(training_warnings: duplicates and cut captions) through warn().
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Callable

from PIL import Image

from library.data.captions import caption_variants, fixed_caption
from library.data.controls import check_family_takes, control_files, find_controls, target_stems
from library.data.image_folders import (bad_size, dataset_buckets, folders_read, held_out_count, held_out_paths,
                                        image_bucket, no_held_out, other_caption_file, read_caption,
                                        refuse_large_buckets, split_by_references, subset_images,
                                        unread_caption_files)
from library.data.dataset import reg_repeats
from library.data.dataset_config import DatasetBlueprint, DatasetSpec, SubsetSpec
from library.data.images import (WIDE_GREY_MODES, exif_orientation, is_image_name, load_rgb, stem_collisions,
                                 upscale_factor, verified_image_size)
from library.data.layers import check_layers, split_layers
from library.data.masks import find_mask, has_alpha


@dataclass
class TokenLimit:
    """How a family's text encoder sees a caption: count(caption) -> its tokens as the encoder
    counts them (template included where the encoder keeps it), max_tokens of them are kept."""

    encoder: str  # "T5-XXL", ...
    max_tokens: int
    count: Callable[[str], int]
    refuses: bool = False  # a longer caption is refused (an error: caching would stop on it), not cut
    cuts_with_references: bool = True  # False: a caption encoded with its references (control_directory) is kept whole


@dataclass
class Problem:
    severity: str  # "error" | "warning"
    kind: str  # image, pixels, caption, tokens, size, bucket, mask, reference, layers, duplicate, folder, regularization
    message: str  # one line naming the file

    def line(self) -> str:
        return f"{self.severity}: {self.message}"


@dataclass
class SubsetReport:
    section: str  # where it is in the TOML: "datasets 1, subset 2"
    image_dir: str
    images: int = 0  # image files found
    trained: int = 0  # of them, the ones training uses
    held_out: int = 0  # of the readable ones, the validation_split share (validation only, never trained on)
    not_drawn: int = 0  # readable regularization images the balance to the training images never draws (reg_repeats)
    sizes: Counter = field(default_factory=Counter)  # "WxH" -> images (as displayed)
    buckets: Counter = field(default_factory=Counter)  # "WxH" -> images
    tokens: list[int] = field(default_factory=list)  # per caption, when a TokenLimit counted them
    problems: list[Problem] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)  # what was handled -> the files
    upscaled: str | None = None  # the images enlarged to their bucket (check.upscaled), one line

    def add(self, severity: str, kind: str, message: str) -> None:
        self.problems.append(Problem(severity, kind, message))

    def note(self, what: str, path: str) -> None:
        self.notes.setdefault(what, []).append(path)

    def to_json(self) -> dict:
        return {**{k: getattr(self, k) for k in ("section", "image_dir", "images", "trained", "held_out", "not_drawn",
                                                 "tokens", "notes", "upscaled")},
                "sizes": dict(self.sizes), "buckets": dict(self.buckets), "problems": [asdict(p) for p in self.problems]}


@dataclass
class DatasetReport:
    source: str
    subsets: list[SubsetReport]
    token_check: str  # what caption lengths were counted with, or why they were not

    def problems(self) -> list[Problem]:
        return [p for s in self.subsets for p in s.problems]

    def to_json(self) -> dict:
        return {"source": self.source, "token_check": self.token_check, "subsets": [s.to_json() for s in self.subsets],
                "errors": sum(p.severity == "error" for p in self.problems()),
                "warnings": sum(p.severity == "warning" for p in self.problems())}


# ----------------------------------------------------------------------------------------------
# Checks shared by the report and training


def content_hashes(paths) -> dict[str, str]:
    """sha256 of each distinct file's bytes."""
    hashes = {}
    for path in dict.fromkeys(paths):
        with open(path, "rb") as f:
            hashes[path] = hashlib.file_digest(f, "sha256").hexdigest()
    return hashes


def duplicate_problems(paths) -> list[tuple[str, Problem]]:
    """(path, warning) for every file whose bytes equal an earlier one's (the same path twice is
    one file: two subsets over one folder are not duplicates)."""
    first: dict[str, str] = {}
    found = []
    for path, digest in content_hashes(paths).items():
        if digest in first:
            found.append((path, Problem("warning", "duplicate", f"{path}: the same file as {first[digest]}")))
        else:
            first[digest] = path
    return found


def caption_tokens(image_path: str, subset: SubsetSpec, caption: str, limit: TokenLimit) -> tuple[int, Problem | None]:
    """(tokens of the longest text encoded for the caption, a warning when the encoder cuts it, an error when it
    refuses it). Its augmented caption_variants are encoded too, and they join the tags with ", ": with another
    caption_separator they are longer than the caption as written. They are seeded by the caption, so counted as cached."""
    trained = limit.count(fixed_caption(caption, subset))
    n = max([trained, *map(limit.count, dict.fromkeys(caption_variants(caption, subset)))])
    kept_whole = bool(subset.control_directory) and not limit.cuts_with_references  # every image there has references
    if n <= limit.max_tokens or kept_whole:
        return n, None
    caption_file = os.path.splitext(image_path)[0] + subset.caption_extension
    where = caption_file if os.path.exists(caption_file) else f"{image_path} (class_tokens)"
    size = f"{n} {limit.encoder} tokens"
    if n > trained:
        size += f" in an augmented variant (caption_variants join its tags with ', '; as written it is {trained})"
    if limit.refuses:
        return n, Problem("error", "tokens", f"{where}: caption is {size}; the encoder takes at "
                                             f"most {limit.max_tokens} and refuses longer ones")
    return n, Problem("warning", "tokens", f"{where}: caption is {size}; the encoder keeps "
                                           f"{limit.max_tokens}, the rest is cut")


def caption_problems(items, limit: TokenLimit) -> list[Problem]:
    """caption_tokens' problems of the ImageItems' captions."""
    captions = {(item.image_path, id(item.subset)): item for item in items}  # one image in two subsets: two captions
    found = (caption_tokens(item.image_path, item.subset, item.caption, limit)[1] for item in captions.values())
    return [p for p in found if p]


def refuse_long_captions(items, limit: TokenLimit | None) -> None:
    """ValueError naming the first of the ImageItems' captions that the text encoder refuses (TokenLimit.refuses):
    caching would stop on it, after the latents, in a line naming no file."""
    if limit is not None and limit.refuses:
        for problem in caption_problems(items, limit):
            raise ValueError(problem.message)


def leak_problem(trained_paths, held_out_paths) -> Problem | None:
    """One warning for the images that are both trained and held out for validation ([[validation_datasets]]
    over a training folder, validation_split in only one of two datasets over a folder); None if none."""
    trained = set(trained_paths)
    both = sorted(set(held_out_paths) & trained)
    if not both:
        return None
    shown = ", ".join(both[:3]) + (f" and {len(both) - 3} more" if len(both) > 3 else "")
    return Problem("warning", "leak", f"{len(both)} validation image(s) also trained: {shown}; the validation loss on "
                                      f"them is on images the LoRA learns (hold out other images, or give every "
                                      f"dataset over that folder the same validation_split)")


def training_warnings(train, validation, limit: TokenLimit | None) -> list[Problem]:
    """What the training scan (scan_images) does not warn about itself, for its ImageItems: files
    that are the same image, images both trained and validated on, and captions the text encoder cuts
    (one that refuses long captions cuts none: refuse_long_captions raises on them)."""
    items = [*train, *validation]
    problems = [p for _, p in duplicate_problems(item.image_path for item in items)]
    leak = leak_problem((item.image_path for item in train), (item.image_path for item in validation))
    problems += [leak] if leak else []
    if limit is None or limit.refuses:
        return problems
    return problems + caption_problems(items, limit)


# References whose tokens in training and at render differ by more than this factor (in area) are said
REFERENCE_AREA_APART = 1.5


def references_sized_apart(items, sample_control_bucket) -> str | None:
    """One line where references train at another size than samples and the pipelines fit them to (the family's
    sample_control_bucket(target, size) -> (w, h)): edit models that train a reference at the target's bucket or
    the resolution's area, where their pipelines (ComfyUI's too) fit it to ~1 MP. Trained at 512 px, the LoRA
    learned references of a quarter of the tokens it renders with, and said nothing. None if none."""
    trained = [(item.bucket, size) for item in items for size in getattr(item, "control_buckets", ())]
    apart = [(size, sample_control_bucket(bucket, size)) for bucket, size in trained]
    apart = [(a, b) for a, b in apart
             if not 1 / REFERENCE_AREA_APART <= (a[0] * a[1]) / (b[0] * b[1]) <= REFERENCE_AREA_APART]
    if not apart:
        return None
    (tw, th), (sw, sh) = apart[0]
    return (f"{len(apart)} of {len(trained)} reference images train at another size than samples and the model's "
            f"pipeline give them (the first: {tw}x{th} in training, {sw}x{sh} to render): the LoRA learns references "
            f"of {tw * th / (sw * sh):.2g}x the tokens it renders with; train at the pipeline's resolution (its "
            f"references' ~{sw * sh / 1e6:.1f} MP) for an edit LoRA that renders as trained")


def upscaled(items) -> str | None:
    """One line on the images (ImageItems, or anything with image_path, size and bucket) that are
    enlarged to their bucket: how many, by how much at most and the image enlarged most; None if none.
    Not a problem (sd-scripts enlarges them too), but a 512 px photo trained at 1024 px is blurred."""
    enlarged = [(upscale_factor(item.size, item.bucket), item) for item in items]
    enlarged = [(factor, item) for factor, item in enlarged if factor > 1]
    if not enlarged:
        return None
    factor, worst = max(enlarged, key=lambda pair: pair[0])
    return (f"{len(enlarged)} of {len(items)} images are upscaled to their bucket, by up to {factor:.2f}x ({worst.image_path}: "
            "{}x{} -> {}x{}); enable_bucket with bucket_no_upscale = true trains them at their own size".format(
                *worst.size, *worst.bucket))


def warn(problems: list[Problem]) -> None:
    """The channel the dataset scan warns through (Python warnings, printed to stderr)."""
    for p in problems:
        warnings.warn(p.message, stacklevel=2)


# ----------------------------------------------------------------------------------------------
# The whole report


def check_dataset(blueprint: DatasetBlueprint, limit: TokenLimit | None = None,
                  token_check: str = "not counted (no tokenizer)", takes: tuple[str, int, int, bool] | None = None,
                  vl_size=None, largest: tuple[int, int] | None = None, control_bucket=None,
                  sample_control_bucket=None) -> DatasetReport:
    """Every subset of the training and validation datasets, checked image by image, plus
    duplicates across all of them. takes: (model_type, min_controls, max_controls, takes_layers) of the
    family that trains on it: reference counts and layered targets it does not take are errors, as
    training's check_family_takes, and with takes, vl_size (its reference_vl_size) refuses references
    its Qwen-VL image processor does not take; largest: its largest_image(), a bucket over it is an error
    (refuse_large_buckets); control_bucket: its control_bucket, references whose sizes split a dataset's batches
    are a warning (split_by_references, as training warns), and with sample_control_bucket references trained at
    another size than the pipeline gives them (references_sized_apart, as training warns)."""
    subsets, where = [], {}  # where: image path -> the report of its first subset
    trained, held_out = set(), {}  # held_out: image path -> the report of its first validation subset
    sections = [("datasets", blueprint.datasets), ("validation_datasets", blueprint.validation_datasets)]
    read = folders_read(blueprint)  # a subset's folder inside another's image_dir is not 'not trained' there
    for name, datasets in sections:
        for di, ds in enumerate(datasets, start=1):
            layered = {}  # the dataset's first composite: every other needs as many layers (as scan_images)
            reports, kept = [], []  # kept: (subset, report, its trained paths), for the regularization balance
            batched = [] if control_bucket else None  # (bucket, its references' buckets) of each image, for the split
            for si, subset in enumerate(ds.subsets, start=1):
                report = SubsetReport(f"{name} {di}, subset {si}", subset.image_dir)
                readable, used = check_subset(report, ds, subset, limit, layered, takes, vl_size=vl_size,
                                              largest=largest, source=blueprint.source, read=read,
                                              batched=None if batched is None else (batched, control_bucket))
                for path in readable:
                    where.setdefault(path, report)
                if name == "validation_datasets":  # every image of it is held out
                    report.held_out, report.trained, split = report.held_out + report.trained, 0, used
                else:  # split_validation's choice (regularization images are never held out)
                    split = [] if subset.is_reg else held_out_paths(used, subset, ds)
                trained.update(path for path in used if path not in split)
                kept.append((subset, report, [path for path in used if path not in split]))
                for path in split:
                    held_out.setdefault(path, report)
                reports.append(report)
            if name == "datasets":  # validation draws every reg image once: no balance there
                balance_regularization(di - 1, kept)
            if reports and (split := split_by_references(batched or [], ds.batch_size)):
                reports[0].add("warning", "reference", f"{blueprint.source}: [[{name}]] #{di}: {split}")
            apart = references_sized_apart(batched or [], sample_control_bucket) if sample_control_bucket else None
            if reports and apart:
                reports[0].add("warning", "reference", f"{blueprint.source}: [[{name}]] #{di}: {apart}")
            if name == "datasets" and ds.validation_split and not any(r.held_out for r in reports):
                reports[0].add("error", "folder", no_held_out(blueprint.source, di - 1, ds))
            subsets += reports
    if leak := leak_problem(trained, held_out):
        held_out[min(set(held_out) & trained)].problems.append(leak)
    for path, problem in duplicate_problems(where):
        where[path].problems.append(problem)
    return DatasetReport(blueprint.source, subsets, f"{limit.encoder}, {limit.max_tokens} tokens kept" if limit
                         else token_check)


def balance_regularization(dataset_index: int, kept: list) -> None:
    """Count only the regularization images training draws (dataset.reg_repeats balances them to the
    training images; the rest are never drawn) and add its warning on the others to their subset's report.
    kept: (subset, report, its trained paths) of one training dataset, in order."""
    items = [SimpleNamespace(dataset_index=dataset_index, subset=subset, image_path=path, report=report)
             for subset, report, paths in kept for path in paths]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        repeats = reg_repeats(items)
    unused = [item for item in items if item.subset.is_reg and repeats[id(item)] == 0]
    for item in unused:
        item.report.trained -= 1
        item.report.not_drawn += 1
    for w in said:
        unused[0].report.add("warning", "regularization", str(w.message))


def check_layered(report: SubsetReport, path: str, its_layers: list[str] | None, layered: dict, size) -> None:
    """A layered target's layer files (check_subset's layered: the dataset's first composite, for the count)."""
    try:
        check_layers(path, its_layers, layered.get("first"), size)
        for layer in its_layers:
            load_rgb(layer, "RGBA")  # the whole decode, as caching does
        layered.setdefault("first", (path, len(its_layers)))
    except ValueError as e:  # no layers, another count, an unreadable layer or one of another size
        report.add("error", "layers", str(e))


def check_subset(report: SubsetReport, ds: DatasetSpec, subset: SubsetSpec, limit: TokenLimit | None,
                 layered: dict | None = None, takes: tuple[str, int, int, bool] | None = None,
                 vl_size=None, largest: tuple[int, int] | None = None,
                 source: str = "<dict>", read=(), batched=None) -> tuple[list[str], list[str]]:
    """Fill `report` for one subset; returns the readable images' paths (for the duplicate check) and
    those training uses (for the held-out ones: split_validation's choice).
    layered: the dataset's first composite ({"first": (path, layer count)}), shared by its subsets;
    takes, vl_size, largest: check_dataset's; source: the dataset TOML, for refuse_large_buckets' line;
    read: the folders the dataset config reads (image_folders.folders_read), not 'not trained' below image_dir;
    batched: (a list, the family's control_bucket): each image with references is appended with its bucket and
    its references' (split_by_references)."""
    layered = {} if layered is None else layered
    scanned = subset_paths(report, subset, read)
    if scanned is None:
        return [], []
    paths, layers = scanned
    report.images = len(paths)
    try:
        controls = control_files(subset.control_directory) if subset.control_directory else None
    except (ValueError, OSError) as e:  # two references of one name (a.png, a.jpg), or no such folder
        report.add("error", "reference", str(e) if isinstance(e, ValueError) else f"{subset.control_directory}: {e.strerror}")
        controls = None
    buckets, readable, targets = dataset_buckets(ds), [], target_stems(paths)
    placed, used = [], []  # the images given a bucket, for the upscale line; the images training uses
    for path in paths:
        if subset.skip_bad_size_images and skipped_for_size(report, path, ds):  # training never decodes it
            continue
        # With alpha_mask the alpha is the loss mask, with multiple_target it is trained: else it is dropped.
        size = check_pixels(report, path, alpha_dropped=not (subset.alpha_mask or subset.multiple_target))
        if size is None:
            continue
        problem = bad_size(size, ds)
        if problem:
            report.add("warning", "size", f"{path}: {problem}" + ("; skipped (skip_bad_size_images)"
                                                                    if subset.skip_bad_size_images else ""))
            if subset.skip_bad_size_images:  # training never looks at it again (nor at its copies: no duplicate)
                continue
        readable.append(path)
        try:
            bucket = image_bucket(path, size, ds, buckets)
            report.buckets["{}x{}".format(*bucket)] += 1
            placed.append(SimpleNamespace(image_path=path, size=size, bucket=bucket))
            refuse_large_buckets(placed[-1:], largest, source)  # as training does before caching
        except ValueError as e:
            report.add("error", "bucket", str(e))
        report.trained += 1
        used.append(path)
        report.sizes["{}x{}".format(*size)] += 1
        check_caption(report, path, subset, limit)
        check_mask(report, path, subset, size)
        references = [path] if subset.multiple_target else []  # the composite is its own (scan_images)
        if controls is not None:
            references, sizes = check_references(report, path, subset, controls, targets)
            if batched is not None and references and placed and placed[-1].image_path == path:
                items, rule = batched  # as scan_controls sizes them
                items.append(SimpleNamespace(bucket=placed[-1].bucket, subset=subset, control_buckets=[
                    tuple(rule(placed[-1].bucket, size, ds.resolution)) for size in sizes]))
        if takes is not None and references is not None:
            try:
                model_type, fewest, most, layered_ok = takes
                check_family_takes([SimpleNamespace(image_path=path, control_paths=references, subset=subset)],
                                   model_type, most, fewest, layered_ok, vl_size)
            except ValueError as e:
                report.add("error", "reference", str(e))
        if subset.multiple_target:
            check_layered(report, path, layers.get(path), layered, size)
    report.upscaled = upscaled(placed)
    if unread := unread_caption_files(paths, subset):  # as scan_images warns
        report.add("warning", "caption", unread)
    if paths and not report.trained and readable and subset.skip_bad_size_images:
        report.add("error", "folder", f"{subset.image_dir}: every image is skipped (skip_bad_size_images)")
    if not subset.is_reg:  # split_validation's count of this subset
        report.held_out = held_out_count(report.trained, ds)
        report.trained -= report.held_out
    return readable, used


def subset_paths(report: SubsetReport, subset: SubsetSpec, read=()) -> tuple[list[str], dict] | None:
    """The subset's images and layer files as training scans them (subset_images), its warnings and errors in
    `report`; where the scan fails (no images, or images of one name) the folder's images all the same, to check
    them anyway; None where there is no folder."""
    layers = {}
    try:
        with warnings.catch_warnings(record=True) as said:  # images in subfolders: this report's warnings
            warnings.simplefilter("always")
            paths, layers = subset_images(subset, read)  # multiple_target: the layer files are not images of their own
    except ValueError as e:  # no folder, no images, or images of one name (then check them anyway)
        report.add("error", "folder", str(e))
        if not os.path.isdir(subset.image_dir):
            return None
        names = sorted(os.listdir(subset.image_dir))
        for collision in stem_collisions(subset.image_dir, names):  # training stops at the first; the check lists all
            if collision != str(e):
                report.add("error", "folder", collision)
        paths = [os.path.join(subset.image_dir, f) for f in names if is_image_name(f)]
        if subset.multiple_target:  # the layer files are layers here too, as subset_images takes them
            paths, layers = split_layers(paths)
    for w in said:  # said before a collision stopped the scan too
        report.add("warning", "folder", str(w.message))
    return paths, layers


def skipped_for_size(report: SubsetReport, path: str, ds: DatasetSpec) -> bool:
    """An image skip_bad_size_images leaves out by its header's size (training's scan reads no more of it: a
    truncated one of those was an error of the check alone): its warning, and True."""
    try:
        problem = bad_size(verified_image_size(path), ds)
    except ValueError:  # unreadable: check_pixels names it, as training's scan does
        return False
    if problem:
        report.add("warning", "size", f"{path}: {problem}; skipped (skip_bad_size_images)")
    return bool(problem)


def check_pixels(report: SubsetReport, path: str, alpha_dropped: bool = True) -> tuple[int, int] | None:
    """The image's size when it reads and decodes as training reads it (load_rgb), else None and
    an error; CMYK and 16-bit grey are noted (converted, scaled). alpha_dropped: transparent pixels
    are noted, from the same decode: training reads them as the colour stored under them (load_rgb
    drops the alpha, as sd-scripts does), often black where a viewer shows white or a checkerboard."""
    try:
        size = verified_image_size(path)
        with Image.open(path) as img:
            mode, alpha = img.mode, "A" in img.getbands() or "transparency" in img.info
            turned = exif_orientation(img, path) in range(2, 9)
        # the whole decode, as caching does: a truncated file or refused pixels fail here
        pixels = load_rgb(path, "RGBA" if alpha and alpha_dropped else "RGB")
    except ValueError as e:  # each names the file
        report.add("error", "image", str(e))
        return None
    if turned:
        report.note("images turned upright by their EXIF orientation, as viewers show them (sd-scripts and "
                    "musubi-tuner train the pixels as stored: a phone photo sideways)", path)
    if mode == "CMYK":
        report.note("CMYK images, converted to RGB (without their colour profile)", path)
    elif mode in WIDE_GREY_MODES:
        report.note("16-bit grey images, scaled to 8 bits", path)
    if pixels.mode == "RGBA" and pixels.getchannel("A").getextrema()[0] < 255:
        report.note("images with transparent pixels, trained as the colour stored under them (the alpha is dropped, "
                    "as sd-scripts drops it; alpha_mask = true leaves them out of the loss)", path)
    return size


def check_caption(report: SubsetReport, path: str, subset: SubsetSpec, limit: TokenLimit | None) -> None:
    caption_file = os.path.splitext(path)[0] + subset.caption_extension
    try:
        caption = read_caption(path, subset)
    except ValueError as e:  # missing, empty, not UTF-8
        report.add("error", "caption", str(e))
        return
    except OSError as e:  # a folder of its name, no permission: training stops on it too, the check goes on
        report.add("error", "caption", f"{caption_file}: cannot read caption file ({e.strerror or type(e).__name__})")
        return
    if not os.path.exists(caption_file):
        if not other_caption_file(path, subset):  # those are in the subset's warning (unread_caption_files)
            report.note(f"images without a caption file, trained on class_tokens {subset.class_tokens!r}", path)
    elif "\n" in caption:
        report.note("captions of several lines, trained whole (sd-scripts trains the first line, or with "
                    "enable_wildcard a random one)", caption_file)
    if limit is not None:
        tokens, problem = caption_tokens(path, subset, caption, limit)
        report.tokens.append(tokens)
        if problem:
            report.problems.append(problem)


def check_mask(report: SubsetReport, path: str, subset: SubsetSpec, size: tuple[int, int]) -> None:
    try:
        find_mask(path, subset, size)
    except ValueError as e:  # missing, unreadable, or not the image's size
        report.add("error", "mask", str(e))
    if subset.alpha_mask and not has_alpha(path):
        report.note("images without an alpha channel (alpha_mask): trained everywhere", path)


def check_references(report: SubsetReport, path: str, subset: SubsetSpec, controls: dict,
                     targets=frozenset()) -> tuple[list[str] | None, list[tuple[int, int]]]:
    """An edit dataset's references of `path`, found and readable, and their sizes (as displayed); (None, [])
    when they are in error."""
    try:
        references = find_controls(path, subset.control_directory, controls, targets)
        sizes = [verified_image_size(reference) for reference in references]
        for reference in references:
            load_rgb(reference)  # the whole decode, as caching does: a truncated JPEG passes verify()
    except ValueError as e:
        report.add("error", "reference", str(e))
        return None, []
    return references, sizes


# ----------------------------------------------------------------------------------------------
# Text


def report_text(report: DatasetReport) -> str:
    lines = [f"{report.source}: {len(report.subsets)} subsets; caption tokens: {report.token_check}"]
    for s in report.subsets:
        lines.append(f"{s.section}: {s.image_dir}")
        unused = s.images - s.trained - s.held_out - s.not_drawn
        lines.append(f"  images: {s.images}, trained: {s.trained}" + (f", held out for validation: {s.held_out}"
                                                                      if s.held_out else "")
                     + (f", not drawn by the regularization balance: {s.not_drawn}" if s.not_drawn else "")
                     + (f" ({unused} unreadable or skipped)" if unused else ""))
        if s.sizes:
            lines.append(f"  sizes: {_histogram(s.sizes)}")
            lines.append(f"  buckets: {_histogram(s.buckets)}")
        if s.tokens:
            lines.append(f"  caption tokens: {min(s.tokens)}..{max(s.tokens)}")
        lines += [f"  {p.line()}" for p in s.problems]
        lines += [f"  note: {len(files)} {what} (first {files[0]})" for what, files in s.notes.items()]
        lines += [f"  note: {s.upscaled}"] if s.upscaled else []
    problems = report.problems()
    errors = sum(p.severity == "error" for p in problems)
    lines.append(f"{errors} errors, {len(problems) - errors} warnings"
                 + (": training stops at the first error" if errors else ""))
    return "\n".join(lines)


def _histogram(counts: Counter, most: int = 8) -> str:
    common = counts.most_common(most)
    rest = sum(counts.values()) - sum(n for _, n in common)
    return ", ".join(f"{k} x{n}" for k, n in common) + (f", {rest} more in {len(counts) - most} others" if rest else "")
