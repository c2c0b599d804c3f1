"""On-disk caches of VAE latents and text-encoder outputs, so the VAE and the text encoders can
leave the GPU before training. After `cache_latents` / `cache_text` an item holds its cache (a file
path, or the tensors in memory) and ImageDataset (library/data/dataset.py) yields the cached
tensors instead of pixels and captions. The empty caption and the sample prompts are kept the same
way (cache_prompts), and after caching the files no entry uses are removed (remove_unused_caches).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Callable

import torch

from library.data.captions import caption_settings, drops_captions, fixed_caption
from library.data.controls import encode_prompts
from library.data.dataset_config import DatasetBlueprint
from library.data.image_folders import ImageItem, largest_bucket, reference_count, subset_images
from library.data.images import load_image
from library.data.masks import load_mask, mask_source_hash
from library.data.prompts import NegativePrompt
from library.io import CheckpointReader, SharedLock, atomic_target, name_limit, save_safetensors, temporary_name

# Part of every latent cache hash: bump it when resize/crop changes so old caches are redone.
PREPROCESS_VERSION = "resize-crop-v1"
CACHE_DTYPE = torch.bfloat16  # what cache files hold; samples are float32
LOAD_WORKERS = min(4, os.cpu_count() or 1)  # threads loading images ahead of the VAE (cache_latents)
TEMPORARY_AGE_S = 3600  # a cache file's temporary this old was left by a killed run (remove_unused_caches)
CACHE_LOCK = ".caches.lock"  # in each cache folder, held shared by the runs and tools caching or reading there
# In-memory caches (to_disk=False) may take at most this share of the memory available when caching starts:
# the rest is for the process itself and the base model that loads after them.
MEMORY_SHARE = 0.9


# ----------------------------------------------------------------------------------------------
# Caches: safetensors files that carry the hash of what they were computed from. A file is named
# for its image, model, the subset settings that shape its content (latent_entry / text_entry)
# and, for latents, the bucket; the content hash then tells whether the named file is current.


def cache_folder(item: ImageItem) -> str:
    """The folder of the item's caches: its image's, or in cache_dir one named for the image folder
    (plus a short hash of its path, so equal names in two folders differ). The real path (symlinked
    folders resolved, not a symlinked image file): two spellings of one folder in a run are one folder
    to lock (hold_cache_folders; the run's two shared locks kept it from ever being alone) and clean."""
    folder = os.path.realpath(os.path.dirname(os.path.abspath(item.image_path)))
    if item.cache_dir:
        tag = hashlib.sha256(folder.encode()).hexdigest()[:8]
        folder = os.path.join(item.cache_dir, f"{os.path.basename(folder)}-{tag}")
    return folder


def hold_cache_folders(items: list[ImageItem], held: contextlib.ExitStack) -> dict[str, SharedLock]:
    """Each of the items' cache folders' CACHE_LOCK, held shared until `held` closes, by {folder}: a
    run alone in a folder (SharedLock.alone) removes the cache files its own entries do not use, which
    may be the very files another run or a tool caches or reads there. A folder this process cannot
    write (it caches nothing there) is held where its lock file exists, read-only."""
    locks = {}
    for folder in sorted({cache_folder(item) for item in items}):
        path = os.path.join(folder, CACHE_LOCK)
        if not os.path.isdir(folder) or os.access(folder, os.W_OK | os.X_OK) or os.path.exists(path):
            locks[folder] = lock = SharedLock(path)
            held.callback(lock.close)
    return locks


def cache_path(item: ImageItem, suffix: str) -> str:
    """`<stem>_<suffix>.safetensors` in cache_folder: beside the image, or in cache_dir. A stem too long for
    that name in the folder's file system (its atomic temporary counted: an image named in 65 CJK characters
    on ext4) keeps its first bytes and a hash of the whole stem, `<start>~<12 hex>`: the name failed with
    'File name too long' at the first write, after the whole VAE pass."""
    folder = cache_folder(item)
    stem = os.path.splitext(os.path.basename(item.image_path))[0]
    name = f"{stem}_{suffix}.safetensors"
    limit = name_limit(folder)
    if len(temporary_name(name).encode()) > limit:
        tag = "~" + hashlib.sha256(stem.encode()).hexdigest()[:12]
        room = max(limit - len(temporary_name(f"{tag}_{suffix}.safetensors").encode()), 0)
        name = f"{stem.encode()[:room].decode(errors='ignore')}{tag}_{suffix}.safetensors"
    return os.path.join(folder, name)


def cache_summary(kind: str, encoded: int, items: list, attr: str, to_disk: bool) -> str:
    """`latents: 3 encoded, 5 reused from disk`: the files, not the items (one image in two datasets or subsets
    shares its file: counted as reused from disk though this run encoded it); in memory, nothing is reused."""
    if not to_disk:
        return f"{kind}: {encoded} encoded (kept in memory)"
    return f"{kind}: {encoded} encoded, {len({getattr(item, attr) for item in items}) - encoded} reused from disk"


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
                      item.control_buckets, *([_beside(item, item.layer_paths)] if item.layer_paths else []),
                      *(["stretched"] if item.controls_stretched else []),  # (the cropped ones keep their entries)
                      *([f"cropped from {item.control_crops}"] if item.control_crops else []),  # (and the covered)
                      # references loaded in another mode than their target (RGBA beside RGB targets): the RGB
                      # ones cached before reference_mode are encoded anew, the others keep their entries
                      *([item.controls_mode] if item.control_paths and item.controls_mode != target_mode(item) else []))


