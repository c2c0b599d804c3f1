"""Step-time cost of issue 12's training features, each against the plain step in the same process.

    python bench/bench_training_features.py [--sizes tiny,mid] [--reps 5]

  masked loss     family.loss_at with a [B, 1, h, w] mask (half zeros) vs without: one multiply of
                  the per-element loss, packed like the latents
  reg weights     the same with per-sample weights (prior_loss_weight on half the batch)
  caption variants cost nothing per step (a cached tensor is read instead of another); their cost is
                  K extra encodings per caption at caching time, timed here on the tiny T5 as
                  cache_text of 16 captions with caption_variants 1 (no shuffle) vs 8
Steps: forward + backward + AdamW of a rank-16 LoRA on our FLUX (tiny, or mid = width 3072, 2 double +
2 single blocks, 256 image + 64 text tokens, batch 2), fp32, alternating (bench_train_step.alternate).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_train_step import add_our_lora, alternate, build_ours, machine_summary, median  # noqa: E402
from library.models.flux1.family import FluxFamily  # noqa: E402


def step_costs(size: str, reps: int):
    args = argparse.Namespace(double=2, single=2, qwen_blocks=2)
    model = build_ours("flux", size, args, torch.float32, torch.device("cpu"))
    model.train()
    _, params = add_our_lora(model, "flux", 16)
    family, cfg = FluxFamily("unused"), model.config
    g = torch.Generator().manual_seed(0)
    side = 16 if size == "mid" else 4
    latents, noise = torch.randn(2, 16, 2 * side, 2 * side, generator=g), torch.randn(2, 16, 2 * side, 2 * side, generator=g)
    text = {"t5": torch.randn(2, 64 if size == "mid" else 7, cfg.context_in_dim, generator=g),
            "clip_pooled": torch.randn(2, cfg.vec_in_dim, generator=g)}
    sigmas = torch.tensor([0.3, 0.7])
    mask = torch.ones(2, 1, 2 * side, 2 * side)
    mask[..., :side] = 0
    weights = torch.tensor([1.0, 0.5])
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step(**kwargs):
        def run():
            optimizer.zero_grad(set_to_none=True)
            loss = family.loss_at(model, latents, text, noise, sigmas, 1.0, **kwargs)
            loss.backward()
            optimizer.step()
            return loss.item()
        return run

    res = alternate({"plain": step(), "masked": step(mask=mask), "reg weights": step(sample_weights=weights)}, 1, reps,
                    torch.device("cpu"))
    base = median(res["plain"]["times"])
    for name in res:
        t = median(res[name]["times"])
        print(f"  flux {size:4s} {name:12s} step {t * 1e3:9.1f} ms  x{t / base:.3f}")


def caption_variant_cost():
    from library.data import caches, dataset as D
    from library.data.dataset_config import parse_dataset_config
    from library.models.flux1.family import FluxFamily as Family
    from tools.make_tiny_models import make_tiny_models
    import tempfile
    from PIL import Image

    work = tempfile.mkdtemp()
    paths = make_tiny_models(os.path.join(work, "models"))
    for i in range(16):
        Image.new("RGB", (64, 64)).save(os.path.join(work, f"{i}.png"))
        with open(os.path.join(work, f"{i}.txt"), "w") as f:
            f.write(f"tag{i}, red, square, studio, photo, plain, background")
    family = Family(paths["flux_bfl"], clip_l=paths["clip_l"], t5xxl=paths["t5xxl"])
    encode = family.load_text_encoder("fp32", torch.device("cpu"), t5_max_length=32)
    for shuffle in (False, True):
        bp = parse_dataset_config({"datasets": [{"resolution": 64, "subsets": [
            {"image_dir": work, "shuffle_caption": shuffle, "caption_variants": 8}]}]})
        ds = D.ImageDataset(bp)
        t = time.perf_counter()
        caches.cache_text(ds.items, encode, "bench", to_disk=False)
        texts = sum(1 + len(it.caption_variants) for it in ds.items)
        print(f"  caption caching, shuffle_caption {shuffle!s:5s}: {texts} encodings, {time.perf_counter() - t:.2f} s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--sizes", default="tiny,mid")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    print(machine_summary())
    for size in args.sizes.split(","):
        step_costs(size, args.reps if size == "mid" else 4 * args.reps)
    caption_variant_cost()


if __name__ == "__main__":
    main()
