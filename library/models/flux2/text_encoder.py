"""FLUX.2 [klein] prompt encoding: Qwen3 (Qwen3-4B for klein 4B, Qwen3-8B for klein 9B) on our LLM core.

As diffusers' Flux2KleinPipeline.encode_prompt / _get_qwen3_prompt_embeds:
- each prompt becomes one user message rendered by the tokenizer's chat template with
  add_generation_prompt=True and enable_thinking=False (Qwen3's template then ends with an empty
  `<think>\\n\\n</think>\\n\\n` block);
- tokens are padded (the tokenizer's side, right for Qwen3) and truncated to max_length 512;
- the model runs with the padding mask and, as transformers does when given no position_ids,
  positions 0..L-1 for every row, pads included; pad rows are kept (the transformer sees all 512);
- hidden_states[9], [18], [27] (transformers' indexing: 0 = embeddings, k = layer k's output) are
  stacked per token: [B, L, 3 * hidden] = [B, 512, 7680] for Qwen3-4B, 12288 for Qwen3-8B;
- text ids [B, L, 4] int64 = (t, h, w, l) = (0, 0, 0, token index).

Only the first 27 layers are loaded and run, and no lm_head (LLM.truncate_for_hidden_states).
Outputs are float32 whatever dtype the weights run in.
"""

from __future__ import annotations

import os

import torch

from library.io import CheckpointError, CheckpointReader, component_folder

KLEIN_HIDDEN_LAYERS = (9, 18, 27)  # the pipeline's text_encoder_out_layers default
KLEIN_MAX_LENGTH = 512  # the pipeline's max_sequence_length default
# What Qwen3's chat template renders for one user message, generation prompt, thinking off: used
# when a tokenizer carries no chat template (e.g. one rebuilt beside a single-file checkpoint).
QWEN3_NO_THINKING_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def klein_prompt_text(tokenizer, prompt: str) -> str:
    """The text the pipeline tokenizes for `prompt`: its apply_chat_template call, verbatim."""
    if not getattr(tokenizer, "chat_template", None):
        return QWEN3_NO_THINKING_PROMPT.format(prompt)
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def klein_text_ids(batch: int, length: int, device=None) -> torch.Tensor:
    """[B, L, 4] int64 RoPE coordinates of the text tokens: (0, 0, 0, l) for l = 0..L-1
    (diffusers' Flux2 _prepare_text_ids without t_coord)."""
    ids = torch.zeros(length, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids.expand(batch, length, 4).clone()


class KleinTextEncoder:
    """encode(prompts) -> (embeds [B, max_length, len(layers) * D] float32, text_ids [B, max_length, 4] int64)."""

    def __init__(self, llm, tokenizer, hidden_layers=KLEIN_HIDDEN_LAYERS, max_length: int = KLEIN_MAX_LENGTH):
        if max(hidden_layers) > len(llm.model.layers):
            raise ValueError(f"KleinTextEncoder: hidden layers {tuple(hidden_layers)} need {max(hidden_layers)} decoder "
                             f"layers, the text encoder has {len(llm.model.layers)}")
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.hidden_layers, self.max_length = tuple(hidden_layers), max_length

    @property
    def embed_dim(self) -> int:
        return len(self.hidden_layers) * self.llm.config.hidden_size

    def tokenize(self, prompts: list[str]):
        """input_ids / attention_mask [B, max_length] int64, as the pipeline's tokenizer call."""
        texts = [klein_prompt_text(self.tokenizer, p) for p in prompts]
        return self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt")

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenize(prompts)
        device = self.llm.model.embed_tokens.weight.device
        ids, mask = tokens.input_ids.to(device), tokens.attention_mask.to(device)  # [B, L] int64
        positions = torch.arange(ids.shape[1], device=device)  # transformers' default: pads keep their index
        states = self.llm.selected_hidden_states(ids, mask, self.hidden_layers, position_ids=positions)
        # [B, L, D] x 3 -> [B, L, 3, D] -> [B, L, 3D]: per token, layer 9's features, then 18's, then 27's
        embeds = torch.stack(states, dim=2).flatten(2).float()
        return embeds, klein_text_ids(ids.shape[0], ids.shape[1], device)


def _single_file_config(path: str):
    """Qwen3-4B or Qwen3-8B, told apart by the embedding width of a file without config.json."""
    from library.models.llm import QWEN3_4B, QWEN3_8B

    reader = CheckpointReader(path)
    key = next((k for k in reader.keys() if k.endswith("embed_tokens.weight")), None)
    width = reader.shape(key)[-1] if key else None
    configs = {QWEN3_4B.hidden_size: QWEN3_4B, QWEN3_8B.hidden_size: QWEN3_8B}
    if width not in configs:
        raise CheckpointError(f"{path}: embedding width {width} is neither Qwen3-4B's (2560) nor Qwen3-8B's (4096); "
                              f"put its config.json beside it")
    return configs[width]


def load_klein_text_encoder(
    path: str,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    config=None,
    fp8: str | None = None,
    hidden_layers=KLEIN_HIDDEN_LAYERS,
    max_length: int = KLEIN_MAX_LENGTH,
) -> KleinTextEncoder:
    """The klein text encoder from a klein repo (text_encoder/ + tokenizer/), a Qwen3 HF folder
    (sharded or not) or a single file (e.g. ComfyUI's qwen_3_4b.safetensors; its config is then
    Qwen3-4B or -8B by embedding width). fp8: the decoder Linears stored in fp8 (embeddings stay in
    `dtype`). Only the layers up to max(hidden_layers) are read."""
    from library.models.family import fp8_prepare
    from library.models.llm import load_llm
    from library.models.text_encoders import _load_tokenizer

    path = component_folder(path, "text_encoder")
    if config is None and os.path.isfile(path) and not os.path.isfile(os.path.join(os.path.dirname(path), "config.json")):
        config = _single_file_config(path)
    llm = load_llm(path, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=max(hidden_layers))
    return KleinTextEncoder(llm, _load_tokenizer(path, tokenizer, "tokenizer", "Qwen2"), hidden_layers, max_length)
