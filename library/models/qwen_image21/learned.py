"""Qwen-Image-2.1's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type qwen_image21
trains it, learned/qwen_image21/ ships it): a Qwen-Image-2.1 transformer as the diffusers repo's transformer/ folder
(bf16); a VAE of the released AutoencoderKLQwenImage21 architecture (16x, RGBA in and out, the released 64 latent
channels) with small widths (32, 32, 32, 32, 64, 64: the released 96 ... 768), as the repo's vae/ folder in float32;
make_tiny_models' frozen tiny Qwen3-VL text encoder (tiny.py, seed 0) with the repo's processor/ beside it.

The VAE is spoken to in images while it learns (ImageQwen21VAE: a time axis of 1 added and dropped, as
QwenImage21VAE does at use): the scenes are opaque RGB, so encode appends the alpha plane +1 the pipeline feeds an
opaque picture as, and the pretrainer's loss asks the decoder for that alpha too (a diffusers user's picture comes
back opaque). The 64 px scenes are 4 x 4 latents: 16 image tokens (the family is unpatched), as the other bases' 16.

The transformer (DIT): width 128 = 4 heads of 32, RoPE axes (8, 12, 12), 4 blocks, MLP 3 x 128, text width the
tiny encoder's.
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKLQwenImage21

from library.models import spec as S
from library.models.qwen_image.learned import OneFrameImages, save_per_channel_vae

VAE_SIZES = dict(base_dim=32, decoder_base_dim=32, dim_mult=[1, 1, 1, 2, 2], num_res_blocks=1)  # widths 32 ... 64
DIT = dict(num_layers=4, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12))


def family(paths: dict[str, str]):
    from library.models.qwen_image21.family import QwenImage21Family

    return QwenImage21Family(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny.write_qwen_image21_text_encoder's text_encoder/ and processor/ (make_tiny_models' seed 0) moved into the
    base's folder, as the diffusers repo lays them out."""
    from library.models.qwen_image21.tiny import write_qwen_image21_text_encoder
    from library.models.tiny_files import place_written

    folder = os.path.dirname(paths["text_encoder"])
    place_written(write_qwen_image21_text_encoder, 0, {"qwen_image21_text_encoder": paths["text_encoder"],
                                                       "qwen_image21_processor": os.path.join(folder, "processor")})


class ImageQwen21VAE(OneFrameImages, AutoencoderKLQwenImage21):
    """The released class spoken to in images for pretraining (OneFrameImages): encode takes [B, 3 or 4, H, W] (an
    RGB batch gets the opaque alpha plane +1), decode gives [B, 4, H, W]. Saved as a plain AutoencoderKLQwenImage21."""

    def encode(self, x, return_dict=True):
        if x.shape[1] == 3:
            x = torch.cat((x, torch.ones_like(x[:, :1])), dim=1)
        return super().encode(x, return_dict)


def new_vae(image_size: int):
    return ImageQwen21VAE(**VAE_SIZES)


def save_vae(vae, paths: dict[str, str], diffusers: bool) -> None:
    """The repo's vae/ folder, float32 (`diffusers` changes nothing), its latents_mean / latents_std per channel
    (Qwen-Image's save_per_channel_vae)."""
    save_per_channel_vae(vae, paths["ae"], "AutoencoderKLQwenImage21")


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny QwenImage21 (float32, torch's init; its zero-centred text norm at 0, as torch's init leaves it),
    its text input text["embeds"]'s width."""
    from library.models.qwen_image21.model import QwenImage21, QwenImage21Config
    from library.models.qwen_image21.tiny import LATENT_CHANNELS

    return QwenImage21(QwenImage21Config(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
                                         context_in_dim=text["embeds"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released format is a diffusers folder already (bf16, as released)."""
    from library.models.qwen_image21.checkpoint import save_qwen_image21_diffusers

    weights = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_qwen_image21_diffusers(weights, model.config, paths["pretrained_model_name_or_path"])


_HERE = __name__ + ":"
LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "transformer"), ("ae", "vae"), ("text_encoder", "text_encoder")),
    new_vae=_HERE + "new_vae", save_vae=_HERE + "save_vae",
    config="quickstart_qwen_image21.toml",
    vae_lr=2e-3, vae_steps=3000, compile_vae=True,
    # tests/test_learning.py's concept LoRA, measured (2026-12-03, the base at 182/216, 2 threads), 60 steps: 0/18
    # before, 14/18 after, 10 of 12 kept.
    # Measured (2026-12-03, seed 0, 2 threads, the pretrainer's train_vae compiled; the 360 scenes decoded and read):
    # widths (32, 32, 32, 32, 64, 64) at 2e-3, 3000 steps (1428 s): loss 0.0056, colour 360, shape 351, position 360
    # of 360 (the shipped VAE); (16, 16, 16, 32, 64, 64) at 3e-3 (703 s): shape 155 (blurred corners: squares, stars
    # and triangles drawn as circles); (16, 16, 32, 64, 128, 128): 3e-3 stalled at loss 0.41, 1.5e-3 spiked at step
    # 1300 and ended at shape 148. The family's own draw (flux_shift at the scenes' 16 tokens) for the transformer:
    # 2000 steps (331 s wall) colour 100%, shape 84%, position 100%: 182 of 216 base prompts right.
)
