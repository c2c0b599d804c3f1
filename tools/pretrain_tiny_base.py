"""Pretrain a family's tiny base on the synthetic scenes (library/data/shapes.py), on the CPU, so that
prompts like "a big red circle on the left, white background" render recognisably: a base that has
learned, for the tests and the demo that check a LoRA teaches what a person sees. What the base is
(sizes, file formats) is the family's spec.LearnedBase (its folder's learned.py).

    python tools/pretrain_tiny_base.py [--model_type T] [--out learned/T] [--seed 0] [--vae_steps N] [--dit_steps 2000]

1. The frozen text encoders: the family's tiny ones (make_tiny_models' seeds), written to OUT.
2. A tiny VAE of the family's released architecture (small channels), trained on every scene, the
   demo's concept (purple stars) included, as a released VAE has seen every colour and shape:
   reconstruction (a shape-weighted MSE) plus a small KL; its shift and scaling factors are then set
   so that the latents have mean 0 and standard deviation 1, as released VAEs' factors aim to (a format
   without a shift, LearnedBase.latent_shift False: a mean square of 1).
3. A tiny transformer of the family's architecture, trained with the trainer's own flow-matching loss
   (DiffusionFamily.loss_at; the family's default timestep sampling unless its LearnedBase.dit_sampling
   names another) on the base scenes only: circles,
   squares and triangles in red, green, blue and yellow. Purple and the star stay unseen: the demo's
   LoRA teaches them.
4. The score: every base caption rendered (8 Euler steps, guidance 1.0) and read by the detector.

Speed (a 2-core CPU): the transformer's blocks run under torch.compile, the VAE's loss too where the
family's LearnedBase.compile_vae says (its fused norms repay the compile), both with fused AdamW;
--eager, or a machine without a C++ compiler, trains eager (bench/RESULTS.md, "The pretrainer compiled").

Writes the family's files into OUT (as released: a single file where the family ships one), and with
--diffusers OUT/diffusers/{transformer,vae}/. Deterministic from --seed on a given number of threads
(--threads; float sums depend on the split), a given CPU and --eager or not: other kernels sum in
another order, and thousands of steps later the weights differ, of similar quality (the README gives
the shipped bases' scores and reruns').
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, one_line, exit_without_collecting  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_type", default=None, help="the family (default: the first with a learned base)")
    p.add_argument("--out", default=None, help="output folder (default: learned/MODEL_TYPE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae_steps", type=int, default=None, help="default: the family's (LearnedBase.vae_steps)")
    p.add_argument("--dit_steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--diffusers", action="store_true", help="also write diffusers folders (transformer/, vae/)")
    p.add_argument("--eager", action="store_true", help="no torch.compile (the transformer's blocks; the VAE where "
                                                        "LearnedBase.compile_vae): slower, other weights at rounding")
    p.add_argument("--reuse_vae", action="store_true", help="keep OUT/ae.safetensors (and the encoders) and train "
                                                            "the transformer only")
    return p


if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.data.shapes import BASE_COLOURS, BASE_SHAPES, COLOURS, SHAPES, all_scenes, draw_scene, jittered  # noqa: E402
from library.models.flow_matching import sampling_of  # noqa: E402
from library.models.spec import load_symbol  # noqa: E402
from tools.learned_base import (IMAGE_SIZE, LEARNED_ROOT, encode_prompts, learned_families, learned_family,  # noqa: E402
                                learned_paths, learned_spec, render, scores)

JITTERS = 4  # drawings of each scene (random centre offsets)
KL_WEIGHT = 1e-6
# The shape's pixels weigh 1 + SHAPE_WEIGHT times a background pixel in the VAE's loss. With a plain MSE
# the VAE settles on a grey blob of the right brightness (colour is ~13% of the pixels and none of the
# backgrounds; 400 steps: 0 of 360 reconstructions show their colour); weighted 3x it learns colour
# first (800 steps: 360 of 360) without losing the backgrounds (9x: it does).
SHAPE_WEIGHT = 3.0
VAE_BATCH = 16  # a VAE step at 64 x 64 costs ~4x a transformer step at batch 32


def scene_pixels(scenes, rng: random.Random) -> torch.Tensor:
    """[N, 3, S, S] float32 in [-1, 1]: each scene drawn JITTERS times, jittered from rng."""
    import numpy as np

    images = [np.asarray(draw_scene(jittered(s, rng), IMAGE_SIZE)) for s in scenes for _ in range(JITTERS)]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def cosine_lr(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def shape_weighted_mse(decoded: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE with the saturated (shape) pixels of `target` (RGB) weighted 1 + SHAPE_WEIGHT (backgrounds are grey). An
    RGBA VAE's decoded alpha plane is asked for +1: the scenes are opaque, as its pipeline feeds a picture."""
    saturated = (target.amax(1, keepdim=True) - target.amin(1, keepdim=True)) > 0.5
    weight = 1.0 + SHAPE_WEIGHT * saturated.float()
    if decoded.shape[1] == 4 and target.shape[1] == 3:
        target = torch.cat((target, torch.ones_like(target[:, :1])), dim=1)
    return (weight * (decoded - target) ** 2).mean() / weight.mean()


