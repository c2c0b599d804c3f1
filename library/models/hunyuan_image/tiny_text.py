"""HunyuanImage-2.1's tiny text encoder files (tools/make_tiny_models.py, once the family lists the writer), in the
diffusers repo's layout (hunyuanvideo-community/HunyuanImage-2.1-Diffusers) and ComfyUI's single files:

  hunyuan_image/text_encoder/       transformers' Qwen2_5_VLForConditionalGeneration as save_pretrained writes it
                                    (`model.language_model.*`, `model.visual.*`, `lm_head.*`): language model of
                                    width TEXT_WIDTH 64, TEXT_LAYERS 4 (hidden_states[-3] reads layer 2's output: 2
                                    run, 2 never loaded), 4 query / 2 key-value heads of 16, M-RoPE sections (2, 3, 3),
                                    qkv bias; a 2-block vision tower (TINY_VISION: the real patch
                                    14, temporal patch 2 and merge 2, never run: the prompts are text)
  hunyuan_image/tokenizer/          a Qwen2.5-VL-style tokenizer (tiny_files.build_qwen_tokenizer with the vision
                                    tokens): the template's system prefix is 34 tokens, as with the real one
  hunyuan_image/text_encoder_2/     transformers' T5EncoderModel, byT5's layout: byte vocabulary 384 (ByT5's 3 +
                                    256 + 125 extra ids; the released glyph file adds 1126 color / font rows),
                                    GLYPH_WIDTH 32, 2 layers, 4 heads of 8, gated-GELU 64
  hunyuan_image/tokenizer_2/        ByT5Tokenizer's save (no vocabulary file: it is code)
  hunyuan_image/comfyui/byt5_small_glyphxl_tiny.safetensors
                                    the glyph weights as ComfyUI's byt5_small_glyphxl_fp16.safetensors holds them
                                    (`shared.weight`, `encoder.*`), no config.json: shaped from its tensors
  hunyuan_image/comfyui_qwen/qwen_2.5_vl_7b_tiny.safetensors
                                    the Qwen2.5-VL weights as ComfyUI's qwen_2.5_vl_7b.safetensors holds them
                                    (`model.*`, `visual.*`, `lm_head.weight`) with the tiny config.json beside it (a
                                    released file without one is read as Qwen2.5-VL-7B: shapes cannot tell Qwen2's
                                    head count)

The transformer's text inputs have these widths: its tiny config's text width must be TEXT_WIDTH (64; the released
3584) and its glyph width GLYPH_WIDTH (32; the released 1472). Seed offsets 113 (Qwen2.5-VL) and 114 (byT5) are this
writer's.
"""

from __future__ import annotations

import os

TEXT_WIDTH = 64  # the tiny Qwen2.5-VL's hidden size = the tiny transformer's text width (released: 3584)
TEXT_LAYERS = 4
GLYPH_WIDTH = 32  # the tiny byT5's d_model = the tiny transformer's glyph width (released: 1472)
# A tiny Qwen2.5-VL vision tower (the released file holds one; the text encoder never reads it): windowed blocks and
# one full-attention block, the real patch sizes
TINY_VISION = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 14,
               "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1]}
GLYPH_VOCAB = 384  # ByT5Tokenizer's: <pad> 0, </s> 1, <unk> 2, bytes 3..258, <extra_id_*> 259..383


def tiny_qwen2_5_vl_config(tokenizer):
    """transformers' Qwen2_5_VLConfig of the tiny text encoder (module docstring)."""
    from transformers import Qwen2_5_VLConfig

    from library.models.tiny_files import round_up, vision_token_ids

    text = {"vocab_size": round_up(len(tokenizer)), "hidden_size": TEXT_WIDTH, "num_hidden_layers": TEXT_LAYERS,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 2 * TEXT_WIDTH,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
            "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    return Qwen2_5_VLConfig(text_config=text, vision_config={**TINY_VISION, "out_hidden_size": TEXT_WIDTH},
                            tie_word_embeddings=False, **vision_token_ids(tokenizer))


def comfyui_qwen_key(key: str) -> str:
    """transformers 5's Qwen2_5_VLForConditionalGeneration key -> ComfyUI's qwen_2.5_vl_7b.safetensors key."""
    for ours, theirs in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if key.startswith(ours):
            return theirs + key[len(ours):]
    return key  # lm_head.weight


def write_hunyuan_image_text_encoders(out: str, seed: int) -> dict[str, str]:
    """Both text encoders and their tokenizers under out/hunyuan_image/ (module docstring); returns their paths."""
    from transformers import ByT5Tokenizer, Qwen2_5_VLForConditionalGeneration, T5Config, T5EncoderModel

    from library.io import save_safetensors
    from library.models.tiny_files import build_qwen_tokenizer, save_tokenizer, seed_component, write_json

    root = os.path.join(out, "hunyuan_image")
    paths = {"hunyuan_image_text_encoder": os.path.join(root, "text_encoder"),
             "hunyuan_image_tokenizer": os.path.join(root, "tokenizer"),
             "hunyuan_image_glyph_encoder": os.path.join(root, "text_encoder_2"),
             "hunyuan_image_glyph_tokenizer": os.path.join(root, "tokenizer_2"),
             "hunyuan_image_glyph_single_file": os.path.join(root, "comfyui", "byt5_small_glyphxl_tiny.safetensors"),
             "hunyuan_image_qwen_single_file": os.path.join(root, "comfyui_qwen", "qwen_2.5_vl_7b_tiny.safetensors")}
    tokenizer = build_qwen_tokenizer(vision_templates=())
    seed_component(seed, 113)
    qwen = Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config(tokenizer))  # float32 (parity at 1e-5)
    qwen.save_pretrained(paths["hunyuan_image_text_encoder"], safe_serialization=True)
    save_tokenizer(tokenizer, paths["hunyuan_image_tokenizer"])
    single = paths["hunyuan_image_qwen_single_file"]
    save_safetensors({comfyui_qwen_key(k): v.contiguous() for k, v in qwen.state_dict().items()}, single)
    write_json(os.path.join(os.path.dirname(single), "config.json"), qwen.config.to_dict())

    seed_component(seed, 114)
    config = T5Config(vocab_size=GLYPH_VOCAB, d_model=GLYPH_WIDTH, d_kv=8, d_ff=2 * GLYPH_WIDTH, num_layers=2,
                      num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0,
                      eos_token_id=1)
    glyph = T5EncoderModel(config)  # float32; relative position bias drawn N(0, 32 ** -0.5) by transformers
    weights = {k: v for k, v in glyph.state_dict().items() if k != "encoder.embed_tokens.weight"}  # tied to shared
    folder = paths["hunyuan_image_glyph_encoder"]
    save_safetensors(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), {"architectures": ["T5EncoderModel"], **config.to_dict()})
    ByT5Tokenizer().save_pretrained(paths["hunyuan_image_glyph_tokenizer"])
    save_safetensors(weights, paths["hunyuan_image_glyph_single_file"])
    return paths
