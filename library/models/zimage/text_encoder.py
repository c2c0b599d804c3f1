"""Z-Image prompt encoding: Qwen3-4B on our LLM core.

As diffusers' ZImagePipeline.encode_prompt / _encode_prompt:
- each prompt becomes one user message rendered by the tokenizer's chat template with
  add_generation_prompt=True and enable_thinking=True (Qwen3's template then adds nothing after
  `<|im_start|>assistant\\n`: no empty think block, unlike FLUX.2 [klein]'s enable_thinking=False);
- tokens are padded to max_length 512 (right, Qwen3's side) and truncated there
  (we run only the longest prompt's real tokens: the pads never reach a real token and are dropped);
- the model runs with the padding mask and positions 0..L-1 (transformers' default when given none);
- the hidden state is hidden_states[-2]: the output of the second-to-last decoder layer (layer 35 of
  Qwen3-4B's 36), before any final norm;
- only each prompt's real tokens are kept (prompt_embeds[i][mask[i]]): a ragged list, no pads, no
  system prompt and nothing dropped from the template's start.

We return that list as one tensor plus a mask: embeds [B, T, 2560] float32, T the longest prompt's
token count, zeros beyond each row's own count, and mask [B, T] bool (True = a real token, real
tokens first): what ZImage.forward takes as txt / txt_mask. Only the layers up to the one read are
loaded and run (Qwen3-4B: 35 of 36, no final norm, no lm_head).
"""

from __future__ import annotations

import os

import torch

from library.io import CheckpointError, CheckpointReader, component_folder
from library.models.text_encoders import second_to_last_layer

ZIMAGE_MAX_LENGTH = 512  # the pipeline's max_sequence_length default
# What Qwen3's chat template renders for one user message with the generation prompt, thinking on:
# used when a tokenizer carries no chat template (e.g. one rebuilt beside a single-file checkpoint).
QWEN3_THINKING_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def zimage_prompt_text(tokenizer, prompt: str) -> str:
    """The text the pipeline tokenizes for `prompt`: its apply_chat_template call, verbatim."""
    if not getattr(tokenizer, "chat_template", None):
        return QWEN3_THINKING_PROMPT.format(prompt)
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)


class ZImageTextEncoder:
    """encode(prompts) -> (embeds [B, T, D] float32, mask [B, T] bool); encode_list as the pipeline returns it."""

    def __init__(self, llm, tokenizer, max_length: int = ZIMAGE_MAX_LENGTH):
        self.layer = second_to_last_layer(llm, "ZImageTextEncoder")
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.max_length = max_length

    @property
    def embed_dim(self) -> int:
        return self.llm.config.hidden_size

    def tokenize(self, prompts: list[str]):
        """input_ids / attention_mask [B, max_length] int64, as the pipeline's tokenizer call."""
        texts = [zimage_prompt_text(self.tokenizer, p) for p in prompts]
        return self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt")

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenize(prompts)
        device = self.llm.model.embed_tokens.weight.device
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device).bool()  # [B, L]
        if not torch.equal(mask, mask.cumsum(1) == torch.arange(1, ids.shape[1] + 1, device=device)):
            raise ValueError("ZImageTextEncoder: the tokenizer must pad on the right (Qwen3's), real tokens first")
        # Only the longest prompt's real tokens run: the pipeline drops every pad's output, and a real
        # token (causal attention, pads on the right) never sees a pad, so the 512-token run it makes
        # gives those tokens the same values (up to summation order) at a fraction of the cost: a
        # 30-token caption runs 30 positions, not 512 (Qwen3-4B on a CPU: ~17x less time).
        length = int(mask.sum(1).max())
        ids, mask = ids[:, :length], mask[:, :length]
        positions = torch.arange(length, device=device)  # transformers' default: 0..L-1
        (hidden,) = self.llm.selected_hidden_states(ids, mask, (self.layer,), position_ids=positions)
        return (hidden.float() * mask[..., None]), mask

    def encode_list(self, prompts: list[str]) -> list[torch.Tensor]:
        """[n_i, D] float32 per prompt: ZImagePipeline._encode_prompt's return value."""
        embeds, mask = self.encode(prompts)
        return [e[m] for e, m in zip(embeds, mask)]


def _single_file_config(path: str):
    """Qwen3-4B, checked by the embedding width of a file without config.json."""
    from library.models.llm import QWEN3_4B

    reader = CheckpointReader(path)
    key = next((k for k in reader.keys() if k.endswith("embed_tokens.weight")), None)
    width = reader.shape(key)[-1] if key else None
    if width != QWEN3_4B.hidden_size:
        raise CheckpointError(f"{path}: embedding width {width} is not Qwen3-4B's ({QWEN3_4B.hidden_size}); "
                              f"put its config.json beside it")
    return QWEN3_4B


def load_zimage_text_encoder(
    path: str,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    config=None,
    fp8: str | None = None,
    max_length: int = ZIMAGE_MAX_LENGTH,
) -> ZImageTextEncoder:
    """The text encoder from a Z-Image repo (text_encoder/ + tokenizer/), a Qwen3 HF folder (sharded
    or not) or a single file (e.g. ComfyUI's qwen_3_4b.safetensors: Qwen3-4B). fp8: the decoder
    Linears stored in fp8 (embeddings stay in `dtype`). Only the layers up to the one read are loaded."""
    from library.models.family import fp8_prepare
    from library.models.llm import _find_config, load_llm
    from library.models.text_encoders import _load_tokenizer

    path = component_folder(path, "text_encoder")
    if config is None and os.path.isfile(path) and not os.path.isfile(os.path.join(os.path.dirname(path), "config.json")):
        config = _single_file_config(path)
    config = config or _find_config(path)
    llm = load_llm(path, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=config.num_layers - 1)
    return ZImageTextEncoder(llm, _load_tokenizer(path, tokenizer, "tokenizer", "Qwen2"), max_length)
