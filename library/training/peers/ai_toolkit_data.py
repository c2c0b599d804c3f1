"""ai-toolkit's `datasets` list and `sample` section as our dataset TOML and sample prompts file
(library/training/peers/ai_toolkit.py reads the rest of a process and calls these).

Datasets. ai-toolkit trains every image of a dataset at each size of its `resolution` list (it splits
the dataset into one per size); ours has one resolution per [[datasets]]. So each size becomes one
[[datasets]] (one per size and batch size) holding every ai-toolkit dataset trained at that size as a
[[datasets.subsets]] over its folder: the same folder in several [[datasets]]. The latent caches keep
the sizes apart (a cache file's name carries its bucket). A regularization dataset (is_reg) becomes a
subset beside the training subsets of its size, where ours balances the two. Buckets as ai-toolkit's:
each image keeps its aspect, its area shrunk to the resolution's, never enlarged (enable_bucket +
bucket_no_upscale), sides multiples of the model's bucket divisibility (ai-toolkit's bucket_tolerance is replaced
by it).

Samples. ai-toolkit's prompts (`sample.prompts`, or `sample.samples` with per-prompt keys) carry inline
flags (--w, --seed, --cfg, --ctrl_img ...) over the section's width, height, seed (walk_seed: + the
prompt's index), guidance_scale, sample_steps and neg. Each becomes one line of our sample prompt file
with every value written out (--w --h --s --d --g, --n, --ci), so the images render as ai-toolkit
set them and not at our models' own defaults; [trigger] (and [name]) become the trigger word.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from library.training.peers.rules import (DROPPED, NOT_CARRIED, RENAMED, Line, Rule, apply_rule, custom, ignored,
                                          implied, is_off, renamed, unsupported)

# ai-toolkit's defaults (toolkit/config_modules.py DatasetConfig, SampleConfig) where a key is left out.
RESOLUTION, BUCKET_TOLERANCE = 512, 64  # (ai-toolkit's loader replaces bucket_tolerance: bucket_step)
SAMPLE_EVERY = 100
SAMPLE_DEFAULTS = {"width": 512, "height": 512, "seed": 0, "walk_seed": False, "guidance_scale": 7,
                   "sample_steps": 20, "neg": "", "network_multiplier": 1}
PIXEL_STEP = 16  # our bucket sides: multiples of 16 (8x VAE, 2x2 patches: dataset_config.PIXELS_PER_TOKEN_SIDE)


def _dot_ext(value: Any) -> str:
    """ai-toolkit's caption_ext "txt" -> ".txt" (it adds the dot, as ours expects it written)."""
    if not isinstance(value, str) or not value.strip("."):
        raise ValueError(f"expected a file extension such as \"txt\", got {value!r}")
    return value if value.startswith(".") else "." + value


def _one_folder(value: Any) -> str:
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError("one control folder per reference: ours takes an image's references from one folder "
                             "(name_0.png, name_1.png ...): put them there, set control_directory")
        value = value[0]
    return value


# SDTrainer: mask_multiplier / mask_multiplier.mean(), over the batch
MASK_MEAN = ("ai-toolkit scales the batch's masks to mean 1 (a small mask's pixels weigh more); ours weighs each "
             "pixel by its mask as it is, as sd-scripts (a half-masked image: half its loss)")


def _handled(t, key, value) -> None:  # read where the dataset is built (to_dataset_toml)
    pass


