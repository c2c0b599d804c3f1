"""The memory planner's caching, edit and sampling phases against train_lora.py's peak RSS on this
CPU, on mid-size configs: full-width transformers with few blocks, the released VAEs, tiny text
encoders (tools/make_tiny_models.py), random weights in the released file formats.

    python bench/bench_planner_cpu.py --work /tmp/planbench                      # both configs
    python bench/bench_planner_cpu.py --work /tmp/planbench --configs flux --skip-write
    python bench/bench_planner_cpu.py --work /tmp/planbench --configs qwen_edit --live-tensors

Configs:
  flux       FLUX.1-dev-shaped transformer at full width, 2 double + 2 single blocks (0.98 B, BFL file,
             bf16), the FLUX VAE at its released size; 4 images at 384x384 cached with vae_batch_size 4
             (the training batch is 1); fp8_scaled base, bf16 compute, checkpointing, rank 16, AdamW,
             2 steps; one sample (384x384, 2 steps) with sample_bf16_reference = true.
  qwen_edit  Qwen-Image-Edit-2509-shaped transformer at full width, 2 blocks (0.68 B, diffusers folder),
             the Qwen-Image VAE at its released size; 1 image at 256x256 with 3 references
             (control_directory), vae_batch_size 1; fp8_scaled base, bf16 compute, checkpointing,
             rank 16, AdamW, 2 steps; no sample.

Measured: train_lora.py runs in a child process with glibc's mmap threshold pinned (freed tensors
leave the RSS at once) and its phases wrapped: at each phase's start the RSS is read and the peak
(VmHWM) reset, at its end the peak is read. VAE caching is DiffusionTask._cache_latents, above the
RSS at its start; training (Trainer.run_epoch) and sampling (DiffusionTask.render_samples) are above
the RSS just before the transformer loads (the process's runtime and caches by then). Planned:
library/training/memory_plan.py on the same config (its VAE part for caching; the edit config at its
cached text length). "old" is what the planner said before issue 23: the encode at the training
batch, one reference, no bf16 copy in sampling. Timing on a shared machine is noise; RSS is not.
--live-tensors: the VAE caching also counts its live CPU tensor bytes (memory_plan.LiveBytes on
"cpu": what max_memory_allocated counts on a GPU, without the CPU kernels' workspaces and the
allocator's slack that the RSS holds; the dispatch mode adds ~2 MB to the RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_full_pipeline_cpu import (  # noqa: E402
    RUN_SETTINGS, GiB, meta_shapes, write_flux_vae, write_qwen_transformer_and_vae, write_random)
from library.training.host_memory import return_freed_buffers  # noqa: E402

FLUX_SIDE, EDIT_SIDE = 384, 256


# ----------------------------------------------------------------------------------------------
# Files and configs


def write_images(folder: str, count: int, side: int, suffixes=("",), caption: str | None = "a plain square") -> None:
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    for i in range(count):
        for k, suffix in enumerate(suffixes):
            Image.new("RGB", (side, side), (40 * i + 20 * k, 90, 200 - 30 * i)).save(os.path.join(folder, f"{i}{suffix}.png"))
        if caption:
            with open(os.path.join(folder, f"{i}.txt"), "w") as f:
                f.write(f"{caption} number {i}")


def write_dataset(work: str, count: int, side: int, references: int = 0) -> None:
    """<work>/images (count captioned images), with `references` each in <work>/control, and dataset.toml."""
    write_images(os.path.join(work, "images"), count, side)
    subset = f'image_dir = "{work}/images"\n'
    if references:
        write_images(os.path.join(work, "control"), count, side, [f"_{k}" for k in range(references)], caption=None)
        subset += f'control_directory = "{work}/control"\n'
    with open(os.path.join(work, "dataset.toml"), "w") as f:
        f.write(f"[[datasets]]\nresolution = {side}\nbatch_size = 1\n[[datasets.subsets]]\n{subset}")


def write_flux(work: str) -> str:
    from library.models.flux1.model import Flux, FluxConfig
    from library.models.flux1.tiny import write_clip, write_t5
    from library.models.tiny_files import TINY

    os.makedirs(work, exist_ok=True)
    config = FluxConfig(vec_in_dim=TINY["clip_hidden"], context_in_dim=TINY["t5_d_model"], depth=2, depth_single=2,
                        guidance_embed=True)
    write_random(os.path.join(work, "flux-mid.safetensors"), meta_shapes(lambda: Flux(config)), 1, metadata={})
    write_flux_vae(work)
    write_dataset(work, 4, FLUX_SIDE)
    with open(os.path.join(work, "prompts.txt"), "w") as f:
        f.write(f"a plain square --w {FLUX_SIDE} --h {FLUX_SIDE} --s 2 --d 7\n")
    return write_config(work, model_type="flux", pretrained_model_name_or_path=f"{work}/flux-mid.safetensors",
                        ae=f"{work}/ae.safetensors", **write_clip(work, 0), **write_t5(work, 0),
                        t5xxl_max_token_length=512, vae_batch_size=4, sample_prompts=f"{work}/prompts.txt",
                        sample_bf16_reference=True)


def write_qwen_edit(work: str) -> str:
    import dataclasses

    from library.models.qwen_image.model import QWEN_IMAGE
    from library.models.qwen_image.tiny import write_qwen_vl_text_encoder
    from library.models.tiny_files import TINY

    os.makedirs(work, exist_ok=True)
    write_qwen_transformer_and_vae(work, dataclasses.replace(QWEN_IMAGE, num_layers=2, joint_attention_dim=TINY["lm_hidden"]))
    write_dataset(work, 1, EDIT_SIDE, references=3)
    return write_config(work, model_type="qwen_image_edit", model_version="qwen-image-edit-2509",
                        pretrained_model_name_or_path=work, ae=f"{work}/vae", vae_batch_size=1,
                        text_encoder=write_qwen_vl_text_encoder(work, 0)["qwen_image_edit_text_encoder"])


def write_config(work: str, **model) -> str:
    """<work>/train.toml: the model's keys, the dataset, and the pipeline benches' run settings."""
    import toml

    path = os.path.join(work, "train.toml")
    with open(path, "w") as f:
        f.write(toml.dumps({**model, "dataset_config": f"{work}/dataset.toml", "output_dir": f"{work}/out",
                            "save_every_n_steps": 0, "cache_text_encoder_outputs_to_disk": True}) + RUN_SETTINGS)
    return path


# ----------------------------------------------------------------------------------------------
# The measured run (child process)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def count_live_tensors(owner, name: str, marks: dict) -> None:
    """`owner.name` also records the peak of its live CPU tensor bytes under marks["<name> live tensors"]."""
    from library.training.memory_plan import LiveBytes

    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        with LiveBytes("cpu") as live:
            try:
                return original(*args, **kwargs)
            finally:
                marks[f"{name} live tensors"] = {"peak": live.peak}

    setattr(owner, name, wrapped)


def child(config: str, marks_path: str, live_tensors: bool = False) -> None:
    """train_lora.py on `config` with its phases wrapped; writes {phase: {start, peak}} (bytes)."""
    return_freed_buffers(65536)  # freed tensors leave the RSS at once
    torch.set_num_threads(2)
    import matplotlib.pyplot  # noqa: F401  (plot_lr loads it before the final samples: in every baseline instead)

    import train_lora
    from library.training.diffusion_task import DiffusionTask

    marks: dict[str, dict[str, int]] = {}

    def watch(owner, name: str, phase: str):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            start = rss()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := the RSS now
            try:
                return original(*args, **kwargs)
            finally:
                seen = marks.setdefault(phase, {"start": start, "peak": 0})
                seen["peak"] = max(seen["peak"], peak_rss())

        setattr(owner, name, wrapped)

    if live_tensors:  # inside the RSS watch: the same run measures both
        count_live_tensors(DiffusionTask, "_cache_latents", marks)
    watch(DiffusionTask, "_cache_latents", "vae caching")
    watch(DiffusionTask, "_load_base", "transformer load")
    watch(train_lora.Trainer, "run_epoch", "training")
    watch(DiffusionTask, "render_samples", "sampling")
    code = train_lora.main(["--config_file", config])
    with open(marks_path, "w") as f:
        json.dump({"code": code, "marks": marks}, f)


def measure(config: str, work: str, live_tensors: bool = False) -> dict[str, int]:
    marks_path = os.path.join(work, "marks.json")
    subprocess.run([sys.executable, __file__, "--child", config, "--marks", marks_path]
                   + (["--live-tensors"] if live_tensors else []), cwd=ROOT, check=True)
    with open(marks_path) as f:
        result = json.load(f)
    assert result["code"] == 0, result
    marks = result["marks"]
    runtime = marks["transformer load"]["start"]
    measured = {"caching": marks["vae caching"]["peak"] - marks["vae caching"]["start"],
                "training": marks["training"]["peak"] - runtime}
    if "sampling" in marks:
        measured["sampling"] = marks["sampling"]["peak"] - runtime
    if "_cache_latents live tensors" in marks:
        measured["caching live tensors"] = marks["_cache_latents live tensors"]["peak"]
    return measured


# ----------------------------------------------------------------------------------------------
# The plan


def cached_text_tokens(work: str) -> int:
    """The text length the run cached (Qwen-Image-Edit: caption + the references' vision tokens)."""
    from safetensors import safe_open

    path = next(os.path.join(work, "images", f) for f in os.listdir(os.path.join(work, "images")) if f.endswith("_te.safetensors"))
    with safe_open(path, "pt") as f:
        return f.get_slice("embeds").get_shape()[0]


def planned(config: str, work: str) -> dict[str, tuple[int, int]]:
    """{phase: (planned bytes, what the planner said before issue 23)}."""
    from library.data.image_folders import reference_count
    from library.data.dataset_config import load_dataset_config
    from library.data.prompts import SamplePrompt, read_prompt_file
    from library.models.family import get_family
    from library.training import memory_plan as mp
    from library.training.config import load_config

    run = load_config(["--config_file", config])
    family, blueprint = get_family(run), load_dataset_config(run.dataset_config)
    (w, h), refs = blueprint.datasets[0].resolution, reference_count(blueprint)
    tokens = mp.text_tokens_for(family, run) if family.arch == "flux" else cached_text_tokens(work)
    caching = mp.caching_phase(family, run, w, h, refs)
    vae = max(v for k, v in caching.parts.items() if k.startswith("vae"))
    plans = {"caching": (vae, mp.vae_pass_peak(family.vae_on_meta(), w, h, 1, decode=False))}
    plan = mp.training_plan(family, run, w, h, 1, tokens, refs).phase(run.blocks_to_swap).peak
    plans["training"] = (plan, mp.training_plan(family, run, w, h, 1, tokens, 1).phase(run.blocks_to_swap).peak
                         if refs else plan)
    if run.sample_prompts:
        p = read_prompt_file(run.sample_prompts, SamplePrompt(""))[0]
        sampling = mp.sampling_phase(family, run, p.width, p.height, tokens, len(p.control_images))
        plans["sampling"] = (sampling.peak, sampling.peak - sampling.parts.get("bf16 reference (base, lora)", 0))
    return plans


CONFIGS = {"flux": write_flux, "qwen_edit": write_qwen_edit}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="/tmp/planbench")
    p.add_argument("--configs", default="flux,qwen_edit")
    p.add_argument("--skip-write", action="store_true", help="reuse the files of an earlier run")
    p.add_argument("--live-tensors", action="store_true", help="also count the VAE caching's live CPU tensor bytes")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--marks", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.marks, args.live_tensors)
    rows = []
    for name in args.configs.split(","):
        work = os.path.join(args.work, name)
        config = os.path.join(work, "train.toml") if args.skip_write else CONFIGS[name](work)
        measured = measure(config, work, args.live_tensors)
        for phase, (plan, old) in planned(config, work).items():
            rows.append((name, phase, plan, old, measured[phase]))
            print(f"{name:10s} {phase:9s} planned {plan / GiB:6.3f}  old {old / GiB:6.3f}  measured "
                  f"{measured[phase] / GiB:6.3f} GiB  planned/measured {plan / measured[phase]:.3f}", flush=True)
            if phase == "caching" and "caching live tensors" in measured:
                live = measured["caching live tensors"]
                print(f"{name:10s} caching   live tensors {live / GiB:6.3f} GiB  planned/live {plan / live:.3f}",
                      flush=True)
    print("\n| config | phase | planned GiB | old plan GiB | measured GiB (RSS) | planned / measured |")
    print("|---|---|---|---|---|---|")
    for name, phase, plan, old, got in rows:
        print(f"| {name} | {phase} | {plan / GiB:.3f} | {old / GiB:.3f} | {got / GiB:.3f} | {plan / got:.3f} |")
    worst = max(abs(plan / got - 1) for *_, plan, _, got in rows)
    print(f"SUMMARY: planner vs peak RSS on {len(rows)} phases, worst |planned/measured - 1| = {worst:.3f}")


if __name__ == "__main__":
    main()
