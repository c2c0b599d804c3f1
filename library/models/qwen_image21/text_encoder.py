"""Qwen-Image-2.1 prompt encoding: the language model of Qwen3-VL-8B on our LLM core.

As diffusers' QwenImage21Pipeline._get_qwen_prompt_embeds / encode_prompt for a text-only prompt:
- the prompt (" " when empty: Qwen has no BOS) goes into the raw template string QWEN_IMAGE21_TEMPLATE,
  tokenized whole (not through apply_chat_template), no length limit;
- the text encoder (Qwen3VLForConditionalGeneration) runs the batch left-padded; the hidden state is
  the LAST decoder layer's output BEFORE the final RMSNorm (the pipeline hooks the norm away: that is
  what the transformer was trained on);
- each prompt's real tokens are kept, the system turn dropped (its token count, `drop`: the processor's
  chat template rendering of the system message, QWEN_IMAGE21_SYSTEM_TURN), right-padded with zeros
  to the longest, with a mask (None from encode_prompt when nothing is padded).

What we compute instead of the left-padded run: each prompt's real tokens alone, right-padded,
positions 0..n-1 (transformers' get_rope_index gives left-padded real tokens the same positions, equal
on Qwen3-VL's three M-RoPE axes, which is plain 1-D RoPE: core.mrope_tables), causal with pads hidden:
a real token sees the same tokens at the same positions. Qwen3-VL's language model is Qwen3's (QK norm,
no bias), which the LLM core runs; deepstack features only enter at image tokens, none here.

Differs from Krea 2's Qwen3-VL path (krea2/text_encoder.py): the 8B model, one hidden state (the last
layer, unnormalized) rather than 12 taps, Qwen-Image-2.1's own system prompt, no max_sequence_length,
and the vision tokens of a condition image (`<|image_pad|>` slots) which the edit path (not written yet)
would fill through transformers' vision tower.
"""

from __future__ import annotations

import os

import torch

from library.io import component_folder
from library.models.text_encoders import right_padded

QWEN_IMAGE21_SYSTEM = "Comprehend and analyze the provided prompt."
QWEN_IMAGE21_SYSTEM_TURN = f"<|im_start|>system\n{QWEN_IMAGE21_SYSTEM}<|im_end|>\n"
QWEN_IMAGE21_TEMPLATE = QWEN_IMAGE21_SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


class QwenImage21TextEncoder:
    """encode(prompts) -> (embeds [B, T, D] float32, zeros beyond each row's count; mask [B, T] bool,
    real tokens first)."""

    def __init__(self, llm, tokenizer):
        self.llm, self.tokenizer = llm.eval().requires_grad_(False), tokenizer
        self.drop = len(tokenizer(QWEN_IMAGE21_SYSTEM_TURN).input_ids)  # the pipeline's _drop_idx

    def token_ids(self, prompts: list[str]) -> list[list[int]]:
        return self.tokenizer([QWEN_IMAGE21_TEMPLATE.format(p or " ") for p in prompts]).input_ids

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.token_ids(prompts)
        device = self.llm.model.embed_tokens.weight.device
        ids, valid = right_padded(rows, self.tokenizer.pad_token_id or 0, device)  # int64 / bool [B, L]
        length = ids.shape[1]
        last = len(self.llm.model.layers)
        (hidden,) = self.llm.selected_hidden_states(ids, valid, [last], position_ids=torch.arange(length, device=device),
                                                    final_norm=False)
        embeds, mask = hidden[:, self.drop:].float(), valid[:, self.drop:]
        return embeds * mask[..., None], mask


def pipeline_tokenizer(path: str) -> str | None:
    """The pipeline folder's processor/ (the tokenizer's folder in Qwen-Image-2.1's repo), None when `path`
    has none (tokenizer_folder then looks beside the weights)."""
    processor = os.path.join(path, "processor")
    return processor if os.path.isdir(processor) else None


