"""Chroma's text: T5-XXL hidden states with the attention mask, and the text mask the transformer gets.

As diffusers' ChromaPipeline (encode_prompt): no CLIP. Prompts are padded to max_length (512, also
the most the pipeline allows) and T5 runs *with* the tokenizer's attention mask, unlike FLUX.1's
unmasked T5. The transformer then attends to the prompt's tokens, its EOS and exactly one padding
token (the first); the other padding tokens are masked out (Chroma's model card: a single unmasked
padding token trained stably and kept fidelity). The hidden states at padding positions are kept in
the [B, max_length, D] output: the mask, not truncation, removes them.
The encoder itself is library/models/text_encoders.py's T5TextEncoder (load_t5).
"""

from __future__ import annotations

import torch

from library.models.text_encoders import T5TextEncoder

T5_MAX_LENGTH = 512


def chroma_text_mask(token_mask: torch.Tensor) -> torch.Tensor:
    """Tokenizer attention mask [B, L] (1 = token, right padding) -> bool [B, L]: True for the
    tokens and the first padding position (index == token count); all True when nothing is padded."""
    lengths = token_mask.sum(dim=1, keepdim=True)
    return torch.arange(token_mask.shape[1], device=token_mask.device)[None] <= lengths


@torch.no_grad()
def encode_chroma_prompts(
    prompts: list[str], t5: T5TextEncoder, max_length: int = T5_MAX_LENGTH
) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 hidden states [B, max_length, D] float32, text mask [B, max_length] bool) for Chroma.
    The mask goes to the transformer as `txt_mask`; text position ids are all zeros."""
    if max_length > T5_MAX_LENGTH:
        raise ValueError(f"Chroma's T5 max_length is at most {T5_MAX_LENGTH}, got {max_length}")
    tokens = t5.tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    device = t5.model.device
    token_mask = tokens.attention_mask.to(device)
    hidden = t5.model(tokens.input_ids.to(device), attention_mask=token_mask).last_hidden_state.float()
    return hidden, chroma_text_mask(token_mask)
