"""Caption-encoder precision (text_encoder_precision) against fp32 on the tiny models: the relative
L2 error of each embedding, and what it does to the training loss of the tiny transformer (same
latents, noise and sigmas; only the text embeddings differ).

    python bench/bench_text_encoder_precision.py [--out /tmp/tiny_set]
"""

import argparse
import os
import sys
import tempfile
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.models.family import stack_text  # noqa: E402
from library.models.flux1.family import FluxFamily  # noqa: E402
from library.models.qwen_image.family import QwenImageFamily  # noqa: E402
from library.models.flow_matching import sampling_of  # noqa: E402
from tools.make_tiny_models import make_tiny_models  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16", "fp8_scaled", "fp8")
CAPTIONS = ["a red fox in the snow", "two cats on a windowsill", "a lighthouse at dusk, long exposure",
            "portrait of an old man, film grain", "a bowl of ramen, top view", "city street in the rain at night",
            "a watercolor of mountains", "macro photo of a dragonfly"]


def main():
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    root = args.out or tempfile.mkdtemp()
    paths = make_tiny_models(os.path.join(root, "models"))
    families = {
        "flux": FluxFamily(paths["flux_bfl"], paths["flux_vae_single"], clip_l=paths["clip_l"], t5xxl=paths["t5xxl"]),
        "qwen_image": QwenImageFamily(paths["qwen_image"], paths["qwen_image_vae"],
                                      text_encoder=paths["qwen_image_text_encoder"]),
    }
    print("| model | precision | embedding rel. L2 error vs fp32 | training loss | loss vs fp32 |")
    print("|---|---|---|---|---|")
    for name, family in families.items():
        model = family.load_transformer(torch.float32)
        run = types.SimpleNamespace(timestep_sampling=None, discrete_flow_shift=3.0, sigmoid_scale=1.0,
                                    guidance_scale=sampling_of(name).guidance_scale, weighting_scheme="none",
                                    loss_type="l2", huber_c=0.1)
        latents = torch.randn(len(CAPTIONS), 16, 32, 32, generator=torch.Generator().manual_seed(0))
        reference, ref_loss = None, None
        for precision in PRECISIONS:
            encoded = family.load_text_encoder(precision, **({"t5_max_length": 512} if name == "flux" else {}))(CAPTIONS)
            errors = []
            if reference is not None:
                for ref, got in zip(reference, encoded):
                    for k in ref:
                        if ref[k].is_floating_point():
                            errors.append(((got[k] - ref[k]).norm() / ref[k].norm()).item())
            losses = []
            with torch.no_grad():
                for i, caption in enumerate(encoded):  # one caption per sample: different text lengths
                    gens = [torch.Generator().manual_seed(100 + i)]
                    loss, _ = family.training_loss(model, latents[i : i + 1], stack_text([caption]), run, gens)
                    losses.append(loss.item())
            loss = sum(losses) / len(losses)
            if reference is None:
                reference, ref_loss = encoded, loss
            err = f"{max(errors):.5f} (max over captions)" if errors else "-"
            print(f"| {name} | {precision} | {err} | {loss:.6f} | {loss - ref_loss:+.2e} |")


if __name__ == "__main__":
    main()
