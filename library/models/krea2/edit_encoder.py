"""Krea 2 edit prompts with reference images: ai-toolkit's encode_krea_prompt with images (its
krea2/src/text_encoder.py), on our LLM core with transformers' Qwen3-VL vision tower.

What ai-toolkit encodes for a caption with references (model_kwargs edit: true):
- the text: Krea 2's template prefix, then "Picture i: <|vision_start|><|image_pad|><|vision_end|>" for
  each reference in order, then the caption (not truncated: the image runs must stay whole), then the
  5-token assistant suffix; the processor expands each <|image_pad|> to the image's merged grid;
- each reference is first scaled down (never up) to at most 384^2 pixels, sides at least 28
  (_prep_vlm_images; the processor then snaps them to its 32-pixel grid);
- Qwen3VLForConditionalGeneration's hidden states of the 12 taps are stacked per token and the 34
  prefix tokens dropped, as for a text-only caption. The image tokens thus stay in the conditioning.

Here: the image tokens carry the vision tower's merged features, positions are Qwen3-VL's M-RoPE ids
(qwen3_vl_positions: an image's grid at (p, p + row, p + col)), and the deepstack features are added
after the first decoder layers at the image tokens (the LLM core's selected_hidden_states). A caption
without references is the text-only encoding (Krea2TextEncoder), as ai-toolkit's else branch.
ai-toolkit resizes a [0, 1] tensor (bicubic, antialiased) and hands it to the processor unrescaled;
we resize the PIL picture (PIL bicubic, antialiased when it shrinks) and give the processor that.
"""

from __future__ import annotations

import math
import os

import torch

from library.io import CheckpointError, component_folder
from library.models.krea2.text_encoder import KREA2_DROP_TOKENS, KREA2_PROMPT_PREFIX, Krea2TextEncoder

VLM_AREA = 384 * 384  # ai-toolkit's vlm_max_pixels default (ComfyUI TextEncodeQwenImageEditPlus's budget)
VLM_MIN_SIDE = 28
IMAGE_SLOT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


def vlm_size(width: int, height: int, area: int = VLM_AREA) -> tuple[int, int]:
    """(w, h) a reference is shown to Qwen3-VL at: scaled by min(1, sqrt(area / (w h))), Python round,
    at least 28 a side (ai-toolkit's _prep_vlm_images)."""
    scale = min(1.0, math.sqrt(area / (width * height)))
    return max(round(width * scale), VLM_MIN_SIDE), max(round(height * scale), VLM_MIN_SIDE)


def edit_prompt(prompt: str, count: int) -> str:
    """The text before the suffix: prefix, one named slot per reference, the caption."""
    return KREA2_PROMPT_PREFIX + "".join(IMAGE_SLOT.format(i + 1) for i in range(count)) + prompt


