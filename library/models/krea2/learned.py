"""Krea 2's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type krea2 trains it,
learned/krea2/ ships it): a Krea 2-architecture transformer as the released single file (the original names, as
raw.safetensors, bf16; its config in the metadata) with the pipeline's model_index.json beside it (Raw: not
distilled, the tapped text layers); Qwen-Image's learned VAE recipe (qwen_image/learned.py: the same
AutoencoderKLQwenImage Krea 2 decodes with, its schedule and seed, so the pretrainer trains the same weights as
learned/qwen_image/vae on the same CPU); make_tiny_models' frozen tiny Qwen3-VL text encoder (tiny.py, seed 0: width
32, 4 layers, 3 of them tapped) with its tokenizer/ beside it. Captions are each caption's tapped states after the chat
template, with a mask, as the family caches them. Renders at guidance 1.0 take no negative prompt (CFG off).

The transformer (DIT): width 128 = 4 heads of 32 over 2 key-value heads (the released 48 over 12), RoPE axes (8, 12,
12) (the released (32, 48, 48) split of a head, scaled), 4 main blocks (the released 28), the MLP int(128 x 8/3) = 341
(the released 16384 over 6144), the text fusion's two layerwise and two refiner blocks as released at the tiny
encoder's width (2 heads, MLP 64).
"""

from __future__ import annotations

import os

import torch

from library.models import spec as S
from library.models.qwen_image.learned import VAE_RECIPE as QWEN_IMAGE_VAE_RECIPE

DIT = dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=341,
           text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64,
           axes_dims_rope=(8, 12, 12))


def family(paths: dict[str, str]):
    from library.models.krea2.family import Krea2Family

    return Krea2Family(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny.write_krea2_text_encoder's text_encoder/, tokenizer/ and model_index.json (make_tiny_models' seed 0) moved
    into the base's folder."""
    from library.models.krea2.tiny import write_krea2_text_encoder
    from library.models.tiny_files import place_written

    def with_index(out: str, seed: int) -> dict[str, str]:
        written = write_krea2_text_encoder(out, seed)
        return {**written, "model_index": os.path.join(out, "krea2", "model_index.json")}

    folder = os.path.dirname(paths["text_encoder"])
    place_written(with_index, 0, {"krea2_text_encoder": paths["text_encoder"],
                                  "krea2_tokenizer": os.path.join(folder, "tokenizer"),
                                  "model_index": os.path.join(folder, "model_index.json")})


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny Krea 2 (float32, torch's init), its text fusion reading text["embeds"]'s [N, T, taps, width]."""
    from library.models.krea2.model import Krea2, Krea2Config
    from library.models.tiny_files import TINY

    _, _, taps, width = text["embeds"].shape
    return Krea2(Krea2Config(in_channels=4 * TINY["latent_channels"], text_hidden_dim=width, num_text_layers=taps,
                             **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released single file (bf16, the original names); with `diffusers` also diffusers' transformer/ under
    diffusers/ (beside the VAE folder)."""
    from library.models.krea2.checkpoint import save_krea2_diffusers, save_krea2_single_file
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_krea2_single_file, save_krea2_diffusers)


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "krea2-learned.safetensors"), ("ae", "vae"),
           ("text_encoder", "text_encoder")),
    config="quickstart_krea2.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-03, the base at 184/216), 60 steps: 0/18 before, 15/18
    # after, 8 of 11 kept (120 steps the same). On the base drawn with the family's own law (176/216): 60 steps 8/18,
    # 6 of 11 kept; 120 steps 16/18, 9 of 11.
    learning_test=(60, 0.5, 0.6),
    **QWEN_IMAGE_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The family's own draw (krea2_shift: mu 0.48 at the scenes' 16 tokens, ~x1.6) left shapes at 81% (2000 steps,
    # 176 of 216 base prompts right); the "shift" draw at 3 gives more of the high-noise sigmas where a render's
    # layout is decided. Measured (2026-12-03, seed 0, 2 threads, quiet, the VAE reused): 2000 steps (327 s wall)
    # colour 100%, shape 85%, position 100%: 184 of 216 base prompts right (the shipped base).
    dit_sampling="shift",
    dit_shift=3.0,
)
