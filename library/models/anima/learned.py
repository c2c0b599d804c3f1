"""Anima's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type anima trains it,
learned/anima/ ships it): an Anima-architecture transformer (the Cosmos-Predict2 DiT with its LLM adapter) as the
released single file (the "net." prefix, the original names, bf16; its config in the metadata); Qwen-Image's
learned VAE recipe (qwen_image/learned.py: the same AutoencoderKLQwenImage class Anima decodes with, its schedule
and seed, so the pretrainer trains the same weights as learned/qwen_image/vae on the same CPU); the tiny set's
frozen Qwen3 text encoder (tiny_text.py, seed 0) with its Qwen2 tokenizer/ and T5 t5_tokenizer/ beside it.
Captions are each caption's own Qwen3 states and T5 ids with their masks, as the family caches them.

The transformer (DIT): the DiT at width 128 = 4 heads of 32 (3-D RoPE (12, 10, 10): the released head_dim // 6 * 2
per spatial axis), 4 blocks, adaLN-LoRA rank 64 (the released 256 of 2048 is 1/8; 64 of 128 keeps the low-rank
pair from being a 16-wide bottleneck), MLP x4 as released. The adapter: 2 blocks of width 64 (2 heads of 32) reading
the text encoder's width 64 (tiny_text.TEXT_WIDTH), cross-attention width (text_dim) 64. The T5 embedding keeps
the released vocabulary (32128 rows: the loader reads the vocabulary from the shape, and any T5 tokenizer's ids fit)
at text_dim 64: 32128 x 64 bf16 = 4.1 MB, most of the file (width 128 would double it to 8.2 MB for rows the tiny
T5 tokenizer's 296 ids never reach). The adapter's output is zero-padded to 64 tokens (min_text_len; released
512, stored in the file's metadata config, which our loader reads): the DiT's unmasked cross-attention reads the
zero tokens as released, 64 - ~15 of them here. At 512 the zero keys were most of a pretraining step's cost
(measured, batch 32, eager, 2 threads under a load of ~8: forward + backward 19-27 s at 512, 4-6 s at 64; the
compiled run at 512 took ~2 s a step, 2000 steps over an hour) for a scene caption of at most ~20 T5 tokens.
"""

from __future__ import annotations

import os

import torch

from library.models import spec as S
from library.models.qwen_image.learned import VAE_RECIPE as QWEN_IMAGE_VAE_RECIPE

DIT = dict(hidden_size=128, num_heads=4, num_blocks=4, adaln_lora_dim=64, text_dim=64, adapter_layers=2,
           adapter_dim=64, adapter_heads=2, min_text_len=64)


def family(paths: dict[str, str]):
    from library.models.anima.family import AnimaFamily

    return AnimaFamily(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny_text.write_anima_text_encoder's text_encoder/, tokenizer/ and t5_tokenizer/ (make_tiny_models' seed 0)
    moved beside each other into the base's folder (its ComfyUI single-file copy of the same weights dropped)."""
    from library.models.anima.tiny_text import write_anima_text_encoder
    from library.models.tiny_files import place_written

    folder = os.path.dirname(paths["text_encoder"])
    place_written(write_anima_text_encoder, 0, {"anima_text_encoder": paths["text_encoder"],
                                                "anima_tokenizer": os.path.join(folder, "tokenizer"),
                                                "anima_t5_tokenizer": os.path.join(folder, "t5_tokenizer")})


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny Anima (float32, torch's init), its adapter reading Qwen3 states of text["qwen"]'s width."""
    from library.models.anima.model import Anima, AnimaConfig
    from library.models.tiny_files import TINY

    channels = TINY["latent_channels"]  # the Qwen-Image VAE's 16
    return Anima(AnimaConfig(in_channels=channels, out_channels=channels, adapter_source_dim=text["qwen"].shape[2],
                             **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released single file (bf16, "net."); with `diffusers` also the pipeline's transformer/ and
    text_conditioner/ under diffusers/."""
    from library.models.anima.checkpoint import save_anima_diffusers, save_anima_single_file
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_anima_single_file, save_anima_diffusers, "")


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "anima-learned.safetensors"), ("ae", "vae"),
           ("text_encoder", "text_encoder")),
    config="quickstart_anima.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-02, the base at 187/216), 120 steps: 2/18 before, 14/18
    # after, 9 of 9 kept (60 steps: 15/18, 6 of 9 kept). The bf16 base renders 2 of the 18 trigger prompts as a purple
    # star before (its two at seed 42; the fp8_scaled base 0 of 18).
    learning_test=(120, 0.5, 0.5),
    before_at_most=2 / 18,
    **QWEN_IMAGE_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The family's own draw (anima_shift, k = 3: time_shift(ln 3) of the sigmoid draw, s' = 3 s / (1 + 2 s)) is the
    # "shift" draw at 3 that Nucleus-Image's base needed: no override. Measured (2026-12-01, seed 0, 2 threads under
    # a load of ~6 then ~2, the VAE reused): 2000 steps (the shipped base; 718 s wall) colour 100%, shape 87%,
    # position 100%: 187 of 216 base prompts right; 1000 steps (1183 s under the load) 130 of 216 (shape 62%).
)