def text_entry(item: ImageItem, with_references: bool) -> str:
    """The subset's inputs of a text entry: the caption's source and options (caption_settings), how
    many variants it holds (validation encodes none) and, where the encoder sees them, the
    references and whether the entry holds the dropped caption."""
    references = (_beside(item, item.control_paths), drops_captions(item.subset)) if with_references else None
    kept = stored_preservation(item, with_references)
    preserved = () if kept is None else ("preserve", kept)  # its own entry
    dropped = item.subset.caption_dropout_text if drops_captions(item.subset) else ""
    dropped = ("dropped", dropped) if dropped else ()  # (the tags of entries without it as before)
    return _entry_tag(caption_settings(item.subset), len(item.caption_variants), references, *preserved, *dropped)


def stored_preservation(item: ImageItem, with_references: bool) -> str | None:
    """The output-preservation prompt an item's text entry holds (`@preserve`), or None: none, or the empty
    caption of an encoder that does not see the references (the run's one empty caption serves it; the
    entry, its name and hash stay those of a run without it)."""
    kept = item.preservation_caption
    return kept if kept or (kept == "" and with_references) else None


def latent_hash(item: ImageItem, model_key: str) -> str:
    h = hashlib.sha256()
    _hash_file(h, item.image_path)
    h.update(f"|{model_key}|{item.bucket[0]}x{item.bucket[1]}|flip={item.subset.flip_aug}|{PREPROCESS_VERSION}".encode())
    if item.masked:  # a changed mask file recomputes the entry
        h.update(f"|{mask_source_hash(item.mask_path, item.subset.alpha_mask)}".encode())
    for path in item.layer_paths:  # layered targets: each layer is a frame of the latents
        _hash_file(h, path, b"|layer|")
    for path, (w, hh) in zip(item.control_paths, item.control_buckets):  # references are cached with it
        _hash_file(h, path, b"|control|")
        h.update(f"|{w}x{hh}".encode())
    return h.hexdigest()


def text_hash(item: ImageItem, model_key: str, with_references: bool = False) -> str:
    text = fixed_caption(item.caption, item.subset)
    if item.caption_variants:  # what is encoded changes with them (and with their count)
        text = "\x1f".join([text, *item.caption_variants])
    if (kept := stored_preservation(item, with_references)) is not None:
        text += f"\x1fpreserve:{kept}"
    h = hashlib.sha256(f"{text}|{model_key}".encode())
    if with_references:  # the encoder sees the references, and the entry holds the dropped caption's text
        for path in item.control_paths:
            _hash_file(h, path, b"|control|")
        h.update(f"|dropped={drops_captions(item.subset)}".encode())
    return h.hexdigest()


