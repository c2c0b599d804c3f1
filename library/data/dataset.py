"""Training data: image folders with captions in aspect-ratio buckets, on-disk caches of VAE
latents and text-encoder outputs, and sliding token windows for the LLM.

Image story: `ImageDataset(blueprint)` scans every subset once (images are verified, captions
read, each image given a bucket; `split_validation` holds out the dataset's validation_split
share), `BucketBatchSampler` yields batches that hold one bucket, and
`collate_batch` stacks them. After `cache_latents` / `cache_text` the dataset yields the cached
tensors instead of pixels/captions, so the VAE and text encoders can leave the GPU.

Randomness (flip, caption shuffle and dropout, batch order) is drawn from `random.Random` seeded
by (seed, epoch, entry): the same seed gives the same run, with any number of DataLoader workers.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from library.data.captions import CAPTION_KEYS, caption_variants, drops_captions, fixed_caption, is_dropped
from library.data.controls import check_control_count, control_files, encode_prompts, scan_controls
from library.data.dataset_config import DatasetBlueprint, DatasetSpec, SubsetSpec
from library.data.images import IMAGE_EXTENSIONS, load_image, verified_image_size
from library.data.masks import balance_reg_repeats, find_mask, load_mask, mask_source_hash, warn_missing_alpha
from library.io import CheckpointReader, read_utf8, save_safetensors

# Part of every latent cache hash: bump it when resize/crop changes so old caches are redone.
PREPROCESS_VERSION = "resize-crop-v1"
CACHE_DTYPE = torch.bfloat16  # what cache files hold; samples are float32


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
    mask_path: str | None = None  # mask_dir's file for it (library/data/masks.py)
    control_paths: list[str] = field(default_factory=list)  # reference images (library/data/controls.py)
    control_buckets: list[tuple[int, int]] = field(default_factory=list)  # (w, h) each reference is encoded at
    subset_index: int = 0  # its subset's place in its dataset: one image in two subsets is two samples

    @property
    def masked(self) -> bool:
        return self.mask_path is not None or self.subset.alpha_mask


# ----------------------------------------------------------------------------------------------
# Aspect-ratio buckets (the idea of sd-scripts' BucketManager)


def make_buckets(resolution: tuple[int, int], min_reso: int, max_reso: int, step: int) -> list[tuple[int, int]]:
    """Every (w, h) with both sides multiples of `step` within [min_reso, max_reso] that is the
    largest such height for its width under the area w*h <= resolution area, plus the square."""
    area = resolution[0] * resolution[1]
    lo = math.ceil(min_reso / step) * step
    side = min(max_reso, int(math.sqrt(area)) // step * step)
    buckets = {(side, side)} if side >= lo else set()
    for w in range(lo, max_reso + 1, step):
        h = min(max_reso, area // w // step * step)
        if h >= lo:
            buckets.update({(w, h), (h, w)})
    return sorted(buckets)


def bucket_for(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket closest in aspect ratio (compared in log space, so 2:1 and 1:2 are treated
    alike); ties go to the larger bucket."""
    log_ar = math.log(size[0] / size[1])
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - log_ar), -b[0] * b[1]))


def bucket_without_upscale(size: tuple[int, int], max_area: int, step: int) -> tuple[int, int]:
    """bucket_no_upscale: shrink to the area budget if larger, never enlarge; sides rounded down
    to `step`."""
    w, h = size
    if w * h > max_area:
        scale = math.sqrt(max_area / (w * h))
        w, h = w * scale, h * scale
    return int(w) // step * step, int(h) // step * step


def size_limits(ds: DatasetSpec) -> tuple[int, str, float]:
    """(smallest image side, the key that sets it, largest aspect ratio) of images dataset `ds` trains
    without upscaling them from below that side or cropping them beyond max_bucket_reso / min_bucket_reso."""
    side, name = (ds.min_bucket_reso, "min_bucket_reso") if ds.enable_bucket else (min(ds.resolution), "resolution")
    return side, name, ds.max_bucket_reso / ds.min_bucket_reso


