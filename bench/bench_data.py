"""Data path: latent caching throughput, and training steps per second with latent caches vs without.

Images: tools/make_tiny_dataset.py at 256 px (two aspect ratios, so two buckets: 256x256 and
320x192), read and bucketed by library.dataset exactly as train_lora.py does.
VAEs, both diffusers AutoencoderKL with FLUX's latent layout (16 channels, shift/scale):
  tiny  the toy VAE of the tiny set (library.models.flux1.tiny.write_flux_vae), loaded by library.models.flux1.vae.load_flux_vae;
  flux  FLUX.1's real VAE configuration (library.models.flux1.vae.FLUX_VAE_CONFIG, 84 M parameters), random weights.
1. Caching: library.dataset.cache_latents over all images, to disk (safetensors beside a temporary
   copy of the images), timed after one warmup encode: images/s.
2. Steps: the tiny FLUX transformer of tools/make_tiny_models.py + a rank-16 LoRA, FluxFamily.training_loss
   + backward + AdamW, one epoch of bucketed batches (batch 2), either
     on the fly  the dataset yields pixels (load + resize + crop from disk) and the step VAE-encodes them,
     cached      the dataset yields latents read from the cache files;
   alternated batch by batch over the same batch order, per VAE: steps/s of each and their ratio.
   Text embeddings are precomputed random tensors in both (text caching is not measured). With a
   full-size transformer the step itself would dominate: the saving per step is the encode time.

    python bench/bench_data.py [--images 8] [--skip-flux-vae]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_step import machine_summary  # noqa: E402

from library.data.caches import cache_latents  # noqa: E402
from library.data.dataset import BucketBatchSampler, ImageDataset, collate_batch  # noqa: E402
from library.data.dataset_config import load_dataset_config  # noqa: E402
from library.models.flux1.family import FluxFamily  # noqa: E402
from library.models.flux1.checkpoint import load_flux  # noqa: E402
from library.models.flux1.vae import FLUX_VAE_CONFIG, FluxVAE, load_flux_vae  # noqa: E402
from networks.lora import LoRANetwork  # noqa: E402
from tools.make_tiny_dataset import make_tiny_dataset  # noqa: E402
from library.models.flux1.tiny import write_flux, write_flux_vae  # noqa: E402
from library.models.tiny_files import TINY  # noqa: E402

LOSS_ARGS = SimpleNamespace(timestep_sampling=None, discrete_flow_shift=3.0, sigmoid_scale=1.0, guidance_scale=1.0,
                            weighting_scheme="none", loss_type="l2", huber_c=0.1)


def real_config_vae() -> FluxVAE:
    """FLUX.1's VAE architecture with PyTorch's default random init (no download), float32."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return FluxVAE(AutoencoderKL(**{k: v for k, v in FLUX_VAE_CONFIG.items()}))


def time_caching(vae: FluxVAE, blueprint, key: str) -> tuple[float, int]:
    """cache_latents over a fresh scan of the dataset (to disk); returns (seconds, images encoded)."""
    items = ImageDataset(blueprint).items
    vae.encode(torch.zeros(1, 3, 64, 64))  # warmup: first-call allocations and kernel selection
    start = time.perf_counter()
    encoded = cache_latents(items, vae.encode, key, to_disk=True)
    return time.perf_counter() - start, encoded


def make_trainer(model_path: str):
    """The tiny FLUX transformer with a LoRA and its optimizer; returns step(latents) -> loss."""
    model = load_flux(model_path)
    model.train()
    network = LoRANetwork(model, "flux", 16)
    network.apply()
    optimizer = torch.optim.AdamW(network.trainable_parameters(), lr=1e-4)
    family, counter = FluxFamily(model_path), [0]

    def step(latents: torch.Tensor) -> float:
        b = latents.shape[0]
        g = torch.Generator().manual_seed(counter[0])
        counter[0] += 1
        text = {"t5": torch.randn(b, 16, TINY["t5_d_model"], generator=g),  # precomputed text, both paths
                "clip_pooled": torch.randn(b, TINY["clip_hidden"], generator=g)}
        gens = [torch.Generator().manual_seed(counter[0] * 100 + i) for i in range(b)]
        optimizer.zero_grad(set_to_none=True)
        loss, _ = family.training_loss(model, latents, text, LOSS_ARGS, gens)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def time_steps(vae: FluxVAE, blueprint, key: str, model_path: str, epochs: int) -> dict[str, list[float]]:
    """Alternate an on-the-fly step and a cached step over the same batches; seconds per step each."""
    raw, cached = ImageDataset(blueprint), ImageDataset(blueprint)
    cache_latents(cached.items, vae.encode, key, to_disk=True)  # already valid on disk: only re-checked
    sampler = BucketBatchSampler(raw, seed=0)
    steps = {"on the fly": make_trainer(model_path), "cached": make_trainer(model_path)}
    times = {name: [] for name in steps}
    for epoch in range(epochs + 1):  # epoch 0 is warmup
        for batch in sampler.batches(epoch):
            for name, step in steps.items():
                start = time.perf_counter()
                if name == "cached":
                    latents = collate_batch([cached[k] for k in batch])["latents"]
                else:
                    latents = vae.encode(collate_batch([raw[k] for k in batch])["images"])
                step(latents)
                if epoch:
                    times[name].append(time.perf_counter() - start)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps a shared machine's noise down)")
    p.add_argument("--skip-flux-vae", action="store_true", help="only the tiny VAE")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        blueprint = load_dataset_config(make_tiny_dataset(os.path.join(tmp, "data"), args.images, args.size)["dataset_config"])
        model_path = write_flux(tmp, 0)["flux_bfl"]
        vaes = {"tiny": load_flux_vae(write_flux_vae(tmp, 0)["flux_vae"])}
        if not args.skip_flux_vae:
            vaes["flux"] = real_config_vae()
        buckets = sorted({item.bucket for item in ImageDataset(blueprint).items})
        print(f"{args.images} images, buckets {buckets}, {torch.get_num_threads()} torch thread(s)")
        for name, vae in vaes.items():
            params = sum(p.numel() for p in vae.vae.parameters())
            seconds, count = time_caching(vae, blueprint, f"bench_{name}")
            print(f"[{name} VAE, {params / 1e6:.2f} M params] cache_latents: {count} images in {seconds:.2f} s = "
                  f"{count / seconds:.2f} images/s")
            times = time_steps(vae, blueprint, f"bench_{name}", model_path, args.epochs)
            fly, cached = statistics.median(times["on the fly"]), statistics.median(times["cached"])
            print(f"  train step (tiny FLUX + LoRA), median of {len(times['cached'])}: on the fly {fly * 1e3:.1f} ms "
                  f"({1 / fly:.2f} steps/s), cached {cached * 1e3:.1f} ms ({1 / cached:.2f} steps/s), "
                  f"cached/on-the-fly speed x{fly / cached:.2f}")
            summary.append(f"{name} VAE {count / seconds:.2f} img/s caching, steps/s x{fly / cached:.2f} with caches")
    print("SUMMARY: " + "; ".join(summary))


if __name__ == "__main__":
    main()
