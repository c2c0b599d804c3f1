"""Ideogram 4 prompt encoding: the language model of Qwen3-VL (8B: width 4096, 36 layers) on our LLM core.

As diffusers' Ideogram4Pipeline.encode_prompt / _get_text_encoder_hidden_states (text-only prompts):
- each prompt goes through the tokenizer's own chat template as one user message with the
  generation prompt (`apply_chat_template(..., add_generation_prompt=True)`), no special tokens
  added; a prompt over max_sequence_length tokens is an error (the pipeline raises, it does not cut);
- prompts are left-padded to max_sequence_length, real tokens at positions 0..n-1 (equal on
  Qwen3-VL's three M-RoPE axes: plain 1-D RoPE), pads hidden as keys by the causal mask;
- the outputs of decoder layers 0, 3, ..., 33, 35 (QWEN3_VL_ACTIVATION_LAYERS: 13 taps, the last
  one the final layer's output WITHOUT the final norm: the pipeline runs the layers itself) are
  stacked per token as [B, L, D, 13] and flattened: feature d * 13 + tap (53248 = 4096 x 13), the
  pads zeroed, float32.
Where it differs from Krea 2's text path (krea2/text_encoder.py, the same Qwen3-VL language model on
the same core): the chat template instead of Qwen-Image's system prompt, no dropped prefix, taps
numbered as decoder layers (hidden_states index + 1) with no final norm, and the taps flattened
with the tap axis innermost instead of kept as an axis.

What we compute instead of the padded run: each prompt's real tokens alone, right-padded to the
longest in the batch, positions 0..n-1 (a real token sees the same tokens at the same positions in
both runs). Returns features [B, T, 13 D] float32 (zeros at pads) and mask [B, T] bool (real first);
Ideogram4.forward takes either padding side. Only layers up to the deepest tap are run.
"""

from __future__ import annotations

import torch

from library.models.text_encoders import _load_tokenizer, right_padded

IDEOGRAM4_TAPS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 35)  # decoder layer indices (the pipeline's)
IDEOGRAM4_MAX_SEQUENCE_LENGTH = 2048  # the pipeline's default


def chat_prompt(tokenizer, prompt: str) -> str:
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class Ideogram4TextEncoder:
    """encode(prompts) -> (features [B, T, taps * D] float32, mask [B, T] bool)."""

    def __init__(self, llm, tokenizer, taps: tuple[int, ...] = IDEOGRAM4_TAPS,
                 max_length: int = IDEOGRAM4_MAX_SEQUENCE_LENGTH):
        if not taps or max(taps) >= len(llm.model.layers) or min(taps) < 0:
            raise ValueError(f"Ideogram4TextEncoder: taps {list(taps)} need decoder layers 0..{max(taps or [0])}; "
                             f"{len(llm.model.layers)} are loaded")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("Ideogram4TextEncoder: the tokenizer has no chat template (Qwen3-VL's tokenizer has one)")
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.taps, self.max_length = tuple(taps), max_length

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        rows = [self.tokenizer(chat_prompt(self.tokenizer, p), add_special_tokens=False).input_ids for p in prompts]
        for p, r in zip(prompts, rows):
            if len(r) > self.max_length:
                raise ValueError(f"prompt has {len(r)} tokens, exceeds max_sequence_length={self.max_length}: {p[:60]!r}")
        return rows

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_ids(prompts)
        device = self.llm.model.embed_tokens.weight.device
        ids, valid = right_padded(rows, self.tokenizer.pad_token_id or 0, device)  # int64 / bool [B, L]
        length = ids.shape[1]
        hidden = self.llm.selected_hidden_states(ids, valid, [t + 1 for t in self.taps],
                                                 position_ids=torch.arange(length, device=device), final_norm=False)
        b, n, d = hidden[0].shape
        features = torch.stack(hidden, dim=-1).reshape(b, n, d * len(self.taps)).float()  # feature d * taps + tap
        return features * valid[..., None], valid


def load_ideogram4_text_encoder(path: str, tokenizer: str | None = None, dtype: torch.dtype = torch.float32,
                                taps: tuple[int, ...] = IDEOGRAM4_TAPS, fp8: str | None = None,
                                max_length: int = IDEOGRAM4_MAX_SEQUENCE_LENGTH) -> Ideogram4TextEncoder:
    """The text encoder from an Ideogram 4 pipeline folder (text_encoder/ + tokenizer/) or a Qwen3-VL
    HF folder (config.json beside the weights; vision keys skipped). Only layers up to the deepest tap
    are loaded (the released taps end at the last layer, so all 36, no lm_head)."""
    from library.io import component_folder
    from library.models.family import fp8_prepare
    from library.models.llm import _find_config, load_llm

    path = component_folder(path, "text_encoder")
    config = _find_config(path)
    llm = load_llm(path, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=max(taps) + 1)
    return Ideogram4TextEncoder(llm, _load_tokenizer(path, tokenizer, "tokenizer", "Qwen2"), taps, max_length)
