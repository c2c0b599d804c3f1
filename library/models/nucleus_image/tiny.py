"""Nucleus-Image's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  nucleus_image/nucleus-image-tiny.safetensors   the transformer as a single file (diffusers' names, as released)
  nucleus_image/transformer/                     the same weights as a diffusers NucleusMoEImageTransformer2DModel
                                                 folder
  nucleus_image/text_encoder/                    transformers' Qwen3VLForConditionalGeneration (a one-block vision
                                                 tower, a Qwen3 language model of width lm_hidden with TEXT_LAYERS
                                                 layers: hidden_states[-8] is layer 3's output), as the pipeline
                                                 folder holds Qwen3-VL-8B
  nucleus_image/processor/                       its Qwen3VLProcessor's files (the Qwen2-style tokenizer with
                                                 Qwen3-VL's chat template, the image processor's config)

The VAE is Qwen-Image's (qwen_image/vae, the same AutoencoderKLQwenImage: 16 latent channels, 64 packed). The
transformer takes the text encoder's width (joint_attention_dim = lm_hidden = 32 != its width 64). As released, its
first three blocks are dense and the rest mixtures of experts: 5 blocks, 8 experts, the released capacity pattern
(4, then 2): an expert picks half, then a quarter of the tokens, so the routing chooses. Seed offsets 80-81 are this
family's.
"""

from __future__ import annotations

import math
import os

from library.models.tiny_files import TINY, seed_component

TEXT_LAYERS = 10  # hidden_states[-8] of 10 layers: the output of layer 3, before the final norm


def tiny_config():
    """width 64 = 2 heads x 32 over 1 key-value head, RoPE axes (8, 12, 12), 5 blocks (3 dense SwiGLU of 128, 2 MoE
    of 8 experts of 48 and a shared one), text width lm_hidden."""
    from library.models.nucleus_image.model import NucleusImageConfig

    return NucleusImageConfig(num_layers=5, attention_head_dim=TINY["dit_hidden"] // TINY["dit_heads"],
                              num_attention_heads=TINY["dit_heads"], num_key_value_heads=1,
                              joint_attention_dim=TINY["lm_hidden"], axes_dims_rope=TINY["axes"], num_experts=8,
                              moe_intermediate_dim=48, capacity_factors=(0, 0, 0, 4, 2))


def random_nucleus_image(config):
    """A NucleusImage with every parameter drawn (the packed experts are built empty): matrices N(0, 1 / fan_in)
    (an expert's fan-in is its middle axis: x @ W), biases N(0, 0.01), norm weights N(1, 0.2) (the released ones are
    learned), from torch's generator as seeded."""
    import torch

    from library.models.nucleus_image.model import NucleusImage

    model = NucleusImage(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape)
            if p.dim() == 1:
                p.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-2] if p.dim() == 3 else p.shape[-1]))
    return model


def write_nucleus_image(out: str, seed: int) -> dict[str, str]:
    """The transformer as a single file and as a diffusers folder (same weights)."""
    from library.models.nucleus_image.checkpoint import save_nucleus_image_diffusers, save_nucleus_image_single_file

    root = os.path.join(out, "nucleus_image")
    seed_component(seed, 80)
    config = tiny_config()
    model = random_nucleus_image(config)
    single, folder = os.path.join(root, "nucleus-image-tiny.safetensors"), os.path.join(root, "transformer")
    save_nucleus_image_single_file(model, single, config)
    save_nucleus_image_diffusers(model, config, folder)
    return {"nucleus_image": single, "nucleus_image_diffusers": folder}


def write_nucleus_image_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The pipeline folder's text side in out/nucleus_image/: text_encoder/ and processor/ (write_qwen3_vl_encoder)."""
    root = os.path.join(out, "nucleus_image")
    folder, processor = os.path.join(root, "text_encoder"), os.path.join(root, "processor")
    write_qwen3_vl_encoder(folder, processor, seed)
    return {"nucleus_image_text_encoder": folder, "nucleus_image_processor": processor}


def write_qwen3_vl_encoder(folder: str, processor: str, seed: int) -> None:
    """`folder`: a Qwen3VLForConditionalGeneration of TEXT_LAYERS layers; `processor` (the pipeline's processor/,
    beside it): the tokenizer, trained on the pipeline's chat text so that its system prompt is a few tokens, with
    Qwen3-VL's chat template, and the image processor's config. The learned base's encoder too (learned.py)."""
    from transformers import Qwen3VLForConditionalGeneration

    from library.models.nucleus_image.text_encoder import NUCLEUS_CHAT_TEXT, NUCLEUS_SYSTEM_PROMPT
    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor, tiny_qwen3_vl_config

    tokenizer = build_qwen_tokenizer(vision_templates=(NUCLEUS_CHAT_TEXT.format(NUCLEUS_SYSTEM_PROMPT, "{}"),))
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    seed_component(seed, 81)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, TEXT_LAYERS, images=True))
    model.save_pretrained(folder, safe_serialization=True)
    save_vl_processor(processor, {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 32 * 32,
                                  "max_pixels": 256 * 256}, "Qwen3VLProcessor", tokenizer)
