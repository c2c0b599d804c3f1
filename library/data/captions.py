"""Caption augmentation that works with cached text-encoder outputs.

Captions are encoded once, before training, so the text encoders can leave the GPU (T5-XXL is
9.5 GB in bf16, Qwen2.5-VL's language model 15 GB: neither can stay beside the transformer on a
24 GB card). A caption that changes every step therefore cannot be encoded on the fly. Instead:

- Caption dropout (`caption_dropout_rate`, `caption_dropout_every_n_epochs`) substitutes the
  embedding of the empty caption, encoded once with the others, or of the subset's
  `caption_dropout_text`, encoded with each caption (ai-toolkit's dropped caption is its trigger word).
- Tag augmentation (`shuffle_caption`, `caption_tag_dropout_rate`, with `keep_tokens` /
  `keep_tokens_separator` fixing the leading / trailing tags) is drawn from `caption_variants`
  = K augmented captions per image, made and encoded at caching time; each step picks one.
  K variants cost K extra encodings per caption when caching (nothing per step), and K times
  the text cache (4 MiB per variant for a 512 x 4096 bf16 encoder output), which is why
  `cache_text_encoder_outputs_to_disk` is the better place for them.

The augmentation itself follows sd-scripts' `process_caption`: split on `caption_separator`,
keep the first keep_tokens tags (or the part before keep_tokens_separator, and after a second
one) in place, shuffle the rest, then drop each of the rest with caption_tag_dropout_rate.
All randomness comes from the `random.Random` the caller passes (seeded by seed, epoch and
entry in the dataset), and variants from the caption text and the variant number, so the
variants, and therefore their cache, do not depend on the training seed.
"""

from __future__ import annotations

import random

from library.data.dataset_config import SubsetSpec


# The subset keys that decide the text encoded for an image, besides its caption file's bytes:
# where the caption comes from and everything fixed_caption / caption_variants read. They name
# its text cache file (library/data/caches.py text_entry), so a new key that changes the text
# belongs here: else two subsets that differ only in it would share one file.
CAPTION_KEYS = ("caption_extension", "class_tokens", "caption_prefix", "caption_suffix", "caption_separator",
                "keep_tokens", "keep_tokens_separator", "shuffle_caption", "caption_tag_dropout_rate", "caption_variants")
AUGMENT_KEYS = ("keep_tokens", "shuffle_caption", "caption_tag_dropout_rate", "caption_variants")  # read only by caption_variants


def augments_tags(subset: SubsetSpec) -> bool:
    """Whether the subset's captions change from step to step (and need cached variants)."""
    return subset.shuffle_caption or subset.caption_tag_dropout_rate > 0


def caption_settings(subset: SubsetSpec) -> list:
    """The subset's CAPTION_KEYS values, those of the augmentation (AUGMENT_KEYS) only where it
    augments: keep_tokens or caption_variants without shuffle_caption change no text."""
    augments = augments_tags(subset)
    return [getattr(subset, key) if augments or key not in AUGMENT_KEYS else None for key in CAPTION_KEYS]


def drops_captions(subset: SubsetSpec) -> bool:
    return subset.caption_dropout_rate > 0 or subset.caption_dropout_every_n_epochs > 0


def is_dropped(subset: SubsetSpec, epoch: int, rng: random.Random) -> bool:
    """caption_dropout_rate: this draw; caption_dropout_every_n_epochs = N: every caption of
    epochs N, 2N, ... counted from 1 as sd-scripts counts them (0-based epoch N-1, 2N-1, ...)."""
    if subset.caption_dropout_rate > 0 and rng.random() < subset.caption_dropout_rate:
        return True
    n = subset.caption_dropout_every_n_epochs
    return n > 0 and (epoch + 1) % n == 0


def _split_tags(caption: str, subset: SubsetSpec) -> tuple[list[str], list[str], list[str]]:
    """(fixed leading tags, tags to shuffle / drop, fixed trailing tags)."""
    sep, keep_sep = subset.caption_separator, subset.keep_tokens_separator

    def tags(text: str) -> list[str]:
        return [t.strip() for t in text.split(sep) if t.strip()]

    if keep_sep and keep_sep in caption:
        fixed, flex = caption.split(keep_sep, 1)
        suffix = ""
        if keep_sep in flex:
            flex, suffix = flex.split(keep_sep, 1)
        return tags(fixed), tags(flex), tags(suffix)
    all_tags = tags(caption)
    return all_tags[: subset.keep_tokens], all_tags[subset.keep_tokens :], []


def augment_tags(caption: str, subset: SubsetSpec, rng: random.Random) -> str:
    """One augmented caption: the flexible tags shuffled (shuffle_caption), then each dropped
    with caption_tag_dropout_rate; the fixed tags stay where they are."""
    fixed, flex, suffix = _split_tags(caption, subset)
    if subset.shuffle_caption:
        rng.shuffle(flex)
    if subset.caption_tag_dropout_rate > 0:
        flex = [t for t in flex if rng.random() >= subset.caption_tag_dropout_rate]
    return ", ".join(fixed + flex + suffix)


def fixed_caption(caption: str, subset: SubsetSpec) -> str:
    """The caption as trained without augmentation: a keep_tokens_separator in it is not text
    the model should learn, so the parts are joined as the augmented captions join them."""
    if subset.keep_tokens_separator and subset.keep_tokens_separator in caption:
        return ", ".join(sum(_split_tags(caption, subset), []))
    return caption


def caption_variants(caption: str, subset: SubsetSpec) -> list[str]:
    """The K augmented captions encoded at caching time ([] when the subset does not augment)."""
    if not augments_tags(subset):
        return []
    return [augment_tags(caption, subset, random.Random(f"{caption}|variant {k}")) for k in range(subset.caption_variants)]


def tag_frequency(captions) -> dict[str, int]:
    """sd-scripts' ss_tag_frequency for one folder (BaseDataset.set_tag_frequency): every comma-separated
    tag of the captions as written, stripped and lowercased, with its count. A1111's LoRA page and
    Civitai read the trained tags from it."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in caption.split(","):
            tag = tag.strip().lower()
            if tag:
                counts[tag] = counts.get(tag, 0) + 1
    return counts