def bad_size(size: tuple[int, int], ds: DatasetSpec) -> str | None:
    """Why an image of `size` (w, h) trains badly in dataset `ds`, or None. A 1x1 image would be
    upscaled to a whole bucket, a 4000x16 strip cropped to its middle 2%: both silently."""
    (w, h), (min_side, name, max_aspect) = size, size_limits(ds)
    problems = []
    if min(w, h) < min_side and not (ds.enable_bucket and ds.bucket_no_upscale):  # that never upscales
        problems.append(f"is smaller than {name} {min_side} (it is upscaled)")
    if max(w, h) / min(w, h) > max_aspect:
        problems.append(f"has aspect ratio {max(w, h) / min(w, h):.1f}, beyond max_bucket_reso / min_bucket_reso "
                        f"= {max_aspect:.1f} (it is cropped)")
    return f"{w}x{h} " + " and ".join(problems) if problems else None


# ----------------------------------------------------------------------------------------------
# Scanning folders


def scan_images(blueprint: DatasetBlueprint, held_out_sets: bool = False, control_bucket=None) -> list[ImageItem]:
    """Every image of every subset with its caption, bucket and reference images (a subset's
    control_directory). Unreadable images, missing or empty captions, colliding file stems and
    missing references are errors naming the file; images of a bad size for the buckets (bad_size)
    are warnings, and skipped with skip_bad_size_images. held_out_sets: the [[validation_datasets]]
    instead, numbered after the training datasets. control_bucket(target bucket, reference size)
    -> (w, h): the family's reference size rule (default: the target's bucket)."""
    items = []
    datasets = blueprint.validation_datasets if held_out_sets else blueprint.datasets
    first = len(blueprint.datasets) if held_out_sets else 0
    for di, ds in enumerate(datasets, start=first):
        buckets = (make_buckets(ds.resolution, ds.min_bucket_reso, ds.max_bucket_reso, ds.bucket_reso_steps)
                   if ds.enable_bucket and not ds.bucket_no_upscale else [ds.resolution])
        for si, subset in enumerate(ds.subsets):
            paths = _image_files(subset.image_dir)
            if subset.alpha_mask:
                warn_missing_alpha(paths, subset)
            controls = control_files(subset.control_directory) if subset.control_directory else None
            first_paired = None  # the subset's first image: every other needs as many references
            for path, size in _usable_images(paths, ds, subset):
                if ds.enable_bucket and ds.bucket_no_upscale:
                    bucket = bucket_without_upscale(size, ds.resolution[0] * ds.resolution[1], ds.bucket_reso_steps)
                    if min(bucket) == 0:
                        raise ValueError(f"{path}: image is {size[0]}x{size[1]}, smaller than "
                                         f"bucket_reso_steps {ds.bucket_reso_steps} (bucket_no_upscale is on)")
                else:
                    bucket = bucket_for(size, buckets)
                item = ImageItem(path, read_caption(path, subset), subset, di, size, bucket, ds.cache_dir,
                                 mask_path=find_mask(path, subset, size), subset_index=si)
                if controls is not None:
                    item.control_paths, item.control_buckets = scan_controls(
                        path, subset.control_directory, controls, bucket, control_bucket or (lambda b, _: b))
                    first_paired = first_paired or item
                    check_control_count(item, first_paired)
                items.append(item)
    return items


