"""Lumina Image 2.0's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type lumina2 trains it,
learned/lumina2/ ships it): a Lumina 2-architecture NextDiT as the released single file (the original names, no prefix,
bf16; its config in the metadata); FLUX.1's learned VAE recipe (flux1/learned.py: the same AutoencoderKL in BFL's
ae.safetensors layout, its schedule and seed, so the pretrainer trains the same bytes as learned/flux/ae.safetensors
on the same CPU); the tiny set's frozen Gemma 2 text encoder (tiny_text.py, seed 0: width 64, 3 layers, of which the
family runs 2 for hidden_states[-2]) with its Gemma-style tokenizer/ beside it. Captions are each caption's own
Gemma states after the pipeline's system prompt ('<system prompt> <Prompt Start> <caption>'), as the family caches
them: the tiny tokenizer learned those words whole (tiny_text.gemma_corpus), so no <unk> reaches the states.

The transformer (DIT): width 128 = 4 query heads of 32 sharing 2 key/value heads (grouped-query attention kept; the
released 24 / 8 is 3:1, which 4 heads of 32 cannot divide: 2:1, as Nucleus-Image's tiny base), RoPE (12, 10, 10)
(checkpoint.default_axes_dims of 32), SwiGLU 512 (4 x 128, a multiple of the released 256), 4 joint layers and one
noise / one context refiner (the released 26 and 2 each), the caption width the tiny Gemma's 64 (cap_feat_dim),
adaLN width 128 (min(dim, 1024), as released).
"""

from __future__ import annotations

import os

import torch

from library.models import spec as S
from library.models.flux1.learned import VAE_RECIPE as FLUX1_VAE_RECIPE

DIT = dict(dim=128, n_heads=4, n_kv_heads=2, n_layers=4, n_refiner_layers=1)


def family(paths: dict[str, str]):
    from library.models.lumina2.family import Lumina2Family

    return Lumina2Family(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny_text.write_lumina2_text_encoder's text_encoder/ and tokenizer/ (make_tiny_models' seed 0) moved beside
    each other into the base's folder (its ComfyUI single-file copy of the same weights dropped)."""
    from library.models.lumina2.tiny_text import write_lumina2_text_encoder
    from library.models.tiny_files import place_written

    folder = os.path.dirname(paths["text_encoder"])
    place_written(write_lumina2_text_encoder, 0, {"lumina2_text_encoder": paths["text_encoder"],
                                                  "lumina2_tokenizer": os.path.join(folder, "tokenizer")})


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny Lumina 2 (float32, torch's init), its caption embedder reading Gemma states of text["embeds"]'s
    width."""
    from library.models.lumina2.checkpoint import default_axes_dims
    from library.models.lumina2.model import Lumina2, Lumina2Config
    from library.models.tiny_files import TINY

    head_dim = DIT["dim"] // DIT["n_heads"]
    return Lumina2(Lumina2Config(in_channels=TINY["latent_channels"], cap_feat_dim=text["embeds"].shape[2],
                                 axes_dims=default_axes_dims(head_dim), **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released single file (bf16, the original names); with `diffusers` also diffusers' transformer/ under
    diffusers/."""
    from library.models.lumina2.checkpoint import save_lumina2_diffusers, save_lumina2_single_file
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_lumina2_single_file, save_lumina2_diffusers)


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "lumina2-learned.safetensors"), ("ae", "ae.safetensors"),
           ("text_encoder", "text_encoder")),
    config="quickstart_lumina2.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-02, the base at 193/216), 60 steps: 0/18 before, 15/18
    # after, 9 of 10 kept (training seeds 1, 2, 3: 11, 11, 14 after, 9 of 10 kept; 120 steps 10/18, 10 of 10 kept).
    learning_test=(60, 0.5, 0.7),
    **FLUX1_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The family's own draw (lumina2_shift, k = 6: sigmoid(randn) shifted to 6 s / (1 + 5 s)) already favours the
    # high-noise sigmas where a 16-token render's layout is decided: no dit_sampling override. Measured (2026-12-02,
    # seed 0, the VAE and encoders reused, 2 cores shared with other sessions): 2000 steps, 2 threads (the shipped
    # base; 304 s wall at a load of ~2) colour 100%, shape 90%, position 100%: 193 of 216 base prompts right; 1000
    # steps, 1 thread (364 s at a load of ~4-6) 187 of 216 (shape 87%).
)
