"""Time and peak memory of tools/merge_lora.py against a plain safetensors copy of the same file.

Writes a bf16 FLUX-shaped BFL checkpoint of >= 2 GB (full width 3072, --double / --single blocks)
into a temporary folder, tensor by tensor (never the whole model in memory), and a rank-16 kohya
LoRA for it; with --lokr also a LyCORIS LoKr (factor 8, rank 16) of the same modules, with --diffusers the
base again as a diffusers folder (its fused qkv / linear1 split by rows, also tensor by tensor). Then, each in
its own child process:
  import    python + torch + the project imported, nothing else (the floor of every run)
  copy      CheckpointReader (safe_open) tensor by tensor -> the streaming safetensors writer, fsync
  load_save safetensors.torch.load_file + save_file, fsync
  merge     merge_lora.main(... --save_precision bf16): the kohya LoRA into the BFL file
  merge_lokr             (--lokr) the LoKr into the BFL file (the fused qkv / linear1 merged whole)
  merge_diffusers        (--diffusers) the kohya LoRA into the diffusers folder (split by its up's rows)
  merge_lokr_diffusers   (both) the LoKr into the diffusers folder: each part of a fused module takes its
                         rows of the whole delta (networks/lora_reader.py RowsOfFused)
safetensors maps the checkpoint and its CPU tensors are views of that map, so VmHWM also counts
the file pages a run touched (reclaimable page cache, up to the file size); the memory a run really
holds is its anonymous RSS, sampled every 2 ms. Both are reported (from /proc/self/status). Prints
the numbers, their ratios and a one-line summary, and appends them to bench/RESULTS.md.

    python bench/bench_merge.py [--double 2] [--single 3] [--lokr] [--diffusers] [--keep DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from library.atomic_files import write_text  # noqa: E402
from library.io import DIFFUSERS_WEIGHTS, CheckpointReader  # noqa: E402
from library.models.flux1.checkpoint import _split_rows, diffusers_config, flux_to_diffusers_state_dict, row_tables  # noqa: E402
from library.models.flux1.model import Flux, FluxConfig  # noqa: E402
from networks.lora import LoRANetwork  # noqa: E402
from networks.lycoris_network import LycorisNetwork  # noqa: E402
from tools.merge_lora import Entry, write_safetensors_streaming  # noqa: E402

# Child processes: run one job, then report wall time and VmHWM as JSON on the last line.
CHILD = r"""
import json, os, sys, threading, time
sys.path.insert(0, {root!r})
import torch
from library.io import CheckpointReader
from tools import merge_lora

def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))

peak_anon, running = [status("RssAnon")], [True]
def sample():  # VmHWM also counts the checkpoint's file pages that safetensors maps; RssAnon does not
    while running[0]:
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.002)
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
job, src, dst, lora = sys.argv[1:5]
start = time.perf_counter()
if job == "copy":
    reader = CheckpointReader(src)
    keys = reader.keys()
    entries = [merge_lora.Entry(k, merge_lora.ST_DTYPES[reader.dtype_name(k)], reader.shape(k)) for k in keys]
    merge_lora.write_safetensors_streaming(dst, entries, ((k, reader.get(k)) for k in keys), reader.metadata)
elif job == "load_save":
    from safetensors.torch import load_file, save_file
    save_file(load_file(src), dst)
elif job.startswith("merge"):
    assert merge_lora.main(["--model", src, "--lora", lora + ":0.8", "--save_to", dst, "--save_precision", "bf16"]) == 0
if job in ("copy", "load_save"):  # merge_lora writes through atomic_path, which fsyncs: so do the copies
    with open(dst, "rb") as f:
        os.fsync(f.fileno())
