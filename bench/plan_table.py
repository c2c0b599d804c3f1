"""The README's "what fits" tables: for each full-size preset and card size, the training settings
the planner (tools/plan_memory.py) finds that fit, batch 1, LoRA rank 16, AdamW.

    python bench/plan_table.py [--resolution 1024] [--cards 12,16,24,32,48,80] [--presets flux1-dev,qwen-image]
    python bench/plan_table.py --lowbit [--cards 8,10,12]   # FLUX.1-dev at 512 and 1024 px, bases down to 4 bits
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.data.image_folders import LargestStep  # noqa: E402
from library.training.memory_plan import GiB  # noqa: E402
from tools.plan_memory import PresetFamily, default_args, fewest_swaps, setting_plans  # noqa: E402


def fastest(plans, base, vram) -> str:
    """The fastest training setting of `base` that fits: no checkpointing before checkpointing, then
    the fewest swapped blocks (each swapped block is copied in twice a step); "no" if none fits."""
    for ckpt in (False, True):
        n = fewest_swaps(plans[base, ckpt], vram)
        if n is not None:
            return ", ".join(w for w in ("ckpt" if ckpt else "", f"swap {n}" if n else "") if w) or "as is"
    return "no"


def cell(plans, vram):
    """bf16 and fp8_scaled, the README's table."""
    return "<br>".join(f"{short}: {fastest(plans, base, vram)}" for base, short in (("bf16", "bf16"), ("fp8_scaled", "fp8")))


LOWBIT_BASES = (("bf16", None), ("fp8_scaled", None), ("int8", None), ("nf4", None), ("GGUF Q8_0", "Q8_0"),
                ("GGUF Q4_K", "Q4_K"))  # (row, GGUF block type planned as a file of that type)


def lowbit_table(cards: list[float], resolutions=(512, 1024), preset="flux1-dev"):
    """Rows: base precisions down to 4 bits; columns: card x resolution; cells: the fastest setting
    that fits, then the no-swap answer for the question the issue asks."""
    plans = {}
    for row, qtype in LOWBIT_BASES:
        family = PresetFamily(preset, qtype)
        base = f"gguf_{qtype.lower()}" if qtype else row
        for side in resolutions:
            found = setting_plans(family, default_args(family.name), LargestStep(side, side, 1, None), bases=(base,))
            plans[row, side] = {ckpt: found[base, ckpt] for ckpt in (False, True)}
    columns = [(vram, side) for side in resolutions for vram in cards]
    print(f"{preset}, LoRA rank 16, AdamW, batch 1; the fastest training setting that fits (planned peak GiB)\n")
    print("| base | " + " | ".join(f"{vram:g} GiB, {side} px" for vram, side in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row, _ in LOWBIT_BASES:
        cells = []
        for vram, side in columns:
            by_ckpt = plans[row, side]
            what = fastest({(row, c): p for c, p in by_ckpt.items()}, row, vram)
            if what != "no":
                ckpt = what.startswith("ckpt")
                swaps = fewest_swaps(by_ckpt[ckpt], vram)
                what += f" ({by_ckpt[ckpt].phase(swaps).peak / GiB:.1f})"
            cells.append(what)
        print(f"| {row} | " + " | ".join(cells) + " |")
    print("\nWithout block swap, gradient checkpointing on (planned training peak, GiB):")
    for row, _ in LOWBIT_BASES:
        print(f"  {row:10s} " + "  ".join(f"{side} px {plans[row, side][True].phase(0).peak / GiB:5.2f}" for side in resolutions))


def main():
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--cards", default=None, help="card sizes in GiB (default 12,16,24,32,48,80; --lowbit: 8,10,12)")
    p.add_argument("--presets", default="flux1-dev,flux1-schnell,qwen-image", help="tools/plan_memory.py --preset names")
    p.add_argument("--lowbit", action="store_true", help="FLUX.1-dev at 512 and 1024 px across bf16, fp8_scaled, int8, "
                                                         "nf4, GGUF Q8_0 and Q4_K")
    args = p.parse_args()
    cards = [float(c) for c in (args.cards or ("8,10,12" if args.lowbit else "12,16,24,32,48,80")).split(",")]
    if args.lowbit:
        return lowbit_table(cards)
    presets = tuple(args.presets.split(","))
    plans = {}
    for preset in presets:
        family = PresetFamily(preset)
        step = LargestStep(args.resolution, args.resolution, 1, None)
        plans[preset] = setting_plans(family, default_args(family.name), step, bases=("bf16", "fp8_scaled"))
    print(f"| card (GiB) | {' | '.join(presets)} |")
    print("|---|" + "---|" * len(presets))
    for vram in cards:
        print(f"| {vram:g} | " + " | ".join(cell(plans[p], vram) for p in presets) + " |")


if __name__ == "__main__":
    main()
