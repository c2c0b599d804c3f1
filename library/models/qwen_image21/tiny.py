"""Qwen-Image-2.1's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  qwen_image21/transformer/                    diffusers QwenImage21Transformer2DModel folder
  qwen_image21/qwen_image21-tiny.safetensors   the same weights as the ComfyUI single file
                                               (`model.diffusion_model.`, img_mlp.gate_up fused)

The transformer's text width is the text encoders' (TINY lm_hidden = 32); latents enter unpatched with
the released 64 channels (the family's latent_channels), the tiny VAE's z_dim too. Seed offsets 50-59 are this family's.
"""

from __future__ import annotations

import os

import torch

from library.models.tiny_files import TINY, seed_component

LATENT_CHANNELS = 64  # the released VAE's z_dim (QwenImage21Family.latent_channels)


def tiny_config():
    """width 64 = 2 heads x 32, RoPE axes (8, 12, 12), 2 blocks, MLP 3 x 64, text width 32, 64 channels."""
    from library.models.qwen_image21.model import QwenImage21Config

    return QwenImage21Config(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=2,
        attention_head_dim=TINY["dit_hidden"] // TINY["dit_heads"], num_attention_heads=TINY["dit_heads"],
        context_in_dim=TINY["lm_hidden"], axes_dims_rope=TINY["axes"],
    )  # fmt: skip


def random_qwen_image21(config) -> "torch.nn.Module":
    """A QwenImage21 whose zero-centred norm weights are random too (the released ones are learned)."""
    from library.models.qwen_image21.model import QwenImage21

    model = QwenImage21(config)
    with torch.no_grad():
        model.txt_in.text_norm.weight.normal_(0.0, 0.1)
    return model


def write_qwen_image21(out: str, seed: int) -> dict[str, str]:
    """The transformer as a diffusers folder and as the ComfyUI single file, same weights."""
    from library.models.qwen_image21.checkpoint import save_qwen_image21_diffusers, save_qwen_image21_single_file

    seed_component(seed, 50)
    config = tiny_config()
    model = random_qwen_image21(config)
    root = os.path.join(out, "qwen_image21")
    paths = {"qwen_image21": os.path.join(root, "transformer"),
             "qwen_image21_comfy": os.path.join(root, "qwen_image21-tiny.safetensors")}
    save_qwen_image21_diffusers(model, config, paths["qwen_image21"])
    save_qwen_image21_single_file(model, paths["qwen_image21_comfy"], config)
    return paths


# Qwen3-VL's chat template, rendering plain and content-list messages (text, image) and the generation
# prompt as the released one does; the pipeline renders the system message with it for its drop count.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{- part.text }}"
    "{%- elif part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_qwen_image21_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The pipeline folder's text side as diffusers saves QwenImage21Pipeline: text_encoder/ (a transformers
    Qwen3VLForConditionalGeneration: a tiny vision tower (patch 16, merge 2) and a Qwen3 language model of
    width lm_hidden, 3 layers, head_dim 16, interleaved M-RoPE sections (2, 3, 3)) and processor/ (a
    Qwen3VLProcessor's files: Qwen2VLImageProcessor settings and the Qwen2-style tokenizer with the vision
    tokens, trained on the template, with the chat template above)."""
    from transformers import Qwen3VLForConditionalGeneration

    from library.models.qwen_image21.text_encoder import QWEN_IMAGE21_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor, tiny_qwen3_vl_config

    tokenizer = build_qwen_tokenizer(vision_templates=(QWEN_IMAGE21_TEMPLATE,))
    seed_component(seed, 51)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, 3, images=True))
    root = os.path.join(out, "qwen_image21")
    folder, processor_folder = os.path.join(root, "text_encoder"), os.path.join(root, "processor")
    model.save_pretrained(folder, safe_serialization=True)
    # processor/ as in the released repo: the image processor's and the tokenizer's files (building a
    # Qwen3VLProcessor object would need torchvision for its video processor), the chat template in
    # tokenizer_config.json.
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    save_vl_processor(processor_folder, {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                                         "min_pixels": 32 * 32, "max_pixels": 256 * 256}, "Qwen3VLProcessor", tokenizer)
    return {"qwen_image21_text_encoder": folder, "qwen_image21_processor": processor_folder}


def write_qwen_image21_vae(out: str, seed: int) -> dict[str, str]:
    """A tiny AutoencoderKLQwenImage21 folder: 16x spatial (four downsamplings), RGBA in and out,
    the released 64 latent channels with per-channel statistics (not 0 / 1, so the normalisation counts)."""
    from diffusers import AutoencoderKLQwenImage21

    seed_component(seed, 52)
    z = LATENT_CHANNELS
    g = torch.Generator().manual_seed(seed * 1000 + 52)
    mean = (torch.randn(z, generator=g) * 0.5).tolist()
    std = (torch.rand(z, generator=g) * 2 + 0.5).tolist()
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True, True], latents_mean=mean, latents_std=std)
    folder = os.path.join(out, "qwen_image21", "vae")
    vae.save_pretrained(folder, safe_serialization=True)
    return {"qwen_image21_vae": folder}