def split_validation(items: list[ImageItem], blueprint: DatasetBlueprint) -> tuple[list[ImageItem], list[ImageItem]]:
    """(training items, validation items). A dataset with validation_split > 0 holds out
    floor(n * validation_split) images of each of its subsets (as sd-scripts): those whose
    sha256(validation_seed | path inside the subset) ranks lowest. The choice depends on neither
    the training seed nor the file order nor where the dataset lives, and adding an image moves
    at most one other."""
    by_subset: dict[int, list[ImageItem]] = {}
    for item in items:
        by_subset.setdefault(id(item.subset), []).append(item)
    held_out: set[int] = set()
    for group in by_subset.values():
        spec = blueprint.datasets[group[0].dataset_index]
        if group[0].subset.is_reg:  # regularization images are never validation images
            continue
        count = int(len(group) * spec.validation_split + 1e-9)  # floor, robust to 0.1 * 30 = 3.0000000000000004

        def rank(item: ImageItem) -> str:
            relpath = os.path.relpath(item.image_path, item.subset.image_dir)
            return hashlib.sha256(f"{spec.validation_seed}|{relpath}".encode()).hexdigest()

        held_out.update(id(item) for item in sorted(group, key=rank)[:count])
    for di, spec in enumerate(blueprint.datasets):
        if spec.validation_split and not any(id(it) in held_out for it in items if it.dataset_index == di):
            raise ValueError(f"{blueprint.source}: [[datasets]] #{di + 1}: validation_split {spec.validation_split} "
                             f"holds out no image (floor(images of a subset x validation_split) is 0 for every "
                             f"subset); raise it, add images, or use [[validation_datasets]]")
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
    min_side, name, max_aspect = size_limits(ds)
    limits = f"smaller than {name} or beyond max_bucket_reso / min_bucket_reso in aspect ratio"
    if bad:
        outcome = ("skipped (skip_bad_size_images)" if skip
                   else "they are trained as they are (skip_bad_size_images = true leaves them out)")
        warnings.warn(f"{subset.image_dir}: {bad} of {len(paths)} images are {limits}; {outcome}", stacklevel=2)
    if not usable:
        raise ValueError(f"{subset.image_dir}: every image was skipped (skip_bad_size_images): none is at least "
                         f"{name} {min_side} per side within max_bucket_reso / min_bucket_reso = {max_aspect:.1f}")
    return usable


