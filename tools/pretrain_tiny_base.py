"""Pretrain a tiny FLUX.1 base on the synthetic scenes (library/data/shapes.py), on the CPU, so that
prompts like "a big red circle on the left, white background" render recognisably: a base that has
learned, for the tests and the demo that check a LoRA teaches what a person sees.

    python tools/pretrain_tiny_base.py --out learned/flux [--seed 0] [--vae_steps 1500] [--dit_steps 2000]

1. The frozen text encoders: tools/make_tiny_models.py's tiny CLIP-L and T5 (seed 0), written to OUT.
2. A tiny VAE of the released FLUX.1 AutoencoderKL architecture (block_out_channels 8/16/32/32), trained
   on every scene, the demo's concept (purple stars) included, as a released VAE has seen every colour
   and shape: reconstruction (MSE) plus a small KL; its shift and scaling factors are then set so that
   the latents have mean 0 and standard deviation 1, as FLUX.1's (0.1159, 0.3611) do for its VAE.
3. A tiny FLUX.1-dev transformer (library/models/flux1/model.py: hidden 128, 4 heads, 2 double- and 2
   single-stream blocks, guidance embedding), trained with the trainer's own flow-matching loss
   (DiffusionFamily.loss_at; FLUX.1's shifted sigmas) on the base scenes only: circles, squares and
   triangles in red, green, blue and yellow. Purple and the star stay unseen: the demo's LoRA teaches them.
4. The score: every base caption rendered (8 Euler steps, guidance 1.0) and read by the detector.

Writes OUT/flux1-learned.safetensors (BFL single file, bf16 as released), OUT/ae.safetensors (BFL
layout, float32), OUT/clip_l/, OUT/t5xxl/, and with --diffusers OUT/diffusers/{transformer,vae}/.
Deterministic from --seed on a given number of threads (--threads; float sums depend on the split).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, one_line  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="learned/flux", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae_steps", type=int, default=1500)
    p.add_argument("--dit_steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--diffusers", action="store_true", help="also write diffusers folders (transformer/, vae/)")
    p.add_argument("--reuse_vae", action="store_true", help="keep OUT/ae.safetensors (and the encoders) and train "
                                                            "the transformer only")
    return p


if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

from library.data.shapes import BASE_COLOURS, BASE_SHAPES, COLOURS, SHAPES, all_scenes, draw_scene, jittered  # noqa: E402
from library.io import save_safetensors  # noqa: E402
from library.models.tiny_files import write_clip_l, write_json, write_t5_encoder  # noqa: E402
from tools.learned_base import IMAGE_SIZE, encode_prompts, flux_family, learned_paths, render, scores  # noqa: E402

VAE_CONFIG = {"block_out_channels": [8, 16, 32, 32], "layers_per_block": 1, "norm_num_groups": 8,
              "sample_size": IMAGE_SIZE, "latent_channels": 16}
DIT = dict(hidden_size=128, num_heads=4, depth=2, depth_single=2, axes_dim=(8, 12, 12), guidance_embed=True)
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
    """MSE with the saturated (shape) pixels of `target` weighted 1 + SHAPE_WEIGHT (backgrounds are grey)."""
    saturated = (target.amax(1, keepdim=True) - target.amin(1, keepdim=True)) > 0.5
    weight = 1.0 + SHAPE_WEIGHT * saturated.float()
    return (weight * (decoded - target) ** 2).mean() / weight.mean()


def train_vae(pixels: torch.Tensor, steps: int, batch: int, seed: int):
    """A FLUX.1-architecture AutoencoderKL (float32) fitted to `pixels`; its latents normalised."""
    from diffusers import AutoencoderKL

    from library.models.flux1.vae import FLUX_VAE_CONFIG

    torch.manual_seed(seed * 1000 + 101)
    vae = AutoencoderKL(**{**FLUX_VAE_CONFIG, **VAE_CONFIG})
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1.5e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed * 1000 + 102)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, 1.5e-3)
        x = pixels[torch.randint(len(pixels), (batch,), generator=gen)]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        loss = shape_weighted_mse(vae.decode(z).sample, x) + KL_WEIGHT * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"vae step {step:5d}  loss {loss.item():.5f}", flush=True)
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        z = torch.cat([vae.encode(pixels[i: i + 256]).latent_dist.mode() for i in range(0, len(pixels), 256)])
    shift, scale = z.mean().item(), 1.0 / z.std().item()
    vae.register_to_config(shift_factor=round(shift, 4), scaling_factor=round(scale, 4))
    return vae


def save_vae(vae, out: str, diffusers: bool) -> str:
    """OUT/ae.safetensors in BFL's layout, the config in its metadata (make_tiny_models' convention)."""
    from library.models.vae import autoencoder_kl_to_ldm_state_dict

    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
    path = os.path.join(out, "ae.safetensors")
    sd = {k: v.contiguous() for k, v in vae.state_dict().items()}
    save_safetensors(autoencoder_kl_to_ldm_state_dict(sd, len(config["block_out_channels"])), path,
                     metadata={"diffusers_config": json.dumps(config)})
    if diffusers:
        folder = os.path.join(out, "diffusers", "vae")
        save_safetensors(sd, os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKL", **config})
    return path


def train_transformer(family, latents: torch.Tensor, text: dict, caption_of: torch.Tensor, steps: int,
                      batch: int, seed: int):
    """A tiny FLUX.1-dev transformer (float32) trained on (latents [N, 16, 8, 8], caption_of [N] -> text rows)
    with the trainer's loss: FLUX.1's shifted sigmas, guidance 1.0."""
    from library.models import flow_matching as fm
    from library.models.flux1.model import Flux, FluxConfig

    torch.manual_seed(seed * 1000 + 201)
    cfg = FluxConfig(in_channels=64, vec_in_dim=text["clip_pooled"].shape[1], context_in_dim=text["t5"].shape[2], **DIT)
    model = Flux(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed * 1000 + 202)
    tokens = (latents.shape[2] // 2) * (latents.shape[3] // 2)
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, 1e-3)
        rows = torch.randint(len(latents), (batch,), generator=gen)
        noise = torch.randn(latents[rows].shape, generator=gen)
        sigmas = fm.sample_sigmas(batch, "flux_shift", generator=gen, image_seq_len=tokens)
        batch_text = {k: v[caption_of[rows]] for k, v in text.items()}
        loss = family.loss_at(model, latents[rows], batch_text, noise, sigmas, 1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"transformer step {step:5d}  loss {loss.item():.5f}", flush=True)
    return model.eval().requires_grad_(False)


def save_transformer(model, out: str, diffusers: bool) -> str:
    from library.models.flux1.checkpoint import save_flux_bfl, save_flux_diffusers

    path = learned_paths(out)["pretrained_model_name_or_path"]
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}  # bf16, as BFL releases
    save_flux_bfl(sd, path, model.config)
    if diffusers:
        save_flux_diffusers(sd, model.config, os.path.join(out, "diffusers", "transformer"))
    return path


def score_base(out: str, seed: int) -> float:
    """Every base caption rendered from the saved files; prints and returns the share whose render
    shows its colour, shape and position."""
    family = flux_family(out)
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


def pretrain(out: str, seed: int = 0, vae_steps: int = 800, dit_steps: int = 2500, batch: int = 32,
             diffusers: bool = False, reuse_vae: bool = False) -> dict[str, str]:
    started = (time.time(), time.process_time())
    os.makedirs(out, exist_ok=True)
    paths = learned_paths(out)
    rng = random.Random(seed)
    every = scene_pixels(all_scenes(shapes=SHAPES, colours=tuple(COLOURS)), rng)  # drawn anyway: rng's state
    if not reuse_vae:
        write_clip_l(paths["clip_l"], 0, 3)  # make_tiny_models' encoders: seed 0, their own offsets
        write_t5_encoder(paths["t5xxl"], 0, 4)
        vae = train_vae(every, vae_steps, VAE_BATCH, seed)
        save_vae(vae, out, diffusers)
        print(f"vae: {clock(started)}; shift {vae.config.shift_factor}, scale {vae.config.scaling_factor}")

    family = flux_family(out)
    base = all_scenes(shapes=BASE_SHAPES, colours=BASE_COLOURS)
    wrapper = family.load_vae(torch.float32)
    pixels = scene_pixels(base, rng)
    latents = torch.cat([wrapper.encode(pixels[i: i + 256]) for i in range(0, len(pixels), 256)])  # float32
    text = encode_prompts(family, [s.caption() for s in base])
    caption_of = torch.arange(len(base)).repeat_interleave(JITTERS)
    model = train_transformer(family, latents, text, caption_of, dit_steps, batch, seed)
    save_transformer(model, out, diffusers)
    print(f"pretrained in {clock(started)}")
    score_base(out, seed)
    return paths


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:
        print(one_line(e), file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    pretrain(args.out, args.seed, args.vae_steps, args.dit_steps, args.batch, args.diffusers, args.reuse_vae)
    return 0


if __name__ == "__main__":
    sys.exit(main())
