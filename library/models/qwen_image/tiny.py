"""Qwen-Image's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  qwen_image/transformer/              diffusers QwenImageTransformer2DModel folder
  qwen_image/vae/                      AutoencoderKLQwenImage diffusers folder
  qwen_image/text_encoder/             Qwen2-style LM (HF Qwen2 names and config)
  qwen_image/tokenizer/                its tokenizer (chat-template special tokens; the Qwen-Image
                                       template prefix is exactly 34 tokens, as with Qwen2.5-VL's)
  qwen_image_edit/transformer/         Qwen-Image-Edit / Edit-2509 transformer (diffusers folder)
  qwen_image_edit/text_encoder/        Qwen2_5_VLForConditionalGeneration (vision tower + M-RoPE LM)
  qwen_image_edit/tokenizer/           its tokenizer (vision special tokens; edit template prefix = 64
                                       tokens, the pipelines' drop index, as with the real one)
  qwen_image_edit/processor/           Qwen2VLImageProcessor preprocessor_config.json + tokenizer
  qwen_image_edit_2511/transformer/    Edit-2511 transformer (zero_cond_t)
  qwen_image_layered/transformer/      Qwen-Image-Layered transformer (use_layer3d_rope, use_additional_t_cond)
  qwen_image_layered/vae/              its RGBA AutoencoderKLQwenImage (input_channels 4)

LM hidden == joint_attention_dim, 16 latent channels (64 packed).
"""

from __future__ import annotations

import os

from library.io import save_safetensors
from library.models.tiny_files import (
    TINY,
    build_qwen_tokenizer,
    round_up,
    save_tokenizer,
    save_vl_processor,
    seed_component,
    vision_token_ids,
    write_json,
    write_lm,
)


def build_edit_tokenizer():
    """The Qwen2.5-VL tokenizer of the Qwen-Image-Edit repos: vision special tokens, and the edit
    prompt template learnt whole (its system prefix is then 64 tokens, as with the real tokenizer)."""
    from library.models.qwen_image.edit_encoder import EDIT_PLUS_PROMPT_TEMPLATE

    return build_qwen_tokenizer(vision_templates=(EDIT_PLUS_PROMPT_TEMPLATE,))


def write_tiny_transformer(folder: str, **flags) -> None:
    """A tiny Qwen-Image transformer (diffusers folder) with a variant's config flags, drawn from torch's
    current seed (seed_component first)."""
    from library.models.qwen_image.model import QwenImage, QwenImageConfig, save_qwen_image_diffusers

    config = QwenImageConfig(
        in_channels=4 * TINY["latent_channels"], out_channels=TINY["latent_channels"], num_layers=2,
        attention_head_dim=sum(TINY["axes"]), num_attention_heads=TINY["dit_heads"],
        joint_attention_dim=TINY["lm_hidden"], axes_dims_rope=TINY["axes"], **flags,
    )
    save_qwen_image_diffusers(QwenImage(config).state_dict(), config, folder)


