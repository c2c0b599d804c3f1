"""Krea 2 prompt encoding: the language model of Qwen3-VL-4B on our LLM core.

As diffusers' Krea2Pipeline.get_text_hidden_states / encode_prompt (text-only prompts):
- the prompt goes into Qwen-Image's chat template: the system prefix (34 tokens) + prompt, cut at
  max_sequence_length + 34 - 5 = 541 tokens, padded there, then the 5-token assistant suffix appended
  after the pads ([prefix | prompt | PAD | suffix]);
- positions count real tokens only (cumsum of the mask - 1, equal on Qwen3-VL's three M-RoPE axes),
  so the suffix follows the prompt directly; the pads are hidden as keys;
- the hidden states of 12 layers are stacked per token (`text_encoder_select_layers`, indices into
  transformers' hidden_states, 0 = the embeddings: 2, 5, ..., 35 of Qwen3-VL-4B's 36 layers, no
  final norm), and the 34 prefix tokens dropped: [B, 512, 12, 2560] with a mask.

Equal positions on the three axes make Qwen3-VL's interleaved M-RoPE plain 1-D RoPE (core.mrope_tables
says why; tests/test_krea2_text.py checks it against transformers), and Qwen3-VL's language model is
Qwen3's (QK norm, no bias): the LLM core runs it. Deepstack visual features only enter at image
tokens, which a text-only prompt has none of.

What we compute instead of the padded run: each prompt's real tokens alone, [prefix | prompt |
suffix], right-padded to the longest in the batch, positions 0..n-1. Causal attention with the pads
hidden means a real token sees exactly the real tokens before it, at the same positions, in both
runs; the pads' outputs are never used (the transformer masks them). We return the real tokens after
the prefix: embeds [B, T, taps, D] float32 (zeros beyond each row's count) and mask [B, T] bool
(real tokens first), T the longest such count; a prompt's cache holds its own n_i tokens.
Only the layers up to the deepest tap are loaded and run (Qwen3-VL-4B: 35 of 36, no lm_head).
"""

from __future__ import annotations

import json
import os

import torch

from library.io import component_folder
from library.models.text_encoders import right_padded

# Copied verbatim from diffusers' Krea2Pipeline (prompt_template_encode_prefix / _suffix / _start_idx /
# _num_suffix_tokens): Qwen-Image's template, split around the padding.
KREA2_PROMPT_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
KREA2_PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
KREA2_DROP_TOKENS = 34
KREA2_SUFFIX_TOKENS = 5
KREA2_MAX_SEQUENCE_LENGTH = 512  # the pipeline's default: tokens after the drop, suffix included
# Krea2Pipeline's default text_encoder_select_layers (the Krea 2 / Qwen3-VL-4B taps).
KREA2_TAPS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


def pipeline_taps(*paths: str | None) -> tuple[int, ...] | None:
    """text_encoder_select_layers of the diffusers pipeline folder holding any of `paths` (its
    model_index.json, where Krea2Pipeline registers them), else None."""
    for path in paths:
        if not path:
            continue
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        for candidate in (folder, os.path.dirname(folder.rstrip("/"))):
            index = os.path.join(candidate, "model_index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    taps = json.load(f).get("text_encoder_select_layers")
                if taps:
                    return tuple(int(t) for t in taps)
    return None


class Krea2TextEncoder:
    """encode(prompts) -> (embeds [B, T, taps, D] float32, mask [B, T] bool)."""

    def __init__(self, llm, tokenizer, taps: tuple[int, ...] = KREA2_TAPS, max_length: int = KREA2_MAX_SEQUENCE_LENGTH):
        if not taps or max(taps) > len(llm.model.layers) or min(taps) < 0:
            raise ValueError(f"Krea2TextEncoder: text_encoder_select_layers {list(taps)} need hidden states 0.."
                             f"{max(taps or [0])}; {len(llm.model.layers)} decoder layers are loaded")
        self.llm, self.tokenizer, self.taps, self.max_length = llm.eval().requires_grad_(False), tokenizer, tuple(taps), max_length
        n = len(tokenizer(KREA2_PROMPT_PREFIX).input_ids)
        if n != KREA2_DROP_TOKENS:
            raise ValueError(f"Krea2TextEncoder: the tokenizer splits the template prefix into {n} tokens, expected "
                             f"{KREA2_DROP_TOKENS} (the Qwen3-VL tokenizer)")
        self.suffix_ids = tokenizer(KREA2_PROMPT_SUFFIX).input_ids

    @property
    def prompt_limit(self) -> int:
        """Tokens of prefix + prompt the pipeline keeps (541 at max_sequence_length 512)."""
        return self.max_length + KREA2_DROP_TOKENS - KREA2_SUFFIX_TOKENS

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's real tokens as the pipeline has them: prefix + prompt cut at prompt_limit, suffix."""
        texts = [KREA2_PROMPT_PREFIX + p for p in prompts]
        cut = self.tokenizer(texts, truncation=True, max_length=self.prompt_limit).input_ids
        return [ids + self.suffix_ids for ids in cut]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_ids(prompts)
        device = self.llm.model.embed_tokens.weight.device
        ids, valid = right_padded(rows, self.tokenizer.pad_token_id or 0, device)  # int64 / bool [B, L]
        length = ids.shape[1]
        positions = torch.arange(length, device=device)  # real tokens first: cumsum(mask) - 1 on them
        hidden = self.llm.selected_hidden_states(ids, valid, self.taps, position_ids=positions)
        stacked = torch.stack(hidden, dim=2)[:, KREA2_DROP_TOKENS:].float()  # [B, L - 34, taps, D] float32
        mask = valid[:, KREA2_DROP_TOKENS:]
        return stacked * mask[..., None, None], mask


def load_krea2_text_encoder(
    path: str,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    taps: tuple[int, ...] | None = None,
    fp8: str | None = None,
    max_length: int = KREA2_MAX_SEQUENCE_LENGTH,
) -> Krea2TextEncoder:
    """The text encoder from a Krea 2 pipeline folder (text_encoder/ + tokenizer/: a Qwen3VLModel), a
    Qwen3-VL HF folder or a single file (ComfyUI's qwen3vl_4b_bf16.safetensors: Qwen3-VL-4B; vision keys
    are skipped), with the tokenizer beside it. taps: text_encoder_select_layers (default: the pipeline
    folder's model_index.json, else the released ones). fp8: the decoder Linears stored in fp8."""
    from library.models.family import fp8_prepare
    from library.models.text_encoders import _load_tokenizer, load_qwen3_vl_language_model

    taps = taps or pipeline_taps(path) or KREA2_TAPS
    llm = load_qwen3_vl_language_model(path, max(taps), dtype, fp8_prepare(fp8, "llm"))
    tokenizer = _load_tokenizer(component_folder(path, "text_encoder"), tokenizer, "tokenizer", "Qwen2")
    return Krea2TextEncoder(llm, tokenizer, taps, max_length)
