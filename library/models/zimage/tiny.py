"""Z-Image's part of the tiny real-format model set (tools/make_tiny_models.py, once the family is listed):

  zimage/transformer/                  ZImageTransformer2DModel diffusers folder (config.json + weights)
  zimage/zimage-tiny.safetensors       the same weights in the single-file layout (fused qkv, original
                                       names, as ComfyUI ships it), the config in its metadata
  zimage/text_encoder/                 Qwen3ForCausalLM (HF names, tied embeddings, explicit head_dim 16
                                       != hidden / heads), two shards + index.json, 4 layers (the
                                       pipeline reads layer 3's output, hidden_states[-2])
  zimage/tokenizer/                    its tokenizer, Qwen3's chat template in tokenizer_config.json

The transformer's caption width is the text encoder's hidden size (TINY lm_hidden = 32), its latent
channels FLUX.1's VAE's (16). Seed offsets 20 and 21 are this family's.
"""

from __future__ import annotations

import os

import torch

from library.models.tiny_files import (
    TINY, build_qwen3_tokenizer, round_up, save_sharded, save_tokenizer, seed_component, write_json,
)

TEXT_LAYERS = 4


def tiny_config():
    """dim 64 = 2 heads x 32, RoPE axes (8, 12, 12) (Z-Image's quarter / 3/8 / 3/8 split), 2 main layers."""
    from library.models.zimage.model import ZImageConfig

    return ZImageConfig(in_channels=TINY["latent_channels"], dim=TINY["dit_hidden"], n_layers=2, n_refiner_layers=2,
                        n_heads=TINY["dit_heads"], cap_feat_dim=TINY["lm_hidden"], axes_dims=TINY["axes"])


def write_zimage(out: str, seed: int) -> dict[str, str]:
    """The transformer as a diffusers folder and as a single file, same weights."""
    from library.models.zimage.checkpoint import save_zimage_diffusers, save_zimage_single_file
    from library.models.zimage.model import ZImage

    seed_component(seed, 20)
    config = tiny_config()
    model = ZImage(config)
    with torch.no_grad():  # released pad tokens are learned, not the fresh zeros
        model.x_pad_token.normal_(0.0, 0.5)
        model.cap_pad_token.normal_(0.0, 0.5)
    root = os.path.join(out, "zimage")
    paths = {"zimage_diffusers": os.path.join(root, "transformer"), "zimage": os.path.join(root, "zimage-tiny.safetensors")}
    save_zimage_diffusers(model, config, paths["zimage_diffusers"])
    save_zimage_single_file(model, paths["zimage"], config)
    return paths


def write_zimage_text_encoder(out: str, seed: int) -> dict[str, str]:
    """Qwen3 text encoder in the repo layout (text_encoder/ + tokenizer/), a transformers Qwen3ForCausalLM
    with Qwen3-4B's traits (tied embeddings, so no lm_head.weight in the files; explicit head_dim; QK norm)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from library.models.llm import LLMConfig

    tokenizer = build_qwen3_tokenizer()
    seed_component(seed, 21)
    h = TINY["lm_hidden"]
    config = LLMConfig(vocab_size=round_up(len(tokenizer)), hidden_size=h, num_layers=TEXT_LAYERS, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=2 * h, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=40960)
    hf = {**config.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    folder, tok_folder = os.path.join(out, "zimage", "text_encoder"), os.path.join(out, "zimage", "tokenizer")
    os.makedirs(folder, exist_ok=True)
    save_sharded({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, folder)
    write_json(os.path.join(folder, "config.json"), hf)
    save_tokenizer(tokenizer, tok_folder)
    return {"zimage_text_encoder": folder, "zimage_tokenizer": tok_folder}
