"""Output preservation, ai-toolkit's two forms: besides the flow-matching loss, each step holds the
LoRA's prediction for a second prompt to the base's prediction for it, at the same noisy latents
and sigmas, so what the LoRA teaches stays with its trigger word.

- diff_output_preservation: the second prompt is the sample's caption with trigger_word replaced by
  diff_output_preservation_class ("a photo of ohwx, smiling" -> "a photo of woman, smiling"): the
  class keeps rendering as the base renders it (the LoRA does not turn every woman into ohwx).
- blank_prompt_preservation: the second prompt is the empty caption (for an edit model: with the
  sample's references, as the pipeline encodes "" with its images).

The term is multiplier * mean((LoRA(x_t, prompt2) - base(x_t, prompt2))^2), in float32, per sample
averaged over the batch (a sample without the trigger in its caption, or a regularization image
under diff_output_preservation, adds 0). The base's prediction runs without gradients with the
trained network's multipliers at 0 (base_loras stay applied: they are part of the base). A step
runs three forwards instead of one and holds two graphs until its backward (the memory planner
counts both). The second prompts are encoded and cached with the captions (`<name>@preserve`).
"""

from __future__ import annotations

import contextlib
import re

from library.errors import ConfigError, blame
from library.data.captions import fixed_caption


def validate_preservation(args, origins: dict[str, str], where: str) -> None:
    """The keys agree: one form at a time, and diff_output_preservation has both of its words."""
    if args.diff_output_preservation and args.blank_prompt_preservation:
        raise ConfigError(f"{blame(origins, where, 'diff_output_preservation', 'blank_prompt_preservation')}: keys "
                          f"'diff_output_preservation' and 'blank_prompt_preservation' are both true; keep one "
                          f"(each adds its own second prompt; ai-toolkit refuses both too)")
    if not args.diff_output_preservation:
        return
    for key, what in (("trigger_word", "the word the captions use for the concept, e.g. \"ohwx\""),
                      ("diff_output_preservation_class", "what the concept is, e.g. \"woman\", put in its place")):
        if not (getattr(args, key) or "").strip():
            raise ConfigError(f"{blame(origins, where, key, 'diff_output_preservation')}: key '{key}' must be set with "
                              f"diff_output_preservation = true ({what})")
    if args.trigger_word.strip() == args.diff_output_preservation_class.strip():
        raise ConfigError(f"{blame(origins, where, 'trigger_word', 'diff_output_preservation_class')}: "
                          f"diff_output_preservation_class is the trigger_word ('{args.trigger_word}'): the second "
                          f"prompt would be the caption itself, holding the LoRA to the base where it must learn")


def preserving(args) -> bool:
    return bool(getattr(args, "diff_output_preservation", False) or getattr(args, "blank_prompt_preservation", False))


def multiplier(args) -> float:
    if args.diff_output_preservation:
        return args.diff_output_preservation_multiplier
    return args.blank_prompt_preservation_multiplier


def class_caption(caption: str, trigger: str, cls: str) -> str | None:
    """`caption` with each whole-word `trigger` replaced by `cls` (case as written: "ohwx," and "(ohwx)"
    match, "ohwxs" does not); None where the caption lacks the trigger."""
    pattern = re.compile(rf"(?<!\w){re.escape(trigger.strip())}(?!\w)")
    replaced, count = pattern.subn(lambda _: cls.strip(), caption)
    return replaced if count else None


def set_preservation_captions(items: list, args, limit=None, source: str = "dataset_config") -> str | None:
    """Each training ImageItem's second prompt (item.preservation_caption; None: no term for it), from its
    caption as trained without augmentation. Returns a line for the log; ValueError where no caption holds
    the trigger (the term would add nothing) or a second prompt is longer than an encoder that refuses
    long captions takes (one that cuts them: the line says how many it cuts)."""
    if not preserving(args):
        return None
    if args.blank_prompt_preservation:
        for item in items:
            item.preservation_caption = ""
        return f"blank_prompt_preservation: every sample's prediction for the empty prompt held to the base's " \
               f"(x{args.blank_prompt_preservation_multiplier:g})"
    trigger, cls = args.trigger_word, args.diff_output_preservation_class
    for item in items:
        caption = None if item.subset.is_reg else class_caption(fixed_caption(item.caption, item.subset), trigger, cls)
        item.preservation_caption = caption
    with_trigger = [item for item in items if item.preservation_caption is not None]
    trained = [item for item in items if not item.subset.is_reg]
    if not with_trigger:
        raise ValueError(f"{source}: trigger_word '{trigger}' is in none of the {len(trained)} training captions "
                         f"(diff_output_preservation replaces it with '{cls}'; it matches whole words, case as written)")
    cut = _longer_than_kept(with_trigger, limit, trigger, cls)
    missing = len(trained) - len(with_trigger)
    return (f"diff_output_preservation: '{trigger}' -> '{cls}' in {len(with_trigger)} of {len(trained)} training "
            f"captions (x{args.diff_output_preservation_multiplier:g})"
            + (f"; the {missing} without '{trigger}' get no preservation term" if missing else "") + cut)


def _longer_than_kept(items: list, limit, trigger: str, cls: str) -> str:
    """ValueError for the first second prompt longer than an encoder that refuses long captions takes; else
    "" or the clause for the log saying how many the encoder cuts (as check_dataset says of captions)."""
    if limit is None:
        return ""
    whole = not limit.cuts_with_references  # a caption encoded with its references is kept whole
    long = [(item, n) for item in items if not (whole and item.subset.control_directory)
            and (n := limit.count(item.preservation_caption)) > limit.max_tokens]
    if not long:
        return ""
    (item, n), *_ = long
    if limit.refuses:
        raise ValueError(f"{item.image_path}: its caption with '{trigger}' replaced by '{cls}' has {n} "
                         f"{limit.encoder} tokens, over the {limit.max_tokens} it takes")
    return (f"; warning: {len(long)} of these second prompts are longer than the {limit.max_tokens} {limit.encoder} "
            f"tokens the encoder keeps, the rest is cut (first: {item.image_path}, {n} tokens)")


def metadata(args) -> str | None:
    """ss_output_preservation: what the second prompt was, or None."""
    if args.diff_output_preservation:
        return f"diff: {args.trigger_word} -> {args.diff_output_preservation_class} x{args.diff_output_preservation_multiplier:g}"
    if args.blank_prompt_preservation:
        return f"blank x{args.blank_prompt_preservation_multiplier:g}"
    return None


@contextlib.contextmanager
def network_off(network):
    """Within: the trained network's modules at multiplier 0 (the base's prediction); restored after. A
    LyCORIS module with dora_wd (`wd`) has its decomposition off too: LyCORIS' own multiplier blends only its
    magnitude and adds the whole update at 0 (our modules apply 0 as the base: dora_at_comfyui_strength)."""
    modules = [m for m in network.modules() if m is not network and isinstance(getattr(m, "multiplier", None), float | int)]
    saved = [(m.multiplier, getattr(m, "wd", None)) for m in modules]
    try:
        for m in modules:
            m.multiplier = 0.0
            if getattr(m, "wd", False):
                m.wd = False
        yield
    finally:
        for m, (value, wd) in zip(modules, saved):
            m.multiplier = value
            if wd is not None:
                m.wd = wd
