"""HiDream-I1's tiny text encoder files (tools/make_tiny_models.py, once the family lists the writer), in the diffusers
repo's layout (HiDream-ai/HiDream-I1-Full's text_encoder*/ + tokenizer*/), meta-llama/Llama-3.1-8B-Instruct's
transformers folder and ComfyUI's single files:

  hidream/text_encoder/ + tokenizer/      CLIP-L: transformers' CLIPTextModelWithProjection, width CLIP_WIDTH 32,
                                          projection 32, 2 layers of 2 heads, quick_gelu, CLIP_POSITIONS 248
                                          positions (Long-CLIP's: the pipeline feeds 128 tokens); the CLIP-style
                                          tokenizer padding with "<|endoftext|>"
  hidream/text_encoder_2/ + tokenizer_2/  CLIP-G: the same shapes with gelu; the tokenizer padding with "!" (id 0), as
                                          SD3's / SDXL's tokenizer_2/ (the pooled EOT state does not depend on it)
  hidream/text_encoder_3/ + tokenizer_3/  T5: T5EncoderModel of d_model T5_WIDTH 64 (tiny_files.write_t5_encoder), its
                                          T5-style tokenizer
  hidream/llama/                          Llama 3.1: transformers' LlamaForCausalLM of width LLAMA_WIDTH 64,
                                          LLAMA_LAYERS 3, 2 query heads and 1 key/value head of Llama-3.1-8B's
                                          head_dim 128 (a single file's shapes cannot tell head_dim, so it is the
                                          released one), its rope_theta 500000 and llama3 rope_scaling (factor 8,
                                          low 1, high 4, original 8192: the low frequencies scaled), eps 1e-5, the
                                          released shard layout (2 shards + index), and a Llama-3-style tokenizer
                                          (build_llama3_tokenizer) in the folder
  hidream/text_encoders/clip_l_hidream.safetensors       ComfyUI's single files (`text_model.*` +
  hidream/text_encoders/clip_g_hidream.safetensors       `text_projection.weight`; T5's `shared.weight` + `encoder.*`;
  hidream/text_encoders/t5xxl.safetensors                Llama's `model.*` + `lm_head.weight`), float32, no config or
  hidream/text_encoders/llama_3.1_8b_instruct.safetensors  tokenizer inside: the CLIPs' and T5's come from the repo
                                                          folders beside text_encoders/, Llama's tokenizer is given

The tiny transformer takes t5_dim T5_WIDTH (64; released 4096), llama_dim LLAMA_WIDTH (64; released 4096), pooled_dim
2 * CLIP_WIDTH (64; released 2048) and llama_layers LLAMA_LAYERS (3; released 32). Seed offsets 132 (CLIP-L),
133 (CLIP-G), 134 (T5), 135 (Llama) are this writer's; 136 is kept for it. Weights are float32 (parity at 1e-5).
"""

from __future__ import annotations

import os

import torch

