"""Z-Image's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type zimage trains it,
learned/zimage/ ships it): a Z-Image-architecture transformer as the released single file (ComfyUI's names: the
fused attention.qkv, bf16; its config in the metadata), which the family reads as Turbo (8 steps, no CFG, shift 3);
FLUX.1's learned VAE recipe (flux1/learned.py: the same AutoencoderKL in BFL's ae.safetensors layout, its schedule
and seed, so the pretrainer trains the same bytes as learned/flux/ae.safetensors on the same CPU); make_tiny_models'
frozen tiny Qwen3 text encoder (tiny.py, seed 0: width 32, 4 layers, of which the family reads hidden_states[-2])
with its byte-level tokenizer/ beside it. Captions are each caption's own Qwen3 states after the chat template,
with a mask, as the family caches them.

The transformer (DIT): width 128 = 4 heads of 32, RoPE axes (8, 12, 12) (the released quarter / 3/8 / 3/8 split of
the head: 32 / 48 / 48 of 128), 4 main layers and one noise / one context refiner (the released 30 and 2 each), the
SwiGLU diffusers' int(dim / 3 * 8) = 341, the caption width the tiny Qwen3's 32 (cap_feat_dim).
"""

from __future__ import annotations

import os

import torch

from library.models import spec as S
from library.models.flux1.learned import VAE_RECIPE as FLUX1_VAE_RECIPE

DIT = dict(dim=128, n_heads=4, n_layers=4, n_refiner_layers=1, axes_dims=(8, 12, 12))


def family(paths: dict[str, str]):
    from library.models.zimage.family import ZImageFamily

    return ZImageFamily(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny.write_zimage_text_encoder's text_encoder/ and tokenizer/ (make_tiny_models' seed 0) moved beside each
    other into the base's folder."""
    from library.models.tiny_files import place_written
    from library.models.zimage.tiny import write_zimage_text_encoder

    folder = os.path.dirname(paths["text_encoder"])
    place_written(write_zimage_text_encoder, 0, {"zimage_text_encoder": paths["text_encoder"],
                                                 "zimage_tokenizer": os.path.join(folder, "tokenizer")})


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny Z-Image (float32, torch's init: its pad tokens start at zero and learn), its caption embedder reading
    Qwen3 states of text["embeds"]'s width."""
    from library.models.tiny_files import TINY
    from library.models.zimage.model import ZImage, ZImageConfig

    return ZImage(ZImageConfig(in_channels=TINY["latent_channels"], cap_feat_dim=text["embeds"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released single file (bf16, ComfyUI's names); with `diffusers` also diffusers' transformer/ under
    diffusers/."""
    from library.models.tiny_files import save_learned_transformer
    from library.models.zimage.checkpoint import save_zimage_diffusers, save_zimage_single_file

    save_learned_transformer(model, paths, diffusers, save_zimage_single_file, save_zimage_diffusers)


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "zimage-learned.safetensors"), ("ae", "ae.safetensors"),
           ("text_encoder", "text_encoder")),
    config="quickstart_zimage.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-03, the base at 199/216), 60 steps: 0/18 before, 14/18
    # after, 9 of 11 kept.
    learning_test=(60, 0.5, 0.7),
    **FLUX1_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
)