# datasets[].<key> -> its rule; renamed ones name our [[datasets.subsets]] key (dataset keys: to_dataset_toml).
DATASET_RULES: dict[str, Rule] = {f"datasets[].{k}": r for k, r in {
    "folder_path": custom(_handled),  # image_dir, one subset per size
    "resolution": custom(_handled),  # one [[datasets]] per size
    "batch_size": custom(_handled),  # its [[datasets]]' batch_size
    "buckets": custom(_handled),  # enable_bucket
    "bucket_tolerance": custom(_handled),  # replaced by the model's step (bucket_step)
    "trigger_word": custom(_handled),  # caption_prefix (or nothing: see add_trigger)
    "cache_latents_to_disk": custom(_handled),  # our cache_latents_to_disk
    "caption_ext": renamed("caption_extension", _dot_ext),
    "caption_type": renamed("caption_extension", _dot_ext),  # its older name
    "caption_dropout_rate": renamed("caption_dropout_rate"),
    "shuffle_tokens": renamed("shuffle_caption"),
    "token_dropout_rate": renamed("caption_tag_dropout_rate"),
    "keep_tokens": renamed("keep_tokens"),
    "num_repeats": renamed("num_repeats"),
    "flip_x": renamed("flip_aug"),
    "is_reg": renamed("is_reg"),
    "alpha_mask": renamed("alpha_mask", why=MASK_MEAN),
    "mask_path": renamed("mask_dir", why=MASK_MEAN),
    "control_path": renamed("control_directory", _one_folder),
    "default_caption": renamed("class_tokens"),
    "cache_latents": ignored("ours always caches latents before training"),
    "cache_text_embeddings": ignored("ours always caches caption embeddings before training"),
    "num_workers": ignored("data loading only (ours: max_data_loader_n_workers)"),
    "prefetch_factor": ignored("data loading only"),
    "cache_latents_num_workers": ignored("caching speed only"),
    "load_image_when_caching_latents": ignored("caching only"),
    "fast_image_size": ignored("how image sizes are read only"),
    "debug": ignored("ai-toolkit's debugging output"),
    "type": implied(lambda v: v == "image", "ours trains image datasets"),
    "scale": implied(lambda v: v == 1.0, "ours trains images at their bucket size (scale 1)"),
    "network_weight": implied(lambda v: v == 1.0, "ours trains at the LoRA's full strength"),
    "loss_multiplier": implied(lambda v: v == 1.0, "ours weights training images 1 (regularization: prior_loss_weight)"),
    "mask_min_value": implied(lambda v: v == 0.0, "ours weighs the loss by the mask as it is (black: 0)"),
    "num_frames": implied(lambda v: v == 1, "ours trains images, not video frames"),
    "replay_transforms": ignored("control images follow their image's resize as ours always does"),
    "full_size_control_images": ignored("ours sizes references as each model's pipeline does"),
    "control_transparent_color": ignored("ours reads references as each model's pipeline does"),
    "flip_y": unsupported("upside-down copies: ours flips left-right only (flip_aug)"),
    "random_crop": unsupported("a crop per step: ours caches latents once"),
    "random_scale": unsupported("a scale per step: ours caches latents once"),
    "square_crop": unsupported("square crops: ours buckets by aspect ratio"),
    "augments": unsupported("pixel augmentations: ours caches latents once"),
    "augmentations": unsupported("pixel augmentations: ours caches latents once"),
    "shuffle_augmentations": unsupported("pixel augmentations: ours caches latents once"),
    "invert_mask": unsupported("ours weighs the loss by the mask as it is (invert the mask files)"),
    "inpaint_path": unsupported("inpainting inputs: ours trains no inpainting"),
    "unconditional_path": unsupported("unconditional images: not ours"),
    "prior_reg": unsupported("ai-toolkit's prior regularization: not ours"),
    "random_triggers": unsupported("random extra trigger words per step: ours reads captions as written"),
    "random_triggers_max": ignored("read with random_triggers"),
    "replacements": unsupported("caption replacements per step: ours reads captions as written"),
    "use_short_captions": unsupported("short captions from a JSON file: ours reads caption files"),
    "dataset_path": unsupported("a JSON dataset: ours reads image folders (folder_path)"),
    "control_from_same_folder": unsupported("a random control image from the image's folder: ours matches by file name"),
    "num_controls_from_same_folder": ignored("read with control_from_same_folder"),
    "controls": unsupported("controls made on the fly (depth, pose ...): ours reads control images from a folder"),
    "clip_image_path": unsupported("adapter training images: ours trains a LoRA"),
    "clip_image_from_same_folder": unsupported("adapter training images: ours trains a LoRA"),
    "clip_image_augmentations": unsupported("adapter training images: ours trains a LoRA"),
    "clip_image_shuffle_augmentations": unsupported("adapter training images: ours trains a LoRA"),
    "poi": unsupported("ai-toolkit no longer reads it (it refuses the key)"),
    "extra_values": unsupported("ai-toolkit's extra per-image values: not ours"),
    "standardize_images": unsupported("image standardization: not ours"),
    "diff_output_preservation": ignored("ai-toolkit sets it from train.diff_output_preservation"),
    "diff_output_preservation_class": ignored("ai-toolkit sets it from train.diff_output_preservation_class"),
    "guidance_type": ignored("a guidance trainer's key (not a LoRA run's)"),
    # how video files are read (the UI writes shrink_video_to_frames into every dataset): images read none of them
    **{k: ignored("video files only") for k in (
        "shrink_video_to_frames", "fps", "auto_frame_count", "trim_auto_frame_count_tail")},
    **{k: unsupported("video / audio training: ours trains images") for k in (
        "do_i2v", "do_audio", "audio_preserve_pitch", "audio_normalize", "cache_tensors_to_disk",
        "cache_clip_vision_to_disk")},
}.items()}
# control_path_1 .. 3: the UI's several control folders (ours: one folder, name_0.png, name_1.png ...)
DATASET_RULES.update({f"datasets[].control_path_{i}": renamed("control_directory", _one_folder) for i in (1, 2, 3)})


