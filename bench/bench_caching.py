"""Latent caching throughput (images/s) on photo-sized JPEGs: library.data.caches.cache_latents with its
images loaded one batch at a time (load_workers 0, as before) against loading ahead in threads
(the default LOAD_WORKERS, or --workers), on the same files, each run to disk from a fresh scan.

Images: --images JPEGs of --photo W x H (default 3072 x 2048, a phone photo: a gradient under noise,
quality 92, so decoding costs what a photo's does), bucketed at --resolution (default 1024: 1216 x 832).
Encoders (--vae, any of):
  gpu-standin  sleeps --encode_ms per image (default 40) and returns zeros: what the loop sees beside a
               GPU VAE, whose encode of a megapixel image takes tens of milliseconds (measure yours with
               --vae flux --device cuda); the sleep holds no core, as a GPU kernel's wait does not
  tiny         the toy FLUX VAE of tools/make_tiny_models.py on --device (on a CPU: encode-bound)
  flux         FLUX.1's VAE architecture (84 M parameters), random weights, on --device (bf16 on CUDA)
The sd-scripts comparison: its new_cache_latents reads a batch's files in threads (decode only),
then resizes and encodes that batch; the next batch's files are read after the encode
(library/train_util.py at 48d368fa). Not run here (it needs cv2); the rows below are ours only.

    python bench/bench_caching.py [--images 16] [--vae gpu-standin,tiny] [--workers 0,2,4] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train_step import machine_summary  # noqa: E402

from library.data.caches import LOAD_WORKERS, cache_latents  # noqa: E402
from library.data.dataset import ImageDataset  # noqa: E402
from library.data.dataset_config import parse_dataset_config  # noqa: E402


def write_photos(folder: str, count: int, size: tuple[int, int]) -> None:
    """`count` JPEGs of `size`: a horizontal gradient plus Gaussian noise (sigma 40), quality 92, captioned."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    w, h = size
    ramp = np.linspace(0, 255, w)[None, :, None] * np.ones((h, 1, 3))
    for i in range(count):
        pixels = np.clip(ramp + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{i:03d}.jpg"), quality=92)
        with open(os.path.join(folder, f"{i:03d}.txt"), "w") as f:
            f.write("a photo")


def encoder(name: str, device: str, encode_ms: float, folder: str):
    """encode(images [B, 3, H, W] float32 on the CPU) -> latents, and a one-line description."""
    if name == "gpu-standin":
        def sleep(images):
            time.sleep(encode_ms / 1e3 * images.shape[0])
            return torch.zeros(images.shape[0], 16, images.shape[2] // 8, images.shape[3] // 8)
        return sleep, f"stand-in, {encode_ms:g} ms per image"
    from library.models.flux1.vae import FLUX_VAE_CONFIG, FluxVAE, load_flux_vae

    if name == "tiny":
        from library.models.flux1.tiny import write_flux_vae

        vae = load_flux_vae(write_flux_vae(folder, 0)["flux_vae"])
    else:
        from diffusers import AutoencoderKL

        torch.manual_seed(0)
        vae = FluxVAE(AutoencoderKL(**FLUX_VAE_CONFIG))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    vae.vae.to(device, dtype)

    def encode(images):
        out = vae.encode(images.to(device, dtype))
        if device == "cuda":
            torch.cuda.synchronize()
        return out.float()
    encode(torch.zeros(1, 3, 64, 64))  # warmup: first-call allocations and kernel selection
    params = sum(p.numel() for p in vae.vae.parameters()) / 1e6
    return encode, f"{name} VAE ({params:.1f} M parameters, {device}, {dtype})"


def run(blueprint, encode, workers: int, batch: int) -> tuple[float, int]:
    """cache_latents over a fresh scan, to disk, caches of an earlier run removed: (seconds, images)."""
    items = ImageDataset(blueprint).items
    for item in items:
        folder = os.path.dirname(item.image_path)
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                os.remove(os.path.join(folder, name))
    start = time.perf_counter()
    count = cache_latents(items, encode, f"bench_{workers}", batch_size=batch, to_disk=True, load_workers=workers)
    return time.perf_counter() - start, count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--photo", default="3072x2048", help="W x H of the generated JPEGs")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="vae_batch_size")
    p.add_argument("--vae", default="gpu-standin,tiny")
    p.add_argument("--encode_ms", type=float, default=40.0)
    p.add_argument("--workers", default=f"0,{LOAD_WORKERS}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--reps", type=int, default=2, help="runs of each setting, alternated; the fastest counts")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {machine_summary()}; {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        write_photos(os.path.join(tmp, "photos"), args.images, tuple(int(v) for v in args.photo.split("x")))
        blueprint = parse_dataset_config({"datasets": [{"resolution": args.resolution, "subsets": [
            {"image_dir": os.path.join(tmp, "photos")}]}]}, source="bench_caching")
        buckets = sorted({item.bucket for item in ImageDataset(blueprint).items})
        print(f"{args.images} JPEGs {args.photo} -> buckets {buckets}, vae_batch_size {args.batch}")
        workers = [int(w) for w in args.workers.split(",")]
        for name in args.vae.split(","):
            encode, label = encoder(name, args.device, args.encode_ms, tmp)
            best = {w: float("inf") for w in workers}
            for _ in range(args.reps):
                for w in workers:
                    seconds, count = run(blueprint, encode, w, args.batch)
                    best[w] = min(best[w], seconds)
            base = best[workers[0]]
            for w in workers:
                print(f"[{label}] load_workers {w}: {args.images / best[w]:.2f} images/s "
                      f"({best[w]:.2f} s), x{base / best[w]:.2f} over load_workers {workers[0]}")


if __name__ == "__main__":
    main()