CLIP_WIDTH = 32
CLIP_POSITIONS = 248
T5_WIDTH = 64
LLAMA_WIDTH = 64
LLAMA_LAYERS = 3
LLAMA_HEAD_DIM = 128  # Llama-3.1-8B's (llama_config_from_shapes reads a single file with it)
# Llama 3's special tokens that a prompt run meets, after the learned vocabulary as in the released tokenizer.json
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def build_llama3_tokenizer():
    """Llama-3-style: byte-level BPE, LLAMA3_SPECIALS after it, <|begin_of_text|> prepended, no eos appended, eos
    <|eot_id|> (Llama-3.1-Instruct's tokenizer_config.json), no pad token (the pipeline pads with eos)."""
    from tokenizers import decoders, pre_tokenizers, processors

    from library.models.tiny_files import fast_tokenizer, train_bpe

    tok = train_bpe(384, pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    tok.add_special_tokens(list(LLAMA3_SPECIALS))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    return fast_tokenizer(tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", model_max_length=131072)


def tiny_llama_config(tokenizer):
    """transformers' LlamaConfig of the tiny Llama 3.1 (module docstring), its ids the tokenizer's."""
    from transformers import LlamaConfig

    from library.models.hidream.text_encoder import LLAMA3_1_8B
    from library.models.tiny_files import round_up

    return LlamaConfig(
        vocab_size=round_up(len(tokenizer)), hidden_size=LLAMA_WIDTH, intermediate_size=2 * LLAMA_WIDTH,
        num_hidden_layers=LLAMA_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=LLAMA_HEAD_DIM,
        rope_theta=LLAMA3_1_8B.rope_theta, rms_norm_eps=LLAMA3_1_8B.rms_norm_eps,
        max_position_embeddings=LLAMA3_1_8B.max_position_embeddings, rope_scaling=LLAMA3_1_8B.rope_scaling.to_hf(),
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def write_llama(folder: str, seed: int) -> dict[str, torch.Tensor]:
    """The tiny Llama 3.1 as a transformers folder (2 shards + index, config.json, its tokenizer); returns the weights
    (`model.*` + `lm_head.weight`)."""
    from transformers import LlamaForCausalLM

    from library.models.tiny_files import save_sharded, save_tokenizer, seed_component, write_json

    tokenizer = build_llama3_tokenizer()
    seed_component(seed, 135)
    config = tiny_llama_config(tokenizer)
    model = LlamaForCausalLM(config)  # float32, weights N(0, 0.02)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    os.makedirs(folder, exist_ok=True)
    save_sharded(weights, folder)
    write_json(os.path.join(folder, "config.json"), {"architectures": ["LlamaForCausalLM"], **config.to_dict()})
    save_tokenizer(tokenizer, folder)
    return weights


def write_hidream_text_encoders(out: str, seed: int) -> dict[str, str]:
    """The four text encoders under out/hidream/ in each layout (module docstring); returns their paths."""
    from library.io import save_safetensors
    from library.models.sd3.tiny_text import write_clip, write_t5
    from library.models.tiny_files import build_clip_tokenizer

    root = os.path.join(out, "hidream")
    singles = os.path.join(root, "text_encoders")
    paths = {"hidream_clip_l": os.path.join(root, "text_encoder"), "hidream_tokenizer": os.path.join(root, "tokenizer"),
             "hidream_clip_g": os.path.join(root, "text_encoder_2"),
             "hidream_tokenizer_2": os.path.join(root, "tokenizer_2"),
             "hidream_t5xxl": os.path.join(root, "text_encoder_3"),
             "hidream_tokenizer_3": os.path.join(root, "tokenizer_3"),
             "hidream_llama": os.path.join(root, "llama"),
             "hidream_clip_l_single": os.path.join(singles, "clip_l_hidream.safetensors"),
             "hidream_clip_g_single": os.path.join(singles, "clip_g_hidream.safetensors"),
             "hidream_t5xxl_single": os.path.join(singles, "t5xxl.safetensors"),
             "hidream_llama_single": os.path.join(singles, "llama_3.1_8b_instruct.safetensors")}
    clip_l = write_clip(paths["hidream_clip_l"], paths["hidream_tokenizer"], build_clip_tokenizer(), "quick_gelu",
                        seed, 132, positions=CLIP_POSITIONS)
    tokenizer_g = build_clip_tokenizer()
    tokenizer_g.pad_token = "!"  # the released SD3 / SDXL tokenizer_2/'s pad (id 0 there and here)
    clip_g = write_clip(paths["hidream_clip_g"], paths["hidream_tokenizer_2"], tokenizer_g, "gelu", seed, 133,
                        positions=CLIP_POSITIONS)
    t5 = write_t5(paths["hidream_t5xxl"], paths["hidream_tokenizer_3"], seed, 134)
    llama = write_llama(paths["hidream_llama"], seed)
    os.makedirs(singles, exist_ok=True)
    for key, weights in (("hidream_clip_l_single", clip_l), ("hidream_clip_g_single", clip_g),
                         ("hidream_t5xxl_single", t5), ("hidream_llama_single", llama)):
        save_safetensors(weights, paths[key])
    return paths
