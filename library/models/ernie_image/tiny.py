"""ERNIE-Image's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  ernie_image/ernie-image-tiny.safetensors   the transformer as a single file (diffusers' names, as released)
  ernie_image/transformer/                   the same weights as a diffusers ErnieImageTransformer2DModel folder
  ernie_image/text_encoder/                  transformers' Mistral3Model (a one-layer Pixtral tower, a Mistral
                                             language model of width lm_hidden with 3 layers: hidden_states[-2]
                                             is layer 2's output), as the pipeline folder holds Ministral 3
  ernie_image/tokenizer/                     its Mistral-style tokenizer (<s> added in front)

The VAE is FLUX.2's (flux2/vae, the same AutoencoderKLFlux2: 32 latent channels, 128 patchified). The transformer
takes the text encoder's width (text_in_dim = lm_hidden = 32 != its hidden 64: text_proj exists, as released).
Seed offsets 70-72 are this family's.
"""

from __future__ import annotations

import os

from library.models.tiny_files import TINY, seed_component

TEXT_LAYERS = 3  # hidden_states[-2] of 3 layers: the output of layer 2, before the final norm


def tiny_config():
    """width 64 = 2 heads x 32, RoPE axes (8, 12, 12), 2 blocks, MLP 128, text_in_dim lm_hidden."""
    from library.models.ernie_image.model import ErnieImageConfig

    return ErnieImageConfig(hidden_size=TINY["dit_hidden"], num_attention_heads=TINY["dit_heads"], num_layers=2,
                            ffn_hidden_size=2 * TINY["dit_hidden"], text_in_dim=TINY["lm_hidden"],
                            rope_axes_dim=TINY["axes"])


def random_ernie_image(config):
    """An ErnieImage as built (torch's Linear init: the shared modulation and the final layer are not zero, as
    diffusers initialises them, so every path shows) with its RMSNorm weights N(1, 0.1) (the released ones are
    learned), from torch's generator as seeded."""
    import torch

    from library.models.ernie_image.model import ErnieImage

    model = ErnieImage(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("_ln." in name or ".norm_" in name):
                p.normal_(1.0, 0.1)
    return model


def write_ernie_image(out: str, seed: int) -> dict[str, str]:
    """The transformer as a single file and as a diffusers folder (same weights)."""
    from library.models.ernie_image.checkpoint import save_ernie_image_diffusers, save_ernie_image_single_file

    root = os.path.join(out, "ernie_image")
    seed_component(seed, 70)
    config = tiny_config()
    model = random_ernie_image(config)
    single, folder = os.path.join(root, "ernie-image-tiny.safetensors"), os.path.join(root, "transformer")
    save_ernie_image_single_file(model, single)
    save_ernie_image_diffusers(model, config, folder)
    return {"ernie_image": single, "ernie_image_diffusers": folder}


def write_mistral3_text_encoder(folder: str, tok_folder: str, model_type: str = "mistral",
                                max_length: int | None = None) -> None:
    """text_encoder/ as ERNIE-Image's pipeline folder holds it (transformers Mistral3Model: a one-layer Pixtral
    tower, the projector and a TEXT_LAYERS-layer language model of width lm_hidden, head_dim 16 != width / heads,
    the released YaRN RoPE with llama_4_scaling_beta, tied embeddings) and its tokenizer (Mistral-style, <s> added;
    model_max_length `max_length` where given). The language model's weights are moved off their init (fresh norms
    are all ones, so the last layer and the final norm count), from torch's generator as seeded."""
    import torch
    from transformers import Mistral3Config, Mistral3Model

    from library.models.ernie_image.text_encoder import MINISTRAL_3_3B_TEXT_CONFIG
    from library.models.tiny_files import build_mistral_tokenizer, round_up, save_tokenizer

    tokenizer = build_mistral_tokenizer(("{}",))
    if max_length is not None:
        tokenizer.model_max_length = max_length
    h = TINY["lm_hidden"]
    text = {"model_type": model_type, "vocab_size": round_up(len(tokenizer)), "hidden_size": h,
            "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "intermediate_size": 2 * h, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
            "sliding_window": None, "tie_word_embeddings": True,
            "rope_parameters": dict(MINISTRAL_3_3B_TEXT_CONFIG["rope_parameters"]),
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "head_dim": 8, "patch_size": 14, "image_size": 56}
    model = Mistral3Model(Mistral3Config(text_config=text, vision_config=vision))
    with torch.no_grad():
        for p in model.language_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, tok_folder)


def write_ernie_image_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The pipeline folder's text side: text_encoder/ and tokenizer/ (write_mistral3_text_encoder)."""
    root = os.path.join(out, "ernie_image")
    folder, tok_folder = os.path.join(root, "text_encoder"), os.path.join(root, "tokenizer")
    seed_component(seed, 71)
    write_mistral3_text_encoder(folder, tok_folder)
    return {"ernie_image_text_encoder": folder, "ernie_image_tokenizer": tok_folder}
