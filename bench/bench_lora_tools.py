"""Throughput of tools/extract_lora.py and tools/resize_lora.py on a mid-size FLUX-shaped checkpoint.

Writes a random bf16 BFL checkpoint (width --hidden, --double / --single blocks, tensor by tensor:
bench_merge.write_checkpoint), a rank --rank kohya LoRA on every extraction target, and the tuned
checkpoint = base + LoRA merged by tools/merge_lora.py in fp32. Then, in this process, with torch
limited to --threads threads (MKL's SVD slows down sharply when its threads are oversubscribed on a
shared machine):
  extract  extract_lora --rank R, with --svd full and lowrank: weights per second, seconds per
           module, the largest per-module relative error (the delta is rank R: ~1e-6 expected)
  resize   resize_lora R -> --new_rank: ours (SVD of the small QR core) vs the full SVD of
           up @ down per module (what sd-scripts does), seconds
Peak anonymous memory above the start (RssAnon sampled every 2 ms) is given for each. Prints a
summary line; add it to bench/RESULTS.md.

    python bench/bench_lora_tools.py [--hidden 1536] [--double 1] [--single 1] [--rank 32] [--new_rank 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_merge import cpu_model, write_checkpoint  # noqa: E402
from library.models.flux1.model import FluxConfig  # noqa: E402
from networks.lora_files import LoRAWeights, write_kohya  # noqa: E402
from tools import extract_lora, merge_lora, resize_lora  # noqa: E402
from tools.lora_common import read_lora_file  # noqa: E402


def rss_anon_mb() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:")) / 1024


@contextlib.contextmanager
def measured(result: dict):
    """Wall seconds and peak RssAnon growth (MiB) of the block, into `result`."""
    start_mem, peak, running = rss_anon_mb(), [0.0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], rss_anon_mb())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    yield
    result["seconds"] = time.perf_counter() - start
    running[0] = False
    sampler.join()
    result["peak_anon_mb"] = max(peak[0], rss_anon_mb()) - start_mem


def write_lora(base_path: str, path: str, rank: int) -> int:
    """A random rank-`rank` LoRA on every extraction target of the checkpoint (fp32)."""
    base = merge_lora.open_base(base_path)
    g = torch.Generator().manual_seed(1)
    weights = {}
    elements = 0
    for target in extract_lora.target_modules(base):  # (a part of a fused weight: its rows)
        out_f, in_f = base.reader.shape(base.weight_key[target.module])
        out_f = out_f if target.rows is None else sum(end - start for start, end in target.rows)
        weights[target.name] = LoRAWeights(torch.randn(rank, in_f, generator=g) / in_f**0.5,
                                           torch.randn(out_f, rank, generator=g) * 0.01, float(rank))  # fmt: skip
        elements += out_f * in_f
    write_kohya(weights, path)
    return elements


def full_svd_resize_seconds(lora_path: str, new_rank: int) -> float:
    """sd-scripts' way: torch.linalg.svd of the [out, in] product up @ down per module."""
    start = time.perf_counter()
    for w in read_lora_file(lora_path, "bench").weights.values():
        U, S, Vh = torch.linalg.svd(w.up.float() @ w.down.float(), full_matrices=False)
        _ = (U[:, :new_rank] * S[:new_rank], Vh[:new_rank])
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=1)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--new_rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = FluxConfig(hidden_size=args.hidden, num_heads=args.hidden // 128, depth=args.double,
                        depth_single=args.single, guidance_embed=True)  # fmt: skip
    work = tempfile.mkdtemp(prefix="bench_lora_tools_")
    try:
        base, lora, tuned, out, small = (os.path.join(work, n) for n in
                                         ("base.safetensors", "lora.safetensors", "tuned.safetensors", "x.safetensors", "r.safetensors"))  # fmt: skip
        size, _ = write_checkpoint(base, config)
        target_params = write_lora(base, lora, args.rank)
        assert merge_lora.main(["--model", base, "--lora", lora, "--save_to", tuned, "--save_precision", "fp32"]) == 0
        ex, fast, rs = {}, {}, {}
        with measured(fast):
            done_fast = extract_lora.extract_lora(base, tuned, out, rank=args.rank, log=lambda line: None, svd="lowrank")
        with measured(ex):
            done = extract_lora.extract_lora(base, tuned, out, rank=args.rank, log=lambda line: None)
        with measured(rs):
            resized = resize_lora.resize_lora(lora, small, args.new_rank)
        full = full_svd_resize_seconds(lora, args.new_rank)
        modules = len(done["modules"])
        lora_mb = os.path.getsize(lora) / 2**20
        summary = (
            f"CPU {cpu_model()}, {args.threads} thread(s), load avg {os.getloadavg()[0]:.1f}; FLUX-shaped width {args.hidden}, "
            f"{args.double} double + {args.single} single blocks, base {size / 1e9:.2f} GB bf16, tuned fp32. "
            f"extract_lora --rank {args.rank}: {modules} modules, {target_params / 1e6:.0f} M target weights in {ex['seconds']:.1f} s "
            f"= {target_params / 1e6 / ex['seconds']:.1f} M weights/s ({ex['seconds'] / modules:.2f} s/module), max relative delta "
            f"error {max(r['rel_error'] for r in done['modules']):.1e}, peak RssAnon +{ex['peak_anon_mb']:.0f} MiB; "
            f"--svd lowrank: {fast['seconds']:.1f} s = {target_params / 1e6 / fast['seconds']:.1f} M weights/s, max error "
            f"{max(r['rel_error'] for r in done_fast['modules']):.1e}, peak RssAnon +{fast['peak_anon_mb']:.0f} MiB. "
            f"resize_lora {args.rank} -> {args.new_rank} of the {lora_mb:.0f} MiB LoRA: {rs['seconds']:.2f} s "
            f"(full SVD of up@down per module, sd-scripts' way: {full:.1f} s, {full / rs['seconds']:.0f}x), "
            f"mean Frobenius energy retained {resized['summary']['mean_fro_retained']:.1%}, peak RssAnon +{rs['peak_anon_mb']:.0f} MiB."
        )
        print(f"SUMMARY: {summary}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