def vae_loss(vae, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Reconstruction of x through a latent sampled with `noise` (the posterior's shape), plus a small KL."""
    posterior = vae.encode(x).latent_dist
    z = posterior.mean + posterior.std * noise
    return shape_weighted_mse(vae.decode(z).sample, x) + KL_WEIGHT * posterior.kl().mean()


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (inductor) would use, or None without one."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return get_cpp_compiler()
    except Exception:  # inductor raises its own errors when none is found
        return None


def use_compile(eager: bool) -> bool:
    """torch.compile unless --eager or without a C++ compiler (said in one line: the run goes on eager)."""
    if eager:
        return False
    if cpp_compiler() is None:
        print("no C++ compiler for torch.compile (g++, or $CXX): training eager, slower, the weights other than the "
              "shipped ones at rounding", flush=True)
        return False
    return True


def train_vae(learned, pixels: torch.Tensor, steps: int, batch: int, seed: int, compile: bool = False):
    """The family's tiny VAE (float32) fitted to `pixels`; its latents normalised. compile (where the
    family's LearnedBase.compile_vae asks for it): the loss (forward; autograd compiles the backward)
    under torch.compile, the same sums in fused kernels."""
    torch.manual_seed(seed * 1000 + 101)
    vae = load_symbol(learned.new_vae)(IMAGE_SIZE)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=learned.vae_lr, weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(seed * 1000 + 102)
    with torch.no_grad():
        latent_shape = (batch, *vae.encode(pixels[:1]).latent_dist.mean.shape[1:])
    loss_of = torch.compile(vae_loss) if compile and learned.compile_vae else vae_loss
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, learned.vae_lr)
        x = pixels[torch.randint(len(pixels), (batch,), generator=gen)]
        loss = loss_of(vae, x, torch.randn(latent_shape, generator=gen))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"vae step {step:5d}  loss {loss.item():.5f}", flush=True)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([vae.encode(pixels[i: i + 256]).latent_dist.mode() for i in range(0, len(pixels), 256)])
    if learned.latent_shift:
        shift, scale = z.mean().item(), 1.0 / z.std().item()
    else:  # a scale-only format (z * scale): unit mean square
        shift, scale = 0.0, 1.0 / z.pow(2).mean().sqrt().item()
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    return vae


def train_transformer(family, learned, latents: torch.Tensor, text: dict, caption_of: torch.Tensor, steps: int,
                      batch: int, seed: int, compile: bool = False):
    """The family's tiny transformer (float32) trained on (latents [N, C, h, w]: 8 x 8 at 8x, 4 x 4 at 16x;
    caption_of [N] -> text rows) with the trainer's loss: the family's default timestep sampling (or its
    LearnedBase.dit_sampling), guidance 1.0. compile: each block under torch.compile, as the trainer's torch_compile
    does."""
    from library.models import flow_matching as fm

    torch.manual_seed(seed * 1000 + 201)
    model = load_symbol(learned.new_transformer)(text)
    if compile:
        for block in model.swappable_blocks():
            block.compile()
    method = learned.dit_sampling or sampling_of(family.arch).method
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(seed * 1000 + 202)
    tokens = (latents.shape[2] // family.patch) * (latents.shape[3] // family.patch)  # as training_loss counts them
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, 1e-3)
        rows = torch.randint(len(latents), (batch,), generator=gen)
        noise = torch.randn(latents[rows].shape, generator=gen)
        sigmas = fm.sample_sigmas(batch, method, generator=gen, shift=learned.dit_shift, image_seq_len=tokens)
        batch_text = {k: v[caption_of[rows]] for k, v in text.items()}
        loss = family.loss_at(model, latents[rows], batch_text, noise, sigmas, 1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"transformer step {step:5d}  loss {loss.item():.5f}", flush=True)
    return model.eval().requires_grad_(False)


