"""FLUX.3's part of the tiny real-format model set (tools/make_tiny_models.py; listed in spec.py TINY):

  flux3/flux3-tiny.safetensors            the base as BFL's single file (the config in its metadata)
  flux3/flux3-distilled-tiny.safetensors  the step-distilled flow map (ref_time_in), BFL's single file
  flux3/transformer/                      the base's weights as a diffusers Flux3Transformer2DModel folder
  flux3/text_encoder/                     Qwen3VLForConditionalGeneration (a one-block vision tower, a Qwen3
                                          language model of width lm_hidden with 33 layers: hidden state 32, the
                                          deepest stacked one, is a layer's output, not the final norm's)
  flux3/tokenizer/                        the processor's files (Qwen2-style tokenizer, Qwen3-VL's chat template)

The VAE is FLUX.2's (flux2/vae, the same AutoencoderKLFlux2: 32 latent channels, 128 packed). The transformer
takes the 8 stacked text layers of width lm_hidden (context 8 x 32 = 256). Seed offsets 60-62 are this family's.
"""

from __future__ import annotations

import os

from library.models.tiny_files import TINY, seed_component

TEXT_LAYERS = 33  # the taps reach hidden_states[32]


def tiny_config(flow_map: bool = False):
    """width 64 = 2 heads x 32, RoPE axes (8, 8, 8, 8), 2 per-mode and 2 single blocks."""
    from library.models.flux2.tiny import LATENT_CHANNELS
    from library.models.flux3.model import Flux3Config
    from library.models.flux3.text_encoder import FLUX3_TAPS

    head_dim = TINY["dit_hidden"] // TINY["dit_heads"]
    return Flux3Config(in_channels=4 * LATENT_CHANNELS, cond_in_channels=4 * LATENT_CHANNELS,
                       context_in_dim=len(FLUX3_TAPS) * TINY["lm_hidden"], hidden_size=TINY["dit_hidden"],
                       num_heads=TINY["dit_heads"], depth=2, depth_single=2, axes_dim=(head_dim // 4,) * 4,
                       flow_map=flow_map)


def random_flux3(config):
    """A Flux3Transformer as built (torch's Linear init) with its QK-norm scales N(1, 0.1) (the released ones are
    learned), from torch's generator as seeded."""
    import torch

    from library.models.flux3.model import Flux3Transformer

    model = Flux3Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".scale"):
                p.normal_(1.0, 0.1)
    return model


def write_flux3(out: str, seed: int) -> dict[str, str]:
    """The base as a BFL file and a diffusers folder (same weights), the flow map as a BFL file."""
    from library.models.flux3.checkpoint import save_flux3_bfl, save_flux3_diffusers

    root, paths = os.path.join(out, "flux3"), {}
    for name, flow_map, offset in (("flux3-tiny", False, 60), ("flux3-distilled-tiny", True, 61)):
        seed_component(seed, offset)
        config = tiny_config(flow_map)
        model = random_flux3(config)
        paths[name.replace("-", "_")] = path = os.path.join(root, f"{name}.safetensors")
        save_flux3_bfl(model, path, config)
        if not flow_map:
            paths["flux3_diffusers"] = folder = os.path.join(root, "transformer")
            save_flux3_diffusers(model, config, folder)
    return paths


def write_flux3_text_encoder(out: str, seed: int) -> dict[str, str]:
    """The pipeline folder's text side as FLUX.3's repo holds it, in out/flux3 (write_qwen3_vl_text_encoder)."""
    root = os.path.join(out, "flux3")
    folder, tok_folder = os.path.join(root, "text_encoder"), os.path.join(root, "tokenizer")
    write_qwen3_vl_text_encoder(folder, tok_folder, seed)
    return {"flux3_text_encoder": folder, "flux3_tokenizer": tok_folder}


def write_qwen3_vl_text_encoder(folder: str, tok_folder: str, seed: int) -> None:
    """text_encoder/ (a transformers Qwen3VLForConditionalGeneration, TEXT_LAYERS layers) in `folder` and
    tokenizer/ (the processor's files: the image processor's and the Qwen2-style tokenizer's, Qwen3-VL's chat
    template in tokenizer_config.json) in `tok_folder`."""
    from transformers import Qwen3VLForConditionalGeneration

    from library.models.flux3.text_encoder import QWEN3_VL_USER_PROMPT
    from library.models.qwen_image21.tiny import QWEN3_VL_CHAT_TEMPLATE
    from library.models.tiny_files import build_qwen_tokenizer, save_vl_processor, tiny_qwen3_vl_config

    tokenizer = build_qwen_tokenizer(vision_templates=(QWEN3_VL_USER_PROMPT,))
    seed_component(seed, 62)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer, TEXT_LAYERS, images=True))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    save_vl_processor(tok_folder, {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 32 * 32,
                                   "max_pixels": 256 * 256}, "Qwen3VLProcessor", tokenizer)
