"""FLUX.3's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type flux3 trains it,
learned/flux3/ ships it): a FLUX.3 [klein]-architecture transformer, the base (no flow map: hidden 128, 4 heads of
32, 2 per-mode blocks for each of image, image_cond and text, 2 single blocks, RoPE axes (8, 8, 8, 8)) in BFL's
single-file format, bf16 as released; FLUX.2's learned VAE recipe (flux2/learned.py: the released
AutoencoderKLFlux2 architecture with small channels, a diffusers folder, float32; the same config and seed, so the
pretrainer trains the same weights as FLUX.2's on the same CPU); make_tiny_models' frozen tiny Qwen3-VL text
encoder (seed 0) with its tokenizer. Captions keep FLUX.3's window of a multiple of 80 tokens (no config key cuts
it; the chat template and the longest scene caption take 41 of the tiny tokenizer's tokens: one window). The
image_cond blocks are trained by no scene (no references): they stay at their init, as in make_tiny_models'."""

from __future__ import annotations

import os

import torch

from library.models import spec as S
from library.models.flux2.learned import VAE_RECIPE as FLUX2_VAE_RECIPE

DIT = dict(hidden_size=128, num_heads=4, depth=2, depth_single=2, axes_dim=(8, 8, 8, 8), flow_map=False)


def family(paths: dict[str, str]):
    from library.models.flux3.family import Flux3Family

    family = Flux3Family(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])
    if not os.path.exists(paths["pretrained_model_name_or_path"]):  # the pretrainer encodes before it is written
        family.is_distilled = False  # DIT: the base, no flow map (is_distilled reads the file's keys)
    return family


def write_text_encoders(paths: dict[str, str]) -> None:
    from library.models.flux3.tiny import write_qwen3_vl_text_encoder

    folder = paths["text_encoder"]
    write_qwen3_vl_text_encoder(folder, os.path.join(os.path.dirname(folder), "tokenizer"), 0)  # make_tiny_models'


def new_transformer(text: dict[str, torch.Tensor]):
    from library.models.flux2.learned import VAE_CONFIG
    from library.models.flux3.model import Flux3Config, Flux3Transformer

    packed = 4 * VAE_CONFIG["latent_channels"]  # 2 x 2 patches of the VAE's latents
    return Flux3Transformer(Flux3Config(in_channels=packed, cond_in_channels=packed,
                                        context_in_dim=text["embeds"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    from library.models.flux3.checkpoint import save_flux3_bfl, save_flux3_diffusers
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_flux3_bfl, save_flux3_diffusers)


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "flux3-learned.safetensors"), ("ae", "vae"),
           ("text_encoder", "text_encoder")),
    config="quickstart_flux3.toml",
    **FLUX2_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # tests/test_learning.py's concept LoRA, measured (2026-12-01, the base at 194/216), 60 steps: 0/18 before, 13/18
    # after, 10 of 10 kept (training seeds 1, 2, 3: 14, 14, 13 after, 9 of 10 kept; 40 steps 11/18, 120 steps 12/18);
    # flipped flow target 0/18 (60 and 120 steps).
    learning_test=(60, 0.6, 0.7),
)
