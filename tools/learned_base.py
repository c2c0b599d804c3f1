"""The tiny FLUX.1 base that has learned the synthetic scenes (tools/pretrain_tiny_base.py writes it,
learned/flux/ ships it): where its files live, and rendering prompts on it and scoring the renders
with the pixel-space detector (library/data/shape_detector.py). The concept demo
(tools/concept_demo.py), the pretrainer and tests/test_learning.py share these.

    learned/flux/flux1-learned.safetensors   the transformer, BFL single file (bf16, config in its metadata)
    learned/flux/ae.safetensors              the VAE, BFL ae.safetensors layout (float32, config in its metadata)
    learned/flux/clip_l/  learned/flux/t5xxl/   the frozen tiny text encoders (tools/make_tiny_models.py's, seed 0)
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from library.data.shape_detector import Detection, detect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNED = os.path.join(ROOT, "learned", "flux")
IMAGE_SIZE = 64  # the scenes' size: 8 x 8 latents, a 4 x 4 grid of patch tokens
SAMPLE_STEPS = 8
T5_TOKENS = 48  # the tiny T5's sequence: the longest caption has 34 tokens (configs/quickstart.toml t5xxl_max_token_length)


def learned_paths(folder: str = LEARNED) -> dict[str, str]:
    """The config keys of the learned base's files in `folder`."""
    return {"pretrained_model_name_or_path": os.path.join(folder, "flux1-learned.safetensors"),
            "ae": os.path.join(folder, "ae.safetensors"),
            "clip_l": os.path.join(folder, "clip_l"), "t5xxl": os.path.join(folder, "t5xxl")}


def flux_family(folder: str = LEARNED):
    from library.models.flux1.family import FluxFamily

    paths = learned_paths(folder)
    return FluxFamily(paths["pretrained_model_name_or_path"], paths["ae"], clip_l=paths["clip_l"], t5xxl=paths["t5xxl"])


def encode_prompts(family, prompts: list[str]) -> dict[str, torch.Tensor]:
    """{"t5": [B, 32, 32], "clip_pooled": [B, 32]} float32, the frozen tiny encoders in float32."""
    encode = family.load_text_encoder("fp32", torch.device("cpu"), t5_max_length=T5_TOKENS)
    per_prompt = encode(prompts)
    return {key: torch.stack([p[key] for p in per_prompt]).float() for key in per_prompt[0]}


def to_images(pixels: torch.Tensor) -> list[Image.Image]:
    """[B, 3, H, W] float in [-1, 1] -> PIL RGB images (uint8)."""
    array = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in array]


@torch.no_grad()
def render(family, model, vae, text: dict[str, torch.Tensor], seed: int = 0, steps: int = SAMPLE_STEPS,
           size: int = IMAGE_SIZE, batch: int = 16) -> list[Image.Image]:
    """One image per prompt of `text` (encode_prompts), guidance 1.0, prompt i drawn with seed + i
    (the same noise whatever the batch), in the model's compute dtype; decoded by `vae` in float32."""
    count = next(iter(text.values())).shape[0]
    images = []
    for start in range(0, count, batch):
        latents = [family.sample_latents(model, {k: v[i: i + 1] for k, v in text.items()}, size, size, steps,
                                         seed + i, 1.0) for i in range(start, min(count, start + batch))]
        images += to_images(vae.decode(torch.cat(latents)))
    return images


def scores(images: list[Image.Image], wanted: list[dict[str, str]]) -> tuple[list[Detection], list[bool]]:
    """(the detection of each image, whether it shows its wanted colour and shape)."""
    found = [detect(image) for image in images]
    return found, [d.shows(w.get("colour"), w.get("shape")) for d, w in zip(found, wanted)]


def grid(rows: list[list[Image.Image]], scale: int = 2, gap: int = 2) -> Image.Image:
    """Images in rows (equal sizes), enlarged `scale` times, on a grey canvas."""
    w, h = rows[0][0].size
    cols = max(len(r) for r in rows)
    canvas = Image.new("RGB", (cols * (w * scale + gap) + gap, len(rows) * (h * scale + gap) + gap), (128, 128, 128))
    for y, row in enumerate(rows):
        for x, image in enumerate(row):
            canvas.paste(image.resize((w * scale, h * scale), Image.NEAREST),
                         (gap + x * (w * scale + gap), gap + y * (h * scale + gap)))
    return canvas
