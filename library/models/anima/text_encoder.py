"""Anima prompt encoding: Qwen3-0.6B on our LLM core, and the T5 token ids the transformer's LLM adapter takes.

As diffusers' AnimaTextEncoderStep.encode_prompt (modular_pipelines/anima/encoders.py; sd-scripts'
strategy_anima.py computes the same at max_length padding):
- the prompt is tokenized by Qwen3's tokenizer as it is: no chat template, no special token added (Qwen2Tokenizer
  adds none), cut at max_sequence_length 512 and padded on the right to the batch's longest ("longest");
- Qwen3Model runs with that padding mask and positions 0..L-1 (transformers' default when given none); the state
  read is last_hidden_state: the last decoder layer's output after the final norm (all 28 layers of Qwen3-0.6B run);
- the state is zeroed where the mask is 0; a batch of empty prompts has no token at all, and the pipeline then
  gives each one token, id 0, mask 0 (a zero state): what sd-scripts' caption dropout caches for "" too;
- the same prompt is tokenized by T5's tokenizer (google/t5-v1_1-xxl's vocabulary of 32100 pieces, the adapter's
  embedding holds 32128 rows), `</s>` appended, cut at 512 and padded to the batch's longest: ids and mask only,
  no T5 model runs ("" -> [</s>], mask 1).

encode(captions) -> (qwen [B, S, 1024] float32, zero past each row's tokens; qwen_mask [B, S] bool; t5_ids
[B, T] int64, the tokenizer's pad id (0) past each row's tokens; t5_mask [B, T] bool), real tokens first in every
row. We pad both ourselves (so a tokenizer configured to pad on the left cannot move the real tokens): on the
right, as the released tokenizers pad, a real query never sees a pad key (causal attention), so each prompt's
states are those of the prompt run alone.

Files: the pipeline repo's text_encoder/ (a saved Qwen3Model: `layers.*` keys, config.json) with tokenizer/ and
t5_tokenizer/ beside it, or a single Qwen3 .safetensors (ComfyUI's text_encoders/qwen_3_06b_base.safetensors:
Qwen3ForCausalLM's `model.*` keys, tied head, no config.json: shaped by its tensors with Qwen3-0.6B's RoPE and
norm epsilon), the tokenizers in its folder, in tokenizer/ / t5_tokenizer/ beside it or given (sd-scripts'
--t5_tokenizer_path).

Memory planner: Qwen3-0.6B as loaded here (embeddings, 28 layers, final norm; tied, so no head), counted on meta
by anima_text_weights(): TextWeights(596_049_920, fp8_weights=440_401_920, fp8_scales=6_881_280) (fp8: the 196
decoder Linears, one scale per 64 weights; the 155.6 M-parameter embedding stays bf16).
"""

from __future__ import annotations

import os

import torch

from library.io import CheckpointError, component_folder
from library.models.llm import LLMConfig
from library.models.text_encoders import right_padded

ANIMA_MAX_LENGTH = 512  # the pipeline's max_sequence_length default, for both tokenizers
T5_VOCAB = 32128  # rows of the LLM adapter's T5 token embedding (t5-v1_1-xxl's padded vocabulary): ids must fit
# Qwen/Qwen3-0.6B-Base's config.json (sd-scripts' configs/qwen3_06b): what a single file without config.json is
# shaped like (its RoPE theta, norm epsilon and context; the sizes come from the file's tensors).
QWEN3_0_6B = LLMConfig(
    vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=3072,
    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=False,
    max_position_embeddings=32768, head_dim=128, qk_norm=True,
)


