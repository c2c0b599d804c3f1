"""The inputs of a Qwen-VL chat model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) for prompts with images, as
transformers' Qwen2_5_VLProcessor / Qwen3VLProcessor build them, without the processor object.

Those processors bundle a video processor that needs torchvision, and the only torchvision wheel
that matches our torch pin is a CUDA build that does not import beside the CPU torch. A prompt
with images needs none of the video part: the image processor (transformers' Qwen2VLImageProcessor,
which falls back to its PIL backend without torchvision; Qwen3-VL uses the same class with patch
size 16) makes pixel_values and image_grid_thw, and each <|image_pad|> of the text is repeated once
per merged patch of its image (grid t * h * w / merge_size^2) before the tokenizer runs, as both
processors' replace_image_token do. mm_token_type_ids marks the image tokens (1; text 0), as the
processors' create_mm_token_type_ids: transformers 5 computes the 3-axis M-RoPE positions from it.

Used by the edit families' vision-language text encoders and the captioning tool
(tools/caption_images.py). tests/test_vlm_inputs.py and the edit encoders' tests check them equal
to the processors' outputs.
"""

from __future__ import annotations

import torch

IMAGE_TOKEN = "<|image_pad|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", IMAGE_TOKEN, "<|video_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a Qwen-VL chat
IMAGE_TOKEN_TYPE = 1  # mm_token_type_ids: 0 text, 1 image (2 video, never made here)
# The image processor refuses an image whose long side is more than this many times its short side
# (transformers' smart_resize: "absolute aspect ratio must be smaller than 200"), naming no file.
MAX_ASPECT_RATIO = 200


def check_aspect_ratio(path: str, size: tuple[int, int], seen: tuple[int, int] | None = None,
                       fix: str = "crop it") -> None:
    """ValueError naming `path` (size: its width, height) when the image processor would refuse it; seen:
    the (width, height) its caller resizes it to for the processor, what smart_resize checks (default: size)."""
    w, h = seen or size
    if min(w, h) == 0 or max(w, h) > MAX_ASPECT_RATIO * min(w, h):
        shown = f", {w} x {h} as the text encoder resizes it" if seen and tuple(seen) != tuple(size) else ""
        ratio = max(w, h) / min(w, h) if min(w, h) else float("inf")
        raise ValueError(f"{path}: {size[0]} x {size[1]} pixels{shown}, an aspect ratio of {ratio:.4g}; the Qwen-VL "
                         f"image processor takes at most {MAX_ASPECT_RATIO}: {fix}")


def expand_image_tokens(text: str, counts: list[int]) -> str:
    """Each <|image_pad|> of `text`, in order, repeated counts[i] times (the image's merged patch
    count), as Qwen2_5_VLProcessor expands them before tokenizing."""
    parts = text.split(IMAGE_TOKEN)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"{len(parts) - 1} {IMAGE_TOKEN} tokens in the prompt but {len(counts)} images")
    return parts[0] + "".join(IMAGE_TOKEN * n + rest for n, rest in zip(counts, parts[1:]))


def qwen_vl_inputs(texts: list[str], images: list[list], image_processor, tokenizer,
                   padding_side: str | None = None) -> dict[str, torch.Tensor]:
    """The processor's output for `texts` (each with one <|image_pad|> per image of images[i], PIL)
    padded to the longest (padding_side: the tokenizer's own unless given; generation pads left):
    input_ids, attention_mask, mm_token_type_ids int64 [B, L]; with images also pixel_values float32
    [patches, channels * temporal * patch^2] and image_grid_thw int64 [N, 3] (t, h, w in patches)."""
    if len(images) != len(texts):
        raise ValueError(f"{len(texts)} prompts but images for {len(images)}")
    flat = [img for sample in images for img in sample]
    vision = {}
    if flat:
        for i, img in enumerate(flat):  # a file's path where PIL kept it (the processor's own error names none)
            check_aspect_ratio(getattr(img, "filename", "") or f"image {i + 1} of {len(flat)}", img.size)
        vision = dict(image_processor(images=flat, return_tensors="pt"))
        counts = (vision["image_grid_thw"].prod(-1) // image_processor.merge_size**2).tolist()
        starts = [sum(len(s) for s in images[:i]) for i in range(len(images))]
        texts = [expand_image_tokens(t, counts[a : a + len(s)]) for t, a, s in zip(texts, starts, images)]
    side = {"padding_side": padding_side} if padding_side else {}
    tokens = tokenizer(texts, padding=True, return_tensors="pt", **side)
    ids = tokens["input_ids"]
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    types = (ids == image_token_id).long() * IMAGE_TOKEN_TYPE
    return {"input_ids": ids, "attention_mask": tokens["attention_mask"], "mm_token_type_ids": types, **vision}