def to_dataset_toml(t, datasets: Any, train: dict, trigger: str | None) -> dict:
    """Our dataset TOML ({"datasets": [...]}) from ai-toolkit's datasets; each key's line on `t` (keys
    "datasets[i].<key>"). trigger: the process's trigger word (a dataset's own wins)."""
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        raise ValueError(f"{t.source}: 'datasets' must be a list of datasets (each with its folder_path), got "
                         f"{datasets!r}")
    groups: dict[tuple, dict] = {}  # (resolution, batch_size, buckets, bucket step) -> our [[datasets]]
    cache_to_disk = False
    for i, entry in enumerate(datasets):
        where = f"datasets[{i}]"
        subset, dataset_keys = _subset(t, entry, where)
        folder = entry.get("folder_path")
        if not isinstance(folder, str) or not folder:
            raise ValueError(f"{t.source}: {where}.folder_path must name the image folder, got {folder!r}")
        t.lines.append(Line(f"{where}.folder_path", folder, RENAMED, "image_dir (one [[datasets.subsets]] per size)"))
        own_trigger = entry.get("trigger_word", trigger)
        if not subset.get("is_reg") and own_trigger:
            add_trigger(t, subset, folder, own_trigger, f"{where}.trigger_word" if "trigger_word" in entry else "trigger_word")
        elif "trigger_word" in entry:
            t.lines.append(Line(f"{where}.trigger_word", entry["trigger_word"], DROPPED,
                                "regularization captions get no trigger word (as ai-toolkit's)"))
        if own_trigger and not subset.get("is_reg") and subset.get("caption_dropout_rate"):
            subset["caption_dropout_text"] = own_trigger  # it puts the trigger word into the dropped caption too
            _amend_line(t, f"{where}.caption_dropout_rate", text=f"caption_dropout_rate, caption_dropout_text = "
                        f"{own_trigger!r} (ai-toolkit trains a dropped caption as its trigger word)")
        if train.get("cache_text_embeddings") or entry.get("cache_text_embeddings"):
            _captions_encoded_once(t, subset, where)
        cache_to_disk = cache_to_disk or _cache_line(t, entry, where)
        batch = _batch_size(t, entry, train, where)
        for size in _sizes(t, entry, where):
            group = groups.setdefault((size, batch, *dataset_keys), _dataset(size, batch, *dataset_keys))
            group["subsets"].append({"image_dir": folder, **subset})
    if cache_to_disk:
        t.config["cache_latents_to_disk"] = True
    kept = []
    for group in groups.values():
        if all(s.get("is_reg") for s in group["subsets"]):
            folders = ", ".join(s["image_dir"] for s in group["subsets"])
            t.lines.append(Line("datasets", folders, NOT_CARRIED, f"regularization images at {group['resolution']} px "
                                f"with no training images at that size and batch size: ours trains them beside "
                                f"training images of one [[datasets]]"))
            continue
        kept.append(group)
    if not kept:
        raise ValueError(f"{t.source}: no training dataset (every dataset has is_reg: true)")
    return {"datasets": kept}


