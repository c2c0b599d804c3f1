"""FLUX.2's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  flux2/text_encoder/                  [klein] text encoder: Qwen3ForCausalLM (HF names, tied
                                       embeddings, explicit head_dim), two shards + index.json
  flux2/tokenizer/                     its tokenizer, with a Qwen3-style chat template in
                                       tokenizer_config.json (enable_thinking=False -> empty <think>)
  flux2/flux2-tiny.safetensors         [klein]-like transformer (no guidance_in), BFL single file
  flux2/transformer/                   the same weights as a diffusers Flux2Transformer2DModel folder
  flux2/flux2-dev-tiny.safetensors     [dev]-like transformer (guidance_in), BFL single file
  flux2/vae/                           AutoencoderKLFlux2 diffusers folder (32 latent channels, BatchNorm
                                       statistics set away from 0 / 1 so that normalisation is seen)
  flux2/dev/text_encoder/              [dev] text encoder: Mistral3ForConditionalGeneration (tiny Pixtral
                                       tower + Mistral LM, released `language_model.model.*` keys, 31 layers)
  flux2/dev/tokenizer/                 its Mistral-style tokenizer (<s> added, <pad>) with a chat template

The text encoders stack 3 hidden states of width lm_hidden (joint_attention_dim 3 x 32 = 96).
"""

from __future__ import annotations

import os

import torch

from library.io import save_safetensors
from library.models.flux2 import spec
from library.models.tiny_files import (
    TINY,
    build_mistral_tokenizer,
    build_qwen3_tokenizer,
    round_up,
    save_sharded,
    save_tokenizer,
    seed_component,
    write_json,
)

LATENT_CHANNELS = dict(spec.TINY.dims)["flux2_latent_channels"]  # AutoencoderKLFlux2's


def write_qwen3_text_encoder(out: str, seed: int) -> dict[str, str]:
    """FLUX.2 [klein] text encoder (diffusers repo layout text_encoder/ + tokenizer/) in out/flux2."""
    folder, tok_folder = os.path.join(out, "flux2", "text_encoder"), os.path.join(out, "flux2", "tokenizer")
    write_klein_text_encoder(folder, tok_folder, seed)
    return {"flux2_text_encoder": folder, "flux2_tokenizer": tok_folder}


def write_klein_text_encoder(folder: str, tok_folder: str, seed: int) -> None:
    """A transformers Qwen3ForCausalLM with 28 layers, so that the pipeline's hidden layers 9, 18, 27 exist;
    head_dim 16 != hidden / heads (8) and tied embeddings, as in Qwen3-4B (whose files have no lm_head.weight);
    its tokenizer in tok_folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from library.models.llm import LLMConfig

    tokenizer = build_qwen3_tokenizer()
    seed_component(seed, 9)
    h = TINY["lm_hidden"]
    config = LLMConfig(vocab_size=round_up(len(tokenizer)), hidden_size=h, num_layers=28, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=2 * h, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=40960)
    hf = {**config.to_hf(), "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id}
    model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    os.makedirs(folder, exist_ok=True)
    save_sharded({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, folder)
    write_json(os.path.join(folder, "config.json"), hf)
    save_tokenizer(tokenizer, tok_folder)


def write_flux2(out: str, seed: int) -> dict[str, str]:
    """FLUX.2 transformers: [klein]-like (BFL file + diffusers folder, same weights) and [dev]-like
    (BFL file). 32 latent channels (128 packed); context = 3 stacked text-encoder layers of lm_hidden."""
    from library.models.flux2.checkpoint import save_flux2_bfl, save_flux2_diffusers
    from library.models.flux2.model import Flux2, Flux2Config

    paths = {}
    for name, guidance, offset in (("flux2-tiny", False, 10), ("flux2-dev-tiny", True, 11)):
        seed_component(seed, offset)
        head_dim = TINY["dit_hidden"] // TINY["dit_heads"]
        config = Flux2Config(
            in_channels=4 * LATENT_CHANNELS, context_in_dim=3 * TINY["lm_hidden"], hidden_size=TINY["dit_hidden"],
            num_heads=TINY["dit_heads"], depth=2, depth_single=2, axes_dim=(head_dim // 4,) * 4, guidance_embed=guidance,
        )
        model = Flux2(config)
        paths[name.replace("-", "_")] = bfl = os.path.join(out, "flux2", f"{name}.safetensors")
        save_flux2_bfl(model, bfl, config)
        if not guidance:
            paths["flux2_diffusers"] = folder = os.path.join(out, "flux2", "transformer")
            save_flux2_diffusers(model, config, folder)
    return paths


def write_flux2_vae(out: str, seed: int) -> dict[str, str]:
    from diffusers import AutoencoderKLFlux2

    seed_component(seed, 12)
    config = {"block_out_channels": [8, 16, 16, 16], "norm_num_groups": 4, "layers_per_block": 1, "sample_size": 64,
              "latent_channels": LATENT_CHANNELS}
    vae = AutoencoderKLFlux2(**config)
    with torch.no_grad():  # released statistics are far from the fresh (0, 1): make the tiny ones so too
        vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.2 + torch.rand_like(vae.bn.running_var))
    folder = os.path.join(out, "flux2", "vae")
    os.makedirs(folder, exist_ok=True)
    save_safetensors(vae.state_dict(), os.path.join(folder, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    full = {k: list(v) if isinstance(v, tuple) else v for k, v in vae.config.items() if not k.startswith("_")}
    write_json(os.path.join(folder, "config.json"), {"_class_name": "AutoencoderKLFlux2", **full})
    return {"flux2_vae": folder}


def write_flux2_dev_text_encoder(out: str, seed: int) -> dict[str, str]:
    """FLUX.2 [dev] text encoder (repo layout flux2/dev/text_encoder/ + tokenizer/): a transformers
    Mistral3ForConditionalGeneration (tiny Pixtral tower + projector + Mistral language model) saved
    by save_pretrained, whose keys are the released `language_model.model.*` layout; 31 layers so that
    the pipeline's hidden layers 10, 20, 30 exist, head_dim 16 != hidden / heads (8), untied head."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from library.models.flux2.dev_text_encoder import DEV_SYSTEM_MESSAGE

    tokenizer = build_mistral_tokenizer(("{}", DEV_SYSTEM_MESSAGE + " {}"))
    seed_component(seed, 13)
    h = TINY["lm_hidden"]
    text = {"model_type": "mistral", "vocab_size": round_up(len(tokenizer)), "hidden_size": h, "num_hidden_layers": 31,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": h,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000000.0, "sliding_window": None, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 11}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8,
              "patch_size": 14, "image_size": 56}
    model = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False))
    with torch.no_grad():  # init leaves <pad>'s row (padding_idx) at 0; released rows are not, and pad rows are kept
        model.get_input_embeddings().weight[11].normal_(0.0, 0.02)
    root = os.path.join(out, "flux2", "dev")
    folder, tok_folder = os.path.join(root, "text_encoder"), os.path.join(root, "tokenizer")
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, tok_folder)
    return {"flux2_dev_text_encoder": folder, "flux2_dev_tokenizer": tok_folder}
