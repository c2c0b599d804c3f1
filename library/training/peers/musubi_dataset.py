"""musubi-tuner's dataset TOML (its docs/dataset_config.md, dataset/config_utils.py) read into ours.

    [general]       resolution, caption_extension, batch_size, num_repeats, enable_bucket, bucket_no_upscale
    [[datasets]]    those, and image_directory, cache_directory, control_directory, multiple_target, ...

becomes our [general] and, per image dataset, a [[datasets]] (resolution, batch_size, buckets, cache_dir) with
one [[datasets.subsets]] (image_dir, num_repeats, caption_extension, control_directory, multiple_target).
Its buckets (16 px steps, or the model's where its spec's peer_bucket_steps says another; sides from half the
resolution's side, BucketSelector) are written as ours' min_bucket_reso / max_bucket_reso / bucket_reso_steps,
which hold every one of them and more (the line says how many). A JSONL or video dataset is not carried, with why."""

from __future__ import annotations

import math
import os
from typing import Any

from library.models.registry import spec_of
from library.training.peers import musubi_models as models
from library.training.peers.rules import KEPT, RENAMED, UNKNOWN, Line, Translation, is_off

RESOLUTION = [960, 544]  # ImageDatasetParams' default
BUCKET_STEP = 16  # BucketSelector's steps for an image model whose spec names none (peer_bucket_steps)
SHARED = ("resolution", "caption_extension", "batch_size", "num_repeats", "enable_bucket", "bucket_no_upscale")
SUBSET_SIDE = ("num_repeats", "caption_extension")  # ours are a subset's: a [[datasets]] value goes there
RENAMED_KEYS = {"image_directory": ("image_dir", "subset"), "cache_directory": ("cache_dir", "dataset")}
DEPRECATED = models.dataset_renames()  # load_user_config's renames of its per-model keys (the specs')
VIDEO = ("video_directory", "video_jsonl_file", "target_frames", "frame_extraction", "frame_stride", "frame_sample",
         "max_frames", "source_fps")
FRAMEPACK = ("fp_latent_window_size", "fp_1f_clean_indices", "fp_1f_target_index", "fp_1f_no_post")
KNOWN = (*SHARED, *RENAMED_KEYS, *DEPRECATED, *VIDEO, *FRAMEPACK, "image_jsonl_file", "control_directory",
         "multiple_target", "no_resize_control", "control_resolution")


def translate_dataset(t: Translation, dataset: dict, source: str, model_type: str) -> dict | None:
    """Our dataset TOML as a dict (None: no dataset carried), each key's line in `t` ("general.resolution",
    "datasets[0].image_directory")."""
    for key, value in dataset.items():
        if key not in ("general", "datasets"):
            t.lines.append(Line(key, value, UNKNOWN, f"not a section of {t.peer}'s dataset TOML ({source})"))
    general_in = dataset.get("general") if isinstance(dataset.get("general"), dict) else {}
    general = {}
    for key, value in general_in.items():
        if key in SHARED:
            general[key] = value
            t.lines.append(Line(f"general.{key}", value, KEPT))
        else:
            t.lines.append(Line(f"general.{key}", value, UNKNOWN, f"not a [general] key of {t.peer}'s ({source})"))
    entries = dataset.get("datasets") if isinstance(dataset.get("datasets"), list) else []
    try:
        ours = [d for i, entry in enumerate(entries) if isinstance(entry, dict)
                for d in [_dataset(t, f"datasets[{i}]", entry, general_in, model_type)] if d is not None]
    except ValueError as e:  # a value it would refuse too: one line naming the file
        raise ValueError(f"{source}: {e}") from None
    if not ours:
        return None
    return {**({"general": general} if general else {}), "datasets": ours}


