"""The dataset TOML (kohya sd-scripts schema), validated into plain dataclasses.

    [general]                 # defaults for every dataset and subset below
    [[datasets]]              # one bucketed image set: resolution, batch size, buckets
    [[datasets.subsets]]      # one image folder: captions, repeats, augmentation
    [[validation_datasets]]   # optional: held-out image sets, same schema (never trained on)

A subset key falls back to its dataset, then to [general], then to DEFAULTS. Every key is
checked for name and type; an unknown key or a wrong type is one ValueError naming the file,
the section, the key and the value. configs/dataset_example.toml documents every key.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field

import toml

from library.data.image_names import IMAGE_EXTENSIONS
from library.data.peer_keys import peer_dataset_hint
from library.text_files import read_utf8, toml_loads

# The VAE downsamples 8x and the transformers pack 2x2 latent patches into one token, so pixel
# sizes must be multiples of 16, and 16 is the smallest image that makes one token.
PIXELS_PER_TOKEN_SIDE = 16

# Keys a [[datasets.subsets]] table may hold (they may also sit in [[datasets]] or [general]).
SUBSET_KEYS = (
    "image_dir", "num_repeats", "caption_extension", "class_tokens", "shuffle_caption",
    "keep_tokens", "keep_tokens_separator", "caption_separator", "caption_dropout_rate",
    "caption_dropout_every_n_epochs", "caption_tag_dropout_rate", "caption_variants", "flip_aug",
    "alpha_mask", "mask_dir", "is_reg", "control_directory", "skip_bad_size_images",
    "multiple_target", "caption_prefix", "caption_suffix", "caption_dropout_text",
)
# Keys a [[datasets]] table may hold (they may also sit in [general]).
DATASET_KEYS = (
    "resolution", "batch_size", "enable_bucket", "min_bucket_reso", "max_bucket_reso",
    "bucket_reso_steps", "bucket_no_upscale", "cache_dir", "validation_split", "validation_seed",
)
KEY_TYPES = {
    "resolution": "resolution", "batch_size": int, "enable_bucket": bool, "min_bucket_reso": int,
    "max_bucket_reso": int, "bucket_reso_steps": int, "bucket_no_upscale": bool, "cache_dir": str,
    "validation_split": float, "validation_seed": int,
    "image_dir": str, "num_repeats": int, "caption_extension": str, "class_tokens": str,
    "shuffle_caption": bool, "keep_tokens": int, "caption_dropout_rate": float, "flip_aug": bool,
    "keep_tokens_separator": str, "caption_separator": str, "caption_dropout_every_n_epochs": int,
    "caption_tag_dropout_rate": float, "caption_variants": int, "alpha_mask": bool, "mask_dir": str, "is_reg": bool,
    "control_directory": str, "skip_bad_size_images": bool, "multiple_target": bool, "caption_prefix": str,
    "caption_suffix": str, "caption_dropout_text": str,
}
# sd-scripts' defaults, except caption_extension: sd-scripts defaults to ".caption" but nearly
# every dataset in use ships ".txt" files, so ".txt" is the default here.
# resolution and image_dir have no default: they must be given.
DEFAULTS = {
    "batch_size": 1, "enable_bucket": False, "min_bucket_reso": 256, "max_bucket_reso": 1024,
    "bucket_reso_steps": 64, "bucket_no_upscale": False, "cache_dir": None,
    "validation_split": 0.0, "validation_seed": 0,
    "num_repeats": 1, "caption_extension": ".txt", "class_tokens": None, "shuffle_caption": False,
    "keep_tokens": 0, "caption_dropout_rate": 0.0, "flip_aug": False,
    "keep_tokens_separator": "", "caption_separator": ",", "caption_dropout_every_n_epochs": 0,
    "caption_tag_dropout_rate": 0.0, "caption_variants": 8, "alpha_mask": False, "mask_dir": None, "is_reg": False,
    "control_directory": None, "skip_bad_size_images": False, "multiple_target": False, "caption_prefix": None,
    "caption_suffix": None, "caption_dropout_text": "",
}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "a boolean (true or false)", str: "a string",
               "resolution": "an integer or [width, height]"}


@dataclass
class SubsetSpec:
    image_dir: str
    num_repeats: int
    caption_extension: str
    class_tokens: str | None
    shuffle_caption: bool
    keep_tokens: int
    caption_dropout_rate: float
    flip_aug: bool
    # library/data/captions.py: how these work with cached text-encoder outputs
    keep_tokens_separator: str = ""
    caption_separator: str = ","
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    caption_variants: int = 8  # augmented captions encoded per image when shuffling / dropping tags
    # library/data/masks.py: loss masks and regularization images
    alpha_mask: bool = False  # the image's alpha channel is the loss mask
    mask_dir: str | None = None  # a grayscale mask per image, matched by file stem
    is_reg: bool = False  # regularization images: loss x prior_loss_weight, repeats balanced to the training images
    # library/data/controls.py: edit models' reference images, matched by file stem
    control_directory: str | None = None
    # library/data/dataset.py bad_size: images below min_bucket_reso or beyond the buckets' aspect ratio
    skip_bad_size_images: bool = False  # leave them out (they are always warned about)
    # library/data/layers.py: layered targets, a composite + its numbered layer images (musubi-tuner's name)
    multiple_target: bool = False
    # sd-scripts': text joined before / after every caption of the subset with a space (image_folders.read_caption)
    caption_prefix: str | None = None
    caption_suffix: str | None = None
    # the caption a dropped one becomes ("": the empty caption, as sd-scripts; ai-toolkit's: its trigger word)
    caption_dropout_text: str = ""


@dataclass
class DatasetSpec:
    resolution: tuple[int, int]  # (width, height)
    batch_size: int
    enable_bucket: bool
    min_bucket_reso: int
    max_bucket_reso: int
    bucket_reso_steps: int
    bucket_no_upscale: bool
    cache_dir: str | None
    validation_split: float = 0.0  # share of each subset's images held out for validation
    validation_seed: int = 0  # which images are held out (library.data.dataset.split_validation)
    subsets: list[SubsetSpec] = field(default_factory=list)


@dataclass
class DatasetBlueprint:
    datasets: list[DatasetSpec]
    source: str = "<dict>"  # the file it came from, for error messages downstream
    validation_datasets: list[DatasetSpec] = field(default_factory=list)  # held out whole


def load_dataset_config(path: str) -> DatasetBlueprint:
    """Read and validate a dataset TOML file."""
    path = os.path.expanduser(path)
    try:
        data = toml_loads(read_utf8(path, "dataset config"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such dataset config file") from None
    except IsADirectoryError:  # was "[Errno 21] Is a directory"
        raise ValueError(f"{path}: a folder; expected a dataset config file (a TOML naming the image folders)") from None
    except toml.TomlDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    return parse_dataset_config(data, source=path)


def parse_dataset_config(data: dict, source: str = "<dict>") -> DatasetBlueprint:
    """Validate an already parsed dataset config (same schema as the TOML file)."""
    _check_keys(source, "top level", data, ("general", "datasets", "validation_datasets"))
    general = data.get("general", {})
    _check_table(source, "general", general)
    _check_keys(source, "general", general, DATASET_KEYS + SUBSET_KEYS[1:])
    datasets = data.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise ValueError(f"{source}: needs at least one [[datasets]] table with [[datasets.subsets]]")
    held_out = data.get("validation_datasets", [])
    if not isinstance(held_out, list):
        raise ValueError(f"{source}: validation_datasets must be [[validation_datasets]] tables, got {held_out!r}")
    validation = [_parse_dataset(source, general, d, "validation_datasets") for d in held_out]
    for d in validation:
        if d.validation_split:  # e.g. inherited from [general]: the whole set is validation already
            raise ValueError(f"{source}: [validation_datasets] key 'validation_split' must be 0 (every image of a "
                             f"validation dataset is held out), got {d.validation_split}")
    return DatasetBlueprint([_parse_dataset(source, general, d) for d in datasets], source=source,
                            validation_datasets=validation)


def _parse_dataset(source: str, general: dict, dataset: dict, section: str = "datasets") -> DatasetSpec:
    _check_table(source, section, dataset)
    _check_keys(source, section, dataset, DATASET_KEYS + SUBSET_KEYS[1:] + ("subsets",))

    def pick(key):
        return dataset.get(key, general.get(key, DEFAULTS.get(key)))

    res = pick("resolution")
    if res is None:
        raise ValueError(f"{source}: [{section}] key 'resolution' is required (in [[{section}]] or [general])")
    spec = DatasetSpec(
        resolution=(res, res) if isinstance(res, int) else (res[0], res[1]),
        **{k: pick(k) for k in DATASET_KEYS if k != "resolution"},
    )
    spec.validation_split = float(spec.validation_split)
    if isinstance(spec.cache_dir, str):
        spec.cache_dir = os.path.expanduser(spec.cache_dir)
    _check_dataset_values(source, spec)
    subsets = dataset.get("subsets")
    if not isinstance(subsets, list) or not subsets:
        raise ValueError(f"{source}: [[{section}]] needs at least one [[{section}.subsets]] with an image_dir")
    spec.subsets = [_parse_subset(source, general, dataset, s, f"{section}.subsets") for s in subsets]
    if all(s.is_reg for s in spec.subsets):  # its entries would be none: the run would loop over empty epochs
        raise ValueError(f"{source}: [[{section}]] with image_dir {spec.subsets[0].image_dir!r}: every subset has "
                         f"is_reg = true; regularization images repeat as often as their dataset's training images, "
                         f"and it has none (add a training subset to this [[datasets]])")
    return spec


def _parse_subset(source: str, general: dict, dataset: dict, subset: dict, section: str = "datasets.subsets") -> SubsetSpec:
    _check_table(source, section, subset)
    _check_keys(source, section, subset, SUBSET_KEYS)
    if "image_dir" not in subset:
        raise ValueError(f"{source}: [{section}] key 'image_dir' is required")
    values = {k: subset.get(k, dataset.get(k, general.get(k, DEFAULTS.get(k)))) for k in SUBSET_KEYS}
    for key in ("image_dir", "mask_dir", "control_directory"):  # ~ as the shell reads it (a TOML has no shell)
        if isinstance(values[key], str):
            values[key] = os.path.expanduser(values[key])
    spec = SubsetSpec(**values)
    spec.caption_dropout_rate = float(spec.caption_dropout_rate)
    spec.caption_tag_dropout_rate = float(spec.caption_tag_dropout_rate)
    where = f"{source}: [{section}] image_dir {spec.image_dir!r}:"
    for key in ("num_repeats", "caption_variants"):
        if getattr(spec, key) < 1:
            raise ValueError(f"{where} key '{key}' must be >= 1, got {getattr(spec, key)}")
    for key in ("keep_tokens", "caption_dropout_every_n_epochs"):
        if getattr(spec, key) < 0:
            raise ValueError(f"{where} key '{key}' must be >= 0, got {getattr(spec, key)}")
    for key in ("caption_dropout_rate", "caption_tag_dropout_rate"):
        if not 0.0 <= getattr(spec, key) <= 1.0:
            raise ValueError(f"{where} key '{key}' must be in [0, 1], got {getattr(spec, key)}")
    if spec.alpha_mask and spec.mask_dir:
        raise ValueError(f"{where} keys 'alpha_mask' and 'mask_dir' both set; the mask comes from one of them")
    if spec.mask_dir is not None and not os.path.isdir(spec.mask_dir):
        raise ValueError(f"{where} key 'mask_dir' {spec.mask_dir!r} is not a folder")
    if spec.control_directory is not None and not os.path.isdir(spec.control_directory):
        raise ValueError(f"{where} key 'control_directory' {spec.control_directory!r} is not a folder")
    control = spec.control_directory
    if control is not None and os.path.realpath(control) == os.path.realpath(spec.image_dir):
        # every image there is a target: name.png became its own reference, name_0.png a target without a caption
        raise ValueError(f"{where} key 'control_directory' {control!r} is the image_dir: each image there is a "
                         f"training image; put the reference images (name.png or name_0.png, ...) in a folder of "
                         f"their own")
    if spec.multiple_target and (spec.control_directory or spec.alpha_mask or spec.mask_dir):
        raise ValueError(f"{where} key 'multiple_target' (layered targets: library/data/layers.py) takes no "
                         f"control_directory, alpha_mask or mask_dir (the composite is the reference; alpha is trained)")
    if spec.is_reg and section.startswith("validation_datasets"):
        raise ValueError(f"{where} key 'is_reg' is for training subsets; validation datasets hold no regularization images")
    if not spec.caption_separator:
        raise ValueError(f"{where} key 'caption_separator' must not be empty")
    if spec.caption_dropout_text and not (spec.caption_dropout_rate > 0 or spec.caption_dropout_every_n_epochs > 0):
        raise ValueError(f"{where} key 'caption_dropout_text' is what a dropped caption becomes: it needs "
                         f"caption_dropout_rate or caption_dropout_every_n_epochs")
    if (spec.shuffle_caption or spec.caption_tag_dropout_rate > 0) and spec.caption_variants < 2:
        raise ValueError(f"{where} key 'caption_variants' must be >= 2 with shuffle_caption or caption_tag_dropout_rate "
                         f"(text is cached: each step picks one of that many augmented captions), got {spec.caption_variants}")
    if not spec.caption_extension.startswith("."):
        raise ValueError(f"{where} key 'caption_extension' must start with '.', got {spec.caption_extension!r}")
    if spec.caption_extension.lower() in IMAGE_EXTENSIONS:  # each image read as its own caption: "not valid UTF-8"
        raise ValueError(f"{where} key 'caption_extension' is {spec.caption_extension!r}, an image extension: captions "
                         f"are text files (.txt, .caption)")
    return spec


def check_token_side(bp: DatasetBlueprint, side: int, model: str) -> None:
    """A model whose token spans more than PIXELS_PER_TOKEN_SIDE pixels (a 32x VAE without a 2x2 patch: 32) takes
    images whose sides are multiples of `side`: each dataset's bucket_reso_steps (or, without buckets, its
    resolution) must be one, checked before anything is cached (else the VAE refused the first bucket off it)."""
    if side <= PIXELS_PER_TOKEN_SIDE:
        return
    for kind, specs in (("datasets", bp.datasets), ("validation_datasets", bp.validation_datasets)):
        for i, d in enumerate(specs):
            if d.enable_bucket and d.bucket_reso_steps % side:
                raise ValueError(f"{bp.source}: [[{kind}]] {i}: key 'bucket_reso_steps' = {d.bucket_reso_steps}; "
                                 f"{model} takes images whose sides are multiples of {side} px (one token each): "
                                 f"give a multiple of {side} (sd-scripts' default 64)")
            if not d.enable_bucket and any(r % side for r in d.resolution):
                raise ValueError(f"{bp.source}: [[{kind}]] {i}: key 'resolution' = {list(d.resolution)}; {model} takes "
                                 f"sides that are multiples of {side} px (one token each) when enable_bucket is false")


def _check_dataset_values(source: str, d: DatasetSpec):
    step = PIXELS_PER_TOKEN_SIDE
    if min(d.resolution) < step:
        raise ValueError(f"{source}: [datasets] key 'resolution' must be at least {step} pixels per side "
                         f"(one 2x2 patch of the 8x-downsampled latent), got {list(d.resolution)}")
    if not 0.0 <= d.validation_split < 1.0:
        raise ValueError(f"{source}: [datasets] key 'validation_split' must be in [0, 1) (the share of each subset's "
                         f"images held out for validation), got {d.validation_split}")
    if d.batch_size < 1:
        raise ValueError(f"{source}: [datasets] key 'batch_size' must be >= 1, got {d.batch_size}")
    if d.bucket_reso_steps <= 0 or d.bucket_reso_steps % step:
        raise ValueError(f"{source}: [datasets] key 'bucket_reso_steps' must be a positive multiple of {step} "
                         f"(8x VAE, 2x2 patches), got {d.bucket_reso_steps}")
    if d.min_bucket_reso < step:
        raise ValueError(f"{source}: [datasets] key 'min_bucket_reso' must be >= {step}, got {d.min_bucket_reso}")
    if d.min_bucket_reso > d.max_bucket_reso:
        raise ValueError(f"{source}: [datasets] min_bucket_reso {d.min_bucket_reso} is larger than "
                         f"max_bucket_reso {d.max_bucket_reso}")
    if d.enable_bucket:
        _widen_bucket_range_to_steps(source, d)
    if d.bucket_no_upscale and not d.enable_bucket:  # an image was enlarged to the resolution all the same
        raise ValueError(f"{source}: [datasets] key 'bucket_no_upscale' = true does nothing without enable_bucket = "
                         f"true (every image is resized to the resolution); set enable_bucket = true or remove it")
    if not d.enable_bucket and any(s % step for s in d.resolution):
        raise ValueError(f"{source}: [datasets] key 'resolution' must be a multiple of {step} per side "
                         f"when enable_bucket is false, got {list(d.resolution)}")
    if d.enable_bucket and (min(d.resolution) < d.min_bucket_reso or max(d.resolution) > d.max_bucket_reso):
        raise ValueError(f"{source}: [datasets] resolution {list(d.resolution)} must lie within "
                         f"[min_bucket_reso, max_bucket_reso] = [{d.min_bucket_reso}, {d.max_bucket_reso}]")
    if d.enable_bucket and not make_buckets(d.resolution, d.min_bucket_reso, d.max_bucket_reso, d.bucket_reso_steps):
        raise ValueError(f"{source}: [datasets] no bucket fits: no multiple of bucket_reso_steps {d.bucket_reso_steps} "
                         f"within [min_bucket_reso, max_bucket_reso] = [{d.min_bucket_reso}, {d.max_bucket_reso}] "
                         f"makes a side of an area up to resolution {list(d.resolution)}'s")


def _widen_bucket_range_to_steps(source: str, d: DatasetSpec) -> None:
    """min_bucket_reso / max_bucket_reso off the bucket_reso_steps grid widen to it, with one warning, as
    sd-scripts' adjust_min_max_bucket_reso_by_steps does (max 2000 at steps 64: 2048). The range narrowed to the
    grid without a word until 2026-11-30 (1984): 734 of 3009 random sizes took another bucket than sd-scripts'."""
    step = d.bucket_reso_steps
    low = d.min_bucket_reso - d.min_bucket_reso % step
    low = low if low >= step else d.min_bucket_reso  # under one step (sd-scripts: 0): buckets begin at one step
    high = -(-d.max_bucket_reso // step) * step
    if (low, high) != (d.min_bucket_reso, d.max_bucket_reso):
        warnings.warn(f"{source}: [datasets] min_bucket_reso / max_bucket_reso = {d.min_bucket_reso} / "
                      f"{d.max_bucket_reso} are not multiples of bucket_reso_steps {step}: buckets span {low} / "
                      f"{high}, as sd-scripts widens them", stacklevel=4)
        d.min_bucket_reso, d.max_bucket_reso = low, high


def make_buckets(resolution: tuple[int, int], min_reso: int, max_reso: int, step: int) -> list[tuple[int, int]]:
    """Every (w, h) with both sides multiples of `step` within [min_reso, max_reso] that is the
    largest such height for its width under the area w*h <= resolution area, plus the square."""
    area = resolution[0] * resolution[1]
    lo, hi = math.ceil(min_reso / step) * step, max_reso // step * step  # sides inside the range, on the grid
    side = min(hi, int(math.sqrt(area)) // step * step)
    buckets = {(side, side)} if side >= lo else set()
    for w in range(lo, hi + 1, step):
        h = min(hi, area // w // step * step)
        if h >= lo:
            buckets.update({(w, h), (h, w)})
    return sorted(buckets)




def _check_table(source: str, section: str, table):
    if not isinstance(table, dict):
        raise ValueError(f"{source}: [{section}] must be a table, got {table!r}")


# sd-scripts' pixel augmentations: each epoch would need new latents, and latents are always cached
# here (sd-scripts refuses them with cache_latents too). flip_aug works: both sides are cached.
PIXEL_AUGMENTATIONS = ("random_crop", "color_aug", "face_crop_aug_range")
# Of them, the switches: `= false` asks for nothing (sd-scripts refuses only true), so it is accepted.
PIXEL_AUGMENTATION_SWITCHES = ("random_crop", "color_aug")


def _check_keys(source: str, section: str, table: dict, allowed: tuple[str, ...]):
    """Unknown keys are errors (a typo must not silently fall back to a default); known keys
    must have their type."""
    for key, value in table.items():
        if key in PIXEL_AUGMENTATION_SWITCHES and value is False and section != "top level":
            continue
        if key not in allowed:
            where = "top level:" if section == "top level" else f"[{section}]"
            if key in PIXEL_AUGMENTATIONS:
                raise ValueError(f"{source}: {where} {key!r} is not supported: latents are always cached before "
                                 f"training, so a per-epoch pixel augmentation cannot apply (sd-scripts refuses it "
                                 f"with cache_latents too); remove it (flip_aug works: both sides are cached)")
            raise ValueError(f"{source}: {where} unknown key {key!r} (allowed: {', '.join(allowed)})"
                             f"{peer_dataset_hint(key, source)}")
        if key in KEY_TYPES and not _has_type(value, KEY_TYPES[key]):
            raise ValueError(f"{source}: [{section}] key {key!r} must be {_TYPE_WORDS[KEY_TYPES[key]]}, "
                             f"got {value!r}")


def _has_type(value, kind) -> bool:
    # bool is a subclass of int in Python: `batch_size = true` must not pass as 1.
    if kind == "resolution":
        if isinstance(value, list):
            return len(value) == 2 and all(_has_type(v, int) for v in value)
        return _has_type(value, int)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)
