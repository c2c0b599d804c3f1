"""Krea 2's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  krea2/krea2-tiny.safetensors         the released single-file layout (original names, as
                                       raw.safetensors / turbo.safetensors), the config in its metadata
  krea2/transformer/                   the same weights as a diffusers Krea2Transformer2DModel folder

The VAE is Qwen-Image's (qwen_image/vae, the same AutoencoderKLQwenImage). The transformer's text
width is the text encoders' (TINY lm_hidden = 32), 3 tapped layers, 16 latent channels (64 packed).
Seed offset 30 is this family's.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from library.models.tiny_files import TINY, seed_component

TEXT_TAPS = (1, 2, 3)  # the tiny pipeline's text_encoder_select_layers (the released: 2, 5, ..., 35)


def tiny_config():
    """width 64 = 2 heads x 32 (1 key-value head: grouped-query), RoPE axes (8, 12, 12) (the original
    split of head_dim 32), 2 main blocks, text fusion 2 heads over 3 tapped layers of width 32."""
    from library.models.krea2.model import Krea2Config

    return Krea2Config(
        in_channels=4 * TINY["latent_channels"], num_layers=2, attention_head_dim=TINY["dit_hidden"] // TINY["dit_heads"],
        num_attention_heads=TINY["dit_heads"], num_key_value_heads=1, intermediate_size=128, timestep_embed_dim=256,
        text_hidden_dim=TINY["lm_hidden"], num_text_layers=len(TEXT_TAPS), text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=64, axes_dims_rope=TINY["axes"],
    )  # fmt: skip


def random_krea2(config) -> "torch.nn.Module":
    """A Krea2 whose zero-initialised tables and norm scales are random too (the released ones are learned)."""
    from library.models.krea2.model import Krea2

    model = Krea2(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".scale", ".lin")):
                p.normal_(0.0, 0.1)
    return model


def write_krea2(out: str, seed: int) -> dict[str, str]:
    """The transformer as a single file and as a diffusers folder, same weights."""
    from library.models.krea2.checkpoint import save_krea2_diffusers, save_krea2_single_file

    seed_component(seed, 30)
    config = tiny_config()
    model = random_krea2(config)
    root = os.path.join(out, "krea2")
    paths = {"krea2": os.path.join(root, "krea2-tiny.safetensors"), "krea2_diffusers": os.path.join(root, "transformer")}
    save_krea2_single_file(model, paths["krea2"], config)
    save_krea2_diffusers(model, config, paths["krea2_diffusers"])
    return paths


def write_krea2_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The pipeline folder's text side as diffusers saves Krea2Pipeline: text_encoder/ (a transformers
    Qwen3VLModel: a tiny vision tower and a Qwen3 language model of width lm_hidden, 4 layers, explicit
    head_dim 16, interleaved M-RoPE sections (2, 3, 3)), tokenizer/ (the Qwen2-style tokenizer: the
    template prefix is 34 tokens and the suffix 5, as with Qwen3-VL's) and model_index.json with the
    pipeline's text_encoder_select_layers (TEXT_TAPS)."""
    from transformers import Qwen3VLModel

    from library.models.tiny_files import build_qwen_tokenizer, save_tokenizer, tiny_qwen3_vl_config, write_json

    tokenizer = build_qwen_tokenizer()
    seed_component(seed, 31)
    model = Qwen3VLModel(tiny_qwen3_vl_config(tokenizer, 4))  # text-only: no vision tokens
    root = os.path.join(out, "krea2")
    folder, tok_folder = os.path.join(root, "text_encoder"), os.path.join(root, "tokenizer")
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, tok_folder)
    write_json(os.path.join(root, "model_index.json"), {
        "_class_name": "Krea2Pipeline", "is_distilled": False, "patch_size": 2, "text_encoder_select_layers": list(TEXT_TAPS),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers", "Qwen3VLModel"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"], "transformer": ["diffusers", "Krea2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"]})
    return {"krea2_text_encoder": folder, "krea2_tokenizer": tok_folder}


def write_sized_krea2(folder: str, hidden: int, depth: int, seed: int) -> str:
    """Krea 2 at width `hidden` (heads of 128, a key-value head per 4, RoPE axes (32, 48, 48)), 2 x `depth`
    main blocks, the MLP 8/3 wide, the tiny text fusion above, every matrix N(0, 0.02) and the norm scales
    N(0, 0.1) as random_krea2 draws them: a single file in the released layout (the spec's TINY.sized)."""
    from library.models.krea2.checkpoint import save_krea2_single_file
    from library.models.tiny_files import random_init

    heads = hidden // 128
    config = dataclasses.replace(tiny_config(), num_layers=2 * depth, attention_head_dim=128, num_attention_heads=heads,
                                 num_key_value_heads=max(1, heads // 4), intermediate_size=8 * hidden // 3,
                                 axes_dims_rope=(32, 48, 48))
    torch.manual_seed(seed)
    path = os.path.join(folder, "krea2_sized.safetensors")
    save_krea2_single_file(random_init(random_krea2(config), seed), path, config)
    return path


def write_krea2_edit_text_encoder(out: str, seed: int) -> dict[str, str]:
    """A Qwen3-VL-4B-Instruct-like download at tiny size for the edit prompts (tests/test_krea2_edit_text.py;
    not in the shared set): a Qwen3VLForConditionalGeneration (a vision tower of patch 16, merge 2, one
    deepstack layer; the language model as write_krea2_text_encoder's, 4 layers) with the Qwen2-style
    tokenizer that has the vision tokens (the template prefix still 34 tokens, the suffix 5) and the
    image processor's files in the same folder, as ai-toolkit loads it (AutoProcessor from that repo)."""
    from transformers import Qwen3VLForConditionalGeneration

    from library.models.krea2.text_encoder import KREA2_PROMPT_PREFIX, KREA2_PROMPT_SUFFIX
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor, tiny_qwen3_vl_config

    tokenizer = build_qwen_tokenizer(vision_templates=(KREA2_PROMPT_PREFIX + "{}" + KREA2_PROMPT_SUFFIX,))
    seed_component(seed, 32)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, 4, images=True))
    folder = os.path.join(out, "krea2_edit", "text_encoder")
    model.save_pretrained(folder, safe_serialization=True)
    save_vl_processor(folder, {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 32 * 32,
                               "max_pixels": 256 * 256}, "Qwen3VLProcessor", tokenizer)
    return {"krea2_edit_text_encoder": folder}