def _dataset(t: Translation, where: str, entry: dict, general: dict, model_type: str) -> dict | None:
    entry, labels = dict(entry), {}  # labels: a deprecated name as written, read as its new one
    for old, new in DEPRECATED.items():
        if old not in entry:
            continue
        value = entry.pop(old)
        if new in entry:  # load_user_config: the new name's value wins
            t.drop(f"{where}.{old}", value, f"{new} is given too, and wins (there too)")
        else:
            entry[new], labels[new] = value, old
    why = _not_an_image_folder(entry)
    if why:
        key = next((k for k in ("image_jsonl_file", *VIDEO) if k in entry), "image_directory")
        t.refuse(f"{where}.{key}", entry.get(key), why)
        return None
    ds, subset = {}, {}
    pick = {k: entry.get(k, general.get(k)) for k in ("resolution", "enable_bucket", "bucket_no_upscale")}
    for key, value in entry.items():
        label = f"{where}.{labels.get(key, key)}"
        if key in SHARED:
            (subset if key in SUBSET_SIDE else ds)[key] = value
            t.lines.append(Line(label, value, KEPT))
        elif key in RENAMED_KEYS:
            ours, side = RENAMED_KEYS[key]
            (subset if side == "subset" else ds)[ours] = value
            t.lines.append(Line(label, value, RENAMED, ours))
        elif key in ("control_directory", "multiple_target", "no_resize_control", "control_resolution"):
            _references(t, label, key, value, entry, pick, model_type, subset)
        elif key in FRAMEPACK:
            (t.drop if is_off(value) else t.refuse)(label, value, "FramePack's one-frame training: a video model")
        else:
            t.lines.append(Line(label, value, UNKNOWN, f"not a [[datasets]] key of {t.peer}'s"))
    _buckets(t, where, pick, ds, spec_of(model_type).peer_bucket_steps.get(models.PEER, BUCKET_STEP))
    return {**ds, "subsets": [subset]}


def _not_an_image_folder(entry: dict) -> str:
    if any(k in entry for k in VIDEO):
        return "a video dataset: our models train on images"
    if "image_jsonl_file" in entry:
        return "a JSONL of image paths and captions: ours reads image folders with a caption file beside each image"
    if "image_directory" not in entry:
        return "no image_directory"
    return ""


def _same_folder(a: Any, b: Any) -> bool:
    return isinstance(a, str) and isinstance(b, str) and os.path.realpath(a) == os.path.realpath(b)


def _references(t: Translation, label: str, key: str, value: Any, entry: dict, pick: dict, model_type: str,
                subset: dict) -> None:
    """control_directory and how its images are sized (the spec's references: "target" or "area"); multiple_target
    (a layered model's frames)."""
    if key == "multiple_target":
        layered = models.layered()
        if model_type in layered and value:
            subset[key] = value
            t.lines.append(Line(label, value, KEPT))
        else:
            (t.drop if is_off(value) else t.refuse)(label, value, f"layered targets: {' / '.join(layered.values())}'s only")
        return
    sizing = models.references().get(model_type)
    if sizing is None:
        (t.drop if is_off(value) else t.refuse)(label, value, "reference images: this model takes none here")
        return
    if key == "control_directory" and _same_folder(value, entry.get("image_directory")):
        t.refuse(label, value, "the references beside the training images (musubi-tuner takes the captioned ones as "
                               "targets): ours reads every image of image_dir as one; move the references (name_0.png "
                               "...) to a folder of their own and set control_directory to it")
    elif key == "control_directory":
        subset[key] = value
        sized = "control_resolution" in entry or entry.get("no_resize_control")
        ours = {"area": "encodes it at the resolution's area, its own aspect",
                "own": "keeps its own size up to 1024 x 1024 pixels"}.get(sizing)
        note = ("" if ours is None or sized else f"it fits each reference to its target's size here; ours {ours} "
                f"(the pipelines' rule)")
        t.lines.append(Line(label, value, KEPT, note=note))
    elif sizing == "own":
        _own_size(t, label, key, value, entry)
    elif key == "no_resize_control":
        (t.drop if is_off(value) else t.refuse)(label, value, "ours resizes every reference (the model's rule)")
    elif sizing == "target":  # control_resolution
        t.refuse(label, value, "ours fits each reference to its target's bucket (musubi-tuner's default)")
    elif _area(value, label) == _area(pick["resolution"] or RESOLUTION) and not entry.get("no_resize_control"):
        t.drop(label, value, "ours encodes references at the resolution's area, their own aspect: the same")
    else:
        t.refuse(label, value, "ours encodes references at the dataset resolution's area: set resolution to it")


def _own_size(t: Translation, label: str, key: str, value: Any, entry: dict) -> None:
    """no_resize_control / control_resolution where ours keeps a reference's own size up to 1 MP (a spec's "own"
    references)."""
    if key == "no_resize_control":
        t.drop(label, value, "ours keeps each reference's own size too (up to 1024 x 1024 pixels, the pipelines' cap)"
               if not is_off(value) else "ours keeps each reference's own size up to 1024 x 1024 pixels")
    elif _area(value, label) == 1024 * 1024:
        t.drop(label, value, "ours scales references over 1024 x 1024 pixels to that area, their own aspect" +
               ("" if entry.get("no_resize_control") else ", and enlarges none (the pipelines' rule)"))
    else:
        t.refuse(label, value, "ours keeps each reference's own size up to 1024 x 1024 pixels (the pipelines' rule)")


