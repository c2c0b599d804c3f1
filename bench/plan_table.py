"""The README's "what fits" table: for each full-size preset and card size, the training settings
the planner (tools/plan_memory.py) finds that fit, at 1024x1024, batch 1, LoRA rank 16, AdamW.

    python bench/plan_table.py [--resolution 1024] [--cards 12,16,24,32,48,80] [--presets flux1-dev,qwen-image]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.training.memory_plan import GiB  # noqa: E402
from tools.plan_memory import PresetFamily, default_args, fewest_swaps, setting_plans  # noqa: E402


def cell(plans, vram):
    """Per base precision, the fastest training setting that fits: no checkpointing before
    checkpointing, then the fewest swapped blocks (each swapped block is copied in twice a step)."""
    found = []
    for base, short in (("bf16", "bf16"), ("fp8_scaled", "fp8")):
        for ckpt in (False, True):
            n = fewest_swaps(plans[base, ckpt], vram)
            if n is not None:
                what = ", ".join(w for w in ("ckpt" if ckpt else "", f"swap {n}" if n else "") if w) or "as is"
                found.append(f"{short}: {what}")
                break
        else:
            found.append(f"{short}: no")
    return "<br>".join(found)


def main():
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--cards", default="12,16,24,32,48,80")
    p.add_argument("--presets", default="flux1-dev,flux1-schnell,qwen-image", help="tools/plan_memory.py --preset names")
    args = p.parse_args()
    cards = [float(c) for c in args.cards.split(",")]
    presets = tuple(args.presets.split(","))
    plans = {}
    for preset in presets:
        family = PresetFamily(preset)
        plans[preset] = setting_plans(family, default_args(family.name), args.resolution, args.resolution, 1)
    print(f"| card (GiB) | {' | '.join(presets)} |")
    print("|---|" + "---|" * len(presets))
    for vram in cards:
        print(f"| {vram:g} | " + " | ".join(cell(plans[p], vram) for p in presets) + " |")


if __name__ == "__main__":
    main()