def cache_latents(items: list[ImageItem], encode_fn: Callable[[torch.Tensor], torch.Tensor], model_key: str,
                  *, batch_size: int = 4, to_disk: bool = True, load_workers: int = LOAD_WORKERS,
                  share: tuple[int, int] = (0, 1)) -> int:
    """Encode every image whose cache is missing or stale; returns how many images were encoded.
    share: (process, processes) of a multi-process run: this process encodes its share of the files
    (owned_by), the others theirs (wait for them before reading).

    encode_fn: float32 images [B,3,H,W] in [-1,1] -> latents [B,C,h,w] (any float dtype; stored
    as bf16). With flip_aug the mirrored image is encoded too ("latents_flipped"). Reference images
    are encoded into the same file ("control_<k>", "control_<k>_flipped").
    to_disk=False keeps the bf16 tensors in memory instead of writing files.
    load_workers: threads that read, resize and crop the next batches while encode_fn runs on this one
    (0: each batch loaded when its turn comes); the files written are the same."""
    todo = _stale_entries(items, "latent_cache", to_disk,
                          lambda item: cache_path(item, f"{model_key}_{latent_entry(item)}_{item.bucket[0]}x{item.bucket[1]}"),
                          lambda item: latent_hash(item, model_key) if to_disk else "", share)
    groups: dict[tuple, list] = {}  # a batch must hold one size; flipped latents only where needed
    for t in todo:
        groups.setdefault((t[0].bucket, tuple(t[0].control_buckets), t[0].subset.flip_aug, len(t[0].layer_paths)),
                          []).append(t)
    chunks = [(group[start: start + batch_size], len(control_buckets), flip_aug)
              for (_, control_buckets, flip_aug, _), group in groups.items()
              for start in range(0, len(group), batch_size)]
    for n, ((chunk, _, flip_aug), pixels) in enumerate(prefetched(chunks, lambda job: _load_chunk(*job), load_workers)):
        encoded = {name: _encode(encode_fn, frames, layered) for name, (frames, layered) in pixels.items()}
        for i, (item, path, digest) in enumerate(chunk):
            tensors = {k: v[i].to(CACHE_DTYPE) for k, v in encoded.items()}
            if item.masked:  # float32: a mask is small and its weights should be exact
                for suffix, flip in (("", False), ("_flipped", True)) if flip_aug else (("", False),):
                    tensors["mask" + suffix] = load_mask(item.image_path, item.mask_path, item.bucket, flip)
            item.latent_cache = _store(tensors, path, digest, to_disk, model_key)
        if n == 0 and not to_disk:  # the first batch's bytes per pixel, over every image's bucket
            pixels_done = sum(item.bucket[0] * item.bucket[1] for item, _, _ in chunk)
            per_pixel = sum(_nbytes(item.latent_cache) for item, _, _ in chunk) / pixels_done
            check_memory_room(per_pixel * sum(item.bucket[0] * item.bucket[1] for item, _, _ in todo), share[1],
                              f"the latents of {len(todo)} images", "cache_latents_to_disk")
    return len(todo)


def loaded_on_first_call(load: Callable[[], Callable]) -> Callable:
    """An encoder that is `load()`ed when it is first called: a re-run whose caches are all current
    loads no VAE and no text encoder (T5-XXL: 9.5 GB read for nothing)."""
    encoder = []

    def call(*args, **kwargs):
        if not encoder:
            encoder.append(load())
        return encoder[0](*args, **kwargs)

    return call


def prefetched(jobs: list, load: Callable, workers: int):
    """(job, load(job)) in the order of `jobs`, with up to `workers` jobs loading ahead in threads while
    the caller works on the current one (image decoding and resizing release the GIL). On a GPU the
    VAE encodes a megapixel image in tens of milliseconds and decoding a photo takes about 0.1 s
    (bench/bench_caching.py), so a caching loop that loads in turn waits on the loading."""
    if workers <= 0:
        for job in jobs:
            yield job, load(job)
        return
    waiting = iter(jobs)
    with ThreadPoolExecutor(workers) as pool:
        pending = deque((job, pool.submit(load, job)) for job in islice(waiting, workers))
        while pending:
            current, future = pending.popleft()
            pending.extend((job, pool.submit(load, job)) for job in islice(waiting, 1))
            yield current, future.result()


