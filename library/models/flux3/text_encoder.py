"""FLUX.3 prompt encoding: the language model of Qwen3-VL-4B on our LLM core.

As diffusers' Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds (the modular pipeline encodes one prompt
per call; the distilled model's step is the same without a negative prompt):
- the prompt is one user message rendered by the chat template with add_generation_prompt
  (`<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n`), tokenized and cut at
  max_sequence_length (8192) real tokens (a cut can drop the template's tail, as there);
- the n real tokens are right-padded with the pad token to the window W = min(ceil(n / 80) * 80,
  max_sequence_length);
- Qwen3-VL runs with the pads masked as keys, real tokens at positions 0..n-1 and every pad at position
  id 1 (passed explicitly: the training environment, transformers 4.57, gave pads 1); equal ids on the
  three M-RoPE axes make Qwen3-VL's interleaved M-RoPE plain 1-D RoPE (core.mrope_tables);
- hidden_states[4, 8, ..., 32] (0 = the embeddings; 32 of Qwen3-VL-4B's 36 layers, so no final norm)
  are stacked per token, tap-major: [1, W, 8 * 2560] = the transformer's joint_attention_dim 20480;
- the transformer attends to all W tokens, the pads included: nothing masks them after Qwen3-VL.
  The negative prompt (classifier-free guidance) is "" encoded the same way.

What we compute instead of the padded run: every pad of a prompt has the same hidden states. A pad's
query sees only the real tokens (causal; pad keys, its own included, are masked), and it sits at
position id 1 whatever its index, so each layer's pad state is a function of the real tokens alone,
not of the pad's index nor of the window length (tests/test_flux3_text.py: diffusers' pads agree
exactly in fp32, and its window at pad_multiple 160 extends the one at 80 with the same state). We run
each prompt's real tokens plus one pad (the batch right-padded to the longest + 1, the extra pads
masked) and fill the rest of the window with that pad's state: a short prompt costs n + 1 tokens, not W.

encode(prompts) -> (embeds [B, T, taps * D] float32, mask [B, T] bool). Row i holds prompt i's window,
W_i tokens (mask True, its pads included: what the transformer sees), then zeros (mask False) up to
T = max W_i. The mask marks the window, not Qwen3-VL's padding. A caption's cache is embeds[i, :W_i].
The LM runs in the dtype it was loaded in (the compute dtype: bf16 on GPU, fp32 in the parity tests);
the outputs are cast to float32 for caching (diffusers returns the text encoder's dtype).

Batches of windows of different lengths: diffusers never masks text, so any token added to a sample's
window changes its prediction: zeros, and copies of its pad state too (those equal what diffusers gives
for a longer window, i.e. another pad_multiple, but not the sample's own input: each copy is one more
key, at its own text position, that the image and text queries attend to). Exact ways: (a) the transformer
takes `mask` as a key mask on the text (the tokens beyond W_i add nothing; their own outputs are never read;
text positions 0..W_i - 1 and the image positions, which do not depend on the text length, are unchanged), or
(b) a batch holds one window length (ceil(n / 80), the cap aside): the family runs (b), one forward per window
length (family.py predict). Zero-padding without the mask (collate_batch's default) is not exact.
"""

from __future__ import annotations

import math
import os

import torch

from library.io import CheckpointError, component_folder
from library.models.text_encoders import right_padded

# Flux3TextEncoderStep's defaults (inputs text_encoder_out_layers and max_sequence_length, pad_multiple).
FLUX3_TAPS = (4, 8, 12, 16, 20, 24, 28, 32)
FLUX3_MAX_SEQUENCE_LENGTH = 8192
FLUX3_PAD_MULTIPLE = 80
FLUX3_PAD_POSITION = 1  # the position id of every pad (transformers 4.57's, which FLUX.3 was trained with)
FLUX3_NEGATIVE_PROMPT = ""  # what the step encodes when the guider needs unconditional embeddings
# What Qwen3-VL-Instruct's chat template renders for one user message and the generation prompt: used when a
# tokenizer carries no chat template (e.g. one rebuilt beside a single-file checkpoint).
QWEN3_VL_USER_PROMPT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def flux3_prompt_text(tokenizer, prompt: str) -> str:
    """The text the pipeline tokenizes for `prompt`: its apply_chat_template call, verbatim."""
    if not getattr(tokenizer, "chat_template", None):
        return QWEN3_VL_USER_PROMPT.format(prompt)
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def window_length(real: int, max_length: int = FLUX3_MAX_SEQUENCE_LENGTH,
                  pad_multiple: int = FLUX3_PAD_MULTIPLE) -> int:
    """The tokens the transformer sees for a prompt of `real` tokens: rounded up to the pad multiple, capped."""
    return min(math.ceil(real / pad_multiple) * pad_multiple, max_length)


