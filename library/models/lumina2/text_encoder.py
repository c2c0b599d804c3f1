"""Lumina Image 2.0 prompt encoding: Gemma-2-2B on our LLM core (library/models/llm.py).

As diffusers' Lumina2Pipeline.encode_prompt / _get_gemma_prompt_embeds (pipelines/lumina2/pipeline_lumina2.py):
- a prompt becomes `system_prompt + " <Prompt Start> " + prompt` (the pipeline's default system prompt:
  LUMINA2_SYSTEM_PROMPT; an empty one still leaves " <Prompt Start> " in front there);
- the negative prompt gets no system prompt at all: the pipeline encodes it as it is ("" by default: the <bos>
  token alone); sd-scripts' strategy_lumina does the same (tokenize(..., is_negative=True)), and with an empty
  --system_prompt it adds nothing to the captions either: encode(captions, None);
- Gemma's tokenizer prepends <bos>, cuts at max_sequence_length 256 and pads on the right to 256;
- Gemma2Model runs with that mask and positions 0..255 (transformers' default) and the state read is
  hidden_states[-2]: the output of decoder layer 25 of 26, no final norm. transformers 5.23 runs Gemma 2 eagerly
  with its attention softcap 50 (Gemma2Model has no SDPA path); so do we (llm.py's module docstring: ComfyUI
  drops the cap; sd-scripts takes its transformers 4.54.1's default, a Gemma2Model._from_config without
  attn_implementation).

encode(captions, system_prompt) -> (hidden [B, S, 2304] float32, zero at the pads; mask [B, S] bool, real tokens
first), S the batch's longest row (<= 256): a real token never sees a pad (causal attention, right padding), so its
state is the one of the 256-padded run; the transformer masks the rest (its own test shows its output does not
depend on the padding). Only the 25 layers read are loaded and run; the final norm and the head never are.

Files: the diffusers repo's text_encoder/ (a saved Gemma2Model: `layers.*` keys, config.json) with tokenizer/
beside it, a Gemma 2 HF folder, or ComfyUI's single file gemma_2_2b_fp16.safetensors (Gemma2's `model.*` keys, no
head, no config.json: shaped by its tensors like GEMMA2_2B; the sentencepiece model it stores under `spiece_model`
is not read: the tokenizer comes from `tokenizer` or a folder beside it, e.g. the diffusers repo's tokenizer/), or
Neta Lumina's / NetaYume Lumina's all-in-one ComfyUI checkpoint (NetaYumev35_pretrained_all_in_one.safetensors): the
same Gemma under `text_encoders.gemma2_2b.transformer.` (llm.py llm_reader; sd-scripts' load_gemma2 "Neta-Lumina
support" strips it too), read and shaped as that single file, the transformer and VAE beside it never read; its
`text_encoders.gemma2_2b.spiece_model` neither (sentencepiece is not a dependency): the tokenizer comes from
`tokenizer`, the file's folder or a tokenizer/ folder beside the file (text_encoders.tokenizer_folder).

Memory planner: lumina2_text_weights() counts Gemma-2-2B as loaded here (embedding 589,824,000, 25 of 26 layers of
77,865,984, the final norm's 2,304 (loaded, never run), no head) on meta: TextWeights(2,536,475,904,
fp8_weights=1,946,419,200, fp8_scales=30,412,800) (fp8: the 175 decoder Linears, one scale per 64 weights; the
embedding stays bf16).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from library.io import CheckpointError, component_folder
from library.models.llm import GEMMA2_2B, LLMConfig
from library.models.text_encoders import right_padded, second_to_last_layer

LUMINA2_MAX_LENGTH = 256  # the pipeline's max_sequence_length default (sd-scripts' gemma2_max_token_length too)
PROMPT_START = " <Prompt Start> "  # between the system prompt and the prompt, spaces included (the pipeline's)
# Lumina2Pipeline.system_prompt: what its encode_prompt puts before every prompt when given none
LUMINA2_SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of "
                         "image-text alignment based on textual prompts or user prompts.")
# sd-scripts' docs/lumina_train_network.md recommends these for --system_prompt (its default is none: "")
SD_SCRIPTS_SYSTEM_PROMPTS = (
    "You are an assistant designed to generate high-quality images based on user prompts.",
    "You are an assistant designed to generate high-quality images with the highest degree of image-text "
    "alignment based on textual prompts.",
)


def lumina2_prompt_text(caption: str, system_prompt: str | None) -> str:
    """The text the tokenizer gets: the pipeline's `system_prompt + " <Prompt Start> " + caption`; None (a negative
    prompt, sd-scripts without a system prompt): the caption as it is."""
    return caption if system_prompt is None else system_prompt + PROMPT_START + caption


class Lumina2TextEncoder:
    """encode(captions, system_prompt) -> (hidden, mask) (module docstring); `.llm` is the Gemma 2 (for .to())."""

    def __init__(self, llm, tokenizer, max_length: int = LUMINA2_MAX_LENGTH):
        self.layer = second_to_last_layer(llm, "Lumina2TextEncoder")
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.max_length = max_length

    @property
    def embed_dim(self) -> int:
        return self.llm.config.hidden_size

    def token_rows(self, captions: list[str], system_prompt: str | None) -> list[list[int]]:
        """Each prompt's ids as the pipeline's tokenizer call gives them (<bos> first, cut at max_length), unpadded."""
        texts = [lumina2_prompt_text(c, system_prompt) for c in captions]
        return self.tokenizer(texts, truncation=True, max_length=self.max_length, padding=False).input_ids

    @torch.no_grad()
    def encode(self, captions: list[str], system_prompt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_rows(captions, system_prompt)
        device = self.llm.model.embed_tokens.weight.device
        pad = self.tokenizer.pad_token_id
        ids, mask = right_padded(rows, 0 if pad is None else pad, device)  # int64 / bool [B, S], S = longest row
        positions = torch.arange(ids.shape[1], device=device)  # int64 0..S-1: transformers' default
        (state,) = self.llm.selected_hidden_states(ids, mask, (self.layer,), position_ids=positions)
        return torch.where(mask[..., None], state.float(), 0.0), mask  # compute dtype -> float32 (the cache's)


def gemma2_config_from_shapes(path: str, like: LLMConfig = GEMMA2_2B) -> LLMConfig:
    """The Gemma 2 of a single file without config.json: vocabulary, width, depth, heads and MLP from its tensors,
    `like`'s head_dim (Gemma-2-2B's 256: q_proj's rows are heads x head_dim, the shapes cannot split them), RoPE,
    epsilon, window and softcaps. A file without Gemma's post-feedforward norms is refused, naming the file. The
    all-in-one file's Gemma is read under its prefix (llm_reader), as load_llm reads it."""
    from library.models.llm import checkpoint_key_to_llm, llm_reader

    reader = llm_reader(path)
    keys = {checkpoint_key_to_llm(k, False): k for k in reader.keys()}

    def shape(name: str) -> tuple[int, ...]:
        if name not in keys:
            raise CheckpointError(f"{path}: no tensor for {name} (keys like {next(iter(reader.keys()), None)!r}); "
                                  f"not a Gemma 2 text encoder (Lumina Image 2.0's is Gemma-2-2B), or put its "
                                  f"config.json beside it")
        return reader.shape(keys[name])

    shape("model.layers.0.post_feedforward_layernorm.weight")  # Gemma 2's own norm: a Llama / Qwen file stops here
    vocab, width = shape("model.embed_tokens.weight")
    layers = 1 + max(int(n.split(".")[2]) for n in keys if n and n.startswith("model.layers."))
    rows = [shape(f"model.layers.0.self_attn.{p}_proj.weight")[0] for p in "qk"]
    if any(r % like.head_dim for r in rows) or rows[0] % rows[1]:
        raise CheckpointError(f"{path}: q_proj / k_proj rows {rows} are not whole heads of {like.head_dim} "
                              f"(Gemma-2-2B's head_dim); put the model's config.json beside it")
    heads, kv_heads = (r // like.head_dim for r in rows)
    window_layers = tuple(i for i in range(layers) if i % 2 == 0)  # Gemma2Config's alternation
    return dataclasses.replace(like, vocab_size=vocab, hidden_size=width, num_layers=layers, num_heads=heads,
                               num_kv_heads=kv_heads, intermediate_size=shape("model.layers.0.mlp.gate_proj.weight")[0],
                               window_layers=window_layers, tie_word_embeddings="lm_head.weight" not in keys)


def lumina2_llm_config(weights: str) -> LLMConfig:
    """The Gemma 2 of `weights` (text_encoder/, an HF folder or a .safetensors): its config.json in or beside it, else
    (a single file) shaped by its tensors. Another model's config is refused."""
    from library.models.llm import _find_config, config_json_path

    if os.path.isfile(weights) and not os.path.isfile(config_json_path(weights)):
        return gemma2_config_from_shapes(weights)
    config = _find_config(weights)
    if not config.gemma_norms:
        raise CheckpointError(f"{config_json_path(weights)}: Lumina Image 2.0's text encoder is Gemma 2 (Gemma-2-2B); "
                              f"this config is another model (width {config.hidden_size}, {config.num_layers} layers)")
    return config


def load_lumina2_tokenizer(weights: str, tokenizer: str | None = None):
    """Gemma's tokenizer: the `tokenizer` folder, else in the weights folder, a tokenizer/ folder beside a single file
    (ComfyUI's Gemma file, the all-in-one checkpoint) or beside the weights folder (tokenizer/ of the diffusers repo).
    A folder holding another kind (a Qwen2 / T5 / CLIP one) is refused."""
    from transformers import AutoTokenizer

    from library.models.text_encoders import tokenizer_folder, tokenizer_kind

    folder = tokenizer_folder(weights, tokenizer, "tokenizer", "Gemma", beside_file=True)
    if tokenizer is not None and not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
        raise CheckpointError(f"{folder}: no tokenizer_config.json; expected the folder of Gemma 2's tokenizer")
    if tokenizer_kind(folder) not in ("Gemma", None):
        raise CheckpointError(f"{folder}: a {tokenizer_kind(folder)} tokenizer, given where Lumina Image 2.0 needs "
                              f"Gemma 2's")
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if loaded.bos_token_id is None or loaded("x").input_ids[:1] != [loaded.bos_token_id]:
        raise CheckpointError(f"{folder}: the tokenizer does not put <bos> first (Gemma's does; the encoder's states "
                              f"are those of <bos> + prompt)")
    return loaded


def load_lumina2_text_encoder(
    path: str,
    dtype: torch.dtype = torch.bfloat16,
    fp8: str | None = None,
    tokenizer: str | None = None,
    max_length: int = LUMINA2_MAX_LENGTH,
) -> Lumina2TextEncoder:
    """The encoder from a Lumina 2 pipeline repo (or its text_encoder/ folder), a Gemma 2 HF folder, ComfyUI's single
    file or the all-in-one checkpoint (module docstring). tokenizer: the tokenizer folder when not beside the weights.
    dtype: the LM's weights and compute dtype (bf16 on GPU); fp8: a base precision ("fp8" / "fp8_scaled" / ...) for the
    decoder Linears."""
    from library.models.family import fp8_prepare
    from library.models.llm import load_llm

    weights = component_folder(path, "text_encoder")
    gemma_tokenizer = load_lumina2_tokenizer(weights, tokenizer)  # before the weights: a quick error
    config = lumina2_llm_config(weights)
    llm = load_llm(weights, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"),
                   keep_layers=config.num_layers - 1)  # hidden_states[-2]: the last layer never runs
    return Lumina2TextEncoder(llm, gemma_tokenizer, max_length)


def lumina2_text_weights(config: LLMConfig = GEMMA2_2B):
    """The memory planner's TextWeights of what load_lumina2_text_encoder keeps of `config`, built on meta: the
    embedding, the first num_layers - 1 decoder layers and the (unused) final norm, no head; fp8: their Linears."""
    from library.models.llm import LLM
    from library.models.llm_spec import FP8
    from library.models.text_encoders import module_text_weights

    with torch.device("meta"):
        llm = LLM(config)
        llm.truncate_for_hidden_states(config.num_layers - 1)
    return module_text_weights(llm, FP8)


def lumina2_caption_token_limit(path: str, tokenizer: str | None = None, system_prompt: str | None = None):
    """-> TokenLimit: Gemma's tokenizer cuts the system-prompted caption at 256 tokens (<bos> and the system prompt
    included), so the dataset check warns when a caption's text would be cut."""
    from library.data.check import TokenLimit

    loaded = load_lumina2_tokenizer(component_folder(path, "text_encoder"), tokenizer)

    def count(text: str) -> int:
        return len(loaded(lumina2_prompt_text(text, system_prompt), verbose=False).input_ids)

    return TokenLimit("Gemma 2", LUMINA2_MAX_LENGTH, count)