def write_tiny_vae(folder: str, **config) -> None:
    """A tiny AutoencoderKLQwenImage diffusers folder (config: constructor arguments of a variant)."""
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=TINY["latent_channels"], **config)
    os.makedirs(folder, exist_ok=True)
    saved = {k: v for k, v in vae.config.items() if not k.startswith("_")}  # "_use_default_values" is a set
    save_safetensors(vae.state_dict(), os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKLQwenImage", **saved})


def write_qwen_image(out: str, seed: int) -> dict[str, str]:
    seed_component(seed, 5)
    folder = os.path.join(out, "qwen_image", "transformer")
    write_tiny_transformer(folder)
    return {"qwen_image": folder}


def write_qwen_vae(out: str, seed: int) -> dict[str, str]:
    seed_component(seed, 6)
    folder = os.path.join(out, "qwen_image", "vae")
    write_tiny_vae(folder)
    return {"qwen_image_vae": folder}


def write_qwen_text_encoder(out: str, seed: int) -> dict[str, str]:
    folder, tok_folder = os.path.join(out, "qwen_image", "text_encoder"), os.path.join(out, "qwen_image", "tokenizer")
    write_lm(folder, build_qwen_tokenizer(), seed, 7, tok_folder)
    return {"qwen_image_text_encoder": folder, "qwen_image_tokenizer": tok_folder}


def write_qwen_image_edit(out: str, seed: int) -> dict[str, str]:
    """Qwen-Image-Edit transformers, each with its release's config.json flags: qwen_image_edit/
    (Edit and Edit-2509 share theirs) and qwen_image_edit_2511/ (zero_cond_t)."""
    from library.models.qwen_image.edit import EDIT, EDIT_2511, TRANSFORMER_FLAGS

    paths = {}
    for name, version, offset in (("qwen_image_edit", EDIT, 13), ("qwen_image_edit_2511", EDIT_2511, 14)):
        seed_component(seed, offset)
        paths[name] = folder = os.path.join(out, name, "transformer")
        write_tiny_transformer(folder, **TRANSFORMER_FLAGS[version])
    return paths


def write_qwen_image_layered(out: str, seed: int) -> dict[str, str]:
    """Qwen-Image-Layered: the transformer with its release's flags and the RGBA VAE (text encoder:
    Qwen-Image's)."""
    from library.models.qwen_image.layered import LAYERED_FLAGS, LAYERED_VAE_CONFIG

    folder, vae_folder = (os.path.join(out, "qwen_image_layered", part) for part in ("transformer", "vae"))
    seed_component(seed, 15)
    write_tiny_transformer(folder, **LAYERED_FLAGS)
    seed_component(seed, 16)
    write_tiny_vae(vae_folder, **LAYERED_VAE_CONFIG)
    return {"qwen_image_layered": folder, "qwen_image_layered_vae": vae_folder}


# A tiny Qwen2.5-VL vision tower: the real patch (14), temporal patch (2) and merge (2) sizes, so the
# real Qwen2VLImageProcessor settings apply; windowed blocks and one full-attention block.
TINY_VISION = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 14,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}
# The Qwen-Image-Edit processor's image settings (preprocessor_config.json), smaller pixel bounds.
TINY_IMAGE_PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64, "patch_size": 14, "merge_size": 2,
                        "temporal_patch_size": 2}


def write_qwen_vl_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The Qwen-Image-Edit text encoder, diffusers repo layout: text_encoder/ (a transformers
    Qwen2_5_VLForConditionalGeneration: vision tower + language model of width lm_hidden, M-RoPE
    sections (2, 3, 3) of head_dim 16), tokenizer/ and processor/ (Qwen2_5_VLProcessor with a
    Qwen2VLImageProcessor)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = build_edit_tokenizer()
    seed_component(seed, 12)
    h = TINY["lm_hidden"]
    text = {"vocab_size": round_up(len(tokenizer)), "hidden_size": h, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 2 * h, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = Qwen2_5_VLConfig(text_config=text, vision_config={**TINY_VISION, "out_hidden_size": h},
                              tie_word_embeddings=False, **vision_token_ids(tokenizer))
    model = Qwen2_5_VLForConditionalGeneration(config)
    root = os.path.join(out, "qwen_image_edit")
    folder = os.path.join(root, "text_encoder")
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, os.path.join(root, "tokenizer"))
    # processor/ as in the released repos: the image processor's and the tokenizer's files (building
    # a Qwen2_5_VLProcessor object would need torchvision for its video processor).
    processor = os.path.join(root, "processor")
    save_vl_processor(processor, TINY_IMAGE_PROCESSOR, "Qwen2_5_VLProcessor", tokenizer)
    return {"qwen_image_edit_text_encoder": folder, "qwen_image_edit_processor": processor}


def write_sized_qwen_image(folder: str, hidden: int, depth: int, seed: int) -> str:
    """Qwen-Image at width `hidden` (heads of 128, RoPE axes (16, 56, 56)), 2 x `depth` blocks, random
    N(0, 0.02), the tiny text encoder's width: a diffusers transformer folder (the spec's TINY.sized)."""
    from library.models.qwen_image.model import QwenImage, QwenImageConfig, save_qwen_image_diffusers
    from library.models.tiny_files import random_init

    config = QwenImageConfig(num_layers=2 * depth, num_attention_heads=hidden // 128,
                             joint_attention_dim=TINY["lm_hidden"])
    path = os.path.join(folder, "qwen_image_sized")
    save_qwen_image_diffusers(random_init(QwenImage(config), seed).state_dict(), config, path)
    return path
