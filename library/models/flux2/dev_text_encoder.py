"""FLUX.2 [dev] prompt encoding: the language model of Mistral Small 3.1 24B on our LLM core.

As diffusers' Flux2Pipeline.encode_prompt / _get_mistral_3_small_prompt_embeds:
- `[IMG]` is removed from each prompt (format_input: the Pixtral processor counts it as an image);
- each prompt becomes a system message (BFL's DEV_SYSTEM_MESSAGE) and a user message, both as lists
  of text parts, rendered by the chat template with add_generation_prompt=False;
- the pipeline tokenizes through the PixtralProcessor's apply_chat_template, which adds no special
  tokens when the rendered text already starts with the BOS token (Mistral's template writes it)
  and otherwise lets the tokenizer add them; padding="max_length" (the tokenizer's side),
  truncation, max_length 512;
- the model runs with the padding mask and, as transformers does when given no position_ids,
  positions 0..L-1 for every row, pads included; pad rows are kept;
- hidden_states[10], [20], [30] (0 = embeddings, k = layer k's output) are stacked per token:
  [B, 512, 3 * 5120] = [B, 512, 15360], the [dev] transformer's joint_attention_dim;
- text ids as [klein]'s: (0, 0, 0, token index).

The processor itself is not needed: for text-only messages it renders the template and calls its
tokenizer, which this module does directly. The vision tower and projector of the checkpoint are
never read (text never reaches them); only the first 30 of the 40 decoder layers are loaded, no lm_head.
Outputs are float32 whatever dtype the weights run in.
"""

from __future__ import annotations

import os

from library.data.tokenizer import folder_chat_template
from library.io import component_folder
from library.models.flux2.text_encoder import KleinTextEncoder

DEV_HIDDEN_LAYERS = (10, 20, 30)  # the pipeline's text_encoder_out_layers default
DEV_MAX_LENGTH = 512  # the pipeline's max_sequence_length default
# diffusers' flux2/system_messages.py SYSTEM_MESSAGE (from BFL's flux2 repo), verbatim.
DEV_SYSTEM_MESSAGE = (
    "You are an AI that reasons about image descriptions. You give structured responses focusing on object "
    "relationships, object\nattribution and actions without speculation."
)
# What the Mistral Small 3.1 chat template renders for one system and one user text message and no
# generation prompt: used only when neither the tokenizer nor its folder carries a chat template.
MISTRAL_PROMPT = "{bos}[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{prompt}[/INST]"


def dev_messages(prompt: str, system_message: str = DEV_SYSTEM_MESSAGE) -> list[dict]:
    """The pipeline's format_input for one text prompt (no images)."""
    return [
        {"role": "system", "content": [{"type": "text", "text": system_message}]},
        {"role": "user", "content": [{"type": "text", "text": prompt.replace("[IMG]", "")}]},
    ]


def dev_prompt_text(tokenizer, prompt: str, template: str | None = None) -> str:
    """The text the pipeline's processor tokenizes for `prompt`."""
    if not template:
        return MISTRAL_PROMPT.format(bos=tokenizer.bos_token or "", system=DEV_SYSTEM_MESSAGE,
                                     prompt=prompt.replace("[IMG]", ""))
    return tokenizer.apply_chat_template(dev_messages(prompt), chat_template=template, tokenize=False,
                                         add_generation_prompt=False)


def adds_special_tokens(tokenizer, text: str) -> bool:
    """Whether the processor lets the tokenizer add its special tokens to `text`: not when the
    template wrote BOS already."""
    bos = tokenizer.bos_token
    return not (bos is not None and text.startswith(bos))


class DevTextEncoder(KleinTextEncoder):
    """encode(prompts) -> (embeds [B, max_length, 3 * D] float32, text_ids [B, max_length, 4] int64),
    [klein]'s stacking with [dev]'s prompt format and layers."""

    def __init__(self, llm, tokenizer, hidden_layers=DEV_HIDDEN_LAYERS, max_length: int = DEV_MAX_LENGTH):
        super().__init__(llm, tokenizer, hidden_layers, max_length)
        self.template = folder_chat_template(tokenizer)

    def tokenize(self, prompts: list[str]):
        texts = [dev_prompt_text(self.tokenizer, p, self.template) for p in prompts]
        # The processor's rule, decided on the first text.
        return self.tokenizer(texts, add_special_tokens=adds_special_tokens(self.tokenizer, texts[0]), padding="max_length",
                              truncation=True, max_length=self.max_length, return_tensors="pt")


def load_dev_text_encoder(path: str, tokenizer: str | None = None, dtype=None, config=None, fp8: str | None = None,
                          hidden_layers=DEV_HIDDEN_LAYERS, max_length: int = DEV_MAX_LENGTH) -> DevTextEncoder:
    """The [dev] text encoder from a FLUX.2-dev repo (text_encoder/ + tokenizer/), a Mistral3 or
    Mistral HF folder (sharded or not; `language_model.model.*` or `model.language_model.*` keys)
    or a single language-model file (config: MISTRAL_SMALL_3_1 unless a config.json is beside it).
    fp8: the decoder Linears stored in fp8. Only the layers up to max(hidden_layers) are read."""
    import torch

    from library.models.family import fp8_prepare
    from library.models.llm import MISTRAL_SMALL_3_1, _find_config, load_llm
    from library.models.text_encoders import _load_tokenizer

    path = component_folder(path, "text_encoder")
    if config is None and os.path.isfile(path) and not os.path.isfile(os.path.join(os.path.dirname(path), "config.json")):
        config = MISTRAL_SMALL_3_1
    config = config or _find_config(path)
    if config.qk_norm or config.qkv_bias:  # e.g. [klein]'s Qwen3 given to a [dev] transformer
        raise ValueError(f"{path}: FLUX.2 [dev] needs the Mistral Small 3.1 language model (Mistral3 / Mistral), "
                         f"this is a Qwen-style model (q/k norms or qkv bias); FLUX.2 [klein] uses Qwen3")
    llm = load_llm(path, config=config, dtype=dtype or torch.float32, prepare=fp8_prepare(fp8, "llm"),
                   keep_layers=max(hidden_layers))
    return DevTextEncoder(llm, _load_tokenizer(path, tokenizer, "tokenizer", "Mistral"), hidden_layers, max_length)
