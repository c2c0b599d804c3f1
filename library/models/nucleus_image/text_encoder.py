"""Nucleus-Image prompt encoding: the language model of Qwen3-VL-8B on our LLM core.

As diffusers' NucleusMoEImagePipeline.encode_prompt (ai-toolkit's get_prompt_embeds does the same):
- each prompt is a chat [system: DEFAULT_SYSTEM_PROMPT, user: [{"type": "text", "text": prompt}]] rendered by the
  processor's chat template with add_generation_prompt (NUCLEUS_CHAT_TEXT: system turn, user turn, `<|im_start|>
  assistant\\n`); "" (the negative prompt of classifier-free guidance, encoded in a call of its own) likewise;
- the Qwen3VLProcessor tokenizes the batch: cut at max_sequence_length real tokens (__call__'s 1024; a cut drops the
  template's tail, as there), padded to the longest and then to a multiple of 8 (pad_to_multiple_of=8), with an
  attention mask;
- Qwen3VLForConditionalGeneration runs on it with the mask and output_hidden_states; the pipeline keeps
  hidden_states[-8]. Qwen3-VL-8B has 36 decoder layers, so 37 states (0 = the embeddings, 36 = the last layer after
  the final norm) and [-8] is state 29: decoder layer 29's output, before the final norm. We run those 29 layers
  (the released text_encoder/ index lists 36 layers and an lm_head: 750 tensors with the vision tower's 351); no
  head, no vision tower, no final norm applied (its 4096 weights are read);
- the mask is dropped (None) when it is all ones. The transformer normalises each text token (txt_norm) and uses the
  text only as keys / values of its joint attention, masked keys taking no weight, at text RoPE positions
  max(h/2, w/2) + 0..T-1 over the padded length T (diffusers' NucleusMoEEmbedRope).

The padding side, which the cached form rests on. The pipeline passes none and Qwen3VLProcessor sets none (its
text_kwargs hold only return_token_type_ids), so the tokenizer's own applies: transformers' default "right" unless
tokenizer_config.json says otherwise. Qwen3-VL-8B-Instruct's says nothing: transformers-5 re-saves of it carry no
padding_side (re-saves keep an explicit one, as those of other models with "left" show) beside its model_max_length
262144, pad <|endoftext|> and processor_class Qwen3VLProcessor; NucleusAI/Nucleus-Image's processor/
tokenizer_config.json has the 239 lines of its text_encoder/ copy of it. (diffusers pipelines that want left padding
pass padding_side="left" themselves; this one does not.) So the released processor pads on the RIGHT, and:
- a prompt's n real tokens come first: at Qwen3-VL positions 0..n-1 (transformers 5 numbers a text-only call 0..L-1
  whatever the mask, 4.57 counted from the mask: the same for tokens in front), seeing only each other (causal, pads
  hidden as keys), and at the transformer's text positions offset + 0..n-1 whatever follows them;
- pad_to_multiple_of only appends masked pads (a prompt of 171 tokens alone gets 5; a batch is padded to its longest
  rounded up to 8). A caption cached as its own tokens [n, 4096] and zero-padded at the end with a mask (collate_batch's
  layout) is what the pipeline gives the transformer but for pads it masks: tests/test_nucleus_image_text.py runs
  diffusers' transformer on both (3.6e-7 apart, tiny and random);
- padded left (a tokenizer_config.json saying so), Qwen3-VL would give the real tokens the same states (its RoPE sees
  only their relative offsets: 1e-7 apart) but they would sit after ceil8(longest) - n pads, which shifts their text
  positions in the transformer by a count that depends on the batch's longest prompt (the tiny transformer's
  prediction moves by 1.4e-2 of 2.1): the cache would have to keep the pads. We reproduce the released right-padded
  layout whatever a tokenizer folder says: encode builds its own right-padded ids.

What we compute: the batch right-padded to its longest prompt, the pads hidden as keys, positions 0..n-1: each real
token's state as in the pipeline's batch or one-prompt call (equal up to the matmuls' summation order).

encode(prompts) -> (embeds [B, T, 4096] float32, mask [B, T] bool). Row i holds prompt i's n_i real tokens, then
zeros; mask is True on the real tokens; T = max n_i. A caption's cache is embeds[i, :n_i] with mask[i, :n_i]. The
LM runs in the dtype it was loaded in (the compute dtype: bf16 on GPU, fp32 in the parity tests); the outputs are
cast to float32 for caching (the pipeline keeps the text encoder's dtype).

Memory planner: what load_nucleus_text_encoder keeps of Qwen3-VL-8B (the embeddings, decoder layers 1..29, the final
norm), counted by nucleus_text_weights(path): TextWeights(6_217_780_480, fp8_weights=5_595_201_536,
fp8_scales=87_425_024) (fp8: the decoder Linears, one scale per 64 weights).
"""

