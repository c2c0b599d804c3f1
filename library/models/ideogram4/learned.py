"""Ideogram 4's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type ideogram4 trains it,
learned/ideogram4/ ships it): an Ideogram 4-architecture transformer as a diffusers folder (transformer/, bf16: the
released layout without BFL's fp8r / nvfp4 quantization, and without the unconditional transformer, which guidance
1.0 never runs); FLUX.2's learned VAE recipe (flux2/learned.py: the same AutoencoderKLFlux2, its schedule and seed,
so the pretrainer trains the same weights as learned/flux2/vae on the same CPU; its BatchNorm statistics are the
same for every token feature, so Ideogram 4's (ph, pw, c) order reads them as FLUX.2's does); make_tiny_models'
frozen tiny Qwen3-VL text encoder (tiny.py, seed 0: width 32, 4 layers, layers 0 and 3 tapped: Ideogram4Family.taps
for 64 features) with its tokenizer/ beside it. Captions are each caption's tapped states after the chat template,
with a mask, as the family caches them.

The transformer (DIT): width 128 = 2 heads of 64 with M-RoPE sections (6, 5, 5) (the released 18 heads of 256 over
(24, 20, 20): half of each head's frequencies, as here), 4 blocks (the released 34), the MLP 336 (about the released
8/3, a multiple of 16 as nvfp4's blocks want), adaLN width 64.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from library.models import spec as S
from library.models.flux2.learned import VAE_RECIPE as FLUX2_VAE_RECIPE

DIT = dict(num_layers=4, attention_head_dim=64, num_attention_heads=2, intermediate_size=336, adaln_dim=64,
           mrope_section=(6, 5, 5))


def family(paths: dict[str, str]):
    from library.models.ideogram4.family import Ideogram4Family
    from library.models.ideogram4.tiny import TINY_TEXT_FEATURES  # the tiny encoder's taps (0, 3) x its width

    path = paths["pretrained_model_name_or_path"]
    family = Ideogram4Family(path, paths["ae"], text_encoder=paths["text_encoder"])
    load_transformer = family.load_transformer

    def header_until_written(*args, **kwargs):
        """The pretrainer encodes before it writes the transformer; the taps read llm_features_dim from its header."""
        if os.path.exists(path):
            return load_transformer(*args, **kwargs)
        return SimpleNamespace(config=SimpleNamespace(llm_features_dim=TINY_TEXT_FEATURES))

    family.load_transformer = header_until_written
    return family


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny.write_ideogram4_text_encoder's text_encoder/ and tokenizer/ (make_tiny_models' seed 0) moved into the
    base's folder."""
    from library.models.ideogram4.tiny import write_ideogram4_text_encoder
    from library.models.tiny_files import place_written

    folder = os.path.dirname(paths["text_encoder"])
    place_written(write_ideogram4_text_encoder, 0, {"ideogram4_text_encoder": paths["text_encoder"],
                                                    "ideogram4_tokenizer": os.path.join(folder, "tokenizer")})


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny Ideogram 4 (float32, torch's init), its text input text["embeds"]'s tapped features."""
    from library.models.flux2.learned import VAE_CONFIG
    from library.models.ideogram4.model import Ideogram4, Ideogram4Config

    return Ideogram4(Ideogram4Config(in_channels=4 * VAE_CONFIG["latent_channels"],
                                     llm_features_dim=text["embeds"].shape[2], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released layout is a diffusers folder already (bf16 here); `diffusers` changes nothing."""
    from library.models.ideogram4.checkpoint import save_ideogram4_diffusers

    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_ideogram4_diffusers(sd, model.config, paths["pretrained_model_name_or_path"])


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "transformer"), ("ae", "vae"), ("text_encoder", "text_encoder")),
    config="quickstart_ideogram4.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-03, the base at 185/216), 120 steps: 0/18 before,
    # 13/18 after, 9 of 11 kept (60 steps: 5/18, 11 of 11 kept).
    learning_test=(120, 0.5, 0.5),
    **FLUX2_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The family's own law at the scenes' 64 px (expit(mu + 1.5 n), mu = 0.5 ln(64^2 / 512^2) = -2.08: a median sigma
    # of 0.11) draws few of the high-noise sigmas where a render's layout is decided: the "shift" draw at 3. Measured
    # (2026-12-03, seed 0, 2 threads, the VAE reused): 2000 steps (270 s wall) colour 99%, shape 86%, position 100%:
    # 185 of 216 base prompts right, rendered on the pipeline's own 8-step schedule at 64 px.
    dit_sampling="shift",
    dit_shift=3.0,
)
