"""Krea 2 edit: our transformer forward with reference latents against ai-toolkit's, on the same tiny
random weights, fp32 on the CPU.

    python bench/bench_krea2_edit_vs_aitoolkit.py [--mirror /work/.mirror/ostris+ai-toolkit/repo] [--commit HEAD]

ai-toolkit's Krea 2 (extensions_built_in/diffusion_models/krea2/src/mmdit.py and pipeline.py) is the
only implementation of the edit scheme (no diffusers pipeline exists). This script exports those two
files from the mirror's git objects (git show) into a temporary package, builds its SingleStreamDiT at
the tiny size, copies our random weights into it by name (the released single files' names, which both
use), and runs its predict_velocity on unpacked latents with per-sample reference latent lists,
against our Krea2.forward with References. Cases: no references, one, two of different grids, each with
and without kv_cache (isolate_refs), and a batch with padded text. Prints the max abs difference of the
velocities; the tests restate the math (tests/test_krea2_edit.py), this is the check against the source.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.models.krea2.model import Krea2Config, References, reference_positions  # noqa: E402
from library.models.krea2.tiny import random_krea2  # noqa: E402
from library.models.latents import pack_latents, unpack_latents  # noqa: E402

MIRROR = "/work/.mirror/ostris+ai-toolkit/repo"
SOURCE = "extensions_built_in/diffusion_models/krea2/src"
C = 16  # latent channels


def import_aitoolkit(mirror: str, commit: str, into: str):
    """ai-toolkit's krea2 src package (mmdit, pipeline) exported from git objects into `into`."""
    package = os.path.join(into, "aitk_krea2")
    os.makedirs(package, exist_ok=True)
    open(os.path.join(package, "__init__.py"), "w").close()
    for name in ("mmdit.py", "pipeline.py"):
        text = subprocess.run(["git", "-C", mirror, "show", f"{commit}:{SOURCE}/{name}"], check=True,
                              capture_output=True, text=True).stdout
        with open(os.path.join(package, name), "w") as f:
            f.write(text)
    sys.path.insert(0, into)
    return importlib.import_module("aitk_krea2.mmdit"), importlib.import_module("aitk_krea2.pipeline")


def tiny_pair(mmdit):
    """(ai-toolkit's SingleStreamDiT, our Krea2) at the tiny size with the same random weights."""
    theirs = mmdit.SingleStreamDiT(mmdit.SingleMMDiTConfig(
        features=64, tdim=256, txtdim=32, heads=2, multiplier=4, layers=2, patch=2, channels=C, kvheads=1,
        txtlayers=3, txtheads=2, txtkvheads=2, theta=1000.0)).eval()  # fmt: skip
    config = Krea2Config(  # the widths its SwiGLU rounding gives (multiplier 4, multiple of 128)
        in_channels=4 * C, num_layers=2, attention_head_dim=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=theirs.blocks[0].mlp.gate.out_features, text_hidden_dim=32, num_text_layers=3,
        text_num_attention_heads=2, text_num_key_value_heads=2,
        text_intermediate_size=theirs.txtfusion.refiner_blocks[0].mlp.gate.out_features, axes_dims_rope=(8, 12, 12))
    torch.manual_seed(0)
    ours = random_krea2(config).eval()  # default Linear init; the zero-initialised tables and scales N(0, 0.1)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return theirs, ours


def case_inputs(grid, ref_grids, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    latents = torch.randn(b, C, 2 * grid[0], 2 * grid[1], generator=g)
    refs = [torch.randn(b, C, 2 * h, 2 * w, generator=g) for h, w in ref_grids]
    txt = torch.randn(b, t, 3, 32, generator=g)
    mask = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    return latents, refs, txt, mask, torch.rand(b, generator=g)


def velocities(pipeline, theirs, ours, grid, ref_grids, lengths, isolate, seed=1):
    latents, refs, txt, mask, sigmas = case_inputs(grid, ref_grids, lengths, seed)
    b, h, w = latents.shape[0], *grid
    with torch.no_grad():
        ref_lists = [[r[i] for r in refs] for i in range(b)] if refs else None
        a = pipeline.predict_velocity(theirs, latents, sigmas, txt.flatten(2), mask.long(), ref_latents=ref_lists,
                                      isolate_refs=isolate)
        references = None
        if refs:
            tokens = torch.cat([pack_latents(r) for r in refs], dim=1)
            references = References(tokens, reference_positions(ref_grids), isolate=isolate)
        o = ours(pack_latents(latents), txt, sigmas, h, w, txt_mask=mask, refs=references)
        plain = ours(pack_latents(latents), txt, sigmas, h, w, txt_mask=mask)  # what the references change
    return a, unpack_latents(o, 2 * h, 2 * w), unpack_latents(plain, 2 * h, 2 * w)


CASES = [  # (target grid, reference grids, text lengths)
    ((4, 6), [], (7,)),
    ((4, 6), [(4, 6)], (7,)),
    ((4, 6), [(3, 5), (6, 4)], (7,)),
    ((5, 3), [(4, 4)], (7, 4)),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mirror", default=MIRROR)
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    commit = subprocess.run(["git", "-C", args.mirror, "rev-parse", args.commit], check=True, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        mmdit, pipeline = import_aitoolkit(args.mirror, commit, tmp)
        theirs, ours = tiny_pair(mmdit)
        print(f"ai-toolkit {commit[:12]}; torch {torch.__version__}; fp32 CPU")
        print("| target | references | text lengths | kv_cache | max abs diff | max abs value | refs change v by |")
        print("|---|---|---|---|---|---|---|")
        worst = 0.0
        for grid, ref_grids, lengths in CASES:
            for isolate in (False, True):
                if isolate and not ref_grids:
                    continue
                a, o, plain = velocities(pipeline, theirs, ours, grid, ref_grids, lengths, isolate)
                diff = (a - o).abs().max().item()
                worst = max(worst, diff)
                refs = ", ".join(f"{h}x{w}" for h, w in ref_grids) or "none"
                print(f"| {grid[0]}x{grid[1]} | {refs} | {lengths} | {isolate} | {diff:.2e} | {a.abs().max().item():.2f} | {(o - plain).abs().max().item():.2f} |")
        print(f"worst {worst:.2e}")
        return worst


if __name__ == "__main__":
    sys.exit(0 if main() <= 1e-5 else 1)