from __future__ import annotations

import os

import torch

from library.io import component_folder
from library.models.llm import hidden_state_index
from library.models.text_encoders import right_padded

NUCLEUS_HIDDEN_STATE = -8  # the pipeline's default_return_index: outputs.hidden_states[-8]
NUCLEUS_MAX_SEQUENCE_LENGTH = 1024  # __call__'s default_max_sequence_length
NUCLEUS_PAD_MULTIPLE = 8  # the processor's pad_to_multiple_of: masked pads only; max_length must be a multiple
NUCLEUS_NEGATIVE_PROMPT = ""  # what __call__ encodes for classifier-free guidance without a negative prompt
NUCLEUS_SINGLE_FILE = "Qwen3-VL-8B"  # a single file without config.json must be this model (text_encoders)
# diffusers' DEFAULT_SYSTEM_PROMPT, verbatim (tests/test_nucleus_image_text.py compares them)
NUCLEUS_SYSTEM_PROMPT = (
    "You are an image generation assistant. Follow the user's prompt literally. Pay careful attention to spatial "
    "layout: objects described as on the left must appear on the left, on the right on the right. Match exact object "
    "counts and assign colors to the correct objects."
)
# What Qwen3-VL's chat template renders for the pipeline's two messages and the generation prompt: used when a
# tokenizer carries no chat template (e.g. one given beside a single-file checkpoint).
NUCLEUS_CHAT_TEXT = "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def nucleus_prompt_text(tokenizer, prompt: str, system: str = NUCLEUS_SYSTEM_PROMPT) -> str:
    """The text the pipeline tokenizes for `prompt`: its _format_prompt's apply_chat_template call, verbatim."""
    if not getattr(tokenizer, "chat_template", None):
        return NUCLEUS_CHAT_TEXT.format(system, prompt)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": [{"type": "text", "text": prompt}]}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class NucleusTextEncoder:
    """encode(prompts) -> (embeds [B, T, D] float32, mask [B, T] bool: each prompt's real tokens first)."""

    def __init__(self, llm, tokenizer, layer: int, max_length: int = NUCLEUS_MAX_SEQUENCE_LENGTH):
        if not 0 <= layer <= len(llm.model.layers):
            raise ValueError(f"NucleusTextEncoder: hidden state {layer} needs {layer} decoder layers, "
                             f"{len(llm.model.layers)} are loaded")
        if max_length % NUCLEUS_PAD_MULTIPLE:  # the processor refuses it (truncation and pad_to_multiple_of)
            raise ValueError(f"NucleusTextEncoder: max_length {max_length} is not a multiple of "
                             f"{NUCLEUS_PAD_MULTIPLE}, as the pipeline's processor needs (pad_to_multiple_of)")
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.layer, self.max_length = layer, max_length

    @property
    def embed_dim(self) -> int:
        return self.llm.config.hidden_size

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's real tokens as the processor has them: the chat template's text, cut at max_length."""
        texts = [nucleus_prompt_text(self.tokenizer, p) for p in prompts]
        return self.tokenizer(texts, truncation=True, max_length=self.max_length).input_ids

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_ids(prompts)
        device = self.llm.model.embed_tokens.weight.device
        pad = self.tokenizer.pad_token_id or 0  # any id: a pad is a hidden key and its output is dropped
        ids, mask = right_padded(rows, pad, device)  # int64 / bool [B, T]
        length = ids.shape[1]
        positions = torch.arange(length, device=device)  # int64: 0..n-1 on each prompt's real tokens (right padding)
        (state,) = self.llm.selected_hidden_states(ids, mask, (self.layer,), position_ids=positions)
        # compute dtype -> float32 (the cache's); the pads' rows -> 0
        return torch.where(mask[..., None], state.float(), 0.0), mask


def nucleus_tokenizer_folder(path: str, tokenizer: str | None = None) -> str:
    """The folder the tokenizer loads from: `tokenizer`, else the pipeline's processor/ beside text_encoder/ (what
    NucleusMoEImagePipeline tokenizes with; the released text_encoder/ holds a copy too), else a Qwen2 tokenizer in
    the weights folder or tokenizer/ beside it (text_encoders.tokenizer_folder)."""
    from library.models.text_encoders import tokenizer_folder, tokenizer_kind

    weights = component_folder(path, "text_encoder")
    folder = weights if os.path.isdir(weights) else os.path.dirname(os.path.abspath(weights))
    processor = os.path.join(os.path.dirname(folder.rstrip("/")), "processor")
    if tokenizer is None and os.path.isfile(os.path.join(processor, "tokenizer_config.json")):
        tokenizer = processor if tokenizer_kind(processor) in ("Qwen2", None) else None
    return tokenizer_folder(weights, tokenizer, "tokenizer", "Qwen2")


def load_nucleus_text_encoder(
    path: str,
    tokenizer: str | None = None,
    dtype: torch.dtype = torch.float32,
    fp8: str | None = None,
    hidden_state: int = NUCLEUS_HIDDEN_STATE,
    max_length: int = NUCLEUS_MAX_SEQUENCE_LENGTH,
) -> NucleusTextEncoder:
    """The text encoder from a Nucleus-Image pipeline folder (text_encoder/: Qwen3VLForConditionalGeneration,
    processor/: its Qwen3VLProcessor's files), a Qwen3-VL HF folder or a single file (Qwen3-VL-8B's language model
    shaped by its tensors when no config.json is beside it), the tokenizer as nucleus_tokenizer_folder finds it.
    Only the layers up to `hidden_state` are read (29 of 36); vision keys and the lm_head never. dtype: the LM's
    weights and compute dtype (bf16 on GPU); fp8: the decoder Linears stored in fp8."""
    from library.models.family import fp8_prepare
    from library.models.text_encoders import load_chat_tokenizer, load_qwen3_vl_language_model, qwen3_vl_language_config

    layer = hidden_state_index(hidden_state, qwen3_vl_language_config(path, NUCLEUS_SINGLE_FILE).num_layers)
    llm = load_qwen3_vl_language_model(path, max(layer, 1), dtype, fp8_prepare(fp8, "llm"), NUCLEUS_SINGLE_FILE)
    return NucleusTextEncoder(llm, load_chat_tokenizer(nucleus_tokenizer_folder(path, tokenizer)), layer, max_length)


def nucleus_text_weights(path: str, hidden_state: int = NUCLEUS_HIDDEN_STATE):
    """The memory planner's TextWeights of what load_nucleus_text_encoder reads of `path`: the embeddings, the
    decoder layers up to `hidden_state` and the final norm; no head, no vision tower (headers only)."""
    from library.models.text_encoders import qwen3_vl_language_config, qwen3_vl_text_weights

    layer = hidden_state_index(hidden_state, qwen3_vl_language_config(path, NUCLEUS_SINGLE_FILE).num_layers)
    return qwen3_vl_text_weights(path, max(layer, 1))