def owned_by(position: int, share: tuple[int, int]) -> bool:
    """Whether the entry at `position` of the run's item list is encoded by process share[0] of
    share[1]. By position, not among the stale entries: a process that looks after another wrote
    its files sees fewer stale ones, and would take a share that leaves some to nobody."""
    process, processes = share
    return position % processes == process


def _stale_entries(items: list[ImageItem], attr: str, to_disk: bool, path_of: Callable[[ImageItem], str],
                   digest_of: Callable[[ImageItem], str], share: tuple[int, int] = (0, 1)
                   ) -> list[tuple[ImageItem, str, str]]:
    """(item, cache path, content hash) of every item whose cache this process must encode; an item
    whose file on disk is valid gets it as `attr` (latent_cache / text_cache) instead, and so does a
    later entry of a file another entry encodes (one image in two datasets, e.g. at two resolutions:
    one caption), encoded once, and a file another process of the run encodes (`share`: owned_by;
    in memory every process encodes every entry, for itself)."""
    todo, claimed = [], {}
    for position, item in enumerate(items):
        digest, path = digest_of(item), path_of(item)
        shared = to_disk and path in claimed
        if to_disk:  # only files are shared
            _claim(claimed, path, digest, item)
        if shared or (to_disk and (not owned_by(position, share) or _cache_is_valid(path, digest))):
            setattr(item, attr, path)
        else:
            todo.append((item, path, digest))
    if to_disk:
        _check_writable(sorted({os.path.dirname(path) for _, path, _ in todo}))
    return todo


def _check_writable(folders: list[str]) -> None:
    """Before anything is encoded: the folders the stale entries go to can be written (a read-only
    dataset folder is fine while its caches are current). Else one error naming the folder."""
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            why = None if os.access(folder, os.W_OK | os.X_OK) else "not writable"
        except OSError as e:
            why = e.strerror or type(e).__name__
        if why:
            raise ValueError(f"{folder}: cache files cannot be written there ({why}); set cache_dir in the dataset "
                             f"config's [[datasets]] (or [general]) to a writable folder")


def _load_chunk(chunk, n_controls: int, flip_aug: bool) -> dict[str, tuple[list[torch.Tensor], bool]]:
    """The chunk's pixels by cache entry name ("latents", "control_<k>", each also "_flipped" with
    flip_aug): (batches to encode, layered). Layered targets (library/data/layers.py) are RGBA, and
    each frame (the composite, then every layer) is a batch of its own: their latents are stacked
    [B, C, 1 + layers, h, w]."""
    pixels = {}
    for flip in (False, True) if flip_aug else (False,):
        suffix = "_flipped" if flip else ""
        pixels["latents" + suffix] = _load_images(chunk, flip)
        for k in range(n_controls):
            pixels[f"control_{k}{suffix}"] = _load_images(chunk, flip, control=k)
    return pixels


def target_mode(item: ImageItem) -> str:
    """The PIL mode its target loads in: RGBA for layered targets (each frame keeps its alpha), else RGB."""
    return "RGBA" if item.layer_paths else "RGB"


def _load_images(chunk, flip: bool, control: int | None = None) -> tuple[list[torch.Tensor], bool]:
    layered = bool(chunk[0][0].layer_paths)
    if control is None and layered:
        frames = [[item.image_path, *item.layer_paths] for item, _, _ in chunk]
        return [torch.stack([load_image(paths[f], item.bucket, flip, target_mode(item))
                             for paths, (item, _, _) in zip(frames, chunk)]) for f in range(len(frames[0]))], True
    sources = [(item.image_path, item.bucket, target_mode(item), False, None) if control is None
               else (item.control_paths[control], item.control_buckets[control],
                     item.controls_mode, item.controls_stretched,  # the family's reference_mode (scan_images)
                     item.control_crop(control))
               for item, _, _ in chunk]
    return [torch.stack([load_image(path, bucket, flip, mode, stretch, crop_from)
                         for path, bucket, mode, stretch, crop_from in sources])], False


