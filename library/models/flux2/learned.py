"""FLUX.2's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type flux2 trains it,
learned/flux2/ ships it): a FLUX.2 [klein]-architecture transformer (hidden 128, 4 heads of 32, 2 double- and 2
single-stream blocks, no guidance embedding, RoPE axes (8, 8, 8, 8)) in BFL's single-file format, bf16 as
released; a VAE of the released AutoencoderKLFlux2 architecture with small channels (8/16/32/32) as a diffusers
folder, float32, its latents' BatchNorm statistics set from the pretrained latents; make_tiny_models' frozen tiny
Qwen3 text encoder (seed 0) with its tokenizer. Captions are padded to MAX_SEQUENCE_LENGTH tokens (the config's
max_sequence_length; the pipelines' 512 would make the tiny model's step 10x slower on text it never reads)."""

from __future__ import annotations

import os

import torch

from library.io import save_safetensors
from library.models import spec as S
from library.models.tiny_files import write_json

VAE_CONFIG = {"block_out_channels": [8, 16, 32, 32], "layers_per_block": 1, "norm_num_groups": 8, "latent_channels": 32}
DIT = dict(hidden_size=128, num_heads=4, depth=2, depth_single=2, axes_dim=(8, 8, 8, 8), guidance_embed=False)
MAX_SEQUENCE_LENGTH = 64  # the chat template and the longest scene caption take 47 of the tiny tokenizer's tokens


def family(paths: dict[str, str]):
    from library.models.flux2.family import Flux2Family

    family = Flux2Family(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])
    if not os.path.exists(paths["pretrained_model_name_or_path"]):  # the pretrainer encodes before it is written
        family.is_dev = lambda: False  # DIT: [klein], no guidance embedding (is_dev reads the file's keys)
    return family


def write_text_encoders(paths: dict[str, str]) -> None:
    from library.models.flux2.tiny import write_klein_text_encoder

    folder = paths["text_encoder"]
    write_klein_text_encoder(folder, os.path.join(os.path.dirname(folder), "tokenizer"), 0)  # make_tiny_models' seed


def new_vae(image_size: int):
    from diffusers import AutoencoderKLFlux2

    return AutoencoderKLFlux2(**VAE_CONFIG, sample_size=image_size)


def save_vae(vae, paths: dict[str, str], diffusers: bool, bn_eps: float | None = None) -> None:
    """A diffusers folder (the released layout; `diffusers` changes nothing). The pretrainer's shift and scale
    (mean and 1 / std of its latents) become the BatchNorm statistics the pipeline normalises by, every patch
    channel alike, with the eps it adds (bn_eps; default the config's batch_norm_eps, as FLUX.2's pipelines);
    its config keeps AutoencoderKLFlux2's own keys."""
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    eps = vae.config.batch_norm_eps if bn_eps is None else bn_eps
    with torch.no_grad():
        vae.bn.running_mean.fill_(shift)
        vae.bn.running_var.fill_(1.0 / scale**2 - eps)
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in vae.config.items()
              if not k.startswith("_") and k not in ("shift_factor", "scaling_factor")}
    folder = paths["ae"]
    save_safetensors({k: v.contiguous() for k, v in vae.state_dict().items()},
                     os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKLFlux2", **config})


def new_transformer(text: dict[str, torch.Tensor]):
    from library.models.flux2.model import Flux2, Flux2Config

    return Flux2(Flux2Config(in_channels=4 * VAE_CONFIG["latent_channels"], context_in_dim=text["embeds"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    from library.models.flux2.checkpoint import save_flux2_bfl, save_flux2_diffusers
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_flux2_bfl, save_flux2_diffusers)


_HERE = __name__ + ":"
# The VAE recipe whole (its class and files, learning rate, steps, no compiled loss): a family that ships FLUX.2's
# VAE spreads it into its LearnedBase, so the pretrainer trains the same weights as learned/flux2/vae
VAE_RECIPE = dict(new_vae=_HERE + "new_vae", save_vae=_HERE + "save_vae", vae_lr=1.5e-3, vae_steps=1500,
                  compile_vae=False)
LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "flux2-learned.safetensors"), ("ae", "vae"),
           ("text_encoder", "text_encoder")),
    encode_kwargs=(("max_length", MAX_SEQUENCE_LENGTH),),
    config="quickstart_flux2.toml",
    **VAE_RECIPE,
    # tests/test_learning.py's concept LoRA, measured (2026-12-01), 120 steps: 10/18 after, 9 of 11 kept.
    learning_test=(120, 0.3, 0.5),
)
