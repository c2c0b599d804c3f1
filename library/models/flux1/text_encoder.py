"""FLUX.1's text: CLIP-L pooled + T5-XXL hidden states (the encoders: library/models/text_encoders.py).

As diffusers' FluxPipeline: CLIP-L pooled output (`pooler_output`, 77 tokens padded to max_length)
-> [B, 768]; T5-XXL last hidden state, prompts padded to max_length (512 for dev, 256 for schnell)
and run without an attention mask -> [B, L, 4096]. The diffusers FLUX repo holds them as
text_encoder/ + tokenizer/ (CLIP-L) and text_encoder_2/ + tokenizer_2/ (T5).
"""

from __future__ import annotations

import torch

from library.models.text_encoders import CLIPTextEncoder, T5TextEncoder

T5_MAX_LENGTH = {"dev": 512, "schnell": 256}


def encode_flux_prompts(
    prompts: list[str], clip: CLIPTextEncoder, t5: T5TextEncoder, max_length: int = T5_MAX_LENGTH["dev"]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(t5 hidden [B, max_length, 4096] float32, clip pooled [B, 768] float32) for FLUX.1."""
    return t5.encode(prompts, max_length), clip.encode(prompts)
