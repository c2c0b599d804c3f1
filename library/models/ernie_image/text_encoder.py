"""ERNIE-Image prompt encoding: the language model of Ministral 3 3B on our LLM core.

The encoder. ERNIE-Image's text_encoder/ is a transformers Mistral3Model (model_index.json), a Pixtral vision
tower and projector around the language model of Ministral 3 3B (Mistral's Ministral-3-3B-*-2512; the released
transformer's text_in_dim 3072 is its width, diffusers' default 2560 is not): 26 decoder layers, hidden 3072,
32 query / 8 key-value heads of 128, SwiGLU 9216, vocabulary 131072, tied embeddings (Mistral3Model has no
head), RMSNorm eps 1e-5, YaRN RoPE (theta 1e6, factor 16 over 16384 positions, beta 32 / 1, mscale =
mscale_all_dim = 1, so cos / sin are not scaled). 3.43 B language-model parameters; the vision part (~0.4 B) is
never read. The released text_config says model_type "mistral" (transformers runs MistralModel, which ignores
the config's llama_4_scaling_beta); a "ministral3" one (Ministral3Model) scales queries by 1 + beta log(1 +
floor(position / 16384)), exactly 1 below 16384 positions: read the same, longer prompts refused.

As diffusers' ErnieImagePipeline.encode_prompt (its modular ErnieImageTextEncoderStep and ai-toolkit's
get_prompt_embeds do the same):
- each prompt is tokenized alone: add_special_tokens (the tokenizer puts <s> in front), no chat template, no
  padding, truncation at the tokenizer's model_max_length (2048 in the released tokenizer_config.json); an empty
  token list would become [bos] ([0] without a BOS token): "" gives [<s>] already;
- the text encoder runs on those ids alone (no mask, positions 0..n-1) with output_hidden_states and the pipeline
  keeps hidden_states[-2][0], [n, 3072]. transformers' hidden_states are (the embeddings, layer 1's output, ...,
  layer 26's output after the final norm), so [-2] is the output of decoder layer 25 of 26 (0-based index 24),
  the second-to-last, before the final norm (the norm only enters the last entry). Layer 26 and the final norm
  play no part: we run layers 1..25 only (the norm's 3072 weights are read, never applied), no head, no vision;
- the negative prompt of classifier-free guidance is "", encoded the same way: one token, <s>;
- _pad_text zero-pads the list to the batch's longest, [B, T, 3072], and passes text_lens [B] int64 (each
  prompt's n): the transformer masks the text by text_lens.

What we compute: the batch right-padded to its longest prompt, the pads hidden as keys, positions 0..n-1. Causal
attention then gives each real token the tokens and positions of the pipeline's one-prompt run (equal up to the
matmuls' summation order; tests/test_ernie_image_text.py).

encode(prompts) -> (embeds [B, T, 3072] float32, mask [B, T] bool). Row i holds prompt i's n_i tokens, then
zeros; mask is True on the real tokens (text_lens = mask.sum(-1)); T = max n_i. A caption's cache is
embeds[i, :n_i]. The LM runs in the dtype it was loaded in (the compute dtype: bf16 on GPU, fp32 in the parity
tests); the outputs are cast to float32 for caching (diffusers keeps the text encoder's dtype until _pad_text
casts to the transformer's).

Memory planner: what load_ernie_text_encoder keeps of Ministral 3 3B (the embeddings, decoder layers 1..25, the
final norm; no head, no vision), counted on meta by ernie_text_weights(): TextWeights(3_312_608_256,
fp8_weights=2_909_798_400, fp8_scales=45_465_600) (fp8: the decoder Linears, one scale per 64 weights).
"""

from __future__ import annotations

import json
import math
import os

import torch

from library.io import CheckpointError, CheckpointReader, component_folder
from library.models.llm import LLMConfig, hidden_state_index
from library.models.text_encoders import right_padded

