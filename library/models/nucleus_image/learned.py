"""Nucleus-Image's learned tiny base (spec.LearnedBase; tools/pretrain_tiny_base.py --model_type nucleus_image trains
it, learned/nucleus_image/ ships it): a Nucleus-Image-architecture transformer WITH its mixture of experts, as the
released diffusers folder (transformer/, bf16); Qwen-Image's learned VAE recipe (qwen_image/learned.py: the released
AutoencoderKLQwenImage architecture with small channels, float32, its schedule and seed, so the pretrainer trains the
same weights as learned/qwen_image/vae on the same CPU); the tiny set's frozen Qwen3-VL text encoder (seed 0) with
the pipeline's processor/ beside it. Captions are each caption's own chat tokens with a mask, as the family caches
them.

The transformer (DIT): width 128 = 4 heads of 32 over 2 key-value heads (the released 4:1 grouping is 16:4; 2:1 keeps
two kv heads at this width), RoPE axes (8, 12, 12) (the released (16, 56, 56) split of a head, scaled), 4 blocks:
block 0 dense (the SwiGLU of int(128 x 4 x 2/3) // 128 x 128 = 256), blocks 1-3 mixtures of 8 experts with a shared
expert ("leave_first_block_dense": the released first three dense of 32 is too many of 4), each expert's inner 128.
The scenes are 64 px: 8 x 8 latents, a 4 x 4 grid = 16 image tokens per sample. Capacity factors (0, 4, 2, 2), the
released pattern's values (4 in the first MoE blocks, then 2): an expert takes ceil(f x 16 / 8) = 8, then 4 of the
16 tokens, so each token meets f experts on average (4, then 2), as in the released model at its 4096 tokens, and
the router must choose (a factor of 8 would give every expert every token). A token's routed width is then ~2-4 x
128 beside the shared expert's 128: about ERNIE-Image's tiny MLP (384). 2.16 M parameters, 1.18 M of them the packed
experts.

The packed experts are Parameters that NucleusImage (as diffusers' class) builds empty: new_transformer draws them as
nn.Linear draws its weight (uniform in +-1 / sqrt(fan_in), fan_in the middle axis: x @ W)."""

from __future__ import annotations

import math

import torch

from library.models import spec as S
from library.models.qwen_image.learned import VAE_RECIPE as QWEN_IMAGE_VAE_RECIPE

DIT = dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, num_key_value_heads=2,
           axes_dims_rope=(8, 12, 12), dense_moe_strategy="leave_first_block_dense", num_experts=8,
           moe_intermediate_dim=128, capacity_factors=(0, 4, 2, 2))


def family(paths: dict[str, str]):
    from library.models.nucleus_image.family import NucleusImageFamily

    return NucleusImageFamily(paths["pretrained_model_name_or_path"], paths["ae"], text_encoder=paths["text_encoder"])


def write_text_encoders(paths: dict[str, str]) -> None:
    import os

    from library.models.nucleus_image.tiny import write_qwen3_vl_encoder

    folder = paths["text_encoder"]
    write_qwen3_vl_encoder(folder, os.path.join(os.path.dirname(folder), "processor"), 0)  # make_tiny_models' seed


def new_transformer(text: dict[str, torch.Tensor]):
    from library.models.nucleus_image.model import NucleusImage, NucleusImageConfig
    from library.models.tiny_files import TINY

    packed = 4 * TINY["latent_channels"]  # 2 x 2 patches of the Qwen-Image VAE's 16 channels
    model = NucleusImage(NucleusImageConfig(in_channels=packed, out_channels=TINY["latent_channels"],
                                            joint_attention_dim=text["embeds"].shape[2], **DIT))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, fan_in, fan_out], built empty
                bound = 1.0 / math.sqrt(p.shape[1])
                p.uniform_(-bound, bound)
    return model


def save_transformer(model, paths: dict[str, str], diffusers: bool) -> None:
    """The released format is a diffusers folder already (bf16, as released); `diffusers` changes nothing."""
    from library.models.nucleus_image.checkpoint import save_nucleus_image_diffusers

    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_nucleus_image_diffusers(sd, model.config, paths["pretrained_model_name_or_path"])


LEARNED = S.LearnedBase(
    module=__name__,
    files=(("pretrained_model_name_or_path", "transformer"), ("ae", "vae"), ("text_encoder", "text_encoder")),
    config="quickstart_nucleus_image.toml",
    # tests/test_learning.py's concept LoRA, measured (2026-12-01, the base at 189/216), 120 steps: 0/18 before, 14/18
    # after, 9 of 11 kept (40 steps: 12/18, 7 of 11 kept; 60 steps: 16/18, 6 of 11 kept); flipped, 60 steps: 2/18.
    learning_test=(120, 0.5, 0.5),
    **QWEN_IMAGE_VAE_RECIPE,  # its VAE recipe whole: class, files, learning rate, steps, compiled loss
    # The transformer's sigmas: the sigmoid draw shifted by 3, not the family's default (nucleus_shift: the sigmoid draw
    # unshifted, as released at shift 1.0), which draws few of the high-noise sigmas where a 16-token render's layout
    # is decided. Measured (2026-12-01, 2000 steps, seed 0, 2 threads): unshifted 44 of 216 base prompts right
    # (position 34%), shifted by 3 189 of 216 (position 100%), in 142 s with the VAE reused.
    dit_sampling="shift",
    dit_shift=3.0,
)
