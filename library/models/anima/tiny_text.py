"""Anima's tiny text encoder files (tools/make_tiny_models.py, once the family lists the writer):

  anima/text_encoder/                  a transformers Qwen3Model as the pipeline's save_pretrained writes it
                                       (`layers.*` keys at the top, config.json naming Qwen3Model): width
                                       TEXT_WIDTH 64, 3 layers, 2 query heads and 1 key/value head of head_dim 16
                                       (explicit, != 64 / 2, as Qwen3-0.6B's 128 != 1024 / 16), tied embeddings,
                                       norm scales drawn (not all 1: the final norm's must show)
  anima/tokenizer/                     a Qwen2-style byte-level BPE (tiny_files.build_qwen3_tokenizer), no
                                       special token added, padding <|endoftext|>
  anima/t5_tokenizer/                  a T5-style tokenizer (tiny_files.build_t5_tokenizer: <pad> 0, </s> 1
                                       appended), 296 ids, within the adapter's 32128
  anima/qwen_3_06b_tiny.safetensors    the same weights as ComfyUI's single file holds Qwen3-0.6B
                                       (Qwen3ForCausalLM's `model.*` keys, no head, no config.json beside it)

The transformer's LLM adapter reads states of the text encoder's width: its tiny config's source width must be
TEXT_WIDTH (64; the released 1024). Seed offset 93 is this writer's.
"""

from __future__ import annotations

import os

import torch

TEXT_WIDTH = 64  # the tiny Qwen3's hidden size = the tiny LLM adapter's source width (released: 1024)
TEXT_LAYERS = 3


def tiny_qwen3_config(vocab_size: int):
    """LLMConfig of the tiny Qwen3 (module docstring), Qwen3-0.6B's RoPE theta and norm epsilon."""
    from library.models.llm import LLMConfig

    return LLMConfig(vocab_size=vocab_size, hidden_size=TEXT_WIDTH, num_layers=TEXT_LAYERS, num_heads=2, num_kv_heads=1,
                     head_dim=16, intermediate_size=2 * TEXT_WIDTH, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, qkv_bias=False, qk_norm=True, max_position_embeddings=32768)


def write_anima_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The text encoder in the pipeline repo's layout (text_encoder/ + tokenizer/ + t5_tokenizer/) and its weights
    as the ComfyUI single file, under out/anima/."""
    from transformers import Qwen3Config, Qwen3Model

    from library.io import save_safetensors
    from library.models.tiny_files import (
        build_qwen3_tokenizer, build_t5_tokenizer, round_up, save_tokenizer, seed_component, write_json,
    )

    root = os.path.join(out, "anima")
    paths = {"anima_text_encoder": os.path.join(root, "text_encoder"),
             "anima_tokenizer": os.path.join(root, "tokenizer"),
             "anima_t5_tokenizer": os.path.join(root, "t5_tokenizer"),
             "anima_qwen3_single_file": os.path.join(root, "qwen_3_06b_tiny.safetensors")}
    tokenizer = build_qwen3_tokenizer()
    seed_component(seed, 93)
    hf = {**tiny_qwen3_config(round_up(len(tokenizer))).to_hf(), "architectures": ["Qwen3Model"],
          "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    model = Qwen3Model(Qwen3Config(**{k: v for k, v in hf.items() if k != "architectures"}))
    with torch.no_grad():  # float32 weights (parity at 1e-5); drawn norm scales around 1
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
    weights = dict(model.state_dict())  # `embed_tokens.weight`, `layers.0...`, `norm.weight`: no `model.`
    save_safetensors(weights, os.path.join(paths["anima_text_encoder"], "model.safetensors"))
    write_json(os.path.join(paths["anima_text_encoder"], "config.json"), hf)
    save_safetensors({"model." + k: v for k, v in weights.items()}, paths["anima_qwen3_single_file"])
    save_tokenizer(tokenizer, paths["anima_tokenizer"])
    save_tokenizer(build_t5_tokenizer(), paths["anima_t5_tokenizer"])
    return paths