def score_base(model_type: str, out: str, seed: int) -> float:
    """Every base caption rendered from the saved files; prints and returns the share whose render
    shows its colour, shape and position."""
    family = learned_family(model_type, out)
    scenes = all_scenes()
    text = encode_prompts(family, [s.caption() for s in scenes])
    model, vae = family.load_transformer(torch.float32), family.load_vae(torch.float32)
    found, _ = scores(render(family, model, vae, text, seed=seed), [{} for _ in scenes])
    right = [d.shows(s.colour, s.shape, s.position) for d, s in zip(found, scenes)]
    for attr in ("colour", "shape", "position"):
        share = sum(getattr(d, attr) == getattr(s, attr) for d, s in zip(found, scenes)) / len(scenes)
        print(f"base renders: {attr} right in {share:.0%}")
    print(f"base renders: colour, shape and position right in {sum(right)}/{len(scenes)} ({sum(right) / len(scenes):.0%})")
    return sum(right) / len(scenes)


def clock(started: tuple[float, float]) -> str:
    """Wall and CPU seconds (this process, all threads) since `started` = (time.time(), time.process_time())."""
    return f"{time.time() - started[0]:.0f} s wall, {time.process_time() - started[1]:.0f} s CPU"


def pretrain(model_type: str, out: str, seed: int = 0, vae_steps: int | None = None, dit_steps: int = 2000, batch: int = 32,
             diffusers: bool = False, reuse_vae: bool = False, eager: bool = False) -> dict[str, str]:
    started = (time.time(), time.process_time())
    os.makedirs(out, exist_ok=True)
    learned, paths = learned_spec(model_type), learned_paths(model_type, out)
    rng = random.Random(seed)
    every = scene_pixels(all_scenes(shapes=SHAPES, colours=tuple(COLOURS)), rng)  # drawn anyway: rng's state
    compile = use_compile(eager)
    if not reuse_vae:
        load_symbol(learned.write_text_encoders)(paths)
        vae = train_vae(learned, every, vae_steps or learned.vae_steps, VAE_BATCH, seed, compile)
        load_symbol(learned.save_vae)(vae, paths, diffusers)
        print(f"vae: {clock(started)}; shift {vae.config.shift_factor}, scale {vae.config.scaling_factor}")

    family = learned_family(model_type, out)
    base = all_scenes(shapes=BASE_SHAPES, colours=BASE_COLOURS)
    wrapper = family.load_vae(torch.float32)
    pixels = scene_pixels(base, rng)
    latents = torch.cat([wrapper.encode(pixels[i: i + 256]) for i in range(0, len(pixels), 256)])  # float32
    text = encode_prompts(family, [s.caption() for s in base])
    caption_of = torch.arange(len(base)).repeat_interleave(JITTERS)
    model = train_transformer(family, learned, latents, text, caption_of, dit_steps, batch, seed, compile)
    load_symbol(learned.save_transformer)(model, paths, diffusers)
    print(f"pretrained in {clock(started)}")
    score_base(model_type, out, seed)
    return paths


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        model_type = args.model_type or learned_families()[0]
        learned_spec(model_type)
    except ValueError as e:
        print(one_line(e), file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    pretrain(model_type, args.out or os.path.join(LEARNED_ROOT, model_type), args.seed, args.vae_steps, args.dit_steps,
             args.batch, args.diffusers, args.reuse_vae, args.eager)
    return 0


if __name__ == "__main__":
    exit_without_collecting(main)
