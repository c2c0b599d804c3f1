"""sd-scripts' dataset as ours (sd_scripts.py translates the rest of its config).

Its dataset TOML (library/config_util.py's schema: [general], [[datasets]], [[datasets.subsets]]) is ours
with a few keys more: each key is carried, dropped or not carried by DATASET_RULES. Without one, its
DreamBooth folders become our subsets: each subfolder of train_data_dir (reg_data_dir: regularization
images) named `<repeats>_<class tokens>` is one, a subfolder without the number is skipped, as
config_util.generate_dreambooth_subsets_config_by_subdirs does. Either way a key a dataset leaves out
falls back to the training argument of that name (BlueprintGenerator: subset, dataset, [general], then
the arguments: train_batch_size is batch_size, dataset_repeats num_repeats), so those arguments become
our [general] where the dataset's [general] does not set them; caption_extension falls back to
sd-scripts' default ".caption" (ours is ".txt").
"""

from __future__ import annotations

import os
from typing import Any

from library.data.image_names import is_image_name
from library.training.peers.rules import (
    RENAMED, UNKNOWN, Line, Rule, Translation, apply_rule, ignored, implied, is_off, is_true, same, unsupported,
)

PIXEL_AUGMENTATION = ("ours caches the latents once before training, so a per-epoch pixel augmentation cannot apply "
                      "(sd-scripts refuses it with cache_latents too; flip_aug works)")


def resolution(value: Any) -> int | list[int]:
    """sd-scripts' "1024,1024" / "1024" / 1024 / [w, h] -> ours: 1024 or [w, h]."""
    if isinstance(value, str):
        try:
            sides = [int(side) for side in value.split(",")]
        except ValueError:
            raise ValueError(f"resolution {value!r}: expected 'size' or 'width,height'") from None
    else:
        sides = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(sides) not in (1, 2) or not all(isinstance(s, int) and not isinstance(s, bool) for s in sides):
        raise ValueError(f"resolution {value!r}: expected 'size' or 'width,height'")
    return sides[0] if len(set(sides)) == 1 else sides


# sd-scripts' dataset keys (config_util.ConfigSanitizer's schemas) -> ours.
DATASET_RULES: dict[str, Rule] = {
    **{key: same() for key in (
        "image_dir", "num_repeats", "shuffle_caption", "caption_separator", "keep_tokens", "keep_tokens_separator",
        "flip_aug", "caption_prefix", "caption_suffix", "caption_dropout_rate", "caption_dropout_every_n_epochs",
        "caption_tag_dropout_rate", "is_reg", "class_tokens", "caption_extension", "alpha_mask", "batch_size",
        "enable_bucket", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale",
        "validation_seed", "validation_split")},
    "resolution": same(convert=resolution),
    "color_aug": unsupported(PIXEL_AUGMENTATION),
    "random_crop": unsupported(PIXEL_AUGMENTATION),
    "face_crop_aug_range": unsupported(PIXEL_AUGMENTATION),
    "secondary_separator": unsupported("a separator kept inside a tag while shuffling: ours has caption_separator only"),
    "enable_wildcard": unsupported("{a|b} choices in captions: ours trains the caption as written"),
    "token_warmup_step": unsupported("tags added over the first steps: ours trains the whole caption from the start"),
    "token_warmup_min": ignored("read only with token_warmup_step"),
    "custom_attributes": unsupported("a custom dataset's attributes: ours reads none"),
    "resize_interpolation": unsupported("ours resizes as sd-scripts' default does: area (box) down, lanczos up"),
    "network_multiplier": implied(lambda v: float(v) == 1.0, "ours trains every dataset at LoRA multiplier 1"),
    "metadata_file": unsupported("fine-tuning captions in a JSON: ours reads a caption file beside each image "
                                 "(the subset is left out)"),
    "cache_info": ignored("sd-scripts' cache of image sizes: ours reads them as it caches"),
    "debug_dataset": ignored("shows the dataset without training"),
}
# The training arguments sd-scripts' datasets fall back to -> our dataset key.
ARG_KEYS = {
    "train_batch_size": "batch_size", "dataset_repeats": "num_repeats", "caption_extention": "caption_extension",
    **{key: key for key in (
        "resolution", "enable_bucket", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale",
        "caption_extension", "shuffle_caption", "caption_separator", "keep_tokens", "keep_tokens_separator",
        "secondary_separator", "enable_wildcard", "caption_prefix", "caption_suffix", "color_aug", "flip_aug",
        "face_crop_aug_range", "random_crop", "token_warmup_min", "token_warmup_step", "alpha_mask",
        "caption_dropout_rate", "caption_dropout_every_n_epochs", "caption_tag_dropout_rate", "resize_interpolation",
        "cache_info", "validation_seed", "validation_split")},
}
THEIR_CAPTION_EXTENSION = ".caption"  # train_util.add_dataset_arguments' default


