"""SD3 / SD3.5's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type sd3 trains it,
learned/sd3/ ships it): an MMDiT as SAI's released single file (our names under "model.diffusion_model.", the
position table `pos_embed`, bf16, as sd3.5_large.safetensors); FLUX.1's learned VAE recipe (flux1/learned.py: the
same 16-channel AutoencoderKL in BFL's ae.safetensors layout, its schedule and seed, so the pretrainer trains the
same bytes as learned/flux/ae.safetensors on the same CPU); the tiny set's frozen CLIP-L, CLIP-G and T5
(sd3/tiny_text.py, seed 0) in the diffusers repo's layout (text_encoder/ + tokenizer/, text_encoder_2/ +
tokenizer_2/, text_encoder_3/ + tokenizer_3/). Captions are encoded as the family caches them: both CLIPs' 77 tokens
(hidden_states[-2], joined by channels to 64 = the tiny T5's width) then T5's T5_TOKENS; pooled: both CLIPs'
projected pooled outputs (32 + 32).

The VAE's normalisation: the file carries its own factors (the pretrainer's latent mean and 1 / std, in the
diffusers_config metadata), and SD3VAE (library/models/vae.py's KLVAE) takes a file's config over its default
(the released 1.5305 / 0.0609): caching (encode) and sampling (decode) both use the file's pair, so latents have mean 0
and std 1 as the released factors aim to, and the two directions agree.

The transformer (DIT): width 128 = 2 heads of 64 (SD3's heads are always 64 wide), MLP ratio 4, 4 joint blocks (the
last one's text stream pre-only, as released), block 0 MMDiT-X (x_block.attn2, as SD3.5-Medium's first 13 of 24), qk
RMSNorm (SD3.5), a 32 x 32 position table (released 192 or 384; 256 px a side, 8x the scenes' 4 x 4 grid); the
context width the tiny T5's 64, the pooled width 64. torch's init (the qk-norm weights ones). 2,409,280 parameters
(the file's 131,072-value position table aside): 5.1 MB in bf16.
"""

from __future__ import annotations

import os

import torch

from library.models import spec as S
from library.models.flux1.learned import VAE_RECIPE as FLUX1_VAE_RECIPE

DIT = dict(depth=4, hidden_size=128, pos_embed_max_size=32, qk_norm=True, dual_attention_layers=(0,))
T5_TOKENS = 48  # the tiny T5's sequence (FLUX.1's learned base's): the longest scene caption has 34 tokens
TEXT_FOLDERS = {"sd3_clip_l": "text_encoder", "sd3_tokenizer": "tokenizer", "sd3_clip_g": "text_encoder_2",
                "sd3_tokenizer_2": "tokenizer_2", "sd3_t5xxl": "text_encoder_3", "sd3_tokenizer_3": "tokenizer_3"}


def family(paths: dict[str, str]):
    from library.models.sd3.family import SD3Family

    return SD3Family(paths["pretrained_model_name_or_path"], paths["ae"], clip_l=paths["clip_l"],
                     clip_g=paths["clip_g"], t5xxl=paths["t5xxl"])


def write_text_encoders(paths: dict[str, str]) -> None:
    """tiny_text.write_sd3_text_encoders' repo folders (make_tiny_models' seed 0) moved into the base's folder (its
    single-file and full-checkpoint copies of the same weights dropped)."""
    from library.models.sd3.tiny_text import write_sd3_text_encoders
    from library.models.tiny_files import place_written

    folder = os.path.dirname(paths["clip_l"])
    place_written(write_sd3_text_encoders, 0, {key: os.path.join(folder, name) for key, name in TEXT_FOLDERS.items()})


def new_transformer(text: dict[str, torch.Tensor]):
    """The tiny MMDiT (float32, torch's init), its context and pooled embedders of text["context"]'s and
    text["pooled"]'s widths."""
    from library.models.sd3.model import SD3, SD3Config

    return SD3(SD3Config(context_dim=text["context"].shape[2], pooled_dim=text["pooled"].shape[1], **DIT))


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """SAI's single file (bf16, "model.diffusion_model.", pos_embed; our config in the metadata); with `diffusers`
    also diffusers' transformer/ under diffusers/."""
    from library.models.sd3.checkpoint import save_sd3_diffusers, save_sd3_single_file
    from library.models.tiny_files import save_learned_transformer

    save_learned_transformer(model, paths, diffusers, save_sd3_single_file, save_sd3_diffusers)


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "sd3-learned.safetensors"), ("ae", "ae.safetensors"),
           ("clip_l", "text_encoder"), ("clip_g", "text_encoder_2"), ("t5xxl", "text_encoder_3")),
    encode_kwargs=(("t5_max_length", T5_TOKENS),),
    config="quickstart_sd3.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-02, the 1000-step base at 169/216), 60 steps: 0/18
    # before, 16/18 after, 8 of 10 kept (training seeds 1, 2, 3: 11, 15, 12 after, 8, 8, 9 of 10 kept; 120 steps 17/18,
    # 8 of 10 kept).
    learning_test=(60, 0.5, 0.7),
    **FLUX1_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The family's own draw (sd3_shift, k = 3: sigmoid(randn) shifted to 3 s / (1 + 2 s), Anima's draw) favours the
    # high-noise sigmas where a 16-token render's layout is decided: no dit_sampling override. Measured (2026-12-02,
    # seed 0, the VAE and encoders reused, 2 cores shared with other sessions at a load of 5-10): 1000 steps, 1 thread
    # (the shipped base; 827 s wall, 406 s CPU) colour 100%, shape 78%, position 100%: 169 of 216 base prompts right.
    # A 2000-step run on 2 threads under that load ran 1.9 s a step (~1 s on 1 thread) and was stopped at step 130.
)