def _encode(encode_fn, frames: list[torch.Tensor], layered: bool) -> torch.Tensor:
    with torch.no_grad():
        latents = [encode_fn(images).detach().cpu() for images in frames]
    return torch.stack(latents, dim=2) if layered else latents[0]


def cache_text(items: list[ImageItem], encode_fn: Callable[..., list[dict[str, torch.Tensor]]],
               model_key: str, *, batch_size: int = 8, to_disk: bool = True, with_references: bool = False,
               share: tuple[int, int] = (0, 1)) -> int:
    """Encode every caption whose cache is missing or stale; returns how many images were encoded
    (share: as for cache_latents).

    encode_fn: captions -> one dict of tensors per caption (no batch axis; floating tensors are
    stored as bf16, others as they are). An item's augmented caption_variants are encoded too and
    stored in the same file as `<name>@<k>` (library/data/captions.py).
    with_references: the encoder sees each item's reference images, encode_fn(captions,
    reference views) (an edit family's text_sees_controls); the entry is then per (caption, references), its hash
    covers the reference files, and with caption dropout it also holds the empty caption encoded
    with the same references (`<name>@dropped`: what dropout substitutes, as the pipeline would
    encode "" with the images). A subset's caption_dropout_text is what dropout substitutes: encoded into each of its
    entries as `<name>@dropped`, with or without references. The references are seen unflipped (flip_aug mirrors
    only latents)."""
    todo = _stale_entries(items, "text_cache", to_disk,
                          lambda item: cache_path(item, f"{model_key}_{text_entry(item, with_references)}_te"),
                          lambda item: text_hash(item, model_key, with_references), share)
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
        stored = [{name: _to_cache_dtype(v) for name, v in out.items()} for out in outputs]
        if start == 0 and not to_disk:  # the first batch's bytes per text, over every text
            variants = sum(len(item.caption_variants) for item, _, _ in todo)
            check_memory_room(sum(map(_nbytes, stored)) / len(chunk) * len(jobs), share[1],
                              f"the text encoder outputs of {len(jobs)} texts ({len(todo)} images"
                              + (f", {variants} of them augmented caption_variants)" if variants else ")"),
                              "cache_text_encoder_outputs_to_disk", " (or set fewer caption_variants)" if variants else "")
        for (i, suffix, _), out in zip(chunk, stored):
            pending[i].update({name + suffix: v for name, v in out.items()})
            remaining[i] -= 1
            if not remaining[i]:
                item, path, digest = todo[i]
                item.text_cache = _store(pending[i], path, digest, to_disk, model_key)
                pending[i] = {}
    return len(todo)


def check_memory_room(needed: float, processes: int, what: str, key: str, other_way: str = "") -> None:
    """In-memory caches that would not fit: one error seconds into caching (from the first batch's size),
    not the kernel's out-of-memory kill minutes later. Each process of a run holds its own in-memory
    caches; `needed` is one process's. Nothing is checked where the available memory is not known."""
    available = memory_available()
    if available is None or needed * processes <= MEMORY_SHARE * available:
        return
    each = f" in each of {processes} processes" if processes > 1 else ""
    raise ValueError(f"in-memory caches: {what} would take {needed / 2**30:.1f} GiB{each}, over "
                     f"{MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB of memory available; set {key} = true "
                     f"to keep them on disk{other_way}")


@dataclass(frozen=True)
class InMemoryCaches:
    """What a run's in-memory caches hold in one process, planned from its dataset config (tools/plan_memory.py)."""

    images: int
    texts: int
    variants: int  # of the texts: augmented caption_variants
    latent_bytes: int
    text_bytes: int


