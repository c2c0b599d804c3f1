"""HunyuanImage-2.1's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type hunyuan_image
trains it, learned/hunyuan_image/ ships it): a HunyuanImage-2.1 transformer as Tencent's single file (its names,
bf16; its config in the metadata); a VAE of the family's own AutoencoderKLHunyuanImage kind, 16x with 64 latent
channels, as the diffusers repo's vae/ folder in float32; make_tiny_models' frozen tiny Qwen2.5-VL and byT5 (tiny_text,
seed 0) with their tokenizers. The scenes' captions quote nothing, so the glyph encoder runs on none of them.

The VAE is the family's class at 16x, not the release's 32x (diffusers' AutoencoderKLHunyuanImage takes any power of
2; the family reads it from the VAE's config): the shared 64 px scenes (tools/learned_base.IMAGE_SIZE) are 4 x 4
latents, 16 image tokens at patch 1, as the other learned bases' 16. At 32x they were 2 x 2 latents, and a 32x tiny
VAE (six levels, channels (32, 32, 32, 32, 64, 128), 3000 steps) reconstructed colour and position in 360 of 360
scenes but shapes in 122 (mostly blobs; bench/RESULTS.md). Channels (32, 32, 32, 64, 128): GroupNorm's 32 groups make
32 the floor of a level, the encoder head's 2 x 64 the last level's; no resnet in an encoder level (layers_per_block
0; the decoder still runs one a level). The family's latents are z * scaling_factor, no shift
(LearnedBase.latent_shift False).

The transformer (DIT): hidden 128 = 4 heads of 32, RoPE rows 16 + columns 16, 2 double- and 2 single-stream blocks,
1 text refiner block, byt5_in's hidden 64 (tiny.py's); text widths the tiny encoders' (64, 32).
"""

from __future__ import annotations

import os

import torch

from library.models import spec as S

VAE_SIZES = {"block_out_channels": [32, 32, 32, 64, 128], "layers_per_block": 0, "spatial_compression_ratio": 16}
DIT = dict(hidden_size=128, num_heads=4, depth=2, depth_single=2, refiner_depth=1, glyph_hidden=64, axes_dim=(16, 16))


def family(paths: dict[str, str]):
    from library.models.hunyuan_image.family import HunyuanImageFamily

    return HunyuanImageFamily(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"],
                              byt5=paths["byt5"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny_text's Qwen2.5-VL and byT5 folders with their tokenizers (make_tiny_models' seed 0) moved into the base's
    folder, as the diffusers repo lays them out (text_encoder/ + tokenizer/, text_encoder_2/ + tokenizer_2/)."""
    from library.models.hunyuan_image.tiny_text import write_hunyuan_image_text_encoders
    from library.models.tiny_files import place_written

    folder = os.path.dirname(paths["text_encoder"])
    place_written(write_hunyuan_image_text_encoders, 0, {
        "hunyuan_image_text_encoder": paths["text_encoder"],
        "hunyuan_image_tokenizer": os.path.join(folder, "tokenizer"),
        "hunyuan_image_glyph_encoder": paths["byt5"],
        "hunyuan_image_glyph_tokenizer": os.path.join(os.path.dirname(paths["byt5"]), "tokenizer_2")})


def new_vae(image_size: int):
    from diffusers import AutoencoderKLHunyuanImage

    from library.models.hunyuan_image.tiny_vae import tiny_vae_config

    return AutoencoderKLHunyuanImage(**{**tiny_vae_config(), **VAE_SIZES, "sample_size": image_size})


def save_vae(vae, paths: dict[str, str], diffusers: bool) -> None:
    """The diffusers repo's vae/ folder, float32 (`diffusers` changes nothing): its scaling_factor the pretrainer's,
    no shift (the format has none)."""
    from library.io import save_diffusers_folder

    config = {k: v for k, v in vae.config.items() if not k.startswith("_") and k != "shift_factor"}
    save_diffusers_folder({k: v.contiguous() for k, v in vae.state_dict().items()},
                          {"_class_name": "AutoencoderKLHunyuanImage", **config}, paths["ae"])


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny HunyuanImage (float32, torch's init), its text inputs text["embeds"]'s and text["glyph"]'s widths."""
    from library.models.hunyuan_image.model import HunyuanImage, HunyuanImageConfig

    return HunyuanImage(HunyuanImageConfig(text_dim=text["embeds"].shape[2], glyph_dim=text["glyph"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """Tencent's single file (bf16, its names); with `diffusers` also diffusers' transformer/ under diffusers/."""
    from library.models.hunyuan_image.checkpoint import save_hunyuan_image_diffusers, save_hunyuan_image_single_file
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_hunyuan_image_single_file, save_hunyuan_image_diffusers)


_HERE = __name__ + ":"
LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "hunyuan_image-learned.safetensors"), ("ae", "vae"),
           ("text_encoder", "text_encoder"), ("byt5", "text_encoder_2")),
    new_vae=_HERE + "new_vae", save_vae=_HERE + "save_vae",
    config="quickstart_hunyuan_image.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-03, the base at 180/216, 2 threads): 60 steps 0/18
    # before, 12/18 after, 5 of the 9 the base renders right kept (120 steps: 8/18, 7 of 9)
    learning_test=(60, 0.5, 0.4),
    # Measured (2026-12-03, seed 0, 2 quiet threads): the VAE 3000 steps at 3e-3 (736 s; 1.5e-3 for layers_per_block 1:
    # as good, twice the time; 3e-3 there diverged) reconstructs colour, shape and position in 346 of 360 scenes; the
    # family's own draw (shift 5) for the transformer: 2000 steps (316 s wall) colour 100%, shape 83%, position 100%:
    # 180 of 216 base prompts right
    latent_shift=False,
    vae_lr=3e-3, vae_steps=3000,
)
