"""Training data for images: `ImageDataset(blueprint)` serves the scanned images (library/data/
image_folders.py: captions, aspect-ratio buckets, the validation hold-out), `BucketBatchSampler`
yields batches that hold one bucket, and `collate_batch` stacks them. After `cache_latents` /
`cache_text` (library/data/caches.py) the dataset yields the cached tensors instead of
pixels/captions, so the VAE and text encoders can leave the GPU. The LLM's text is
library/data/text_corpus.py.

Randomness (flip, caption shuffle and dropout, batch order) is drawn from `random.Random` seeded
by (seed, epoch, entry): the same seed gives the same run, with any number of DataLoader workers.
"""

from __future__ import annotations

import os
import random
import warnings

import torch

from library.data.caches import read_cache, read_text_cache
from library.data.captions import caption_variants, drops_captions, fixed_caption, is_dropped
from library.data.dataset_config import DatasetBlueprint
from library.data.image_folders import ImageItem, scan_images, split_validation
from library.data.images import load_image
from library.data.masks import balance_reg_repeats, load_mask


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
            reg = reg_repeats(self.items)
            repeats = [reg.get(id(item), n) for item, n in zip(self.items, repeats)]
        self.entries = [i for i, n in enumerate(repeats) for _ in range(n)]
        self.repeat_of = [r for n in repeats for r in range(n)]
        if not validation:  # validation uses the captions as written
            for item in self.items:
                item.caption_variants = caption_variants(item.caption, item.subset)
        self.empty_text: dict | None = None  # the empty caption's cached text (cache_empty_caption)
        self.preserving = any(item.preservation_caption is not None for item in self.items)  # output preservation

    def __len__(self) -> int:
        return len(self.entries)

    def drawn_items(self) -> list[ImageItem]:
        """The items an epoch draws: regularization images past the balance are never drawn, so not cached
        (they stay in `items`: the state's record of the files and the header's counts are of the scan)."""
        drawn = set(self.entries)
        return [item for i, item in enumerate(self.items) if i in drawn]

    def __getitem__(self, key) -> dict:
        entry, epoch, *stratum = key if isinstance(key, tuple) else (key, 0)
        item = self.items[self.entries[entry]]
        rng = random.Random(f"{self.seed}:{epoch}:{entry}")
        flip = item.subset.flip_aug and not self.validation and rng.random() < 0.5
        # key: which occurrence of which image this is (dataset:subset:path#repeat), independent of
        # where the dataset lives. It seeds the noise and sigma: with the step, every repeat of an
        # image in a step, and the same image in two subsets, gets its own draw (an optimizer step
        # lies within one epoch, where each repeat occurs once).
        # A held-out image's key is its path in its folder alone: its validation noise must not move when
        # another dataset or subset is listed before it (a val_loss compares between such runs).
        relpath = os.path.relpath(item.image_path, item.subset.image_dir)
        key = relpath if self.validation else f"{item.dataset_index}:{item.subset_index}:{relpath}#{self.repeat_of[entry]}"
        caption, variant = self._caption(item, epoch, rng)
        sample = {"image_path": item.image_path, "key": key, "bucket": item.bucket, "caption": caption,
                  "is_reg": item.subset.is_reg}
        if stratum:  # num_timestep_buckets: the stratum of the uniform quantile its sigma is drawn at
            sample["stratum"] = stratum[0]
        if item.latent_cache is not None:
            cached = read_cache(item.latent_cache)
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
                sample["control_images"] = [load_image(p, b, flip, item.controls_mode, item.controls_stretched,
                                                       item.control_crop(k))
                                            for k, (p, b) in enumerate(zip(item.control_paths, item.control_buckets))]
        if item.text_cache is not None:
            text = read_text_cache(item.text_cache, variant)  # "dropped": the item's own, if encoded with its references
            if variant == "dropped" and not text:
                text = self._empty_text()
            sample["text"] = _floats(text)
            if self.preserving:  # output preservation: every sample of the batch has a second prompt, used or not
                sample["preserved"] = item.preservation_caption is not None
                kept = read_text_cache(item.text_cache, "preserve") if sample["preserved"] else text
                kept = kept or self._empty_text()  # "": the empty caption's, unless encoded with the item's references
                sample["preservation_text"] = _floats(kept)
        return sample

    def _caption(self, item: ImageItem, epoch: int, rng: random.Random) -> tuple[str, int | str | None]:
        """(caption, which cached text goes with it: None the caption's own, k its k-th variant,
        "dropped" the dropped caption's: the subset's caption_dropout_text, or the run's empty caption).
        Validation always uses the caption as written."""
        if self.validation:
            return fixed_caption(item.caption, item.subset), None
        if drops_captions(item.subset) and is_dropped(item.subset, epoch, rng):
            return item.subset.caption_dropout_text, "dropped"
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
    Each iteration advances the epoch; batches(epoch) gives any epoch's explicitly (EpochBatches).
    timestep_buckets (num_timestep_buckets, musubi-tuner's stratified sigmas): keys `(entry, epoch, stratum)`, the
    epoch's samples dealt the strata 0 .. buckets - 1 evenly (counts within one) in a random order of their own."""

    def __init__(self, dataset: ImageDataset, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 timestep_buckets: int | None = None):
        self.seed, self.shuffle, self.drop_last, self.epoch = seed, shuffle, drop_last, 0
        self.timestep_buckets = timestep_buckets if timestep_buckets and timestep_buckets > 1 else None
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
        return self._stratified(batches, epoch) if self.timestep_buckets else batches

    def _stratified(self, batches: list[list[tuple[int, int]]], epoch: int) -> list[list[tuple[int, int, int]]]:
        """Each key with its stratum: the epoch's n samples take strata j * buckets // n (j < n), shuffled (musubi-
        tuner's pool: ceil(n / buckets) of each, shuffled, cut to n)."""
        n = sum(len(batch) for batch in batches)
        strata = [j * self.timestep_buckets // n for j in range(n)]
        random.Random(f"{self.seed}:{epoch}:strata").shuffle(strata)
        dealt = iter(strata)
        return [[(entry, ep, next(dealt)) for entry, ep in batch] for batch in batches]

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        yield from self.batches(epoch)

    def __len__(self) -> int:
        return len(self.batches(self.epoch))


def process_share(batch: list, rank: int, world: int) -> list:
    """Process `rank`'s contiguous slice of a global batch among `world`; a short batch is padded by
    cycling, so every process gets as many samples (DDP needs the same count everywhere)."""
    per = -(-len(batch) // world)
    return (batch * world)[: per * world][rank * per : (rank + 1) * per]


class EpochBatches(torch.utils.data.Sampler):
    """This process's share of one epoch: the global batches (batch_size * world samples each)
    split into `world` equal contiguous slices, slice `rank` for this process; a short last batch
    is padded by cycling so every process gets the same count, as DDP needs. N processes thus see
    exactly the batches one process sees with an N-times batch. The first `skip` batches (trained
    before a resume) are left out; the epoch is explicit, so resuming is exact."""

    def __init__(self, sampler: BucketBatchSampler, epoch: int, rank: int = 0, world: int = 1, skip: int = 0):
        self.batches = [process_share(batch, rank, world) for batch in sampler.batches(epoch, world)][skip:]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def reg_repeats(items: list[ImageItem]) -> dict[int, int]:
    """id(item) -> repeats for every regularization item, balanced within its dataset (check_dataset's
    count too: items need only dataset_index, subset and image_path)."""
    out: dict[int, int] = {}
    for di in sorted({item.dataset_index for item in items}):
        in_dataset = [item for item in items if item.dataset_index == di]
        train = sum(item.subset.num_repeats for item in in_dataset if not item.subset.is_reg)
        reg_items = [item for item in in_dataset if item.subset.is_reg]
        balanced = balance_reg_repeats(train, reg_items)
        unused = [item for item in reg_items if balanced[id(item)] == 0]
        if unused:  # sd-scripts says so too: a silent cap hid 14 of the concept demo's 24 reg images
            warnings.warn(f"dataset {di}: {len(unused)} of {len(reg_items)} regularization images are not used "
                          f"(first: {unused[0].image_path}); reg images are used in file order until they match the "
                          f"{train} training images x num_repeats per epoch: raise the training subsets' num_repeats "
                          f"to use more", stacklevel=2)
        out.update(balanced)
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
    for key in ("text", "preservation_text"):  # (the second: output preservation's prompts)
        if key in samples[0]:
            batch[key] = {k: _pad_stack([s[key][k] for s in samples]) for k in samples[0][key]}
    if "preserved" in samples[0]:
        batch["preserved"] = torch.tensor([s["preserved"] for s in samples])
    batch["is_reg"] = torch.tensor([s.get("is_reg", False) for s in samples])
    if "stratum" in samples[0]:
        batch["strata"] = [s["stratum"] for s in samples]
    if any("mask" in s for s in samples):  # unmasked samples of a mixed batch train everywhere
        like = next(s["mask"] for s in samples if "mask" in s)
        batch["masks"] = torch.stack([s.get("mask", torch.ones_like(like)) for s in samples])
    return batch


def _floats(text: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A cached text's floating tensors in float32 (bf16 on disk), the others as they are."""
    return {k: v.float() if v.is_floating_point() else v for k, v in text.items()}


def _pad_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() == 0 or all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors)
    longest = max(t.shape[0] for t in tensors)
    out = tensors[0].new_zeros((len(tensors), longest, *tensors[0].shape[1:]))
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out