def _image_files(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: image_dir does not exist or is not a folder")
    files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
        raise ValueError(f"{folder}: image_dir holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    stems: dict[str, str] = {}
    for f in files:
        stem = os.path.splitext(f)[0]
        if stem in stems:  # they would share one caption file and one cache file
            raise ValueError(f"{folder}: images '{stems[stem]}' and '{f}' share the name '{stem}'")
        stems[stem] = f
    return [os.path.join(folder, f) for f in files]


def read_caption(image_path: str, subset: SubsetSpec) -> str:
    caption_path = os.path.splitext(image_path)[0] + subset.caption_extension
    if os.path.exists(caption_path):
        caption = read_utf8(caption_path, "caption file").strip()
        if not caption:
            raise ValueError(f"{caption_path}: caption file is empty")
        return caption
    if subset.class_tokens:
        return subset.class_tokens
    raise ValueError(f"{image_path}: no caption file '{os.path.basename(caption_path)}' "
                     f"and no class_tokens for its subset")


# ----------------------------------------------------------------------------------------------
# Dataset, sampler, collate


class ImageDataset(torch.utils.data.Dataset):
    """One entry per image per repeat. Index with `(entry, epoch)` (what BucketBatchSampler
    yields) or a plain entry (epoch 0). `items`: the images to use (default: the training images
    of the blueprint, the validation_split share removed); validation=True: each image once,
    never flipped. A sample is a dict:
    image_path, bucket (w, h), caption (processed str), and either image (float32 [3,H,W] in
    [-1,1]) or latents (float32 [C,h,w], from the bf16 cache), plus text (dict of tensors,
    floating ones float32) when captions are cached."""

    def __init__(self, blueprint: DatasetBlueprint, seed: int = 0, items: list[ImageItem] | None = None,
                 validation: bool = False):
        self.blueprint, self.seed, self.validation = blueprint, seed, validation
        self.items = split_validation(scan_images(blueprint), blueprint)[0] if items is None else items
        repeats = [1 if validation else item.subset.num_repeats for item in self.items]
        if not validation:  # regularization images: repeats balanced to the training images per dataset
            reg = _reg_repeats(self.items)
            repeats = [reg.get(id(item), n) for item, n in zip(self.items, repeats)]
        self.entries = [i for i, n in enumerate(repeats) for _ in range(n)]
        self.repeat_of = [r for n in repeats for r in range(n)]
        if not validation:  # validation uses the captions as written
            for item in self.items:
                item.caption_variants = caption_variants(item.caption, item.subset)
        self.empty_text: dict | None = None  # the empty caption's cached text (cache_empty_caption)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, key) -> dict:
        entry, epoch = key if isinstance(key, tuple) else (key, 0)
        item = self.items[self.entries[entry]]
        rng = random.Random(f"{self.seed}:{epoch}:{entry}")
        flip = item.subset.flip_aug and not self.validation and rng.random() < 0.5
        # key: which occurrence of which image this is (dataset:subset:path#repeat), independent of
        # where the dataset lives. It seeds the noise and sigma: with the step, every repeat of an
        # image in a step, and the same image in two subsets, gets its own draw (an optimizer step
        # lies within one epoch, where each repeat occurs once).
        relpath = os.path.relpath(item.image_path, item.subset.image_dir)
        key = f"{item.dataset_index}:{item.subset_index}:{relpath}#{self.repeat_of[entry]}"
        caption, variant = self._caption(item, epoch, rng)
        sample = {"image_path": item.image_path, "key": key, "bucket": item.bucket, "caption": caption,
                  "is_reg": item.subset.is_reg}
        if item.latent_cache is not None:
            cached = _read_cache(item.latent_cache)
            sample["latents"] = cached["latents_flipped" if flip else "latents"].float()
            if item.masked:
                sample["mask"] = cached["mask_flipped" if flip else "mask"].float()
            if item.control_paths:  # mirrored with the target
                sample["controls"] = [cached[f"control_{k}" + ("_flipped" if flip else "")].float()
                                      for k in range(len(item.control_paths))]
        else:
            sample["image"] = load_image(item.image_path, item.bucket, flip)
            if item.masked:
                sample["mask"] = load_mask(item.image_path, item.mask_path, item.bucket, flip)
            if item.control_paths:
                sample["control_images"] = [load_image(p, b, flip) for p, b in zip(item.control_paths, item.control_buckets)]
        if item.text_cache is not None:
            text = _read_text_cache(item.text_cache, variant)  # "dropped": the item's own, if encoded with its references
            if variant == "dropped" and not text:
                text = self._empty_text()
            sample["text"] = {k: v.float() if v.is_floating_point() else v for k, v in text.items()}
        return sample

    def _caption(self, item: ImageItem, epoch: int, rng: random.Random) -> tuple[str, int | str | None]:
        """(caption, which cached text goes with it: None the caption's own, k its k-th variant,
        "dropped" the empty caption's). Validation always uses the caption as written."""
        if self.validation:
            return fixed_caption(item.caption, item.subset), None
        if drops_captions(item.subset) and is_dropped(item.subset, epoch, rng):
            return "", "dropped"
        if item.caption_variants:
            k = rng.randrange(len(item.caption_variants))
            return item.caption_variants[k], k
        return fixed_caption(item.caption, item.subset), None

    def _empty_text(self) -> dict:
        if self.empty_text is None:
            raise ValueError("caption dropout with cached text needs the empty caption's text: call cache_empty_caption")
        return self.empty_text


class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches of `(entry, epoch)` keys where every batch holds one bucket of one dataset (with
    that dataset's batch_size) and one size of reference images. Entries and batches are shuffled per epoch from (seed, epoch).
    Each iteration advances the epoch; batches(epoch) gives any epoch's explicitly (EpochBatches)."""

    def __init__(self, dataset: ImageDataset, seed: int = 0, shuffle: bool = True, drop_last: bool = False):
        self.seed, self.shuffle, self.drop_last, self.epoch = seed, shuffle, drop_last, 0
        self.groups: dict[tuple, list[int]] = {}
        for entry, i in enumerate(dataset.entries):
            item = dataset.items[i]
            self.groups.setdefault((item.dataset_index, item.bucket, tuple(item.control_buckets)), []).append(entry)
        self.batch_sizes = {key: dataset.blueprint.datasets[key[0]].batch_size for key in self.groups}

    def batches(self, epoch: int, world: int = 1) -> list[list[tuple[int, int]]]:
        """The epoch's batches; with `world` processes, global batches of batch_size * world."""
        rng = random.Random(f"{self.seed}:{epoch}")
        batches = []
        for key in sorted(self.groups):
            entries = list(self.groups[key])
            if self.shuffle:
                rng.shuffle(entries)
            size = self.batch_sizes[key] * world
            for start in range(0, len(entries), size):
                chunk = entries[start : start + size]
                if len(chunk) == size or not self.drop_last:
                    batches.append([(e, epoch) for e in chunk])
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        yield from self.batches(epoch)

    def __len__(self) -> int:
        return len(self.batches(self.epoch))


class EpochBatches(torch.utils.data.Sampler):
    """This process's share of one epoch: the global batches (batch_size * world samples each)
    split into `world` equal contiguous slices, slice `rank` for this process; a short last batch
    is padded by cycling so every process gets the same count, as DDP needs. N processes thus see
    exactly the batches one process sees with an N-times batch. The first `skip` batches (trained
    before a resume) are left out; the epoch is explicit, so resuming is exact."""

    def __init__(self, sampler: BucketBatchSampler, epoch: int, rank: int = 0, world: int = 1, skip: int = 0):
        local = []
        for batch in sampler.batches(epoch, world):
            per = -(-len(batch) // world)
            padded = (batch * world)[: per * world]
            local.append(padded[rank * per : (rank + 1) * per])
        self.batches = local[skip:]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _reg_repeats(items: list[ImageItem]) -> dict[int, int]:
    """id(item) -> repeats for every regularization item, balanced within its dataset."""
    out: dict[int, int] = {}
    for di in sorted({item.dataset_index for item in items}):
        in_dataset = [item for item in items if item.dataset_index == di]
        train = sum(item.subset.num_repeats for item in in_dataset if not item.subset.is_reg)
        out.update(balance_reg_repeats(train, [item for item in in_dataset if item.subset.is_reg]))
    return out


def collate_batch(samples: list[dict]) -> dict:
    """Stack one bucket's samples: images [B,3,H,W] or latents [B,C,h,w] float32, captions list,
    text dict of [B, ...] tensors (different lengths zero-padded at the end of axis 0, so
    variable-length encoders must cache their own mask); reference images or latents as lists
    ("control_images" / "controls") of one stacked tensor per reference."""
    batch = {"image_paths": [s["image_path"] for s in samples], "keys": [s["key"] for s in samples],
             "captions": [s["caption"] for s in samples],
             "bucket": samples[0]["bucket"]}
    for key, out in (("image", "images"), ("latents", "latents")):
        if key in samples[0]:
            batch[out] = torch.stack([s[key] for s in samples])
    for key in ("controls", "control_images"):  # a batch holds one reference count and size
        if key in samples[0]:
            batch[key] = [torch.stack(refs) for refs in zip(*(s[key] for s in samples))]
    if "text" in samples[0]:
        batch["text"] = {k: _pad_stack([s["text"][k] for s in samples]) for k in samples[0]["text"]}
    batch["is_reg"] = torch.tensor([s.get("is_reg", False) for s in samples])
    if any("mask" in s for s in samples):  # unmasked samples of a mixed batch train everywhere
        like = next(s["mask"] for s in samples if "mask" in s)
        batch["masks"] = torch.stack([s.get("mask", torch.ones_like(like)) for s in samples])
    return batch


def _pad_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() == 0 or all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors)
    longest = max(t.shape[0] for t in tensors)
    out = tensors[0].new_zeros((len(tensors), longest, *tensors[0].shape[1:]))
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out


# ----------------------------------------------------------------------------------------------
# Caches: safetensors files that carry the hash of what they were computed from. A file is named
# for its image, model, the subset settings that shape its content (latent_entry / text_entry)
# and, for latents, the bucket; the content hash then tells whether the named file is current.


def cache_path(item: ImageItem, suffix: str) -> str:
    """`<stem>_<suffix>.safetensors` beside the image, or in cache_dir under a folder named for
    the image folder (plus a short hash of its path, so equal names in two folders differ)."""
    folder, name = os.path.split(os.path.abspath(item.image_path))
    stem = os.path.splitext(name)[0]
    if item.cache_dir:
        tag = hashlib.sha256(folder.encode()).hexdigest()[:8]
        folder = os.path.join(item.cache_dir, f"{os.path.basename(folder)}-{tag}")
    return os.path.join(folder, f"{stem}_{suffix}.safetensors")


def _hash_file(h, path: str, tag: bytes = b"") -> None:
    """Feed `tag` and then the bytes of the file at `path` into the hash `h`."""
    with open(path, "rb") as f:
        h.update(tag + f.read())


def _entry_tag(*parts) -> str:
    """8 hex digits for what decides a cache entry besides its image, model and bucket (which the
    file name holds already): two subsets over one folder that differ in it get their own files.
    It names inputs (settings, paths), not their bytes, which the content hash covers: an edited
    caption or reference rewrites its own file instead of leaving the old one beside it."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:8]


def _beside(item: ImageItem, paths: list[str]) -> list[str]:
    """`paths` relative to the item's image: the same after the dataset moves as a whole."""
    return [os.path.relpath(p, os.path.dirname(item.image_path)) for p in paths]


def latent_entry(item: ImageItem) -> str:
    """The subset's inputs of a latent entry: flip_aug, the mask, the references and their sizes."""
    mask = _beside(item, [item.mask_path] if item.mask_path else [])
    return _entry_tag(item.subset.flip_aug, item.subset.alpha_mask, mask, _beside(item, item.control_paths),
                      item.control_buckets)


def text_entry(item: ImageItem, with_references: bool) -> str:
    """The subset's inputs of a text entry: the caption's source and options (CAPTION_KEYS), how
    many variants it holds (validation encodes none) and, where the encoder sees them, the
    references and whether the entry holds the dropped caption."""
    references = (_beside(item, item.control_paths), drops_captions(item.subset)) if with_references else None
    return _entry_tag([getattr(item.subset, key) for key in CAPTION_KEYS], len(item.caption_variants), references)


def latent_hash(item: ImageItem, model_key: str) -> str:
    h = hashlib.sha256()
    _hash_file(h, item.image_path)
    h.update(f"|{model_key}|{item.bucket[0]}x{item.bucket[1]}|flip={item.subset.flip_aug}|{PREPROCESS_VERSION}".encode())
    if item.masked:  # a changed mask file recomputes the entry
        h.update(f"|{mask_source_hash(item.mask_path, item.subset.alpha_mask)}".encode())
    for path, (w, hh) in zip(item.control_paths, item.control_buckets):  # references are cached with it
        _hash_file(h, path, b"|control|")
        h.update(f"|{w}x{hh}".encode())
    return h.hexdigest()


def text_hash(item: ImageItem, model_key: str, with_references: bool = False) -> str:
    text = fixed_caption(item.caption, item.subset)
    if item.caption_variants:  # what is encoded changes with them (and with their count)
        text = "\x1f".join([text, *item.caption_variants])
    h = hashlib.sha256(f"{text}|{model_key}".encode())
    if with_references:  # the encoder sees the references, and the entry holds the dropped caption's text
        for path in item.control_paths:
            _hash_file(h, path, b"|control|")
        h.update(f"|dropped={drops_captions(item.subset)}".encode())
    return h.hexdigest()


def cache_latents(items: list[ImageItem], encode_fn: Callable[[torch.Tensor], torch.Tensor], model_key: str,
                  *, batch_size: int = 4, to_disk: bool = True) -> int:
    """Encode every image whose cache is missing or stale; returns how many images were encoded.

    encode_fn: float32 images [B,3,H,W] in [-1,1] -> latents [B,C,h,w] (any float dtype; stored
    as bf16). With flip_aug the mirrored image is encoded too ("latents_flipped"). Reference images
    are encoded into the same file ("control_<k>", "control_<k>_flipped").
    to_disk=False keeps the bf16 tensors in memory instead of writing files."""
    todo, claimed = [], {}
    for item in items:
        digest = latent_hash(item, model_key) if to_disk else ""
        path = cache_path(item, f"{model_key}_{latent_entry(item)}_{item.bucket[0]}x{item.bucket[1]}")
        if to_disk:  # only files are shared
            _claim(claimed, path, digest, item)
        if to_disk and _cache_is_valid(path, digest):
            item.latent_cache = path
        else:
            todo.append((item, path, digest))
    groups: dict[tuple, list] = {}  # a batch must hold one size; flipped latents only where needed
    for t in todo:
        groups.setdefault((t[0].bucket, tuple(t[0].control_buckets), t[0].subset.flip_aug), []).append(t)
    for (_, control_buckets, flip_aug), group in groups.items():
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            encoded = {}
            for flip in (False, True) if flip_aug else (False,):
                suffix = "_flipped" if flip else ""
                encoded["latents" + suffix] = _encode_images(encode_fn, chunk, flip)
                for k in range(len(control_buckets)):
                    encoded[f"control_{k}{suffix}"] = _encode_images(encode_fn, chunk, flip, control=k)
            for i, (item, path, digest) in enumerate(chunk):
                tensors = {k: v[i].to(CACHE_DTYPE) for k, v in encoded.items()}
                if item.masked:  # float32: a mask is small and its weights should be exact
                    for suffix, flip in (("", False), ("_flipped", True)) if flip_aug else (("", False),):
                        tensors["mask" + suffix] = load_mask(item.image_path, item.mask_path, item.bucket, flip)
                item.latent_cache = _store(tensors, path, digest, to_disk, model_key)
    return len(todo)


def _encode_images(encode_fn, chunk, flip: bool, control: int | None = None) -> torch.Tensor:
    """The chunk's images (or their reference number `control`) encoded."""
    images = torch.stack([load_image(item.image_path, item.bucket, flip) if control is None
                          else load_image(item.control_paths[control], item.control_buckets[control], flip)
                          for item, _, _ in chunk])
    with torch.no_grad():
        return encode_fn(images).detach().cpu()


def cache_text(items: list[ImageItem], encode_fn: Callable[..., list[dict[str, torch.Tensor]]],
               model_key: str, *, batch_size: int = 8, to_disk: bool = True, with_references: bool = False) -> int:
    """Encode every caption whose cache is missing or stale; returns how many images were encoded.

    encode_fn: captions -> one dict of tensors per caption (no batch axis; floating tensors are
    stored as bf16, others as they are). An item's augmented caption_variants are encoded too and
    stored in the same file as `<name>@<k>` (library/data/captions.py).
    with_references: the encoder sees each item's reference images, encode_fn(captions,
    reference views) (Qwen-Image-Edit); the entry is then per (caption, references), its hash
    covers the reference files, and with caption dropout it also holds the empty caption encoded
    with the same references (`<name>@dropped`: what dropout substitutes, as the pipeline would
    encode "" with the images). The references are seen unflipped (flip_aug mirrors only latents)."""
    todo, claimed = [], {}
    for item in items:
        digest = text_hash(item, model_key, with_references)
        path = cache_path(item, f"{model_key}_{text_entry(item, with_references)}_te")
        if to_disk:  # only files are shared
            _claim(claimed, path, digest, item)
        if to_disk and _cache_is_valid(path, digest):
            item.text_cache = path
        else:
            todo.append((item, path, digest))
    # One job per text; batches may span images, and an image's file is written with its last text.
    texts = [_texts(item, with_references) for item, _, _ in todo]
    jobs = [(i, suffix, text) for i, item_texts in enumerate(texts) for suffix, text in item_texts]
    remaining = [len(item_texts) for item_texts in texts]
    pending: list[dict] = [{} for _ in todo]
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        with torch.no_grad():
            outputs = encode_prompts(encode_fn, [text for _, _, text in chunk],
                                     [todo[i][0].control_paths for i, _, _ in chunk], with_references)
        for (i, suffix, _), out in zip(chunk, outputs):
            pending[i].update({name + suffix: _to_cache_dtype(v) for name, v in out.items()})
            remaining[i] -= 1
            if not remaining[i]:
                item, path, digest = todo[i]
                item.text_cache = _store(pending[i], path, digest, to_disk, model_key)
                pending[i] = {}
    return len(todo)


def _texts(item: ImageItem, with_references: bool) -> list[tuple[str, str]]:
    """(name suffix, text) of everything an item's text cache holds."""
    texts = [("", fixed_caption(item.caption, item.subset))]
    texts += [(f"@{k}", variant) for k, variant in enumerate(item.caption_variants)]
    if with_references and drops_captions(item.subset):
        texts.append(("@dropped", ""))
    return texts


def cache_empty_caption(dataset: "ImageDataset", encode_fn: Callable[[list[str]], list[dict[str, torch.Tensor]]]):
    """What caption dropout substitutes: the empty caption's text, encoded once, in the cache dtype
    (so it goes through the same bf16 rounding as every cached caption)."""
    with torch.no_grad():
        (out,) = encode_fn([""])
    dataset.empty_text = {name: _to_cache_dtype(v) for name, v in out.items()}


def _to_cache_dtype(v: torch.Tensor) -> torch.Tensor:
    return (v.to(CACHE_DTYPE) if v.is_floating_point() else v).detach().cpu()


def _read_text_cache(cache: str | dict, variant: int | str | None) -> dict[str, torch.Tensor]:
    """The caption's own tensors (variant None), those of its variant k or of the dropped caption
    ("dropped", when cached per item), under their plain names."""
    source = cache if isinstance(cache, dict) else CheckpointReader(cache)
    names = source.keys()
    if variant is None:
        wanted = {n: n for n in names if "@" not in n}
    else:
        suffix = f"@{variant}"
        wanted = {n: n[: -len(suffix)] for n in names if n.endswith(suffix)}
    get = source.__getitem__ if isinstance(cache, dict) else source.get
    return {plain: get(n) for n, plain in wanted.items()}


def _claim(claimed: dict[str, str], path: str, digest: str, item: ImageItem) -> None:
    """Two entries of one run may share a cache file only with the same content: else the file
    name misses an input (latent_entry / text_entry) and one would silently train on the other's."""
    if claimed.setdefault(path, digest) != digest:
        raise RuntimeError(f"{path}: two cache entries of {item.image_path} with different content would share "
                           f"this file (its name misses what sets their subsets apart)")


def _cache_is_valid(path: str, digest: str) -> bool:
    if not os.path.exists(path):
        return False
    try:
        return CheckpointReader(path).metadata.get("content_hash") == digest
    except Exception:  # a truncated or foreign file is simply recomputed
        return False


def _store(tensors: dict, path: str, digest: str, to_disk: bool, model_key: str) -> str | dict:
    if not to_disk:
        return tensors
    save_safetensors(tensors, path, metadata={"content_hash": digest, "model_key": model_key})
    return path


def _read_cache(cache: str | dict) -> dict[str, torch.Tensor]:
    if isinstance(cache, dict):
        return cache
    reader = CheckpointReader(cache)
    return {k: reader.get(k) for k in reader.keys()}


# ----------------------------------------------------------------------------------------------
# LLM text: documents -> one token stream -> fixed windows


def load_text_corpus(paths: str | list[str]) -> list[str]:
    """The documents (one per .txt file) from files and/or folders (their *.txt, sorted)."""
    files = []
    for p in [paths] if isinstance(paths, str) else paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".txt"))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise ValueError(f"{p}: no such text file or folder")
    if not files:
        raise ValueError(f"{paths}: no .txt files found")
    documents = [read_utf8(f) for f in files]
    if not any(d.strip() for d in documents):
        raise ValueError(f"{paths}: all text files are empty")
    return documents


def tokenize_documents(documents: list[str], encode: Callable[[str], list[int]], eos_id: int | None) -> torch.Tensor:
    """One int64 token stream; eos_id (if given) ends each document so windows see the border."""
    ids: list[int] = []
    for doc in documents:
        ids += list(encode(doc)) + ([eos_id] if eos_id is not None else [])
    return torch.tensor(ids, dtype=torch.long)


def train_val_split(ids: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The last val_fraction of the stream is validation: a contiguous tail, so no window of
    validation text also appears in training."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(ids) * val_fraction))
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :]


class TextWindowDataset(torch.utils.data.Dataset):
    """Windows of max_length tokens every `stride` tokens (default: max_length, no overlap).
    Item i is (input_ids, targets), both int64 [max_length], targets = inputs shifted by one.
    Tokens after the last full window are not used."""

    def __init__(self, token_ids, max_length: int, stride: int | None = None):
        self.ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        self.max_length, self.stride = max_length, stride or max_length
        if max_length < 1 or self.stride < 1:
            raise ValueError(f"max_length and stride must be >= 1, got {max_length}, {self.stride}")
        if len(self.ids) < max_length + 1:
            raise ValueError(f"text has {len(self.ids)} tokens, fewer than max_length + 1 = {max_length + 1}")
        self.starts = range(0, len(self.ids) - max_length, self.stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        window = self.ids[s : s + self.max_length + 1]
        return window[:-1], window[1:]