def dataset_of(t: Translation, flat: dict, dataset: dict | None, source: str | None) -> dict | None:
    """Our dataset TOML as a dict: from sd-scripts' dataset TOML, else its DreamBooth folders (None: neither,
    or a fine-tuning JSON, in_json, which is not carried)."""
    try:
        if dataset is not None:
            return carry_toml(t, dataset, is_true(flat.get("masked_loss")))
        if flat.get("in_json") or not flat.get("train_data_dir"):
            return None
        subsets = dreambooth_subsets(t, "train_data_dir", flat["train_data_dir"], False)
        if not subsets:
            raise ValueError(f"train_data_dir {flat['train_data_dir']!r}: no subfolder named <repeats>_<class tokens> "
                             f"(sd-scripts' DreamBooth layout, e.g. 10_ohwx/ holding the images)")
        if flat.get("reg_data_dir"):
            subsets += dreambooth_subsets(t, "reg_data_dir", flat["reg_data_dir"], True)
        return {"datasets": [{"subsets": subsets}]}
    except ValueError as e:
        raise ValueError(f"{source if dataset is not None else t.source}: {e}") from None


def dreambooth_subsets(t: Translation, key: str, folder: str, is_reg: bool) -> list[dict]:
    """One subset per `<repeats>_<class tokens>` subfolder of `folder`, in name order."""
    if not isinstance(folder, str) or not os.path.isdir(folder):
        raise ValueError(f"{key} {folder!r}: no such folder (sd-scripts' DreamBooth folders: <repeats>_<class tokens>/ "
                         f"inside)")
    subsets = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isdir(path):
            continue
        repeats, _, tokens = name.partition("_")
        try:
            count = int(repeats)
        except ValueError:
            t.drop(f"{key} {name}/", path, "no <repeats>_ prefix: sd-scripts skips the folder")
            continue
        if count < 1:
            t.drop(f"{key} {name}/", path, "repeats below 1: sd-scripts skips the folder")
            continue
        subsets.append({"image_dir": path, "num_repeats": count, "class_tokens": tokens, **({"is_reg": True} if is_reg else {})})
    return subsets


def carry_toml(t: Translation, doc: dict, masked_loss: bool) -> dict | None:
    """sd-scripts' dataset TOML as ours, each key's line in t.lines (None: no dataset left to train)."""
    ours: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "general" and isinstance(value, dict):
            ours["general"] = carry_table(t, "general", value, masked_loss)
        elif key == "datasets" and isinstance(value, list):
            general = doc.get("general") if isinstance(doc.get("general"), dict) else {}
            carried = [carry_dataset(t, i, table, masked_loss, general) for i, table in enumerate(value)]
            ours["datasets"] = [d for d in carried if d is not None]
        else:
            t.lines.append(Line(f"dataset {key}", value, UNKNOWN, "not a table of sd-scripts' dataset TOML"))
    return ours if ours.get("datasets") else None


def carry_dataset(t: Translation, index: int, table: Any, masked_loss: bool, general: dict) -> dict | None:
    where = f"datasets[{index}]"
    if not isinstance(table, dict):
        raise ValueError(f"[[datasets]] {index}: expected a table, got {table!r}")
    ours = carry_table(t, where, {k: v for k, v in table.items() if k != "subsets"}, masked_loss)
    subsets = []
    for number, subset in enumerate(table.get("subsets", [])):
        carried = carry_table(t, f"{where}.subsets[{number}]", subset, masked_loss)
        if "metadata_file" not in subset and "image_dir" in carried and trains(t, f"{where}.subsets[{number}]", {
                **general, **table, **subset}):
            subsets.append(carried)
    if not subsets:
        t.refuse(where, f"{len(table.get('subsets', []))} subsets", "no subset left that ours can train")
        return None
    return {**ours, "subsets": subsets}


def trains(t: Translation, where: str, subset: dict) -> bool:
    """Whether sd-scripts trains the subset (its keys over its dataset's and [general]'s): it skips one of fewer
    than 1 repeats (a subset switched off) and one whose folder holds no image, with a warning (train_util's
    DreamBoothDataset), where ours refuses both: left out, with a line."""
    repeats, folder = subset.get("num_repeats", 1), subset["image_dir"]
    if isinstance(repeats, int) and repeats < 1:
        t.drop(f"{where}", folder, f"num_repeats {repeats}: sd-scripts skips the subset")
        return False
    if isinstance(folder, str) and os.path.isdir(folder) and not any(map(is_image_name, os.listdir(folder))):
        t.drop(f"{where}", folder, "no images in the folder: sd-scripts skips the subset")
        return False
    return True


def carry_table(t: Translation, where: str, table: Any, masked_loss: bool) -> dict:
    """One table's keys by DATASET_RULES into ours (a dict), each with its line in t.lines."""
    if not isinstance(table, dict):
        raise ValueError(f"[{where}]: expected a table, got {table!r}")
    ours: dict[str, Any] = {}
    for key, value in table.items():
        label = f"{where}.{key}"
        if key == "conditioning_data_dir":  # with masked_loss: the loss masks (config_util's ControlNet subsets)
            if masked_loss:
                ours["mask_dir"] = value
                t.lines.append(Line(label, value, RENAMED, "mask_dir (grey masks by file stem; sd-scripts reads the "
                                                           "R channel of colour ones, ours refuses them)"))
            else:
                t.refuse(label, value, "a ControlNet's conditioning images: ours trains none (with masked_loss they are "
                                       "the loss masks: mask_dir)")
            continue
        scratch = Translation(t.peer, t.source)
        apply_rule(scratch, key, value, DATASET_RULES.get(key))
        ours.update(scratch.config)
        for line in scratch.lines:
            line.key = f"{where}.{line.key}"
            line.text = "not a key of sd-scripts' dataset TOML (a newer version's, or a typo?)" if line.verdict == UNKNOWN else line.text
        t.lines.extend(scratch.lines)
    return ours


