"""The Qwen-Image-Edit text encoder: the prompt together with the condition images through Qwen2.5-VL.

As diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline `_get_qwen_prompt_embeds`:
- the prompt goes into the edit chat template (Edit: one image's vision tokens before the prompt;
  2509 / 2511: "Picture i: <|vision_start|><|image_pad|><|vision_end|>" per image before it);
- transformers' Qwen2VLImageProcessor makes pixel_values / image_grid_thw and each <|image_pad|>
  is expanded to the image's merged patch count (as Qwen2_5_VLProcessor does); transformers'
  vision tower (a maintained implementation, not rewritten here) turns the patches into features
  of the language model's width;
- our LLM core (library/models/llm.py) runs the language model with the image tokens' embeddings
  replaced by those features and M-RoPE positions: image tokens take (t, h, w) grid ids, text
  tokens equal ids on all three axes, as transformers' get_rope_index computes them;
- the last hidden state (after the final norm) of the valid tokens, minus the template's first 64
  tokens (the system prompt; the image tokens are kept), padded to the longest prompt with a mask.

Note: diffusers 0.42 with transformers >= 5 does not pass the processor's mm_token_type_ids to the
text encoder, which then falls back to 1-D positions for image tokens (diffusers issue #14194, PR
#14189). We compute the 3-axis positions the model was trained with, as transformers 4.x did.

Precision: position ids are int64 and the RoPE tables float32 (core.mrope_tables); the vision tower
runs in the encoder's dtype; outputs are float32.
"""

from __future__ import annotations

import json
import os

import torch
from accelerate import init_empty_weights

from library.data.vlm_inputs import IMAGE_TOKEN, VISION_TOKENS, expand_image_tokens, qwen_vl_inputs  # noqa: F401
from library.io import CheckpointError, CheckpointReader, component_folder, load_streaming
from library.models.qwen_image.edit import EDIT, check_version

# Copied verbatim from diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline (prompt_template_encode).
_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
EDIT_PROMPT_TEMPLATE = _SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_PROMPT_TEMPLATE = _SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
PICTURE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
EDIT_DROP_TOKENS = 64  # prompt_template_encode_start_idx: the system part + "<|im_start|>user\n"


def edit_prompt(version: str, prompt: str, num_images: int) -> str:
    """The text the pipeline tokenizes for `prompt` with `num_images` condition images."""
    if check_version(version) == EDIT:
        if num_images != 1:
            raise ValueError(f"{EDIT} encodes exactly one condition image with the prompt, got {num_images}")
        return EDIT_PROMPT_TEMPLATE.format(prompt)
    pictures = "".join(PICTURE_TEMPLATE.format(i + 1) for i in range(num_images))
    return EDIT_PLUS_PROMPT_TEMPLATE.format(pictures + prompt)


def mrope_position_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                       image_token_id: int, merge_size: int) -> torch.Tensor:
    """int64 [B, L, 3] (t, h, w) ids, as transformers' Qwen2.5-VL get_rope_index for text + images.

    Over each row's valid tokens: text tokens count on from the running position p on all three
    axes; an image of merged grid (t, h, w) takes p + (frame, row, column) and moves p on by max(h,
    w). Images are taken from image_grid_thw in order; padding gets 0."""
    batch, length = input_ids.shape
    positions = torch.zeros(batch, length, 3, dtype=torch.int64)
    grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    for b in range(batch):
        valid = torch.ones(length, dtype=torch.bool) if attention_mask is None else attention_mask[b].bool().cpu()
        ids = input_ids[b].cpu()[valid].tolist()
        parts, current, i = [], 0, 0
        while i < len(ids):
            if ids[i] == image_token_id:
                t, h, w = next(grids, (0, 0, 0))
                h, w = h // merge_size, w // merge_size
                count = t * h * w
                if count == 0 or ids[i : i + count] != [image_token_id] * count:
                    raise ValueError(f"row {b}: image tokens at {i} do not match image_grid_thw (expected {count})")
                axes = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
                parts.append(torch.stack(axes, dim=-1).reshape(-1, 3) + current)
                current, i = current + max(h, w), i + count
            else:
                j = i
                while j < len(ids) and ids[j] != image_token_id:
                    j += 1
                parts.append((current + torch.arange(j - i))[:, None].expand(-1, 3))
                current, i = current + j - i, j
        positions[b, valid] = torch.cat(parts) if parts else positions[b, valid]
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw lists more images than the prompts have image tokens")
    return positions.to(input_ids.device)