def _subset(t, entry: dict, where: str) -> tuple[dict, tuple]:
    """The [[datasets.subsets]] keys of one ai-toolkit dataset, and (enable_bucket, bucket_reso_steps)."""
    subset: dict[str, Any] = {}
    buckets, step = entry.get("buckets", True), bucket_step(t.model_type)
    for key, value in entry.items():
        rule = DATASET_RULES.get(f"datasets[].{key}")
        shown = f"{where}.{key}"
        if rule is not None and rule.kind == "custom":
            continue  # folder_path, resolution ...: read below and by to_dataset_toml
        if key == "mask_min_value" and not (entry.get("mask_path") or entry.get("alpha_mask")):
            t.lines.append(Line(shown, value, DROPPED, "no mask (mask_path, alpha_mask): unread"))  # the UI writes 0.1
            continue
        if rule is None or rule.kind != "renamed":
            apply_rule(t, shown, value, rule)
            continue
        try:
            converted = rule.convert(value) if rule.convert else value
        except ValueError as e:
            t.lines.append(Line(shown, value, NOT_CARRIED, str(e)))
            continue
        if is_off(converted) and rule.ours in ("mask_dir", "control_directory", "class_tokens"):
            t.lines.append(Line(shown, value, DROPPED, "off"))
            continue
        if subset.get(rule.ours, converted) != converted:  # control_path_1 and _2, caption_ext and caption_type
            t.lines.append(Line(shown, value, NOT_CARRIED, f"a second {rule.ours} ({subset[rule.ours]!r} is the "
                                f"first): ours takes one (references: one folder, name_0.png, name_1.png ...)"))
            continue
        subset[rule.ours] = converted
        t.lines.append(Line(shown, value, RENAMED, rule.ours, rule.why))
    if subset.get("shuffle_caption") and subset.get("keep_tokens"):
        t.lines.append(Line(f"{where}.keep_tokens", subset.pop("keep_tokens"), NOT_CARRIED,
                            "ai-toolkit shuffles every tag (keep_tokens guards only token dropout); ours keeps the "
                            "first keep_tokens in place"))
    if "buckets" in entry:
        t.lines.append(Line(f"{where}.buckets", buckets, RENAMED, "enable_bucket"))
    if "bucket_tolerance" in entry:
        t.lines.append(Line(f"{where}.bucket_tolerance", entry["bucket_tolerance"], DROPPED, f"ai-toolkit replaces it "
                            f"by the model's bucket divisibility, {step} px: bucket_reso_steps = {step}"))
    return subset, (bool(buckets), step)


def bucket_step(model_type: str) -> int:
    """The bucket step ai-toolkit trains `model_type` at: its model's get_bucket_divisibility (the family spec's
    peer_bucket_steps), which its dataset loader writes over every dataset's bucket_tolerance. The converter
    carried bucket_tolerance (64 unset) where ai-toolkit bucketed most models at 16: other buckets, other crops."""
    from library.models.registry import spec_of

    return spec_of(model_type).peer_bucket_steps.get("ai-toolkit", BUCKET_TOLERANCE)


def _dataset(size: int, batch: int, buckets: bool, step: int) -> dict:
    """One [[datasets]] at `size`: ai-toolkit's buckets (each image at its own aspect, shrunk to the area,
    never enlarged), within the bucket range our checks take for that size."""
    dataset: dict[str, Any] = {"resolution": size, "batch_size": batch}
    if buckets:
        dataset.update(enable_bucket=True, bucket_no_upscale=True, bucket_reso_steps=step)
        if size < 256:  # our default bucket range is 256..1024: the resolution must lie within it
            dataset["min_bucket_reso"] = size // PIXEL_STEP * PIXEL_STEP
        if size > 1024:
            dataset["max_bucket_reso"] = size
    dataset["subsets"] = []
    return dataset


def _sizes(t, entry: dict, where: str) -> list[int]:
    value = entry.get("resolution", RESOLUTION)
    sizes = value if isinstance(value, list) else [value]
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= PIXEL_STEP for s in sizes):
        raise ValueError(f"{t.source}: {where}.resolution must be a size in pixels (>= {PIXEL_STEP}) or a list of "
                         f"them, got {value!r}")
    shown = f"{where}.resolution" + ("" if "resolution" in entry else " (ai-toolkit's default)")
    sizes = list(dict.fromkeys(sizes))
    t.lines.append(Line(shown, value, RENAMED, "resolution" if len(sizes) == 1 else
                        f"resolution of {len(sizes)} [[datasets]] over its folder, one per size"))
    return sizes


