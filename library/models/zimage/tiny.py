"""Z-Image's part of the tiny real-format model set (tools/make_tiny_models.py, once the family is listed):

  zimage/transformer/                  ZImageTransformer2DModel diffusers folder (config.json + weights)
  zimage/zimage-tiny.safetensors       the same weights in the single-file layout (fused qkv, original
                                       names, as ComfyUI ships it), the config in its metadata
  zimage/text_encoder/                 Qwen3ForCausalLM (HF names, tied embeddings, explicit head_dim 16
                                       != hidden / heads), two shards + index.json, 4 layers (the
                                       pipeline reads layer 3's output, hidden_states[-2])
  zimage/tokenizer/                    its tokenizer, Qwen3's chat template in tokenizer_config.json

  zimage_omni/                         the Omni repo as ZImageOmniPipeline loads it: transformer/ (with the
                                       SigLIP branch), siglip/ (Siglip2VisionModel, 2 layers), siglip_processor/
                                       (Siglip2ImageProcessor, 8-pixel patches, at most 16), text_encoder/ +
                                       tokenizer/ (the Qwen3 above with Qwen's <|vision_start|> / <|vision_end|>),
                                       scheduler/, model_index.json; the VAE is FLUX.1's tiny one

The transformer's caption width is the text encoder's hidden size (TINY lm_hidden = 32), its latent
channels FLUX.1's VAE's (16). Seed offsets 20, 21 and 24 to 26 are this family's.
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
    folder, tok_folder = _write_qwen3(os.path.join(out, "zimage"), build_qwen3_tokenizer(), seed, 21)
    return {"zimage_text_encoder": folder, "zimage_tokenizer": tok_folder}


def _write_qwen3(root: str, tokenizer, seed: int, offset: int) -> tuple[str, str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from library.models.llm import LLMConfig

    seed_component(seed, offset)
    h = TINY["lm_hidden"]
    config = LLMConfig(vocab_size=round_up(len(tokenizer)), hidden_size=h, num_layers=TEXT_LAYERS, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=2 * h, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=40960)
    hf = {**config.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    folder, tok_folder = os.path.join(root, "text_encoder"), os.path.join(root, "tokenizer")
    os.makedirs(folder, exist_ok=True)
    save_sharded({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, folder)
    write_json(os.path.join(folder, "config.json"), hf)
    save_tokenizer(tokenizer, tok_folder)
    return folder, tok_folder


SIGLIP_HIDDEN = 24  # the tiny SigLIP's width = the tiny Omni transformer's siglip_feat_dim (1152 released)


def write_zimage_omni(out: str, seed: int) -> dict[str, str]:
    """A tiny Z-Image Omni repo in the layout ZImageOmniPipeline.from_pretrained reads (the VAE aside)."""
    import dataclasses

    from transformers import Siglip2ImageProcessor, Siglip2VisionConfig, Siglip2VisionModel

    from library.data.vlm_inputs import VISION_TOKENS
    from library.models.zimage.checkpoint import save_zimage_diffusers
    from library.models.zimage.omni import ZImageOmni

    root = os.path.join(out, "zimage_omni")
    seed_component(seed, 24)
    config = dataclasses.replace(tiny_config(), siglip_feat_dim=SIGLIP_HIDDEN)
    model = ZImageOmni(config)
    with torch.no_grad():  # learned pad tokens, not the fresh zeros
        for pad in (model.x_pad_token, model.cap_pad_token, model.siglip_pad_token):
            pad.normal_(0.0, 0.5)
    save_zimage_diffusers(model, config, os.path.join(root, "transformer"))

    seed_component(seed, 25)
    siglip = Siglip2VisionModel(Siglip2VisionConfig(hidden_size=SIGLIP_HIDDEN, intermediate_size=48, num_hidden_layers=2,
                                                    num_attention_heads=2, num_patches=16, patch_size=8))
    siglip.save_pretrained(os.path.join(root, "siglip"))
    Siglip2ImageProcessor(patch_size=8, max_num_patches=16).save_pretrained(os.path.join(root, "siglip_processor"))

    tokenizer = build_qwen3_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS[:2])})  # Qwen3's, as in its vocabulary
    _write_qwen3(root, tokenizer, seed, 26)
    os.makedirs(os.path.join(root, "scheduler"), exist_ok=True)
    write_json(os.path.join(root, "scheduler", "scheduler_config.json"),
               {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 6.0,
                "use_dynamic_shifting": False})
    write_json(os.path.join(root, "model_index.json"), {
        "_class_name": "ZImageOmniPipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "siglip": ["transformers", "Siglip2VisionModel"], "siglip_processor": ["transformers", "Siglip2ImageProcessor"]})
    return {"zimage_omni": root}


def write_sized_zimage(folder: str, hidden: int, depth: int, seed: int) -> str:
    """Z-Image at width `hidden` (heads of 128, RoPE axes (32, 48, 48)), 2 x `depth` main blocks and one
    refiner of each kind, random N(0, 0.02), the tiny text encoder's width: a single file in ComfyUI's
    layout with its config (the spec's TINY.sized)."""
    from library.models.tiny_files import random_init
    from library.models.zimage.checkpoint import save_zimage_single_file
    from library.models.zimage.model import ZImage, ZImageConfig

    config = ZImageConfig(in_channels=TINY["latent_channels"], dim=hidden, n_layers=2 * depth, n_refiner_layers=1,
                          n_heads=hidden // 128, cap_feat_dim=TINY["lm_hidden"])
    path = os.path.join(folder, "zimage_sized.safetensors")
    save_zimage_single_file(random_init(ZImage(config), seed), path, config)
    return path