def plan_in_memory_caches(blueprint: DatasetBlueprint, latent_per_pixel: float, text_bytes: int) -> InMemoryCaches:
    """Upper bounds of the caches cache_latents / cache_text keep in memory for `blueprint`'s images (the held-out
    sets' too), from the folders' file lists alone: each image's latents at its dataset's largest bucket (a
    bucket's area is at most that), once more per reference (the most any image has; a layered image's composite)
    and per layer file, twice with flip_aug; its caption, its caption_variants (with shuffle_caption or
    caption_tag_dropout_rate) and its caption_dropout_text, each `text_bytes` (the planned caption length's).
    latent_per_pixel: cached bytes per pixel of an image."""
    references = reference_count(blueprint)
    images = texts = variants = latents = 0
    for ds in [*blueprint.datasets, *blueprint.validation_datasets]:
        width, height = largest_bucket(ds)
        for subset in ds.subsets:
            paths, layers = subset_images(subset)
            own = references if subset.control_directory else 1 if subset.multiple_target else 0  # a composite: its own
            frames = sum(1 + len(layers.get(p, ())) + own for p in paths)
            latents += frames * (2 if subset.flip_aug else 1) * width * height * latent_per_pixel
            augmented = subset.caption_variants if subset.shuffle_caption or subset.caption_tag_dropout_rate > 0 else 0
            dropped = 1 if subset.caption_dropout_text and drops_captions(subset) else 0  # its own "@dropped"
            images, texts = images + len(paths), texts + len(paths) * (1 + augmented + dropped)
            variants += len(paths) * augmented
    return InMemoryCaches(images, texts, variants, int(latents), texts * text_bytes)


def memory_available() -> int | None:
    """Bytes of memory the kernel can give without swapping (Linux's MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _texts(item: ImageItem, with_references: bool) -> list[tuple[str, str]]:
    """(name suffix, text) of everything an item's text cache holds."""
    texts = [("", fixed_caption(item.caption, item.subset))]
    texts += [(f"@{k}", variant) for k, variant in enumerate(item.caption_variants)]
    if drops_captions(item.subset) and (with_references or item.subset.caption_dropout_text):
        texts.append(("@dropped", item.subset.caption_dropout_text))  # else: the run's one empty caption
    if (kept := stored_preservation(item, with_references)) is not None:  # else: none, or the empty caption's
        texts.append(("@preserve", kept))
    return texts


def cache_empty_caption(dataset, encode_fn: Callable[[list[str]], list[dict[str, torch.Tensor]]], model_key: str,
                        folder: str | None = None) -> str | None:
    """What caption dropout substitutes: the empty caption's text, encoded once (kept in `folder` as
    a prompt is: cache_prompts), in the cache dtype (so it goes through the same bf16 rounding as
    every cached caption), as the ImageDataset `dataset`'s empty_text. Returns its file."""
    (out,), (path,) = cache_prompts([("", (), None)], encode_fn, model_key, folder)
    dataset.empty_text = {name: _to_cache_dtype(v) for name, v in out.items()}
    return path


def prompt_cache_path(folder: str, model_key: str, text: str, references, sample_size=None) -> str:
    """`prompt-<tag>_<model_key>_te.safetensors`: named for the text, its reference paths and the
    sample size its encoder fits them to (where it does)."""
    named = (text, list(references)) if sample_size is None else (text, list(references), tuple(sample_size))
    if isinstance(text, NegativePrompt):  # encoded as a negative (a family may encode it otherwise): its own file
        named += ("negative",)
    tag = hashlib.sha256(repr(named).encode()).hexdigest()[:16]
    return os.path.join(folder, f"prompt-{tag}_{model_key}_te.safetensors")