def _batch_size(t, entry: dict, train: dict, where: str) -> int:
    batch = entry.get("batch_size") or train.get("batch_size", 1)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        key = f"{where}.batch_size" if entry.get("batch_size") else "train.batch_size"  # the dataset's wins (there too)
        raise ValueError(f"{t.source}: {key} must be a whole number >= 1, got {batch!r}")
    if "batch_size" in entry:
        t.lines.append(Line(f"{where}.batch_size", entry["batch_size"], RENAMED, "batch_size of its [[datasets]]"))
    return batch


def _cache_line(t, entry: dict, where: str) -> bool:
    if "cache_latents_to_disk" not in entry:
        return False
    value = entry["cache_latents_to_disk"]
    t.lines.append(Line(f"{where}.cache_latents_to_disk", value, RENAMED if value else DROPPED,
                        "cache_latents_to_disk" if value else "off (ours caches latents in memory then)"))
    return bool(value)


def _amend_line(t, key: str, **changes) -> None:
    """The line of `key` (its rule wrote it) with `changes` (what another key made of it)."""
    at = next((i for i, line in enumerate(t.lines) if line.key == key), None)
    if at is not None:
        t.lines[at] = dataclasses.replace(t.lines[at], **changes)


def _captions_encoded_once(t, subset: dict, where: str) -> None:
    """cache_text_embeddings (train's is every dataset's): ai-toolkit encodes each caption once, drops no tokens
    then (dataloader_mixins skips token_dropout_rate) and shuffles its tags once, the order baked into the cached
    embedding: one fixed order per image, as ours' caption as written is (ours' shuffle would draw a new one of
    its variants every step)."""
    if subset.pop("caption_tag_dropout_rate", 0):
        _amend_line(t, f"{where}.token_dropout_rate", verdict=DROPPED, note="",
                    text="ai-toolkit drops no tokens when it caches the text embeddings (cache_text_embeddings)")
    if subset.pop("shuffle_caption", False):
        _amend_line(t, f"{where}.shuffle_tokens", verdict=DROPPED, note="",
                    text="ai-toolkit shuffles each caption once when it caches the text embeddings "
                         "(cache_text_embeddings): one fixed order per image, as ours' caption as written")


def add_trigger(t, subset: dict, folder: str, trigger: str, key: str) -> None:
    """ai-toolkit puts the trigger word at the front of each caption that lacks it and replaces [trigger] in
    captions; ours reads captions as written, plus a subset's caption_prefix. Where this machine holds the
    captions, that is told exactly: none holds the trigger -> caption_prefix; all do -> nothing to add;
    else (or [trigger] in them) the captions need editing."""
    ext = subset.get("caption_extension", ".txt")
    texts = _captions(folder, ext)
    if texts is None:
        subset["caption_prefix"] = trigger
        t.lines.append(Line(key, trigger, RENAMED, f"caption_prefix of {folder} (its captions are not on this "
                            f"machine: ai-toolkit adds the trigger only to captions without it; remove the "
                            f"caption_prefix if they hold it)"))
        return
    holding = [text for text in texts if trigger in text]
    placeholders = sum("[trigger]" in text or "[name]" in text for text in texts)
    if placeholders or 0 < len(holding) < len(texts):
        t.lines.append(Line(key, trigger, NOT_CARRIED, f"{placeholders} caption(s) in {folder} hold [trigger] and "
                            f"{len(texts) - len(holding)} of {len(texts)} lack {trigger!r}: ours reads captions as "
                            f"written; write the trigger word into them"))
    elif holding:
        t.lines.append(Line(key, trigger, DROPPED, f"every caption in {folder} holds it already"))
    else:
        subset["caption_prefix"] = trigger
        t.lines.append(Line(key, trigger, RENAMED, f"caption_prefix of {folder} (no caption there holds it)"))


def _captions(folder: str, ext: str) -> list[str] | None:
    """The caption files' texts in `folder` (None: the folder is not on this machine)."""
    if not os.path.isdir(folder):
        return None
    texts = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(ext) and os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    return texts


# ----------------------------------------------------------------------------------------------
# Samples


def _sampled(t, key, value) -> None:  # read where the prompt file is written (sample_prompts)
    pass