class QwenImageEditTextEncoder:
    """encode(prompts, images) -> (embeds [B, T, D] float32, mask [B, T] bool); images[i] is the
    list of sample i's condition images (PIL, already sized for the VL encoder: edit_sizes().encoder).

    image_processor: transformers' Qwen2VLImageProcessor (pixel patches and grids); tokenizer: the
    Qwen2.5-VL tokenizer. Qwen2_5_VLProcessor bundles the two with a video processor, which needs
    torchvision; the edit prompt never has video, so its inputs are built as it builds them
    (library/data/vlm_inputs.py)."""

    def __init__(self, llm, visual, image_processor, tokenizer, version: str):
        self.llm, self.visual = llm.eval().requires_grad_(False), visual.eval().requires_grad_(False)
        self.image_processor, self.tokenizer, self.version = image_processor, tokenizer, check_version(version)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.merge_size = visual.spatial_merge_size
        if not llm.config.mrope_section:
            raise ValueError("QwenImageEditTextEncoder: the language model has no M-RoPE sections (not a Qwen2.5-VL config)")
        if image_processor.merge_size != self.merge_size:
            raise ValueError(f"image processor merge_size {image_processor.merge_size} != the vision tower's {self.merge_size}")

    def _inputs(self, texts: list[str], images: list[list]):
        """(input_ids, attention_mask, pixel_values or None, image_grid_thw or None) as the processor gives them."""
        inputs = qwen_vl_inputs(texts, images, self.image_processor, self.tokenizer)
        return inputs["input_ids"], inputs["attention_mask"], inputs.get("pixel_values"), inputs.get("image_grid_thw")

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list[list]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but condition images for {len(images)} samples")
        texts = [edit_prompt(self.version, p, len(imgs)) for p, imgs in zip(prompts, images)]
        ids, valid, pixels, grid = self._inputs(texts, images)
        device = self.llm.model.embed_tokens.weight.device
        ids, valid = ids.to(device), valid.to(device).bool()  # [B, L]
        embeds = self.llm.model.embed_tokens(ids)
        if grid is not None:  # image tokens carry the vision tower's merged patch features
            pixels = pixels.to(device, self.visual.dtype)
            features = self.visual(pixels, grid_thw=grid.to(device)).pooler_output
            image_mask = (ids == self.image_token_id)[..., None]
            if int(image_mask.sum()) != features.shape[0]:
                raise ValueError(f"{int(image_mask.sum())} image tokens but {features.shape[0]} vision features")
            embeds = embeds.masked_scatter(image_mask, features.to(embeds.dtype))
        positions = mrope_position_ids(ids, valid, grid, self.image_token_id, self.merge_size)  # int64 [B, L, 3]
        hidden = self.llm.hidden_states(ids, valid, positions, inputs_embeds=embeds).float()  # [B, L, D] float32
        kept = [h[m][EDIT_DROP_TOKENS:] for h, m in zip(hidden, valid)]
        length = max(k.shape[0] for k in kept)
        out = hidden.new_zeros(len(kept), length, hidden.shape[-1])
        mask = torch.zeros(len(kept), length, dtype=torch.bool, device=device)
        for i, k in enumerate(kept):
            out[i, : k.shape[0]], mask[i, : k.shape[0]] = k, True
        return out, mask


def _vision_key(key: str) -> str | None:
    """Checkpoint key -> vision tower key (`visual.*` or transformers 5's `model.visual.*`), else None."""
    for prefix in ("model.visual.", "visual."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def load_vision_tower(path: str, dtype: torch.dtype = torch.float32):
    """transformers' Qwen2.5-VL vision tower from a Qwen2_5_VLForConditionalGeneration folder."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{path}: no config.json; the edit text encoder needs a Qwen2.5-VL folder (text_encoder/)")
    with open(config_file) as f:
        config = json.load(f)
    if "vision_config" not in config:
        raise CheckpointError(f"{config_file}: no vision_config; expected a Qwen2_5_VLForConditionalGeneration config")
    vision_config = Qwen2_5_VLConfig(**config).vision_config
    with init_empty_weights():  # parameters on meta; the rotary inv_freq buffer stays real
        visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config)
    load_streaming(visual, CheckpointReader(path), _vision_key, dtype=dtype)
    return visual


def find_processor(path: str) -> str:
    """The processor folder (preprocessor_config.json + tokenizer) of the text encoder at `path`: the repo's
    processor/, one beside the text encoder folder, or that folder itself."""
    folder = component_folder(path, "text_encoder")
    candidates = [os.path.join(path, "processor"), os.path.join(os.path.dirname(folder.rstrip("/")), "processor"), folder]
    found = [c for c in candidates if os.path.isfile(os.path.join(c, "preprocessor_config.json"))]
    if not found:
        raise CheckpointError(f"{folder}: no processor (preprocessor_config.json) in {candidates}; pass processor=<folder>")
    return found[0]


def load_qwen_image_edit_text_encoder(path: str, version: str, processor: str | None = None,
                                      dtype: torch.dtype = torch.float32, fp8: str | None = None) -> QwenImageEditTextEncoder:
    """From a Qwen-Image-Edit repo (text_encoder/ + processor/) or a Qwen2.5-VL folder holding its
    processor files (preprocessor_config.json + tokenizer). fp8: the language model's Linears
    stored in fp8 (the vision tower stays in dtype)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    from library.models.family import fp8_prepare
    from library.models.llm import load_llm

    processor = processor or find_processor(path)
    path = component_folder(path, "text_encoder")
    llm = load_llm(path, dtype=dtype, prepare=fp8_prepare(fp8, "llm"))
    image_processor = Qwen2VLImageProcessor.from_pretrained(processor, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(processor, local_files_only=True)
    return QwenImageEditTextEncoder(llm, load_vision_tower(path, dtype), image_processor, tokenizer, version)
