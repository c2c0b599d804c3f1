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

import os

import torch

from library.io import component_folder
from library.models.text_encoders import T5TextEncoder, load_t5

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


def per_caption(hidden: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """Encoder output [B, L, D] + text mask [B, L] -> per caption the attended prefix (its tokens, EOS
    and the one unmasked padding token), float32 and bool, as cached. The positions cut off are masked
    keys whose own outputs nobody reads, so the image prediction is the same; a batch is zero-padded
    again with the mask False there (library/data/dataset.py collate_batch)."""
    return [{"t5": h[: int(m.sum())], "mask": m[: int(m.sum())]} for h, m in zip(hidden, mask)]


def t5_paths(path: str) -> tuple[str, str | None]:
    """(weights, tokenizer folder or None: beside the weights as load_t5 looks) of T5-XXL given as an HF
    folder, a t5xxl_*.safetensors file, a Chroma diffusers repo (text_encoder/ with tokenizer/ beside it) or
    a FLUX.1 / Flex.1 one (text_encoder_2/ with tokenizer_2/: the T5 ai-toolkit's Chroma reads). That layout's
    text_encoder/ and tokenizer/ are CLIP's: its text_encoder_2/ took CLIP's tokenizer (T5 fed CLIP's ids)."""
    second = component_folder(path, "text_encoder_2")
    path = second if second != path else component_folder(path, "text_encoder")
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    name = "tokenizer_2" if os.path.basename(folder.rstrip("/")) == "text_encoder_2" else "tokenizer"
    sibling = os.path.join(os.path.dirname(folder.rstrip("/")), name)
    own = os.path.isfile(os.path.join(folder, "tokenizer_config.json"))
    return path, sibling if not own and os.path.isfile(os.path.join(sibling, "tokenizer_config.json")) else None


def t5_tokenizer(path: str):
    """The tokenizer alone (the dataset check counts caption tokens with it)."""
    from library.models.text_encoders import _load_tokenizer

    weights, tokenizer = t5_paths(path)
    return _load_tokenizer(weights, tokenizer, "tokenizer_2", "T5")


def load_chroma_t5(path: str, dtype: torch.dtype = torch.float32, fp8: str | None = None) -> T5TextEncoder:
    """T5-XXL (weights in `dtype`, or fp8 / fp8_scaled Linears) from any layout t5_paths reads."""
    weights, tokenizer = t5_paths(path)
    return load_t5(weights, tokenizer, dtype=dtype, fp8=fp8)