SAMPLE_RULES: dict[str, Rule] = {f"sample.{k}": r for k, r in {
    **{k: custom(_sampled) for k in ("prompts", "samples", "sample_every", "width", "height", "seed", "walk_seed",
                                     "guidance_scale", "sample_steps", "neg", "network_multiplier", "sample_start_step")},
    "sampler": implied(lambda v: v == "flowmatch", "ours samples with the model's flow-matching Euler sampler"),
    "format": ignored("ours writes PNG samples"),
    "guidance_rescale": unsupported("guidance rescale: ours renders without it"),
    "adapter_conditioning_scale": ignored("adapters only"),
    "refiner_start_at": ignored("refiner models only"),
    "extra_values": ignored("ai-toolkit's extra per-sample values"),
    "num_frames": implied(lambda v: v == 1, "ours renders images, not video"),
    "fps": ignored("video only"),
    "do_cfg_norm": unsupported("CFG normalization: ours renders without it"),
}.items()}
# ai-toolkit's inline prompt flags (toolkit/config_modules.py GenerateImageConfig) -> ours (None: not ours)
FLAGS = {"w": "w", "h": "h", "d": "d", "seed": "d", "l": "g", "cfg": "g", "s": "s", "steps": "s", "n": "n",
         "ctrl_img": "ci"}
NOT_OUR_FLAGS = {"m": "the LoRA's strength", "network_multiplier": "the LoRA's strength", "p2": "a second prompt",
                 "n2": "a second negative prompt", "gr": "guidance rescale", "a": "an adapter's scale",
                 "ref": "a refiner", "ev": "extra values", "extra_values": "extra values", "frames": "video frames",
                 "num_frames": "video frames", "fps": "video", "ctrl_idx": "a control index"}
FULL_STRENGTH = "ours renders samples with the LoRA at 1.0"
VIDEO_KEYS = ("fps", "num_frames")  # a sample's; at their defaults (16, 1) an image's
ENTRY_KEYS = {"width": "w", "height": "h", "seed": "d", "guidance_scale": "g", "sample_steps": "s", "neg": "n",
              "ctrl_img": "ci", "ctrl_img_1": "ci", "ctrl_img_2": "ci", "ctrl_img_3": "ci"}


def sample_prompts(t, sample: dict, train: dict, trigger: str | None) -> str | None:
    """Our sample prompt file's text from ai-toolkit's sample section (None: no samples); sets
    sample_every_n_steps and sample_at_first, each key's line on `t`."""
    for key, value in sample.items():
        rule = SAMPLE_RULES.get(f"sample.{key}")
        if rule is None or rule.kind != "custom":
            apply_rule(t, f"sample.{key}", value, rule)
    read = {k: v for k, v in sample.items() if SAMPLE_RULES.get(f"sample.{k}", custom(_sampled)).kind == "custom"
            and f"sample.{k}" in SAMPLE_RULES}
    entries = [] if train.get("disable_sampling") else _entries(t, sample)
    if not entries:
        why = "train.disable_sampling is on" if train.get("disable_sampling") else "no prompts to render"
        t.lines.extend(Line(f"sample.{k}", v, DROPPED, why) for k, v in read.items())
        return None
    settings = {**SAMPLE_DEFAULTS, **{k: sample[k] for k in SAMPLE_DEFAULTS if k in sample}}
    for key, value in read.items():
        if key in ("prompts", "samples", "sample_every", "sample_start_step"):
            continue
        if key == "network_multiplier" and value != 1:
            t.lines.append(Line("sample.network_multiplier", value, NOT_CARRIED, FULL_STRENGTH))
        else:
            t.lines.append(Line(f"sample.{key}", value, RENAMED, "each line of sample_prompts"))
    section = "samples" if "samples" in sample else "prompts"
    lines, seed = [], settings["seed"]
    for i, entry in enumerate(entries):  # its current_seed: walk_seed's start + i, else the last one a sample set
        if settings["walk_seed"] and settings["seed"] is not None:
            seed = settings["seed"] + i
        seed = seed if entry.get("seed") is None else entry["seed"]
        lines.append(_prompt_line(t, f"sample.{section}[{i}]", seed, entry, settings, trigger))
    every = sample.get("sample_every", SAMPLE_EVERY)
    shown = "sample.sample_every" + ("" if "sample_every" in sample else " (ai-toolkit's default)")
    t.set("sample_every_n_steps", every, shown, every, RENAMED, "sample_every_n_steps")
    if "sample_start_step" in sample:
        start = sample["sample_start_step"]
        t.lines.append(Line("sample.sample_start_step", start, NOT_CARRIED if start else DROPPED,
                            "ours samples every sample_every_n_steps from the start" if start else "off"))
    _first_sample(t, train)
    head = "# ai-toolkit's sample prompts, by tools/convert_config.py (each with its size, steps, seed, guidance)\n"
    return head + "\n".join(lines) + "\n"


