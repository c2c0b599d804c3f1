"""HiDream-O1-Image's prompt ids: the model has no separate text encoder; the prompt's token ids enter the
denoiser (its Qwen3-VL language model), so a caption is cached as its ids.

As the peers build a text-to-image prompt (musubi-tuner's hidream_o1_utils.build_t2i_input_ids and
pipeline.build_t2i_text_sample, ai-toolkit's HiDreamO1Pipeline.encode_prompt, ComfyUI's HiDreamO1Tokenizer):
- the prompt is one user message through the processor's chat template with the generation prompt
  (`apply_chat_template(add_generation_prompt=True)`: no system turn, no think block), then `<|boi_token|>`
  and one `<|tms_token|>`, tokenized whole with no special tokens added:
  `<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n<|boi_token|><|tms_token|>`;
- the unconditional prompt of classifier-free guidance is " " (a space) through the same template;
  an empty caption (caption dropout) is the empty prompt through it, as the peers would tokenize it;
- nothing is cut: none of the peers applies a length limit (ComfyUI's tokenizer takes 99,999,999 tokens).
  The layout sets one: the text takes positions 0..T-1 and the image's first patch 4096 on the three M-RoPE
  axes (get_rope_index_fix_point's fix point), so a row of more than 4096 tokens would run into the image's
  positions, which the model never saw. Such a caption is refused (caption_token_limit, and encode itself).

Where we differ in form, not in ids: the boi / tms ids are appended to the template's ids rather than
tokenized with it. They are added tokens, which the tokenizer splits off before its pre-tokenizer, so the
template's text tokenizes the same either way (tests/test_hidream_o1_text.py checks the peers' form).

The tokenizer is the HiDream-O1 processor's (the HF repo's root holds its files; a Qwen3-VL tokenizer lacks
the HiDream-O1 tokens, 151669-151673 in the released one); for ComfyUI's single file, which holds none, a
`tokenizer` folder beside it (or given). The special ids are looked up by their token strings, so a tiny
tokenizer with other ids works alike.
"""

from __future__ import annotations

import os

import torch

from library.io import CheckpointError

BOI_TOKEN = "<|boi_token|>"  # begin of image: the last token of the text prefix the image follows
TMS_TOKEN = "<|tms_token|>"  # the timestep token: its embedding is replaced by the model's time embedding
NEGATIVE_PROMPT = " "  # the pipelines' unconditional prompt
IMAGE_POSITION = 4096  # where the target image's positions start (the peers' fix_point)
MAX_TEXT_TOKENS = IMAGE_POSITION  # a row's text (template, prompt, boi, tms) ends below the image's positions


def chat_text(tokenizer, prompt: str) -> str:
    """The chat template's text of one user message with the generation prompt."""
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class HiDreamO1PromptIds:
    """encode(captions) -> per caption {"input_ids": int64 [T], "length": int64 []}: T = the row's token count
    (template + prompt + boi + tms). A batch's rows are zero-padded to the longest when collated, and id 0 is a
    real token, so the length says where each row ends."""

    def __init__(self, tokenizer, folder: str):
        if not getattr(tokenizer, "chat_template", None):
            raise CheckpointError(f"{folder}: the tokenizer has no chat template (tokenizer_config.json, "
                                  f"chat_template.jinja or chat_template.json); HiDream-O1's processor files have one")
        vocabulary = tokenizer.get_vocab()
        missing = [t for t in (BOI_TOKEN, TMS_TOKEN) if t not in vocabulary]
        if missing:
            raise CheckpointError(f"{folder}: the tokenizer has no {' or '.join(missing)}: not HiDream-O1's (a "
                                  f"Qwen3-VL tokenizer lacks its tokens); use the HiDream-O1-Image repo's processor "
                                  f"files (its root folder)")
        self.tokenizer, self.folder = tokenizer, folder
        self.boi_id, self.tms_id = vocabulary[BOI_TOKEN], vocabulary[TMS_TOKEN]

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        """Each prompt's row: the chat template's ids, then boi and tms; an empty caption stays empty (a sample without
        --n encodes NEGATIVE_PROMPT: the family's empty_negative)."""
        texts = [chat_text(self.tokenizer, p) for p in prompts]
        return [ids + [self.boi_id, self.tms_id] for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def encode(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        rows = self.token_ids(captions)
        for caption, row in zip(captions, rows):
            if len(row) > MAX_TEXT_TOKENS:
                raise ValueError(f"caption is {len(row)} tokens with HiDream-O1's template; at most {MAX_TEXT_TOKENS} "
                                 f"fit before the image's positions: {caption[:60]!r}")
        return [{"input_ids": torch.tensor(row, dtype=torch.int64), "length": torch.tensor(len(row), dtype=torch.int64)}
                for row in rows]


def hidream_o1_tokenizer_folder(weights_path: str, tokenizer: str | None = None) -> str:
    """The processor's folder: `tokenizer` if given, else the weights folder (the HF repo's root), else a
    `tokenizer` folder beside the single file or beside the weights folder. No torch: checked before caching."""
    from library.models.text_encoders import tokenizer_folder

    return tokenizer_folder(weights_path, tokenizer, "tokenizer", "Qwen2", beside_file=True)


def load_hidream_o1_prompt_ids(weights_path: str, tokenizer: str | None = None,
                               tms_token_id: int | None = None) -> HiDreamO1PromptIds:
    """The prompt ids of the transformer at `weights_path` (an HF folder or ComfyUI's single file). tms_token_id: the
    transformer config's, which the tokenizer's <|tms_token|> must be: the model replaces the embedding of that id
    by the time, so ids of another (another release's tokenizer, a small one beside a released file, read with the
    released 151673) would train and sample with no time in the model and fail nowhere. Checked once, here."""
    from library.models.text_encoders import load_chat_tokenizer

    folder = hidream_o1_tokenizer_folder(weights_path, tokenizer)
    ids = HiDreamO1PromptIds(load_chat_tokenizer(folder), os.path.abspath(folder))
    if tms_token_id is not None and ids.tms_id != tms_token_id:
        raise CheckpointError(f"{ids.folder}: the tokenizer's {TMS_TOKEN} is id {ids.tms_id}, the transformer's "
                              f"({weights_path}) tms_token_id is {tms_token_id} (its config; a file without our "
                              f"metadata or config.json is read with the released 151673): the time would never "
                              f"enter the model; use the tokenizer of this model's release")
    return ids


def hidream_o1_caption_token_limit(ids: HiDreamO1PromptIds):
    """-> TokenLimit: a caption's row counted as encode builds it; over MAX_TEXT_TOKENS it is refused (nothing cut)."""
    from library.data.check import TokenLimit

    return TokenLimit("Qwen3-VL", MAX_TEXT_TOKENS, lambda text: len(ids.token_ids([text])[0]), refuses=True)
