"""Sample-prompt files in sd-scripts syntax, one prompt per line:

    a photo of a cat --w 1024 --h 1024 --s 20 --d 42 --g 3.5 --n blurry, lowres

Flags: --w width, --h height, --s steps, --d seed, --g guidance (the embedded guidance of a
guidance-distilled model, the CFG scale of a true-CFG one), --n negative prompt, --ci a reference (control) image for edit
models (musubi-tuner's flag; repeat it for several, in order). Lines starting with # and blank lines are
skipped. An unknown flag or a bad value is an error naming the file and line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from library.text_files import read_utf8


@dataclass(frozen=True)
class SamplePrompt:
    prompt: str
    width: int = 1024
    height: int = 1024
    steps: int = 20
    seed: int | None = None
    guidance: float = 3.5
    negative: str = ""
    control_images: tuple[str, ...] = ()  # --ci paths, in order


FLAGS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "d": ("seed", int), "g": ("guidance", float), "n": ("negative", str)}


def parse_prompt_line(line: str, where: str, defaults: SamplePrompt | None = None) -> SamplePrompt:
    parts = re.split(r"\s--(?=\S)", " " + line.strip())
    prompt = parts[0].strip()
    if not prompt:
        raise ValueError(f"{where}: empty prompt")
    fields, controls = {}, []
    for part in parts[1:]:
        flag, _, value = part.partition(" ")
        if flag == "ci":
            if not os.path.isfile(value.strip()):
                raise ValueError(f"{where}: --ci {value.strip()!r} is not an image file")
            controls.append(value.strip())
            continue
        if flag not in FLAGS:
            raise ValueError(f"{where}: unknown flag '--{flag}' (allowed: {', '.join('--' + f for f in FLAGS)}, --ci)")
        name, kind = FLAGS[flag]
        try:
            fields[name] = kind(value.strip())
        except ValueError:
            raise ValueError(f"{where}: flag '--{flag}' needs {kind.__name__}, got {value.strip()!r}") from None
    for side in ("width", "height"):
        if side in fields and (fields[side] < 16 or fields[side] % 16):
            raise ValueError(f"{where}: {side} {fields[side]} must be a multiple of 16 and >= 16")
    if "steps" in fields and fields["steps"] < 1:
        raise ValueError(f"{where}: steps must be >= 1")
    if controls:  # a line's own --ci replace the defaults' (e.g. generate.py --control_image)
        fields["control_images"] = tuple(controls)
    return replace(defaults or SamplePrompt(prompt), prompt=prompt, **fields)


def read_prompt_file(path: str, defaults: SamplePrompt | None = None) -> list[SamplePrompt]:
    try:
        lines = read_utf8(path, "prompt file").splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read prompt file ({e.strerror})") from None
    prompts = [
        parse_prompt_line(line, f"{path}:{i}", defaults)
        for i, line in enumerate(lines, 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
