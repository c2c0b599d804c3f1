"""Qwen-Image's text encoder: the Qwen2.5-VL language model on our LLM core (library/models/llm.py).

As diffusers' QwenImagePipeline._get_qwen_prompt_embeds: the prompt goes into a chat template with a
fixed system prompt, the language model's last hidden state (after the final norm, what transformers
returns as hidden_states[-1]) is taken, the template's leading 34 tokens are dropped and the rest is
padded to the longest prompt with a boolean mask -> ([B, T, 3584], [B, T]).
"""

from __future__ import annotations

import torch

from library.models.text_encoders import load_qwen2_5_vl_language_model, load_qwen2_5_vl_tokenizer

# Copied verbatim from diffusers' QwenImagePipeline (prompt_template_encode / _start_idx).
QWEN_IMAGE_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_DROP_TOKENS = 34  # the template's system part + "<|im_start|>user\n"
QWEN_IMAGE_MAX_TOKENS = 1024  # encode_prompt's tokenizer_max_length after the drop (__call__ default: 512)


class QwenImageTextEncoder:
    """encode(prompts) -> (embeds [B, T, D] float32, mask [B, T] bool), T = longest prompt's
    token count after dropping the template's 34 leading tokens; padded rows are zeros."""

    def __init__(self, llm, tokenizer):
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        # Right padding: with a causal model the valid tokens then never see padding.
        self.tokenizer.padding_side = "right"
        prefix = QWEN_IMAGE_PROMPT_TEMPLATE.split("{}")[0]
        n = len(tokenizer(prefix).input_ids)
        if n != QWEN_IMAGE_DROP_TOKENS:
            raise ValueError(
                f"QwenImageTextEncoder: the tokenizer splits the template prefix into {n} tokens, "
                f"expected {QWEN_IMAGE_DROP_TOKENS} (the Qwen2.5-VL tokenizer)"
            )

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        texts = [QWEN_IMAGE_PROMPT_TEMPLATE.format(p) for p in prompts]
        max_length = QWEN_IMAGE_MAX_TOKENS + QWEN_IMAGE_DROP_TOKENS
        tokens = self.tokenizer(texts, max_length=max_length, padding=True, truncation=True, return_tensors="pt")
        device = self.llm.model.embed_tokens.weight.device
        valid = tokens.attention_mask.bool()  # [B, L]
        hidden = self.llm.hidden_states(tokens.input_ids.to(device), valid.to(device)).float()  # [B, L, D] float32
        kept = [h[m.to(device)][QWEN_IMAGE_DROP_TOKENS:] for h, m in zip(hidden, valid)]
        length = max(k.shape[0] for k in kept)
        embeds = hidden.new_zeros(len(kept), length, hidden.shape[-1])
        mask = torch.zeros(len(kept), length, dtype=torch.bool, device=device)
        for i, k in enumerate(kept):
            embeds[i, : k.shape[0]] = k
            mask[i, : k.shape[0]] = True
        return embeds, mask


def load_qwen_image_text_encoder(
    path: str, tokenizer: str | None = None, dtype: torch.dtype = torch.float32, config=None, fp8: str | None = None
) -> QwenImageTextEncoder:
    """Qwen-Image text encoder from a Qwen-Image repo (text_encoder/ + tokenizer/), an HF folder
    or a single file (e.g. ComfyUI's qwen_2.5_vl_7b.safetensors; vision keys are skipped).
    fp8: the language model's Linears stored in fp8 (embeddings and lm_head stay in `dtype`)."""
    from library.models.family import fp8_prepare

    llm = load_qwen2_5_vl_language_model(path, dtype, config, fp8_prepare(fp8, "llm"))
    return QwenImageTextEncoder(llm, load_qwen2_5_vl_tokenizer(path, tokenizer))
