"""What the command lines of train_lora.py and tools/ share. Nothing heavy is imported here (no
torch): a script builds its parser and checks its arguments (check_command_line) before it imports
torch and the library, which takes seconds, so --help and a bad flag answer at once.

Abbreviated flags are refused everywhere (argparse's allow_abbrev): `--save_t` for `--save_to` or
`--learning_rat` for `--learning_rate` would otherwise be taken silently, and a flag added later
could change what an old abbreviation means.

Also the one parser of `path[:ratio]` LoRA arguments (generate, merge_lora, combine_loras,
precision_doctor): a ratio must be finite and within MAX_LORA_RATIO.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Parser(argparse.ArgumentParser):
    """argparse whose errors are a ValueError (one line and exit status 2 through the tool's main)
    and which refuses abbreviated flags."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message):
        raise ValueError(message)


def one_line(error: Exception) -> str:
    return f"error: {' '.join(str(error).split())}"


def check_command_line(build_parser: Callable[[], argparse.ArgumentParser]) -> None:
    """A script run from the shell calls this before its heavy imports: --help prints and exits 0, a
    bad flag prints one line and exits 2. main() parses the same arguments again afterwards."""
    try:
        build_parser().parse_args()
    except ValueError as e:  # Parser's errors (a plain argparse parser exits by itself)
        print(one_line(e), file=sys.stderr)
        sys.exit(2)


def command_line_scripts() -> list[str]:
    """train_lora.py and every tools/*.py that parses a command line, relative to the repository root."""
    tools = sorted(glob.glob(os.path.join(ROOT, "tools", "*.py")))
    return ["train_lora.py"] + [os.path.relpath(p, ROOT) for p in tools if _has_command_line(p)]


def _has_command_line(path: str) -> bool:
    with open(path) as f:
        source = f.read()
    return re.search(r'^if __name__ == "__main__":', source, re.M) is not None and "parse_args(" in source


# A LoRA's strength: 1 applies it as trained. Far beyond this bound the delta swamps the base weights
# (1e30 renders a black image), so a larger value is taken for a typo.
MAX_LORA_RATIO = 100.0


@dataclass
class LoRASpec:
    path: str
    ratio: float


def parse_lora_spec(spec: str) -> LoRASpec:
    """'a.safetensors:0.8' -> (a.safetensors, 0.8); no ':ratio' (or a path that exists with its
    colon) means 1.0. The ratio must be a finite number with |ratio| <= MAX_LORA_RATIO."""
    path, sep, ratio = spec.rpartition(":")
    if not sep or os.path.exists(spec):
        return LoRASpec(spec, 1.0)
    try:
        value = float(ratio)
    except ValueError:
        raise ValueError(f"--lora {spec!r}: ratio {ratio!r} is not a number (expected path[:ratio], e.g. a.safetensors:0.8)") from None
    if not abs(value) <= MAX_LORA_RATIO:  # also false for nan
        raise ValueError(f"--lora {spec!r}: ratio {ratio!r} is not a finite number in [-{MAX_LORA_RATIO:g}, "
                         f"{MAX_LORA_RATIO:g}] (1 applies the LoRA as trained)")
    return LoRASpec(path, value)
