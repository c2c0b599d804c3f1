"""What a LoRA taught the learned tiny base, measured: renders the concept's trigger prompts and
unrelated prompts on the base without and with the LoRA, on the bf16 base and on the base precision
the LoRA was trained on (the quickstart: fp8_scaled), reads every render with the pixel-space detector
(library/data/shape_detector.py), writes the before / after grid and prints one line.

    python tools/make_tiny_dataset.py --out tiny_models/concept --concept --overwrite  # "zxq" = a purple star
    python train_lora.py --config_file configs/quickstart.toml                         # the LoRA
    python tools/concept_demo.py --config_file configs/quickstart.toml [--concept tiny_models/concept/concept.json]

The line: the concept rate (renders of the trigger prompts that show the concept's colour and shape)
before and after, and how many unrelated prompts still render their own shape and colour after (of
those the base renders right before). The grid (default OUTPUT_DIR/concept_grid.png): one column per
prompt (six trigger prompts, six unrelated), rows bf16 base before / after, trained-on base before /
after. The LoRA is applied unmerged (runtime), as tools/generate.py applies it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, one_line, exit_without_collecting  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config_file", required=True, help="the training TOML (model paths, output_dir/output_name)")
    p.add_argument("--concept", default="tiny_models/concept/concept.json", help="make_tiny_dataset --concept's concept.json")
    p.add_argument("--lora", default=None, help="default: OUTPUT_DIR/OUTPUT_NAME.safetensors")
    p.add_argument("--grid", default=None, help="default: OUTPUT_DIR/concept_grid.png")
    p.add_argument("--seed", type=int, default=0)
    return p


if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.data.shapes import parse_caption  # noqa: E402
from tools.learned_base import encode_prompts, grid, render, scores  # noqa: E402

GRID_COLUMNS = 6  # of each kind of prompt


def read_concept(path: str) -> dict:
    try:
        with open(path) as f:
            concept = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the concept file ({e}); write it with "
                         f"tools/make_tiny_dataset.py --out DIR --concept") from None
    missing = {"trigger", "colour", "shape", "trigger_prompts", "unrelated_prompts"} - concept.keys()
    if missing:
        raise ValueError(f"{path}: concept file lacks {sorted(missing)}; expected make_tiny_dataset --concept's")
    return concept


def wanted_of(concept: dict, prompts: list[str]) -> list[dict[str, str]]:
    """The colour and shape each prompt asks for; every prompt must name both (else a render would pass
    whatever it shows)."""
    meaning = (concept["colour"], concept["shape"])
    wanted = [parse_caption(p, concept["trigger"], meaning) for p in prompts]
    for prompt, w in zip(prompts, wanted):
        if "colour" not in w or "shape" not in w:
            raise ValueError(f"prompt {prompt!r} names no colour and shape (nor the trigger {concept['trigger']!r})")
    return wanted


def render_and_score(family, model, vae, text: dict, wanted: list[dict[str, str]], seed: int):
    """Render each prompt of `text` (encode_prompts) on `model` as it is (a LoRA applied or merged, a
    patched RoPE: whatever the caller set up) and read every render with the shape detector:
    (images, whether each shows the colour and shape `wanted` of its prompt). tools/precision_matrix.py
    scores its cells with it."""
    images = render(family, model, vae, text, seed)
    return images, scores(images, wanted)[1]


def renders_with_and_without(family, precision: str, lora: str, text: dict, wanted: list, seed: int):
    """((renders, hits) without the LoRA, (renders, hits) with it) on the base loaded in `precision`,
    float32 compute."""
    from networks.factory import network_from_file

    model = family.load_transformer(torch.float32, precision).requires_grad_(False).eval()
    vae = family.load_vae(torch.float32)
    before = render_and_score(family, model, vae, text, wanted, seed)
    network_from_file(model, family.arch, lora).apply()
    return before, render_and_score(family, model, vae, text, wanted, seed)


def concept_demo(config_file: str, concept_path: str, lora: str | None = None, grid_path: str | None = None,
                 seed: int = 0, overrides: list[str] = ()) -> dict:
    """Render, score, write the grid; returns the counts (see the module docstring) per base."""
    from library.models.family import get_family
    from library.training.config import base_precision, load_config

    args = load_config(["--config_file", config_file, *overrides])
    concept = read_concept(concept_path)
    lora = lora or os.path.join(args.output_dir, args.output_name + ".safetensors")
    grid_path = grid_path or os.path.join(args.output_dir, "concept_grid.png")
    family = get_family(args)
    prompts = concept["trigger_prompts"] + concept["unrelated_prompts"]
    wanted, n = wanted_of(concept, prompts), len(concept["trigger_prompts"])
    text = encode_prompts(family, prompts)
    # every third trigger prompt, stepping one background further each time (the prompts cycle through 3)
    shown = sorted({min(n - 1, i * max(1, n // GRID_COLUMNS) + i % 3) for i in range(GRID_COLUMNS)})
    shown += [n + i for i in range(min(GRID_COLUMNS, len(concept["unrelated_prompts"])))]
    results, rows = {}, []
    for precision in dict.fromkeys(("bf16", base_precision(args))):
        (before, hits_before), (after, hits_after) = renders_with_and_without(family, precision, lora, text, wanted, seed)
        results[precision] = {"before": sum(hits_before[:n]), "after": sum(hits_after[:n]), "trigger_prompts": n,
                              "unrelated_kept": sum(a for b, a in zip(hits_before[n:], hits_after[n:]) if b),
                              "unrelated_right_before": sum(hits_before[n:]), "unrelated_prompts": len(prompts) - n}
        rows += [[before[i] for i in shown], [after[i] for i in shown]]
    os.makedirs(os.path.dirname(os.path.abspath(grid_path)), exist_ok=True)
    grid(rows).save(grid_path)
    results["grid"] = grid_path
    return results


def summary_line(concept: dict, results: dict, trained_on: str) -> str:
    r = results[trained_on]
    pct = lambda a, b: f"{a}/{b} ({a / max(1, b):.0%})"  # noqa: E731
    others = "; ".join(f"{p} base {pct(v['before'], v['trigger_prompts'])} -> {pct(v['after'], v['trigger_prompts'])}"
                       for p, v in results.items() if p not in (trained_on, "grid"))
    return (f"concept '{concept['trigger']}' = {concept['colour']} {concept['shape']}: concept rate on the trigger prompts "
            f"{pct(r['before'], r['trigger_prompts'])} before -> {pct(r['after'], r['trigger_prompts'])} after "
            f"({trained_on} base{'; ' + others if others else ''}); unrelated prompts still their own shape and colour: "
            f"{pct(r['unrelated_kept'], r['unrelated_right_before'])} (of the {r['unrelated_right_before']} of "
            f"{r['unrelated_prompts']} the base renders right)")


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        concept = read_concept(args.concept)
        results = concept_demo(args.config_file, args.concept, args.lora, args.grid, args.seed)
    except (ValueError, OSError) as e:
        print(one_line(e), file=sys.stderr)
        return 2
    from library.training.config import base_precision, load_config

    trained_on = base_precision(load_config(["--config_file", args.config_file]))
    print(f"wrote {results['grid']}")
    print(summary_line(concept, results, trained_on))
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
