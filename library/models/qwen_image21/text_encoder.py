"""Qwen-Image-2.1 prompt encoding: the language model of Qwen3-VL-8B on our LLM core.

As diffusers' QwenImage21Pipeline._get_qwen_prompt_embeds / encode_prompt for a text-only prompt:
- the prompt (" " when empty: Qwen has no BOS) goes into the raw template string QWEN_IMAGE21_TEMPLATE,
  tokenized whole (not through apply_chat_template), no length limit;
- the text encoder (Qwen3VLForConditionalGeneration) runs the batch left-padded; the hidden state is
  the LAST decoder layer's output BEFORE the final RMSNorm (the pipeline hooks the norm away: that is
  what the transformer was trained on);
- each prompt's real tokens are kept, the system turn dropped (its token count, `drop`: the processor's
  chat template rendering of the system message, QWEN_IMAGE21_SYSTEM_TURN), right-padded with zeros
  to the longest, with a mask (None from encode_prompt when nothing is padded).

What we compute instead of the left-padded run: each prompt's real tokens alone, right-padded,
positions 0..n-1 (transformers' get_rope_index gives left-padded real tokens the same positions, equal
on Qwen3-VL's three M-RoPE axes, which is plain 1-D RoPE: core.mrope_tables), causal with pads hidden:
a real token sees the same tokens at the same positions. Qwen3-VL's language model is Qwen3's (QK norm,
no bias), which the LLM core runs; deepstack features only enter at image tokens, none here.

Differs from Krea 2's Qwen3-VL path (krea2/text_encoder.py): the 8B model, one hidden state (the last
layer, unnormalized) rather than 12 taps, Qwen-Image-2.1's own system prompt, no max_sequence_length,
and the vision tokens of a condition image (`<|image_pad|>` slots) which the edit path (not written yet)
would fill through transformers' vision tower.
"""

from __future__ import annotations

import os

import torch

from library.io import component_folder

QWEN_IMAGE21_SYSTEM = "Comprehend and analyze the provided prompt."
QWEN_IMAGE21_SYSTEM_TURN = f"<|im_start|>system\n{QWEN_IMAGE21_SYSTEM}<|im_end|>\n"
QWEN_IMAGE21_TEMPLATE = QWEN_IMAGE21_SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


class QwenImage21TextEncoder:
    """encode(prompts) -> (embeds [B, T, D] float32, zeros beyond each row's count; mask [B, T] bool,
    real tokens first)."""

    def __init__(self, llm, tokenizer):
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.drop = len(tokenizer(QWEN_IMAGE21_SYSTEM_TURN).input_ids)  # the pipeline's _drop_idx

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        return self.tokenizer([QWEN_IMAGE21_TEMPLATE.format(p or " ") for p in prompts]).input_ids

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_ids(prompts)
        device = self.llm.model.embed_tokens.weight.device
        length = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([r + [pad] * (length - len(r)) for r in rows], device=device)  # int64 [B, L]
        valid = torch.arange(length, device=device)[None] < torch.tensor([len(r) for r in rows], device=device)[:, None]
        last = len(self.llm.model.layers)
        (hidden,) = self.llm.selected_hidden_states(ids, valid, [last], position_ids=torch.arange(length, device=device),
                                                    final_norm=False)
        embeds, mask = hidden[:, self.drop:].float(), valid[:, self.drop:]
        return embeds * mask[..., None], mask


def load_qwen_image21_text_encoder(path: str, tokenizer: str | None = None, dtype: torch.dtype = torch.float32,
                                   fp8: str | None = None) -> QwenImage21TextEncoder:
    """The text encoder from a Qwen-Image-2.1 pipeline folder (text_encoder/: Qwen3VLForConditionalGeneration,
    processor/ holding the tokenizer), or a Qwen3-VL HF folder with its tokenizer; vision keys and the lm_head
    are never read. fp8: the decoder Linears stored in fp8."""
    from library.models.family import fp8_prepare
    from library.models.llm import _find_config, load_llm
    from library.models.text_encoders import _load_tokenizer

    root = path
    path = component_folder(path, "text_encoder")
    config = _find_config(path)
    llm = load_llm(path, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=config.num_layers)
    if tokenizer is None and os.path.isdir(os.path.join(root, "processor")):
        tokenizer = os.path.join(root, "processor")
    return QwenImage21TextEncoder(llm, _load_tokenizer(path, tokenizer, "processor"))
