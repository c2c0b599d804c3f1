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
With --sd_scripts DIR (a kohya-ss/sd-scripts checkout), sd-scripts' own FLUX.1 caching runs on the same
files in a subprocess (its new_cache_latents with FluxLatentsCachingStrategy, to disk, the same
encoder, the same vae_batch_size; it reads a batch's files in threads, then resizes and encodes that
batch). It needs cv2: --peer_deps DIR adds a folder holding it (pip install --target DIR
opencv-python-headless) at the end of its path; without torchvision, its ToTensor and Normalize stand
in with the same arithmetic.

    python bench/bench_caching.py [--images 16] [--vae gpu-standin,tiny] [--workers 0,2,4] [--device cpu]
        [--sd_scripts DIR --peer_deps DIR]
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


SD_SCRIPTS_RUN = r"""
import os, sys, time, types
root, deps, folder, resolution, batch, encoder, encode_ms, reps = sys.argv[1:9]
sys.path[:] = [root] + [p for p in sys.path if p not in ("", os.getcwd())] + [deps]
import importlib.machinery, importlib.util
import numpy as np
import torch
import diffusers, transformers  # noqa: E401  (they probe torchvision at import: before any stand-in)
from diffusers import AutoencoderKL  # noqa: F401
def module(name):
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = m
    return m
if importlib.util.find_spec("torchvision") is None:  # sd-scripts' train_util builds ToTensor + Normalize(0.5, 0.5)
    transforms = module("torchvision.transforms")
    module("torchvision").transforms = transforms
    transforms.Compose = lambda steps: (lambda x: [x := f(x) for f in steps][-1])
    # ToTensor as torchvision's: HWC uint8 -> CHW float / 255
    transforms.ToTensor = lambda: (lambda a: torch.from_numpy(a.transpose(2, 0, 1).copy()).float().div(255))
    transforms.Normalize = lambda mean, std: (lambda t: t.sub(mean[0]).div(std[0]))
    print("torchvision: ToTensor and Normalize stood in (torchvision's arithmetic)")
import library  # theirs
for name, cls in (("lpw_stable_diffusion", "StableDiffusionLongPromptWeightingPipeline"),
                  ("sdxl_lpw_stable_diffusion", "SdxlStableDiffusionLongPromptWeightingPipeline")):
    # SD inference pipelines train_util imports by name; they import transformers 4's CLIPFeatureExtractor
    setattr(module("library." + name), cls, None)
import flux_train_network
from library import config_util, strategy_base, strategy_flux, train_util

args = flux_train_network.setup_parser().parse_args(
    ["--resolution", resolution, "--caption_extension", ".txt", "--vae_batch_size", batch, "--cache_latents_to_disk"])
train_util.prepare_dataset_args(args, True)  # "1024" -> (1024, 1024), as their train_network does
strategy_base.LatentsCachingStrategy.set_strategy(strategy_flux.FluxLatentsCachingStrategy(True, int(batch), False))
blueprint = config_util.BlueprintGenerator(config_util.ConfigSanitizer(True, True, False, True)).generate(
    {"datasets": [{"subsets": [{"image_dir": folder}]}]}, args)
class StandIn:
    device, dtype = torch.device("cpu"), torch.float32
    def encode(self, images):
        time.sleep(float(encode_ms) / 1e3 * images.shape[0])
        return torch.zeros(images.shape[0], 16, images.shape[2] // 8, images.shape[3] // 8)
class Tiny(StandIn):  # the toy VAE's diffusers folder: the encoder's work, as our FluxVAE.encode runs it
    def __init__(self):
        from diffusers import AutoencoderKL
        self.vae = AutoencoderKL.from_pretrained(os.environ["BENCH_TINY_VAE"]).eval()
    def encode(self, images):
        return self.vae.encode(images).latent_dist.mode()
vae = StandIn() if encoder == "gpu-standin" else Tiny()
accelerator = types.SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"), is_main_process=True,
                                wait_for_everyone=lambda: None)
best = float("inf")
for _ in range(int(reps)):
    for name in os.listdir(folder):
        if name.endswith(".npz"):
            os.remove(os.path.join(folder, name))
    group, _ = config_util.generate_dataset_group_by_blueprint(blueprint.dataset_group)  # fresh: it notes its caches
    start = time.perf_counter()
    group.new_cache_latents(vae, accelerator)
    best = min(best, time.perf_counter() - start)
print(f"SECONDS {best:.4f} NPZ {sum(n.endswith('.npz') for n in os.listdir(folder))}")
"""


def sd_scripts_caching(root: str, deps: str, folder: str, resolution: int, batch: int, vae: str, encode_ms: float,
                       reps: int, tiny_vae: str | None) -> tuple[float, int]:
    """sd-scripts' FLUX.1 latent caching over `folder` in a subprocess: (best seconds, npz files written)."""
    import subprocess

    env = {**os.environ, "BENCH_TINY_VAE": tiny_vae or ""}
    out = subprocess.run([sys.executable, "-c", SD_SCRIPTS_RUN, root, deps, folder, str(resolution), str(batch), vae,
                          str(encode_ms), str(reps)], cwd=root, env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("SECONDS")]
    if out.returncode or not lines:
        raise SystemExit(f"sd-scripts caching failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    _, seconds, _, files = lines[-1].split()
    return float(seconds), int(files)


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
    p.add_argument("--sd_scripts", default=None, help="a kohya-ss/sd-scripts checkout: its caching on the same files")
    p.add_argument("--peer_deps", default="", help="a folder with cv2 and torchvision for sd-scripts")
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
            if args.sd_scripts and name in ("gpu-standin", "tiny") and args.device == "cpu":
                tiny = os.path.join(tmp, "flux", "ae") if name == "tiny" else None  # write_flux_vae's folder
                seconds, files = sd_scripts_caching(args.sd_scripts, args.peer_deps, os.path.join(tmp, "photos"),
                                                    args.resolution, args.batch, name, args.encode_ms, args.reps, tiny)
                ours = min(best.values())
                print(f"[{label}] sd-scripts new_cache_latents: {args.images / seconds:.2f} images/s ({seconds:.2f} s, "
                      f"{files} npz); ours (best load_workers) / sd-scripts time {ours / seconds:.2f}")


if __name__ == "__main__":
    main()