def _area(resolution: Any, key: str = "resolution") -> int:
    """w * h of an integer or [width, height] (musubi-tuner's scalar_or_twodim); a ValueError naming `key` else."""
    if isinstance(resolution, int) and not isinstance(resolution, bool):
        return resolution * resolution
    if isinstance(resolution, list) and len(resolution) == 2 and all(isinstance(v, int) for v in resolution):
        return resolution[0] * resolution[1]
    raise ValueError(f"{key}: expected an integer or [width, height], got {resolution!r}")


def _buckets(t: Translation, where: str, pick: dict, ds: dict, step: int) -> None:
    """The resolution its default gives, and its bucket grid (at the model's `step`) as our three keys."""
    resolution = pick["resolution"]
    if resolution is None:
        ds["resolution"] = resolution = RESOLUTION
        t.lines.append(Line(f"{where}.resolution (unset)", RESOLUTION, KEPT, note=f"{t.peer}'s default"))
    if pick["bucket_no_upscale"] and not pick["enable_bucket"]:
        ds["bucket_no_upscale"] = False  # ours refuses it there; [general]'s would reach this dataset
        t.drop(f"{where}.bucket_no_upscale", True, "does nothing without enable_bucket (there too)")
    if pick["enable_bucket"]:
        low, high = bucket_sides(resolution, step)
        ds.update(min_bucket_reso=low, max_bucket_reso=high, bucket_reso_steps=step)
        note = grid_note(t.peer, resolution, low, high, step)
        if pick["bucket_no_upscale"]:  # its BucketSelector.get_bucket_resolution: the grid for images over the area
            note = (f"with bucket_no_upscale an image over the area is sized on its own to it here (sd-scripts' rule), "
                    f"where {t.peer} gives it its grid's bucket of the nearest aspect ratio; one within the area "
                    f"keeps its size on the {step} px grid in both")
        t.lines.append(Line(f"{where} buckets", f"{low}..{high} px, step {step}", RENAMED,
                            "min_bucket_reso, max_bucket_reso, bucket_reso_steps", note))


def peer_buckets(resolution: Any, step: int = BUCKET_STEP) -> set[tuple[int, int]]:
    """BucketSelector's buckets (musubi-tuner's dataset/bucket.py): widths from half the area's side to the side
    in `step` px steps, each with the height the area leaves on the grid, and both orientations."""
    area = _area(resolution, "resolution")
    side = int(math.sqrt(area))
    low = side // 2 - side // 2 % step
    pairs = [(w, area // w - area // w % step) for w in range(low, side + step, step)]
    return {*pairs, *((h, w) for w, h in pairs)}


def grid_note(peer: str, resolution: Any, low: int, high: int, step: int = BUCKET_STEP) -> str:
    """What the three keys give against the peer's grid: every one of its buckets, and ours' sd-scripts-style
    grid has more (a height for every width on the grid), so an image may train at another one (the line said
    "musubi-tuner's bucket grid": 48 buckets of 95 at its default 960x544 were ours alone)."""
    from library.data.dataset_config import make_buckets

    area = _area(resolution, "resolution")
    size = tuple(resolution) if isinstance(resolution, list) else (resolution, resolution)
    ours, theirs = set(make_buckets(size, low, high, step)), peer_buckets(resolution, step)
    assert theirs <= ours, (theirs - ours, area)  # (a grid of ours would have lost one of theirs)
    more = len(ours - theirs)
    return (f"{peer}'s bucket grid" if not more else f"every bucket of {peer}'s grid ({len(theirs)}) and {more} more "
            f"(ours has a height for every width on the grid): an image may train at a nearer aspect ratio than there")


def bucket_sides(resolution: Any, step: int = BUCKET_STEP) -> tuple[int, int]:
    """(shortest, longest) side of BucketSelector's buckets: widths from half the area's side, heights the
    area over them, both on the `step` px grid."""
    area = _area(resolution, "resolution")
    half = int(math.sqrt(area)) // 2
    low = half - half % step
    if low == 0:  # musubi-tuner's BucketSelector divides by it too
        raise ValueError(f"resolution: {resolution!r} is too small for its buckets (their shortest side is half the "
                         f"resolution's, on the {step} px grid)")
    return low, area // low - (area // low) % step


def dataset_keys() -> set[str]:
    """The keys of its dataset TOML this module knows that ours does not (the data layer's MUSUBI_DATASET_KEYS)."""
    return {k for k in KNOWN if k not in SHARED + ("control_directory", "multiple_target")}
