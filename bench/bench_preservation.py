"""Output preservation on the learned tiny base: `make demo`'s concept ("zxq" = a purple star, 10 images,
120 steps) trained without its 200 regularization images, with each preservation form, and with the
regularization images for reference; each LoRA read by tools/concept_demo.py (the concept rate on the
18 trigger prompts, and how many of the unrelated prompts the base renders right still render right).

    python bench/bench_preservation.py [--seeds 42 1] [--out /tmp/bench_preservation]

Prints one row per (mode, seed): the training seconds and the demo's two rates. Runs on the CPU
(about 1-2 minutes a row on 2 cores). Recorded in bench/RESULTS.md ("Output preservation").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOP = ["--diff_output_preservation", "true", "--trigger_word", "zxq"]
MODES = {
    "none": [],
    "diff_output_preservation (class star)": [*DOP, "--diff_output_preservation_class", "star"],
    "diff_output_preservation (class star, x3)": [*DOP, "--diff_output_preservation_class", "star",
                                                  "--diff_output_preservation_multiplier", "3"],
    "blank_prompt_preservation": ["--blank_prompt_preservation", "true"],
    "regularization images (the demo)": None,  # the concept's own dataset TOML, reg subset included
}


def without_reg(toml: str, dest: str) -> str:
    """The concept's dataset TOML up to its regularization subset."""
    with open(toml) as f:
        text = f.read()
    with open(dest, "w") as f:
        f.write(text[: text.index("[[datasets.subsets]]  # regularization")])
    return dest


def run(cmd: list[str], log: str) -> str:
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{' '.join(cmd[:3])} ... failed (exit {done.returncode}); see {log}")
    with open(log) as f:
        return f.read()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 1])
    p.add_argument("--out", default="/tmp/bench_preservation")
    args = p.parse_args()
    py, concept = sys.executable, os.path.join(args.out, "concept")
    os.makedirs(args.out, exist_ok=True)
    run([py, "tools/make_tiny_dataset.py", "--out", concept, "--concept", "--overwrite"], os.path.join(args.out, "data.log"))
    plain = without_reg(os.path.join(concept, "concept.toml"), os.path.join(args.out, "noreg.toml"))
    print(f"{'mode':44s} {'seed':>4s} {'train s':>8s}  concept  unrelated kept")
    for seed in args.seeds:
        for mode, extra in MODES.items():
            out = os.path.join(args.out, f"{re.sub(r'[^a-z0-9]+', '_', mode)}_{seed}")
            dataset = os.path.join(concept, "concept.toml") if extra is None else plain
            start = time.perf_counter()
            run([py, "train_lora.py", "--config_file", "configs/quickstart.toml", "--dataset_config", dataset,
                 "--output_dir", out, "--seed", str(seed), "--sample_prompts", "", "--sample_at_first", "false",
                 *(extra or [])], out + ".log")
            seconds = time.perf_counter() - start
            said = run([py, "tools/concept_demo.py", "--config_file", "configs/quickstart.toml", "--concept",
                        os.path.join(concept, "concept.json"), "--lora", os.path.join(out, "tiny_flux_lora.safetensors"),
                        "--grid", os.path.join(out, "grid.png")], out + "_demo.log")
            rate = re.search(r"-> (\d+/\d+) \(\d+%\) after", said).group(1)
            kept = re.search(r"colour: (\d+/\d+)", said).group(1)
            print(f"{mode:44s} {seed:4d} {seconds:8.0f}  {rate:>7s}  {kept:>9s}", flush=True)


if __name__ == "__main__":
    main()