ERNIE_HIDDEN_STATE = -2  # the pipeline's outputs.hidden_states[-2]
# The language model of Ministral 3 3B as ERNIE-Image's text_encoder/config.json nests it (its text_config):
# the config of a single file that has no config.json beside it.
MINISTRAL_3_3B_TEXT_CONFIG = {
    "model_type": "mistral", "vocab_size": 131072, "hidden_size": 3072, "num_hidden_layers": 26,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9216,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "sliding_window": None,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                        "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1},
}


def _yarn_mscale(factor: float, mscale: float) -> float:
    """transformers' yarn get_mscale."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def mistral3_llm_config(config: dict) -> tuple[LLMConfig, int]:
    """(LLMConfig, the longest prompt in tokens, 0 = any) of a Mistral3 / Mistral / Ministral 3 config.json dict
    (its text_config where nested), as transformers runs the language model on text. Resolved here before
    LLMConfig.from_hf, which reads neither:
    - YaRN's mscale and mscale_all_dim (both set, no attention_factor): transformers' cos / sin scale
      mscale(factor, mscale) / mscale(factor, mscale_all_dim), passed on as attention_factor (1 for Ministral 3);
    - model_type ministral3: Mistral's layers and a query scale that is 1 below original_max_position_embeddings
      positions (returned as the longest prompt when llama_4_scaling_beta is set), read as mistral with its own
      sliding_window default (none, where Mistral's is 4096). llama_4_scaling_beta is dropped either way."""
    text = {**{k: v for k, v in config.items() if k != "text_config"}, **config.get("text_config", {})}
    key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = dict(text.get(key) or {})
    beta = rope.pop("llama_4_scaling_beta", None)
    longest = 0
    if text.get("model_type") == "ministral3":
        longest = int(rope.get("original_max_position_embeddings") or 0) if beta else 0
        text = {**text, "model_type": "mistral", "sliding_window": text.get("sliding_window")}
    mscale, all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    if yarn and rope.get("attention_factor") is None and mscale and all_dim:
        factor = rope.get("factor") or text["max_position_embeddings"] / rope["original_max_position_embeddings"]
        rope["attention_factor"] = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    return LLMConfig.from_hf({**text, key: rope}), longest


MINISTRAL_3_3B = mistral3_llm_config(MINISTRAL_3_3B_TEXT_CONFIG)[0]


class ErnieTextEncoder:
    """encode(prompts) -> (embeds [B, T, D] float32, mask [B, T] bool: each prompt's real tokens first)."""

    def __init__(self, llm, tokenizer, layer: int, longest: int = 0):
        if not 0 <= layer <= len(llm.model.layers):
            raise ValueError(f"ErnieTextEncoder: hidden state {layer} needs {layer} decoder layers, "
                             f"{len(llm.model.layers)} are loaded")
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.layer, self.longest = layer, longest

    @property
    def embed_dim(self) -> int:
        return self.llm.config.hidden_size

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's tokens as the pipeline has them: special tokens added, cut at the tokenizer's
        model_max_length; none -> [bos] ([0] without a BOS token)."""
        rows = self.tokenizer(list(prompts), add_special_tokens=True, truncation=True, padding=False).input_ids
        bos = self.tokenizer.bos_token_id
        return [list(r) or [bos if bos is not None else 0] for r in rows]

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_ids(prompts)
        counts = [len(r) for r in rows]
        if self.longest and max(counts) > self.longest:
            raise ValueError(f"ErnieTextEncoder: a prompt of {max(counts)} tokens; Ministral 3 scales the queries "
                             f"past {self.longest} positions, which this encoder does not")
        device = self.llm.model.embed_tokens.weight.device
        pad = self.tokenizer.pad_token_id or 0  # any id: a pad is a hidden key and its output is dropped
        ids, mask = right_padded(rows, pad, device)  # int64 / bool [B, T]
        length = ids.shape[1]
        positions = torch.arange(length, device=device)  # int64: 0..n-1 on each prompt's real tokens
        (state,) = self.llm.selected_hidden_states(ids, mask, (self.layer,), position_ids=positions)
        # compute dtype -> float32 (the cache's); the pads' rows -> 0
        return torch.where(mask[..., None], state.float(), 0.0), mask


def _single_file_config(path: str) -> LLMConfig:
    """Ministral 3 3B's language model, checked by the embedding width of a file without config.json."""
    reader = CheckpointReader(path)
    key = next((k for k in reader.keys() if k.endswith("embed_tokens.weight")), None)
    width = reader.shape(key)[-1] if key else None
    if width != MINISTRAL_3_3B.hidden_size:
        raise CheckpointError(f"{path}: embedding width {width} is not Ministral 3 3B's ({MINISTRAL_3_3B.hidden_size}, "
                              f"ERNIE-Image's text encoder); put its config.json beside it")
    return MINISTRAL_3_3B


def ernie_llm_config(path: str) -> tuple[LLMConfig, int]:
    """mistral3_llm_config of the config.json in or beside `path` (a folder, a .safetensors or an index), else
    Ministral 3 3B's for a single file. Errors name the file; a Qwen-style model is refused."""
    from library.models.llm import config_json_path

    config_path = config_json_path(path)
    if not os.path.isfile(config_path):
        if os.path.isdir(path):
            raise CheckpointError(f"{path}: text encoder folder has no config.json")
        return _single_file_config(path), 0
    with open(config_path) as f:
        try:
            config, longest = mistral3_llm_config(json.load(f))
        except ValueError as e:  # from_hf says "config.json: ...": name the file itself
            raise CheckpointError(f"{config_path}: {str(e).removeprefix('config.json: ')}") from None
    if config.qk_norm or config.qkv_bias:
        raise CheckpointError(f"{config_path}: ERNIE-Image needs Ministral 3's language model (Mistral3 / Mistral), "
                              f"this is a Qwen-style model (q/k norms or qkv bias)")
    return config, longest


def load_ernie_text_encoder(
    path: str,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    fp8: str | None = None,
    hidden_state: int = ERNIE_HIDDEN_STATE,
) -> ErnieTextEncoder:
    """The text encoder from an ERNIE-Image pipeline folder (text_encoder/: a Mistral3Model, tokenizer/), a Mistral3
    or Mistral HF folder (sharded or not; `language_model.*`, `model.language_model.*` or `language_model.model.*`
    keys) or a single language-model file (Ministral 3 3B unless a config.json is beside it), the tokenizer
    beside it or at `tokenizer`. Only the layers up to `hidden_state` are read (25 of 26); vision keys and a
    head never. dtype: the LM's weights and compute dtype (bf16 on GPU); fp8: the decoder Linears stored in fp8."""
    from library.models.family import fp8_prepare
    from library.models.llm import load_llm
    from library.models.text_encoders import _load_tokenizer

    weights = component_folder(path, "text_encoder")
    config, longest = ernie_llm_config(weights)
    layer = hidden_state_index(hidden_state, config.num_layers)
    llm = load_llm(weights, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=max(layer, 1))
    return ErnieTextEncoder(llm, _load_tokenizer(weights, tokenizer, "tokenizer", "Mistral"), layer, longest)


def ernie_text_weights(config: LLMConfig = MINISTRAL_3_3B, hidden_state: int = ERNIE_HIDDEN_STATE):
    """The memory planner's TextWeights of what load_ernie_text_encoder keeps of `config`, built on meta: the
    embeddings, the layers up to `hidden_state`, the final norm; fp8: the decoder Linears (the llm spec's rules)."""
    from library.models.llm import LLM
    from library.models.llm_spec import FP8
    from library.models.text_encoders import module_text_weights

    with torch.device("meta"):
        llm = LLM(config)
        llm.truncate_for_hidden_states(max(hidden_state_index(hidden_state, config.num_layers), 1))
    return module_text_weights(llm, FP8)
