"""ERNIE-Image's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type ernie_image trains
it, learned/ernie_image/ ships it): an ERNIE-Image-architecture transformer (hidden 128, 4 heads of 32, 4
single-stream layers, MLP 384 (the released 3x), RoPE axes (8, 12, 12): the released split of the head) as the
released single file (diffusers' names), bf16; FLUX.2's learned VAE recipe (flux2/learned.py: the released
AutoencoderKLFlux2 architecture with small channels, the same config and seed, so the pretrainer trains the same
weights as FLUX.2's on the same CPU), its latents' BatchNorm statistics set for the eps ERNIE-Image normalises with
(1e-5, vae.py); make_tiny_models' frozen tiny Mistral3 text encoder (seed 0) with its tokenizer. Captions are each
caption's own tokens with a mask, as the family caches them (no window, no padding to a length)."""

from __future__ import annotations

import os

import torch

from library.models import spec as S

DIT = dict(hidden_size=128, num_attention_heads=4, num_layers=4, ffn_hidden_size=384, rope_axes_dim=(8, 12, 12))


def family(paths: dict[str, str]):
    from library.models.ernie_image.family import ErnieImageFamily

    return ErnieImageFamily(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    from library.models.ernie_image.tiny import write_mistral3_text_encoder
    from library.models.tiny_files import seed_component

    folder = paths["text_encoder"]
    seed_component(0, 71)  # make_tiny_models' seed for it (write_ernie_image_text_encoder)
    write_mistral3_text_encoder(folder, os.path.join(os.path.dirname(folder), "tokenizer"))


def save_vae(vae, paths: dict[str, str], diffusers: bool) -> None:
    """flux2.learned.save_vae's folder with running_var = 1 / scale^2 - 1e-5: ErnieImagePipeline adds 1e-5 (not the
    config's batch_norm_eps 1e-4), so its latents come out with the pretrainer's mean 0 and std 1."""
    from library.models.ernie_image.vae import BN_EPS
    from library.models.flux2.learned import save_vae as save_flux2_vae

    save_flux2_vae(vae, paths, diffusers, bn_eps=BN_EPS)


def new_transformer(text: dict[str, torch.Tensor]):
    from library.models.ernie_image.model import ErnieImage, ErnieImageConfig
    from library.models.flux2.learned import VAE_CONFIG

    packed = 4 * VAE_CONFIG["latent_channels"]  # 2 x 2 patches of the VAE's latents
    return ErnieImage(ErnieImageConfig(in_channels=packed, out_channels=packed, text_in_dim=text["embeds"].shape[2],
                                       **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    from library.models.ernie_image.checkpoint import save_ernie_image_diffusers, save_ernie_image_single_file
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_ernie_image_single_file, save_ernie_image_diffusers)


_HERE, _FLUX2 = __name__ + ":", "library.models.flux2.learned:"
LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "ernie-image-learned.safetensors"), ("ae", "vae"),
           ("text_encoder", "text_encoder")),
    new_vae=_FLUX2 + "new_vae", save_vae=_HERE + "save_vae",
    config="quickstart_ernie_image.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-01, the base at 166/216), 120 steps: 0/18 before, 10/18
    # after, 8 of 10 kept (60 steps: 7/18, 9 of 10 kept); flipped 0/18.
    learning_test=(120, 0.4, 0.5),
)