def _entries(t, sample: dict) -> list[dict]:
    """ai-toolkit's samples: `samples` (a list of dicts with prompt and per-sample keys) or `prompts`."""
    if "samples" in sample:
        entries = sample["samples"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("prompt"), str)
                                                    for e in entries):
            raise ValueError(f"{t.source}: sample.samples must be a list of {{prompt: ..., ...}}, got {entries!r}")
        return entries
    prompts = sample.get("prompts", [])
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{t.source}: sample.prompts must be a list of prompts, got {prompts!r}")
    return [{"prompt": p} for p in prompts]


def _prompt_line(t, where: str, seed: int | None, entry: dict, settings: dict, trigger: str | None) -> str:
    """One of our prompt lines: the entry's text and inline flags over its keys over the section's; `seed` its
    (sample_prompts' caller: ai-toolkit's current_seed)."""
    text, flags = _inline_flags(t, entry["prompt"], where)
    t.lines.append(Line(where, entry["prompt"], RENAMED, "a line of sample_prompts"))
    ours = {"w": settings["width"], "h": settings["height"], "s": settings["sample_steps"], "d": seed,
            "g": settings["guidance_scale"], "n": settings["neg"] or ""}
    controls = []
    for key, value in entry.items():
        if key in ("prompt", "seed") or value is None:
            continue
        if key in ENTRY_KEYS:
            if ENTRY_KEYS[key] == "ci":
                controls.append(value)
            else:
                ours[ENTRY_KEYS[key]] = value
        elif key == "network_multiplier" and value != 1:
            t.lines.append(Line(f"{where}.{key}", value, NOT_CARRIED, FULL_STRENGTH))
        elif key not in ("network_multiplier", "ctrl_idx", "do_cfg_norm") and not (key in VIDEO_KEYS and value in (1, 16)):
            t.lines.append(Line(f"{where}.{key}", value, NOT_CARRIED, "not a sample key ours reads"))
    for flag, value in flags:
        if flag == "ci":
            controls.append(value)
        else:
            ours[flag] = value
    # seed: null is a random seed there (none written: ours draws one too)
    line = _with_trigger(text, trigger) + "".join(f" --{f} {ours[f]}" for f in "whsdg" if ours[f] is not None)
    line += f" --n {_with_trigger(str(ours['n']), trigger)}" if ours["n"] else ""
    return line + "".join(f" --ci {path}" for path in dict.fromkeys(controls))


def _inline_flags(t, prompt: str, where: str) -> tuple[str, list[tuple[str, str]]]:
    """ai-toolkit's reading of a prompt: the text before the first '--', then `--flag value` pieces."""
    text, *pieces = prompt.strip().split("--")
    flags = []
    for piece in pieces:
        flag = piece.split(" ")[0].strip()
        value = piece[len(flag):].strip()
        if flag in FLAGS:
            flags.append((FLAGS[flag], value))
        else:
            why = f"{NOT_OUR_FLAGS[flag]}: not ours" if flag in NOT_OUR_FLAGS else "not a flag ai-toolkit reads"
            t.lines.append(Line(f"{where} --{flag}", value, NOT_CARRIED, why))
    return text.strip(), flags


def _with_trigger(text: str, trigger: str | None) -> str:
    """ai-toolkit replaces [trigger] and [name] in sample prompts with the trigger word (with none: removes them)."""
    for placeholder in ("[trigger]", "[name]"):
        text = text.replace(placeholder, trigger or "")
    return re.sub(r"\s{2,}", " ", text).strip()


def _first_sample(t, train: dict) -> None:
    """ai-toolkit renders the samples before the first step unless skip_first_sample, which wins over
    force_first_sample (that one only samples a resumed run's first step too)."""
    first = not train.get("skip_first_sample")
    t.config["sample_at_first"] = first
    for key in ("skip_first_sample", "force_first_sample"):
        if key in train:
            t.lines.append(Line(f"train.{key}", train[key], RENAMED, f"sample_at_first = {str(first).lower()}"))
    if "skip_first_sample" not in train and "force_first_sample" not in train:
        t.lines.append(Line("train.skip_first_sample (ai-toolkit's default)", False, RENAMED, "sample_at_first = true"))