seconds = time.perf_counter() - start
running[0] = False
sampler.join()
print(json.dumps({{"seconds": seconds, "peak_rss_mb": status("VmHWM") / 1024, "peak_anon_mb": peak_anon[0] / 1024}}))
"""


def write_checkpoint(path: str, config: FluxConfig) -> tuple[int, int]:
    """Random bf16 BFL checkpoint, generated and written one tensor at a time.
    Returns (bytes, largest tensor's element count)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Flux(config).state_dict().items()}
    entries = [Entry(k, torch.bfloat16, s) for k, s in shapes.items()]
    g = torch.Generator().manual_seed(0)

    def tensors():
        for e in entries:
            std = e.shape[-1] ** -0.5 if len(e.shape) == 2 else 0.1
            yield e.key, (torch.randn(e.shape, generator=g) * std).to(torch.bfloat16)

    meta = {"flux_config": json.dumps(dataclasses.asdict(config))}
    write_safetensors_streaming(path, entries, tensors(), meta)
    return os.path.getsize(path), max(torch.Size(e.shape).numel() for e in entries)


def write_diffusers(folder: str, src: str, config: FluxConfig) -> None:
    """The BFL checkpoint `src` as a diffusers folder (flux_to_diffusers_state_dict's names and order), one BFL
    tensor read and split at a time."""
    reader = CheckpointReader(src)
    keys = set(reader.keys())
    rows, norms = row_tables(keys, reader.shape, diffusers=False)
    with torch.device("meta"):
        planned = flux_to_diffusers_state_dict(Flux(config).state_dict())
    entries = [Entry(k, torch.bfloat16, tuple(v.shape)) for k, v in planned.items()]

    def tensors():
        for module, parts in rows.items():
            for suffix in ("weight", "bias"):
                if f"{module}.{suffix}" in keys:
                    for target, tensor in _split_rows(reader.get(f"{module}.{suffix}"), parts).items():
                        yield f"{target}.{suffix}", tensor
        for bfl_key, diffusers_key in norms.items():
            yield diffusers_key, reader.get(bfl_key)

    os.makedirs(folder, exist_ok=True)
    write_safetensors_streaming(os.path.join(folder, DIFFUSERS_WEIGHTS), entries, tensors(), {"format": "pt"})
    write_text(os.path.join(folder, "config.json"), json.dumps(diffusers_config(config), indent=2) + "\n")


def write_lokr(path: str, config: FluxConfig) -> int:
    """A LyCORIS LoKr (factor 8, rank 16) of the LoRA's modules, trained on BFL names (fused qkv, linear1)."""
    with torch.device("meta"):
        model = Flux(config)
    net = LycorisNetwork(model, "flux", 16, 8, network_args={"algo": "lokr", "factor": 8})
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoKr starts at a zero delta (one factor zero): make every factor nonzero
        for p in net.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    net.save(path, dtype=torch.bfloat16)
    return len({k.split(".")[0] for k in CheckpointReader(path).keys()})


def write_lora(path: str, config: FluxConfig) -> int:
    with torch.device("meta"):
        model = Flux(config)
    net = LoRANetwork(model, "flux", rank=16, alpha=8)  # LoRA tensors are made on the CPU
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.01)
    net.save(path, dtype=torch.bfloat16)
    return len(net.lora_modules())


