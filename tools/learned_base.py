"""The tiny bases that have learned the synthetic scenes (library/data/shapes.py): a family declares one
in its spec (`learned`: spec.LearnedBase), tools/pretrain_tiny_base.py trains it, learned/<model_type>/
ships it. Here: where its files live, loading it, rendering prompts on it and scoring the renders with
the pixel-space detector (library/data/shape_detector.py). The concept demo (tools/concept_demo.py),
the pretrainer and tests/test_learning.py share these.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from library.data.shape_detector import Detection, detect
from library.models.registry import FAMILIES, family_folder, spec_of
from library.models.spec import load_symbol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEARNED_ROOT = os.path.join(ROOT, "learned")
IMAGE_SIZE = 64  # the scenes' size: 8 x 8 latents, a 4 x 4 grid of patch tokens
SAMPLE_STEPS = 8


def learned_families() -> list[str]:
    """The model_types with a learned base, one per family folder (a variant shares its base's)."""
    folders = {}
    for model_type in FAMILIES:
        if spec_of(model_type).learned:
            folders.setdefault(family_folder(model_type), model_type)
    return list(folders.values())


def learned_spec(model_type: str):
    """The family's spec.LearnedBase; a ValueError naming those that have one."""
    if model_type not in FAMILIES or not spec_of(model_type).learned:
        raise ValueError(f"model_type {model_type!r} has no learned tiny base: expected one of {', '.join(learned_families())}")
    return load_symbol(spec_of(model_type).learned)


def learned_paths(model_type: str | None = None, folder: str | None = None) -> dict[str, str]:
    """The training-config keys of the learned base's files (default: the first family's, in learned/<model_type>)."""
    model_type = model_type or learned_families()[0]
    folder = folder or os.path.join(LEARNED_ROOT, model_type)
    return {key: os.path.join(folder, name) for key, name in learned_spec(model_type).files}


def learned_family(model_type: str | None = None, folder: str | None = None):
    """The DiffusionFamily on the learned base's files."""
    model_type = model_type or learned_families()[0]
    return load_symbol(learned_spec(model_type).family)(learned_paths(model_type, folder))


def encode_prompts(family, prompts: list[str]) -> dict[str, torch.Tensor]:
    """{embedding name: [B, ...]} float32, the family's frozen tiny encoders in float32 at the learned
    base's sequence lengths. Families that cache each caption at its own length (embeds
    [T, D] and a mask [T]) are padded at the end to the longest with zeros (mask False), as the
    trainer's collate does. Integer token ids (an embedding's indices, cached beside the states) keep their dtype."""
    kwargs = dict(learned_spec(family.name).encode_kwargs)
    encode = family.load_text_encoder("fp32", torch.device("cpu"), **kwargs)
    per_prompt = encode(prompts)
    stacked = {key: padded_stack([p[key] for p in per_prompt]) for key in per_prompt[0]}
    return {key: t.float() if t.is_floating_point() or t.dtype == torch.bool else t for key, t in stacked.items()}


def padded_stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[B, T_max, ...] from tensors [T_i, ...], zero-padded along the first axis (equal lengths: a plain stack)."""
    longest = max(t.shape[0] for t in tensors) if tensors[0].dim() else 0
    return torch.stack([torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))]) if t.dim() else t for t in tensors])


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