def load_qwen_image21_text_encoder(path: str, tokenizer: str | None = None, dtype: torch.dtype = torch.float32,
                                   fp8: str | None = None) -> QwenImage21TextEncoder:
    """The text encoder from a Qwen-Image-2.1 pipeline folder (text_encoder/: Qwen3VLForConditionalGeneration,
    processor/ holding the tokenizer), or a Qwen3-VL HF folder with its tokenizer; vision keys and the lm_head
    are never read. fp8: the decoder Linears stored in fp8."""
    from library.models.family import fp8_prepare
    from library.models.llm import _find_config, load_llm
    from library.models.text_encoders import _load_tokenizer

    tokenizer = tokenizer or pipeline_tokenizer(path)
    path = component_folder(path, "text_encoder")
    config = _find_config(path)
    llm = load_llm(path, config=config, dtype=dtype, prepare=fp8_prepare(fp8, "llm"), keep_layers=config.num_layers)
    return QwenImage21TextEncoder(llm, _load_tokenizer(path, tokenizer, "processor", "Qwen2"))


# ----------------------------------------------------------------------------------------------
# Prompts with condition images (the edit path): Qwen3-VL's vision tower (transformers') and deepstack

IMAGE_SLOT = "<image{}><|vision_start|><|image_pad|><|vision_end|>"  # the pipeline's prompt_template_ti2i slots


def image_prompt(prompt: str, count: int) -> str:
    """The pipeline's text for `prompt` with `count` condition images: "<image1><|vision_start|>...<|vision_end|>",
    then " <image2>..." for each further one, before the prompt in the user turn."""
    slots = IMAGE_SLOT.format(1) + "".join(" " + IMAGE_SLOT.format(i) for i in range(2, count + 1))
    return QWEN_IMAGE21_SYSTEM_TURN + "<|im_start|>user\n" + slots + (prompt or " ") + "<|im_end|>\n<|im_start|>assistant\n"


def qwen3_vl_positions(ids: list[int], image_token_id: int, grids: list[list[int]], merge: int) -> torch.Tensor:
    """int64 [L, 3] M-RoPE ids of one unpadded prompt as transformers' Qwen3VLModel.get_rope_index gives them:
    text runs count on, equal on the three axes; an image's merged h x w grid sits at (p, p + row, p + col)
    from the count p so far, which then advances by max(h, w)."""
    out, position, grid_iter, start = [], 0, iter(grids), 0
    runs = []
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (ids[i] == image_token_id) != (ids[start] == image_token_id):
            runs.append((start, i, ids[start] == image_token_id))
            start = i
    for begin, end, is_image in runs:
        if not is_image:
            out.append(torch.arange(position, position + end - begin)[:, None].expand(-1, 3))
            position += end - begin
            continue
        _, gh, gw = (int(v) for v in next(grid_iter))
        h, w = gh // merge, gw // merge
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        out.append(torch.stack((torch.full((h * w,), position), position + rows.flatten(), position + cols.flatten()), -1))
        position += max(h, w)
    return torch.cat(out).to(torch.int64)


def _white_backed(image):
    """An RGBA picture composited over white, as the pipeline gives the vision encoder (the checkpoint was
    trained so); other modes as they are."""
    from PIL import Image

    if getattr(image, "mode", None) != "RGBA":
        return image
    white = Image.new("RGB", image.size, (255, 255, 255))
    white.paste(image, mask=image.getchannel("A"))
    return white


