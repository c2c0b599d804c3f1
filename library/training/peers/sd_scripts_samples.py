"""sd-scripts' sample images as ours (sd_scripts.py translates the rest of its config): its prompt file, and when
it renders (its sample_images: only where sample_every_n_steps, sample_every_n_epochs or sample_at_first says so;
ours renders the prompts at the end too). The samples of the models it trains that we translate read the flags
--w --h --s --d --l --g --n of a prompt line (some --fs too: SdScriptsModels.sample_flags) and skip any other (--ss,
--cn, --ctr, --rcfg) without a word; ours refuses most of those and would read --fs (a flow shift sd-scripts never
applied elsewhere), so a prompt file with them is copied without them. Where its samples read --l alone (a model's
SdScriptsModels.sample_scale), a lone --g, which ours reads as the CFG scale, is left out and --l written at its
default. No torch here (rules.py)."""

from __future__ import annotations

import re
from typing import Any

from library.training.peers import sd_scripts_models as models
from library.training.peers.rules import Rule, Translation, copy_prompts_without, custom, ignored, is_off, sample_when

SAMPLE_KEYS = ("sample_every_n_steps", "sample_every_n_epochs", "sample_at_first")  # when sd-scripts renders samples
# The flags its samples read, with the patterns train_util.line_to_prompt_dict matches their values by
# (a value they do not match, --d -1, is skipped too).
SAMPLE_FLAGS = {"w": r"\d+", "h": r"\d+", "d": r"\d+", "s": r"\d+", "l": r"[\d\.]+", "g": r"[\d\.]+", "n": r".+",
                "fs": r".+"}
READ_BY_ALL = ("w", "h", "d", "s", "l", "g", "n")  # the rest only where a model's sample_flags names them


def sample_flag_read(part: str, extra: tuple[str, ...] = ()) -> bool:
    """sd-scripts' samples read this prompt flag ("w 1024", "ss euler_a": the text after its --); extra: the flags a
    model's samples read beside READ_BY_ALL."""
    flag = part.split(" ", 1)[0].lower()
    return flag in (*READ_BY_ALL, *extra) and re.match(f"{flag} {SAMPLE_FLAGS[flag]}", part, re.IGNORECASE) is not None


def flags_as_read(flags: list[str]) -> list[str]:
    """A line's flags (those sample_flag_read keeps) with each value as sd-scripts' samples read it: the part its
    pattern matches (--w 1024.0 and 1024px are 1024, --g 1e1 is 1.0), --s within 1..1000. Kept as written, ours
    refused what it took (needs int, got '1024.0') or read another value (1e1: 10). A value ours reads alike stays."""
    out = []
    for part in flags:
        name, written = part.split(" ", 1)
        flag = name.lower()
        match = re.match(SAMPLE_FLAGS[flag], written)
        read = _read_value(flag, match.group(0)) if flag != "n" else None
        shown = f"{read:g}" if isinstance(read, float) else str(read)  # a seed as its digits (:g: 1.23457e+08)
        out.append(part if read is None or _ours(flag, written) == read else f"{name} {shown}")
    return out


def _read_value(flag: str, text: str) -> float | None:
    """sd-scripts' value of a flag's matched text (None: its float() fails, "1.2.3", and ours names the line)."""
    if flag in ("l", "g", "fs"):
        try:
            return float(text)
        except ValueError:
            return None
    return max(1, min(1000, int(text))) if flag == "s" else int(text)


def _ours(flag: str, written: str) -> float | None:
    """The value ours reads from a flag's text (None: ours refuses it)."""
    try:
        return float(written) if flag in ("l", "g", "fs") else int(written)
    except ValueError:
        return None


def scale_as_read(flags: list[str], scale: float) -> list[str]:
    """A line's flags where its samples read --l alone, at `scale` without one: its --g left out (ours reads a lone
    --g as the CFG scale), --l written at that default where the line has none."""
    kept = [part for part in flags if part.split(" ", 1)[0].lower() != "g"]
    return kept if any(part.split(" ", 1)[0].lower() == "l" for part in kept) else [*kept, f"l {scale:g}"]


def _sample_prompts(t: Translation, key: str, value: Any) -> None:
    """The kohya_ss GUI writes sample_prompts (its prompt box as a file, maybe empty) into every config."""
    if not is_off(value) and all(is_off(t.given.get(k)) for k in SAMPLE_KEYS):
        t.drop(key, value, f"no {', '.join(SAMPLE_KEYS)}: sd-scripts renders none (ours would at the end)")
        return
    entry = models.model_entry(t.config["model_type"])
    rewrite, note = flags_as_read, "with each value as sd-scripts reads it (--w 1024.0: 1024; --s 1..1000)"
    if entry.sample_scale is not None:
        rewrite = lambda flags: scale_as_read(flags_as_read(flags), entry.sample_scale)  # noqa: E731
        note += f"; its samples read --l alone (--g left out, --l {entry.sample_scale:g} where none is given)"
    copy_prompts_without(t, key, value, lambda part: sample_flag_read(part, entry.sample_flags),
                         "sd-scripts' samples skip them (ours refuses most, and would read --fs)", (rewrite, note))


RULES: dict[str, Rule] = {
    "sample_prompts": custom(_sample_prompts),
    **{key: custom(lambda t, key, value: sample_when(t, key, value, t.given)) for key in SAMPLE_KEYS},
    "sample_sampler": ignored("sd-scripts' samples of these models ignore it (Euler, as ours)"),
}