def run_child(job: str, src: str, dst: str, lora: str) -> dict:
    code = CHILD.format(root=ROOT)
    done = subprocess.run([sys.executable, "-c", code, job, src, dst, lora], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{job} failed:\n{done.stderr[-2000:]}")
    if os.path.isdir(dst):
        shutil.rmtree(dst)  # keep the disk use at two checkpoints (three with --diffusers)
    elif os.path.exists(dst):
        os.remove(dst)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--double", type=int, default=2, help="double blocks (340 M parameters each)")
    parser.add_argument("--single", type=int, default=3, help="single blocks (141 M parameters each)")
    parser.add_argument("--lokr", action="store_true", help="also merge a LyCORIS LoKr (factor 8) of the same modules")
    parser.add_argument("--diffusers", action="store_true", help="also merge into the base written as a diffusers folder")
    parser.add_argument("--keep", default=None, help="work in this folder instead of a temporary one")
    args = parser.parse_args(argv)
    config = FluxConfig(depth=args.double, depth_single=args.single, guidance_embed=True)
    work = args.keep or tempfile.mkdtemp(prefix="bench_merge_")
    base, lora, lokr, out = (os.path.join(work, n) for n in ("base.safetensors", "lora.safetensors", "lokr.safetensors", "out.safetensors"))
    folder, folder_out = os.path.join(work, "base_diffusers"), os.path.join(work, "out_diffusers")
    size, largest = write_checkpoint(base, config)
    modules = write_lora(lora, config)
    print(f"checkpoint {size / 1e9:.2f} GB bf16 ({args.double} double + {args.single} single blocks, width 3072), "
          f"largest tensor {largest / 1e6:.1f} M elements = {largest * 4 / 2**20:.0f} MiB fp32; LoRA rank 16, {modules} modules")  # fmt: skip
    runs = {job: (job, base, out, lora) for job in ("import", "copy", "load_save", "merge")}
    if args.lokr:
        print(f"LyCORIS LoKr factor 8 rank 16, {write_lokr(lokr, config)} modules (BFL names)")
        runs["merge_lokr"] = ("merge", base, out, lokr)
    if args.diffusers:
        write_diffusers(folder, base, config)
        runs["merge_diffusers"] = ("merge", folder, folder_out, lora)
        if args.lokr:
            runs["merge_lokr_diffusers"] = ("merge", folder, folder_out, lokr)
    results = {name: run_child(*job) for name, job in runs.items()}
    for line in table(results):
        print(line)
    copy, merge, whole = results["copy"], results["merge"], results["load_save"]
    anon = lambda r: r["peak_anon_mb"] - results["import"]["peak_anon_mb"]  # noqa: E731
    summary = (
        f"merge_lora bf16 of a {size / 1e9:.2f} GB checkpoint: {merge['seconds']:.1f} s = {merge['seconds'] / copy['seconds']:.2f}x "
        f"the streaming copy ({copy['seconds']:.1f} s); peak anonymous memory above import {anon(merge):.0f} MiB "
        f"(= {anon(merge) * 2**20 / (largest * 4):.1f} largest fp32 tensors of {largest * 4 / 2**20:.0f} MiB) vs copy {anon(copy):.0f} MiB "
        f"vs load_file+save_file {anon(whole):.0f} MiB; VmHWM {merge['peak_rss_mb']:.0f} / {copy['peak_rss_mb']:.0f} / "
        f"{whole['peak_rss_mb']:.0f} MiB (includes the mmapped checkpoint pages)"
    )
    print(summary)
    record(results, summary, args)
    if not args.keep:
        shutil.rmtree(work)


def table(results: dict) -> list[str]:
    """Markdown rows: time, VmHWM (counts mmapped file pages) and sampled peak RssAnon, raw and above import."""
    floor = results["import"]
    copy = results["copy"]["seconds"]
    rows = ["| run | seconds | time / copy | VmHWM MiB | peak RssAnon MiB | RssAnon above import MiB |",
            "|---|---|---|---|---|---|"]
    for job, r in results.items():
        rows.append(f"| {job} | {r['seconds']:.1f} | {r['seconds'] / copy:.2f} | {r['peak_rss_mb']:.0f} | "
                    f"{r['peak_anon_mb']:.0f} | {r['peak_anon_mb'] - floor['peak_anon_mb']:.0f} |")  # fmt: skip
    return rows


def record(results: dict, summary: str, args):
    lines = [
        f"\n## bench_merge.py, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores. Command: `python bench/bench_merge.py --double {args.double} --single {args.single}"
        f"{' --lokr' * args.lokr}{' --diffusers' * args.diffusers}`",
        "",
        *table(results),
        "",
        summary,
        "",
    ]
    with open(os.path.join(ROOT, "bench", "RESULTS.md"), "a") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