class Flux3TextEncoder:
    """encode(prompts) -> (embeds [B, T, len(taps) * D] float32, mask [B, T] bool: each prompt's window)."""

    def __init__(self, llm, tokenizer, taps: tuple[int, ...] = FLUX3_TAPS, max_length: int = FLUX3_MAX_SEQUENCE_LENGTH,
                 pad_multiple: int = FLUX3_PAD_MULTIPLE):
        if not taps or min(taps) < 0 or max(taps) > len(llm.model.layers):
            raise ValueError(f"Flux3TextEncoder: text_encoder_out_layers {list(taps)} need hidden states 0.."
                             f"{max(taps or [0])}; {len(llm.model.layers)} decoder layers are loaded")
        if tokenizer.pad_token_id is None:
            raise ValueError("Flux3TextEncoder: the tokenizer has no pad token; the window is padded with it")
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.taps, self.max_length, self.pad_multiple = tuple(taps), max_length, pad_multiple

    @property
    def embed_dim(self) -> int:
        return len(self.taps) * self.llm.config.hidden_size

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's real tokens as the pipeline has them: the chat template's text, cut at max_length."""
        texts = [flux3_prompt_text(self.tokenizer, p) for p in prompts]
        return self.tokenizer(texts, truncation=True, max_length=self.max_length).input_ids

    def windows(self, prompts: list[str]) -> list[int]:
        """Each prompt's window length W (its tokens in the transformer, pads included)."""
        return [window_length(len(r), self.max_length, self.pad_multiple) for r in self.token_ids(prompts)]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_ids(prompts)
        counts = [len(r) for r in rows]
        windows = [window_length(n, self.max_length, self.pad_multiple) for n in counts]
        device = self.llm.model.embed_tokens.weight.device
        length = max(counts) + 1  # one pad column at least: its state is every pad's (module docstring)
        ids, real = right_padded(rows, self.tokenizer.pad_token_id, device, length)  # int64 / bool [B, L]
        positions = torch.arange(length, device=device)[None].masked_fill(~real, FLUX3_PAD_POSITION)  # int64 [B, L]
        states = self.llm.selected_hidden_states(ids, real, self.taps, position_ids=positions)
        # [B, L, D] x taps -> [B, L, taps, D] -> [B, L, taps * D]: per token, tap 4's features, then 8's, ...
        stacked = torch.stack(states, dim=2).flatten(2).float()  # compute dtype -> float32 (the cache's)
        embeds = stacked.new_zeros(len(rows), max(windows), stacked.shape[-1])
        mask = torch.arange(max(windows), device=device)[None] < torch.tensor(windows, device=device)[:, None]
        for i, (n, w) in enumerate(zip(counts, windows)):
            embeds[i, :n] = stacked[i, :n]
            embeds[i, n:w] = stacked[i, n]  # the pad state (nothing when the window has no pads)
        return embeds, mask


def flux3_tokenizer_folder(path: str, tokenizer: str | None = None) -> str:
    """The folder the tokenizer loads from: `tokenizer`, else beside the text encoder as tokenizer_folder finds
    it (the weights folder itself, or tokenizer/: FLUX.3's repo keeps the processor there), else processor/
    (the name other Qwen3-VL pipeline repos give it)."""
    from library.models.text_encoders import tokenizer_folder

    weights = component_folder(path, "text_encoder")
    try:
        return tokenizer_folder(weights, tokenizer, "tokenizer", "Qwen2")
    except CheckpointError:
        folder = weights if os.path.isdir(weights) else os.path.dirname(weights)
        if not os.path.isdir(os.path.join(os.path.dirname(folder.rstrip("/")), "processor")):
            raise
        return tokenizer_folder(weights, None, "processor", "Qwen2")


def load_flux3_tokenizer(path: str, tokenizer: str | None = None):
    """The Qwen3-VL tokenizer with its chat template: the tokenizer's own (tokenizer_config.json or
    chat_template.jinja), else a processor's legacy chat_template.json in the same folder."""
    from library.models.text_encoders import load_chat_tokenizer

    return load_chat_tokenizer(flux3_tokenizer_folder(path, tokenizer))


def load_flux3_text_encoder(
    path: str,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    taps: tuple[int, ...] = FLUX3_TAPS,
    fp8: str | None = None,
    max_length: int = FLUX3_MAX_SEQUENCE_LENGTH,
    pad_multiple: int = FLUX3_PAD_MULTIPLE,
) -> Flux3TextEncoder:
    """The text encoder from a FLUX.3 pipeline folder (text_encoder/: Qwen3VLForConditionalGeneration, tokenizer/
    or processor/ holding the processor's tokenizer), a Qwen3-VL HF folder or a single file (Qwen3-VL-4B without
    config.json beside it), the tokenizer beside it or at `tokenizer`. Only the layers up to max(taps) are
    read; vision keys and the lm_head never. dtype: the LM's weights and compute dtype (bf16 on GPU);
    fp8: the decoder Linears stored in fp8."""
    from library.models.family import fp8_prepare
    from library.models.text_encoders import load_qwen3_vl_language_model

    llm = load_qwen3_vl_language_model(path, max(taps), dtype, fp8_prepare(fp8, "llm"))
    return Flux3TextEncoder(llm, load_flux3_tokenizer(path, tokenizer), taps, max_length, pad_multiple)