def cache_prompts(prompts: list[tuple[str, tuple[str, ...], tuple[int, int] | None]], encode_fn: Callable,
                  model_key: str, folder: str | None,
                  with_references: bool = False) -> tuple[list[dict[str, torch.Tensor]], list[str | None]]:
    """The encoding of each (text, reference image paths, the family's sample_text_size) as
    encode_prompts gives it (one dict per prompt, no batch axis, dtypes as encoded): the sample
    prompts and the empty caption. With `folder` each is kept there (prompt_cache_path: a file per
    sample size too), its content hash over the text, the model key and, where the encoder sees
    them, the references' bytes, and read back while current: a re-run whose captions and prompts
    are all cached loads no text encoder. A folder that cannot be written (read-only) keeps new
    ones in memory. Returns (encodings, their files: None where not kept)."""
    out, files = [], []
    for text, references, sample_size in prompts:
        references, sample_size = (tuple(references), sample_size) if with_references else ((), None)
        path = prompt_cache_path(folder, model_key, text, references, sample_size) if folder else None
        h = hashlib.sha256(f"{text}|{model_key}{'|negative' if isinstance(text, NegativePrompt) else ''}".encode())
        for reference in references:
            _hash_file(h, reference, b"|control|")
        files.append(path)
        if path and _cache_is_valid(path, h.hexdigest()):
            out.append(read_cache(path))
            continue
        with torch.no_grad():
            (tensors,) = encode_prompts(encode_fn, [text], [list(references)], with_references, sample_size)
        tensors = {name: v.detach().cpu() for name, v in tensors.items()}
        if path:
            try:
                _store(tensors, path, h.hexdigest(), True, model_key)
            except OSError as e:  # a read-only cache folder is used as it is: this one stays in memory
                if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                files[-1] = None
        out.append(tensors)
    return out, files


def remove_unused_caches(folders, family: str, used: set[str], latents: bool, text: bool) -> tuple[int, int]:
    """Delete the cache files in `folders` that no entry of this run uses (used: their paths), as
    musubi-tuner's cache scripts do unless --keep_cache: each changed setting or model file left the
    old files beside the new. Only files this cache wrote are touched: a `.safetensors` whose header
    says it is a cache (content_hash) of this family (model_key `<family>_<10 hex>...`, also in its
    name), latent ones only with `latents` (kept on disk this run) and text ones (`_te`) only with
    `text`; also a killed run's temporaries of such files (_is_left_temporary). A user's file,
    another family's caches and a file that cannot be removed are left.
    Returns (files removed, bytes freed)."""
    removed = freed = 0
    for folder in sorted(set(folders)):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            kind_kept = text if "_te.safetensors" in name else latents
            if path in used or not kind_kept or f"_{family}_" not in name:  # before any header is read
                continue
            if not (_is_cache_of(path, name, family) or _is_left_temporary(path, name, family)):
                continue
            size = os.path.getsize(path)
            try:
                os.remove(path)
            except OSError:  # a read-only folder: its caches stay
                continue
            removed, freed = removed + 1, freed + size
    return removed, freed


def _is_left_temporary(path: str, name: str, family: str) -> bool:
    """A cache file's temporary (library/io.py atomic_path: `.<name>.<random>.tmp`) that a killed run
    left, an hour old: a write in progress takes milliseconds."""
    target = atomic_target(name) or ""
    return (re.fullmatch(rf".+_{re.escape(family)}_[0-9a-f]{{10}}_.+\.safetensors", target) is not None
            and os.path.isfile(path) and time.time() - os.path.getmtime(path) > TEMPORARY_AGE_S)


def _is_cache_of(path: str, name: str, family: str) -> bool:
    if not name.endswith(".safetensors") or not os.path.isfile(path):
        return False
    try:
        metadata = CheckpointReader(path).metadata
    except Exception:  # not a safetensors file: not ours
        return False
    key = metadata.get("model_key", "")
    return ("content_hash" in metadata and re.match(rf"{re.escape(family)}_[0-9a-f]{{10}}(_|$)", key) is not None
            and f"_{key}_" in name)


def _to_cache_dtype(v: torch.Tensor) -> torch.Tensor:
    return (v.to(CACHE_DTYPE) if v.is_floating_point() else v).detach().cpu()


def read_text_cache(cache: str | dict, variant: int | str | None) -> dict[str, torch.Tensor]:
    """The caption's own tensors (variant None), those of its variant k, of the dropped caption
    ("dropped", when cached per item) or of its preservation prompt ("preserve"), under their plain names."""
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


def read_cache(cache: str | dict) -> dict[str, torch.Tensor]:
    if isinstance(cache, dict):
        return cache
    reader = CheckpointReader(cache)
    return {k: reader.get(k) for k in reader.keys()}