class AnimaTextEncoder:
    """encode(captions) -> (qwen, qwen_mask, t5_ids, t5_mask): the LLM adapter's inputs (module docstring)."""

    def __init__(self, llm, tokenizer, t5_tokenizer, max_length: int = ANIMA_MAX_LENGTH):
        self.llm, self.tokenizer, self.t5_tokenizer = llm.eval().requires_grad_(False), tokenizer, t5_tokenizer
        self.max_length = max_length

    @property
    def embed_dim(self) -> int:
        return self.llm.config.hidden_size

    def token_rows(self, captions: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """(Qwen3 rows, T5 rows): each caption's tokens as the pipeline's two tokenizer calls give them, unpadded."""
        cut = {"truncation": True, "max_length": self.max_length, "padding": False}
        return self.tokenizer(list(captions), **cut).input_ids, self.t5_tokenizer(list(captions), **cut).input_ids

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        qwen_rows, t5_rows = self.token_rows(captions)
        device = self.llm.model.embed_tokens.weight.device
        pad = self.tokenizer.pad_token_id
        # a batch of empty prompts: one masked pad each, as the pipeline makes it; any id: a pad's output is zeroed
        ids, mask = right_padded(qwen_rows, 0 if pad is None else pad, device, max(1, max(map(len, qwen_rows))))
        positions = torch.arange(ids.shape[1], device=device)  # int64 0..L-1: transformers' default
        (state,) = self.llm.selected_hidden_states(ids, mask, (self.llm.config.num_layers,), position_ids=positions)
        qwen = torch.where(mask[..., None], state.float(), 0.0)  # compute dtype -> float32 (the cache's)
        t5_ids, t5_mask = right_padded(t5_rows, self.t5_tokenizer.pad_token_id or 0, device,
                                       max(1, max(map(len, t5_rows))))
        return qwen, mask, t5_ids, t5_mask


def anima_llm_config(weights: str) -> LLMConfig:
    """The Qwen3 of `weights` (text_encoder/, an HF folder or a .safetensors): its config.json in or beside it, else
    (a single file) Qwen3-0.6B's shaped by the file's tensors. A model without Qwen3's q/k norms is refused."""
    from library.models.llm import _find_config, config_json_path
    from library.models.text_encoders import qwen3_config_from_shapes

    if os.path.isfile(weights) and not os.path.isfile(config_json_path(weights)):
        return qwen3_config_from_shapes(weights, QWEN3_0_6B, "Qwen3 language model (Anima's is Qwen3-0.6B)")
    config = _find_config(weights)
    if not config.qk_norm:
        raise CheckpointError(f"{config_json_path(weights)}: Anima's text encoder is Qwen3 (q/k norms); this config "
                              f"is another model (qkv_bias {config.qkv_bias}, width {config.hidden_size})")
    return config


def _load_tokenizer_of(weights: str, given: str | None, sibling: str, kind: str):
    """The `kind` tokenizer (text_encoders.tokenizer_folder: `given`, else in or beside the weights); a given folder
    holding another kind is refused too (both tokenizers are given side by side and swap easily). A T5 one's ids
    must fit the adapter's T5_VOCAB rows."""
    from transformers import AutoTokenizer

    from library.models.text_encoders import tokenizer_folder, tokenizer_kind

    folder = tokenizer_folder(weights, given, sibling, kind)
    if given is not None and not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        raise CheckpointError(f"{folder}: no tokenizer_config.json; expected the folder of Anima's {kind} tokenizer")
    if given is not None and tokenizer_kind(folder) not in (kind, None):
        raise CheckpointError(f"{folder}: a {tokenizer_kind(folder)} tokenizer, given where Anima needs its {kind} one")
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if kind == "T5" and len(loaded) > T5_VOCAB:
        raise CheckpointError(f"{folder}: a tokenizer of {len(loaded)} tokens; the LLM adapter embeds T5 ids below "
                              f"{T5_VOCAB} (google/t5-v1_1-xxl's tokenizer)")
    return loaded


def load_anima_text_encoder(
    path: str,
    t5_tokenizer: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    fp8: str | None = None,
    tokenizer: str | None = None,
    max_length: int = ANIMA_MAX_LENGTH,
) -> AnimaTextEncoder:
    """The encoder from an Anima pipeline repo (or its text_encoder/ folder) or a single Qwen3 file (module
    docstring). t5_tokenizer / tokenizer: the tokenizer folders when not beside the weights. dtype: the LM's weights
    and compute dtype (bf16 on GPU); fp8: "fp8" / "fp8_scaled" for the decoder Linears stored in fp8."""
    from library.models.family import fp8_prepare
    from library.models.llm import load_llm

    weights = component_folder(path, "text_encoder")
    qwen_tokenizer = _load_tokenizer_of(weights, tokenizer, "tokenizer", "Qwen2")  # before the weights: a quick error
    t5 = _load_tokenizer_of(weights, t5_tokenizer, "t5_tokenizer", "T5")
    config = anima_llm_config(weights)
    # keep_layers = all: last_hidden_state reads the last layer; a stored lm_head (untied copy) is never read
    llm = load_llm(weights, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=config.num_layers)
    return AnimaTextEncoder(llm, qwen_tokenizer, t5, max_length)


def anima_text_weights(config: LLMConfig = QWEN3_0_6B):
    """The memory planner's TextWeights of what load_anima_text_encoder keeps of `config`, built on meta: the
    embeddings, every decoder layer, the final norm, no head; fp8: the decoder Linears (the llm spec's rules)."""
    from library.models.llm import LLM
    from library.models.llm_spec import FP8
    from library.models.text_encoders import module_text_weights

    with torch.device("meta"):
        llm = LLM(config)
        llm.truncate_for_hidden_states(config.num_layers)
    return module_text_weights(llm, FP8)


def anima_caption_token_limit(path: str, t5_tokenizer: str | None = None, tokenizer: str | None = None):
    """-> TokenLimit: both tokenizers cut a caption at 512 tokens; a caption counts as the longer of its Qwen3 and
    its T5 token rows (T5's `</s>` included), so the dataset check warns when either cuts it."""
    from library.data.check import TokenLimit

    weights = component_folder(path, "text_encoder")
    qwen = _load_tokenizer_of(weights, tokenizer, "tokenizer", "Qwen2")
    t5 = _load_tokenizer_of(weights, t5_tokenizer, "t5_tokenizer", "T5")

    def count(text: str) -> int:
        return max(len(qwen(text, verbose=False).input_ids), len(t5(text, verbose=False).input_ids))

    return TokenLimit("Qwen3 / T5", ANIMA_MAX_LENGTH, count)
