"""Chroma's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type chroma trains it,
learned/chroma/ ships it): a Chroma-architecture transformer as the released single file (BFL's names, bf16; its
config in the metadata); FLUX.1's learned VAE recipe (flux1/learned.py: the same AutoencoderKL in BFL's
ae.safetensors layout, its schedule and seed, so the pretrainer trains the same bytes as learned/flux/ae.safetensors
on the same CPU); make_tiny_models' frozen tiny T5 for Chroma (tiny.py, seed 0) with its tokenizer inside.
Captions are each caption's attended T5 prefix with Chroma's mask (the tokens, EOS and one padding token), as the
family caches them. Renders at guidance 1.0 take no negative prompt (true CFG off), as the base learned.

The transformer (DIT): FLUX.1's learned base's blocks (hidden 128 = 4 heads of 32, RoPE axes (8, 12, 12), 2 double-
and 2 single-stream blocks) without their modulation Linears; the approximator (the released 5 layers of 5120 over a
64-wide input) at 2 layers of 128, making the 3 x 2 + 12 x 2 + 2 = 32 modulation vectors.
"""

from __future__ import annotations

import torch

from library.models import spec as S
from library.models.flux1.learned import T5_TOKENS, VAE_RECIPE as FLUX1_VAE_RECIPE

DIT = dict(hidden_size=128, num_heads=4, depth=2, depth_single=2, axes_dim=(8, 12, 12), approximator_in_dim=64,
           approximator_hidden=128, approximator_layers=2)


def family(paths: dict[str, str]):
    from library.models.chroma.family import ChromaFamily

    return ChromaFamily(paths["pretrained_model_name_or_path"], paths["ae"], t5xxl=paths["t5xxl"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny.write_t5's T5 (make_tiny_models' seed 0, Chroma's own offset) with its tokenizer inside."""
    from library.models.tiny_files import write_t5_encoder

    write_t5_encoder(paths["t5xxl"], 0, 22)


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny Chroma (float32, torch's init), its text input T5 states of text["t5"]'s width."""
    from library.models.chroma.model import Chroma, ChromaConfig
    from library.models.tiny_files import TINY

    return Chroma(ChromaConfig(in_channels=4 * TINY["latent_channels"], context_in_dim=text["t5"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released single file (bf16, BFL's names); with `diffusers` also diffusers' transformer/ under diffusers/."""
    from library.models.chroma.checkpoint import save_chroma_bfl, save_chroma_diffusers
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_chroma_bfl, save_chroma_diffusers)


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "chroma-learned.safetensors"), ("ae", "ae.safetensors"),
           ("t5xxl", "t5xxl")),
    encode_kwargs=(("t5_max_length", T5_TOKENS),),
    config="quickstart_chroma.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-03, the base at 198/216), 60 steps: 0/18 before, 14/18
    # after, 10 of 11 kept.
    learning_test=(60, 0.5, 0.7),
    **FLUX1_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The family's own draw (flux_shift: mu 0.46 at the scenes' 16 tokens, ~x1.6) learns the layout: no dit_sampling
    # override. Measured (2026-12-03, seed 0, 2 threads, the VAE reused): 2000 steps (360 s wall) colour 100%, shape
    # 92%, position 100%: 198 of 216 base prompts right.
)