def dataset_arg(t: Translation, key: str, value: Any) -> None:
    """A training argument sd-scripts' datasets fall back to: our [general] key, where the dataset's [general]
    does not set it."""
    ours = ARG_KEYS[key]
    if t.dataset is None:
        t.drop(key, value, "no dataset translated (dataset_config or train_data_dir)")
        return
    if key == "caption_extension" and t.given.get("caption_extention") is not None:
        t.drop(key, value, "caption_extention (its old spelling) overrides it")
        return
    if any(line.key == f"general.{ours}" for line in t.lines):
        t.drop(key, value, f"the dataset's [general] sets {ours}")
        return
    scratch = Translation(t.peer, t.source)
    apply_rule(scratch, ours, value, DATASET_RULES[ours])
    line = scratch.lines[0]
    line.key, line.value = key, value
    if scratch.config:
        t.dataset.setdefault("general", {}).update(scratch.config)
        line.verdict, line.text = RENAMED, f"dataset [general] {ours}"
    t.lines.append(line)


def no_upscale_without_buckets(t: Translation, general: dict) -> None:
    """bucket_no_upscale where a dataset has no enable_bucket: sd-scripts sets it false there (train_util's
    BaseDataset), ours refuses it ("does nothing without enable_bucket"): written false on that dataset, and
    [general]'s left out where no dataset reads it."""
    datasets = t.dataset["datasets"]
    for i, dataset in enumerate(datasets):
        value = dataset.get("bucket_no_upscale", general.get("bucket_no_upscale"))
        if is_true(value) and not is_true(dataset.get("enable_bucket", general.get("enable_bucket"))):
            dataset["bucket_no_upscale"] = False
            t.drop(f"datasets[{i}].bucket_no_upscale", value, "without enable_bucket: sd-scripts sets it false")
    if "bucket_no_upscale" in general and all("bucket_no_upscale" in d for d in datasets):
        del general["bucket_no_upscale"]


def finish(t: Translation) -> None:
    """caption_extension at sd-scripts' default where no level sets it; bucket_no_upscale off without buckets;
    [general] first in the file."""
    if t.dataset is None:
        return
    general = t.dataset.setdefault("general", {})
    no_upscale_without_buckets(t, general)
    if "caption_extension" not in general and not all(
            "caption_extension" in subset or "caption_extension" in d for d in t.dataset["datasets"] for subset in d["subsets"]):
        general["caption_extension"] = THEIR_CAPTION_EXTENSION
        t.lines.append(Line("caption_extension (default)", THEIR_CAPTION_EXTENSION, RENAMED,
                            "dataset [general] caption_extension: sd-scripts' default (ours: .txt)"))
    t.dataset = {"general": general, **{k: v for k, v in t.dataset.items() if k != "general"}} if general else {
        k: v for k, v in t.dataset.items() if k != "general"}


def holds_out_images(t: Translation) -> bool:
    """Some dataset holds images out for validation (validation_split > 0 at some level, or as an argument)."""
    tables = [] if t.dataset is None else [t.dataset.get("general", {}), *t.dataset.get("datasets", [])]
    return any(float(table.get("validation_split", 0) or 0) > 0 for table in tables) or float(
        t.given.get("validation_split") or 0) > 0


def dataset_line(t: Translation, key: str, value: Any) -> None:
    """train_data_dir / reg_data_dir / in_json: what became of sd-scripts' image folders."""
    if is_off(value):  # the kohya_ss GUI writes reg_data_dir = "" where there are none
        t.drop(key, value, "empty: no folder")
    elif t.given.get("dataset_config"):
        t.drop(key, value, "dataset_config names the images (sd-scripts ignores it then)")
    elif key == "in_json":
        t.refuse(key, value, "fine-tuning captions in a JSON: ours reads a caption file beside each image")
    elif t.given.get("in_json"):
        t.refuse(key, value, "goes with in_json, not carried")
    else:
        subsets = [s for d in (t.dataset or {}).get("datasets", []) for s in d["subsets"]
                   if s.get("is_reg", False) == (key == "reg_data_dir")]
        t.lines.append(Line(key, value, RENAMED, "dataset subsets " + ", ".join(
            f"{os.path.basename(s['image_dir'])} ({s['num_repeats']} repeats)" for s in subsets)))


ARG_RULES: dict[str, Rule] = {
    **{key: Rule("custom", handle=dataset_arg) for key in ARG_KEYS},
    **{key: Rule("custom", handle=dataset_line) for key in ("train_data_dir", "reg_data_dir", "in_json")},
}
