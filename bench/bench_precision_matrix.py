"""The precision matrix (tools/precision_matrix.py) on mid-size transformers of any family.

    python bench/bench_precision_matrix.py [--out bench_out/matrix] [--steps 20] [--resolution 768]
        [--hidden 1024] [--depth 2] [--families flux,qwen_image,zimage,chroma,krea2]

Mid size here: the real head width (128) and RoPE axes, `hidden / 128` heads, block counts from
`depth`, random weights N(0, 0.02), written by the family's spec (TINY.sized: FLUX.1 and Chroma
`depth` double + `depth` single blocks, Qwen-Image, Z-Image and Krea 2 2 x `depth` blocks); the tiny VAE and
text encoders of tools/make_tiny_models.py feed it (their widths are the transformer's context
widths; the config comes from TINY.config_files). Each family's four LoRAs are trained on the
generated shapes dataset at --resolution (768 px: a 48 x 48 patch grid, where e4m3 positions lose
part of 17..47), then every cell is evaluated; the tables are printed and written under OUT/<family>/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.models.registry import FAMILIES, spec_of  # noqa: E402
from library.models.spec import load_symbol  # noqa: E402
from tools import precision_matrix  # noqa: E402
from tools.make_tiny_dataset import make_tiny_dataset  # noqa: E402
from tools.make_tiny_models import make_tiny_models, tiny_config  # noqa: E402


def write_config(family: str, tiny: dict, folder: str, hidden: int, depth: int) -> str:
    """The family's training config on the tiny set, its transformer the spec's sized one."""
    model = load_symbol(spec_of(family).tiny.sized)(folder, hidden, depth, 1)
    path = os.path.join(folder, f"{family}.toml")
    with open(path, "w") as f:
        f.write(tiny_config(family, tiny, model, mixed_precision="no", network_dim=16, network_alpha=16,
                            optimizer_type="AdamW", learning_rate=1e-3, cache_latents_to_disk=True,
                            cache_text_encoder_outputs_to_disk=True, output_dir=f"{folder}/unused", seed=42))
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default="bench_out/matrix")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resolution", type=int, default=768)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--max_items", type=int, default=2)
    p.add_argument("--sigmas", default="0.3,0.6,0.9")
    p.add_argument("--families", default="flux,qwen_image,zimage,chroma,krea2")
    args = p.parse_args(argv)
    families = args.families.split(",")
    # a variant (flux_kontext, zimage_omni) needs its own inputs: its base's writer does not fit it
    for family in families:
        spec = spec_of(family) if family in FAMILIES else None
        if spec is None or spec.arch != family or not spec.tiny.sized:
            p.error(f"--families {family}: expected a family whose spec writes a sized transformer (TINY.sized): "
                    + ", ".join(f for f in FAMILIES if spec_of(f).arch == f and spec_of(f).tiny.sized))
    os.makedirs(args.out, exist_ok=True)
    tiny = make_tiny_models(os.path.join(args.out, "tiny"))
    tiny.update(make_tiny_dataset(os.path.join(args.out, "tiny", "dataset")))
    for family in families:
        start = time.time()
        folder = os.path.join(args.out, family)
        os.makedirs(folder, exist_ok=True)
        config = write_config(family, tiny, folder, args.hidden, args.depth)
        code = precision_matrix.main(["--config_file", config, "--out", folder, "--steps", str(args.steps),
                                      "--resolution", str(args.resolution), "--max_items", str(args.max_items),
                                      "--sigmas", args.sigmas])
        print(f"{family}: exit {code} in {time.time() - start:.0f} s")
        if code == 0:
            print(open(os.path.join(folder, "matrix.md")).read())


if __name__ == "__main__":
    main()