class QwenImage21ImageTextEncoder(QwenImage21TextEncoder):
    """encode_with_images(prompts, images) -> (embeds [B, T, D] float32, mask [B, T] bool, slots [B, T] bool:
    True at each `<|image_pad|>` token, whose place a condition image's latents take in the transformer).
    images[i]: sample i's condition images (PIL, already at the sizes the pipeline resizes them to)."""

    def __init__(self, llm, tokenizer, visual, image_processor):
        super().__init__(llm, tokenizer)
        self.visual, self.image_processor = visual.eval().requires_grad_(False), image_processor
        self.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.merge = visual.spatial_merge_size

    @torch.no_grad()
    def encode_one(self, prompt: str, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        from library.data.vlm_inputs import qwen_vl_inputs

        images = [_white_backed(i) for i in images]
        inputs = qwen_vl_inputs([image_prompt(prompt, len(images))], [images], self.image_processor, self.tokenizer)
        device = self.llm.model.embed_tokens.weight.device
        ids = inputs["input_ids"].to(device)  # [1, L], nothing padded
        embeds = self.llm.model.embed_tokens(ids)
        where = ids == self.image_token_id
        vision = self.visual(inputs["pixel_values"].to(device, self.visual.dtype), grid_thw=inputs["image_grid_thw"].to(device))
        if int(where.sum()) != vision.pooler_output.shape[0]:
            raise ValueError(f"{int(where.sum())} image tokens but {vision.pooler_output.shape[0]} vision features")
        embeds = embeds.index_put((where,), vision.pooler_output.to(embeds.dtype))
        positions = qwen3_vl_positions(ids[0].tolist(), self.image_token_id, inputs["image_grid_thw"].tolist(), self.merge)
        last = len(self.llm.model.layers)
        (hidden,) = self.llm.selected_hidden_states(ids, None, [last], position_ids=positions[None].to(device),
                                                    final_norm=False, inputs_embeds=embeds,
                                                    deepstack=(where, list(vision.deepstack_features)))
        return hidden[0, self.drop:].float(), where[0, self.drop:]

    def encode_with_images(self, prompts: list[str], images: list[list]):
        rows = [self.encode_one(p, imgs) for p, imgs in zip(prompts, images, strict=True)]
        length = max(h.shape[0] for h, _ in rows)
        embeds = rows[0][0].new_zeros(len(rows), length, rows[0][0].shape[-1])
        mask = torch.zeros(len(rows), length, dtype=torch.bool, device=embeds.device)
        slots = torch.zeros_like(mask)
        for i, (h, s) in enumerate(rows):
            embeds[i, : h.shape[0]], mask[i, : h.shape[0]], slots[i, : h.shape[0]] = h, True, s
        return embeds, mask, slots


def load_qwen3_vl_vision_tower(path: str, dtype: torch.dtype = torch.float32):
    """transformers' Qwen3-VL vision tower (with its deepstack mergers) from a Qwen3VLForConditionalGeneration
    folder: `model.visual.*` (or `visual.*`) keys only, the language model never read."""
    import json

    from accelerate import init_empty_weights
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from library.io import CheckpointError, CheckpointReader, load_streaming

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{path}: no config.json; condition images need a Qwen3-VL folder (text_encoder/)")
    with open(config_file) as f:
        config = json.load(f)
    if "vision_config" not in config:
        raise CheckpointError(f"{config_file}: no vision_config; expected a Qwen3VLForConditionalGeneration config")
    with init_empty_weights():  # parameters on meta; buffers stay real
        visual = Qwen3VLVisionModel._from_config(Qwen3VLConfig(**config).vision_config)

    def vision_key(key: str) -> str | None:
        for prefix in ("model.visual.", "visual."):
            if key.startswith(prefix):
                return key[len(prefix):]
        return None

    load_streaming(visual, CheckpointReader(path), vision_key, dtype=dtype)
    return visual


def image_processor_folder(path: str, processor: str | None = None) -> tuple[str | None, list[str]]:
    """(the folder holding the image processor's preprocessor_config.json, or None; the folders looked in) of
    the pipeline folder or text encoder folder at `path`: `processor`, its processor/, the one beside it, itself."""
    from library.io import component_folder

    folder = component_folder(path, "text_encoder")
    candidates = [c for c in (processor, os.path.join(path, "processor"),
                              os.path.join(os.path.dirname(folder.rstrip("/")), "processor"), folder) if c]
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "preprocessor_config.json"))), None), candidates


def with_vision(encoder: QwenImage21TextEncoder, path: str, dtype: torch.dtype = torch.float32,
                processor: str | None = None) -> QwenImage21ImageTextEncoder:
    """`encoder` (its language model and tokenizer, shared) with the vision tower and the image processor of
    the pipeline folder or text encoder folder at `path` (processor/preprocessor_config.json beside it)."""
    from transformers import Qwen2VLImageProcessor

    from library.io import CheckpointError

    folder = component_folder(path, "text_encoder")
    found, candidates = image_processor_folder(path, processor)
    if found is None:
        raise CheckpointError(f"{path}: reference images need the image processor (preprocessor_config.json) in one "
                              f"of {candidates}")
    image_processor = Qwen2VLImageProcessor.from_pretrained(found, local_files_only=True)
    return QwenImage21ImageTextEncoder(encoder.llm, encoder.tokenizer, load_qwen3_vl_vision_tower(folder, dtype),
                                       image_processor)


def load_qwen_image21_image_text_encoder(path: str, tokenizer: str | None = None, dtype: torch.dtype = torch.float32,
                                         fp8: str | None = None) -> QwenImage21ImageTextEncoder:
    """The text encoder with its vision tower and image processor (processor/ of the pipeline folder)."""
    return with_vision(load_qwen_image21_text_encoder(path, tokenizer, dtype, fp8), path, dtype)
