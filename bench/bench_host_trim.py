"""What caching leaves in the process's memory after its encoder is freed, and what
library.training.host_memory.release_freed_memory (gc, then glibc's malloc_trim) hands back to the kernel.

A VAE at its released size (random weights; --vae qwen_image: diffusers' AutoencoderKLQwenImage, flux:
AutoencoderKL at FLUX.1's config) encodes --encodes images of --size px on the CPU in float32, is deleted, and
the process's RSS is read: loaded, encoded, freed (gc only, as the trainer did before), released. The RSS left
after the free is glibc keeping the pages of freed tensors below its mmap threshold, which grows to the largest
block freed (up to 32 MiB): the trainer loads its base into that process next.

With --saved the VAE is written to a temporary folder first and read back by diffusers' from_pretrained (a
file's weights pass through the heap as the trainer's loading does).

    python bench/bench_host_trim.py [--vae qwen_image] [--size 256] [--encodes 2] [--saved]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.training.host_memory import release_freed_memory  # noqa: E402


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def build_vae(name: str, folder: str | None = None) -> tuple[torch.nn.Module, bool]:
    """(the VAE, whether it takes a frame axis): read from `folder` where given, else built."""
    if name == "qwen_image":
        from diffusers import AutoencoderKLQwenImage

        return (AutoencoderKLQwenImage.from_pretrained(folder) if folder else AutoencoderKLQwenImage()), True
    from diffusers import AutoencoderKL

    if folder:
        return AutoencoderKL.from_pretrained(folder), False
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False), False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vae", choices=("qwen_image", "flux"), default="qwen_image")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--encodes", type=int, default=2)
    p.add_argument("--saved", action="store_true", help="load the VAE from a file written first")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="bench_host_trim_") if args.saved else None
    if folder:  # written and freed before the first mark
        built, _ = build_vae(args.vae)
        built.save_pretrained(folder)
        del built
        release_freed_memory()
    marks = {"start": rss_gib()}
    vae, video = build_vae(args.vae, folder)
    if folder:
        shutil.rmtree(folder)
    vae.eval()
    marks["loaded"] = rss_gib()
    shape = (1, 3, 1, args.size, args.size) if video else (1, 3, args.size, args.size)
    with torch.no_grad():
        for _ in range(args.encodes):
            vae.encode(torch.randn(shape)).latent_dist.mean
    marks["encoded"] = rss_gib()
    del vae
    gc.collect()
    marks["freed (gc)"] = rss_gib()
    release_freed_memory()
    marks["released"] = rss_gib()
    print(f"{args.vae} VAE{' (read from a file)' if args.saved else ''}, {args.encodes} encodes at {args.size} px, torch {torch.__version__}: RSS GiB "
          + ", ".join(f"{k} {v:.3f}" for k, v in marks.items())
          + f"; release_freed_memory returned {marks['freed (gc)'] - marks['released']:.3f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