class Krea2ImageTextEncoder(Krea2TextEncoder):
    """encode_with_images(prompts, images) -> (embeds [B, T, taps, D] float32, mask [B, T] bool);
    images[i]: sample i's references (PIL, any size; resized here by vlm_size)."""

    def __init__(self, llm, tokenizer, visual, image_processor, taps, max_length):
        super().__init__(llm, tokenizer, taps, max_length)
        self.visual, self.image_processor = visual.eval().requires_grad_(False), image_processor
        self.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.merge = visual.spatial_merge_size

    def vl_inputs(self, prompt: str, images: list) -> dict[str, torch.Tensor]:
        """The processor's ids for prompt + references with the suffix appended, pixel_values, image_grid_thw."""
        from library.data.vlm_inputs import qwen_vl_inputs

        sized = [img.convert("RGB").resize(vlm_size(*img.size), resample=3) for img in images]  # 3: BICUBIC
        inputs = qwen_vl_inputs([edit_prompt(prompt, len(sized))], [sized], self.image_processor, self.tokenizer)
        suffix = torch.tensor([self.suffix_ids], dtype=inputs["input_ids"].dtype)
        inputs["input_ids"] = torch.cat((inputs["input_ids"], suffix), dim=1)
        return inputs

    @torch.no_grad()
    def encode_one(self, prompt: str, images: list) -> torch.Tensor:
        """[L - 34, taps, D] float32: one caption's tapped states with its references' tokens."""
        from library.models.qwen_image21.text_encoder import qwen3_vl_positions

        inputs = self.vl_inputs(prompt, images)
        device = self.llm.model.embed_tokens.weight.device
        ids = inputs["input_ids"].to(device)  # [1, L], nothing padded
        where = ids == self.image_token_id
        vision = self.visual(inputs["pixel_values"].to(device, self.visual.dtype), grid_thw=inputs["image_grid_thw"].to(device))
        if int(where.sum()) != vision.pooler_output.shape[0]:
            raise ValueError(f"{int(where.sum())} image tokens but {vision.pooler_output.shape[0]} vision features")
        embeds = self.llm.model.embed_tokens(ids)
        embeds = embeds.index_put((where,), vision.pooler_output.to(embeds.dtype))
        positions = qwen3_vl_positions(ids[0].tolist(), self.image_token_id, inputs["image_grid_thw"].tolist(), self.merge)
        hidden = self.llm.selected_hidden_states(ids, None, self.taps, position_ids=positions[None].to(device),
                                                 inputs_embeds=embeds, deepstack=(where, list(vision.deepstack_features)))
        return torch.stack(hidden, dim=2)[0, KREA2_DROP_TOKENS:].float()

    def encode_with_images(self, prompts: list[str], images: list[list]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for prompt, imgs in zip(prompts, images, strict=True):
            if imgs:
                rows.append(self.encode_one(prompt, imgs))
            else:  # ai-toolkit's text-only branch
                embeds, mask = self.encode([prompt])
                rows.append(embeds[0, : int(mask[0].sum())])
        length = max(r.shape[0] for r in rows)
        embeds = rows[0].new_zeros(len(rows), length, *rows[0].shape[1:])
        mask = torch.zeros(len(rows), length, dtype=torch.bool, device=embeds.device)
        for i, r in enumerate(rows):
            embeds[i, : r.shape[0]], mask[i, : r.shape[0]] = r, True
        return embeds, mask


def find_image_processor(path: str, processor: str | None = None) -> str:
    """The folder holding preprocessor_config.json: `processor`, else processor/ of the pipeline folder,
    beside the text encoder folder, or the text encoder folder itself (a Qwen3-VL-4B-Instruct download)."""
    folder = component_folder(path, "text_encoder")
    candidates = [c for c in (processor, os.path.join(path, "processor"),
                              os.path.join(os.path.dirname(folder.rstrip("/")), "processor"), folder) if c]
    found = next((c for c in candidates if os.path.isfile(os.path.join(c, "preprocessor_config.json"))), None)
    if found is None:
        raise CheckpointError(f"{path}: reference images need Qwen3-VL's image processor (preprocessor_config.json) "
                              f"in one of {candidates}")
    return found


def with_vision(encoder: Krea2TextEncoder, path: str, dtype: torch.dtype = torch.float32,
                processor: str | None = None) -> Krea2ImageTextEncoder:
    """`encoder` (its language model and tokenizer, shared) with the vision tower of the text encoder
    folder at `path` (visual.* or model.visual.*) and Qwen3-VL's image processor."""
    from transformers import Qwen2VLImageProcessor

    from library.models.qwen_image21.text_encoder import load_qwen3_vl_vision_tower

    image_processor = Qwen2VLImageProcessor.from_pretrained(find_image_processor(path, processor), local_files_only=True)
    visual = load_qwen3_vl_vision_tower(component_folder(path, "text_encoder"), dtype)
    return Krea2ImageTextEncoder(encoder.llm, encoder.tokenizer, visual, image_processor, encoder.taps, encoder.max_length)
