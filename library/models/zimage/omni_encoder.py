"""Z-Image Omni's conditioning, as ZImageOmniPipeline computes it: the caption segments (Qwen3-4B,
text_encoder.py's encoder on a hand-written template) and each reference's SigLIP2 features.

Text (the pipeline's _encode_prompt): with N reference images the prompt becomes N + 2 strings,
split where each image's tokens would go,

    "<|im_start|>user\\n<|vision_start|>"
    "<|vision_end|><|vision_start|>"                                   (N - 1 times)
    "<|vision_end|>" + prompt + "<|im_end|>\\n<|im_start|>assistant\\n<|vision_start|>"
    "<|vision_end|><|im_end|>"

and without images the one string "<|im_start|>user\\n" + prompt + "<|im_end|>\\n<|im_start|>assistant\\n"
(no chat template, no think tokens). Each string is tokenized on its own (padded to 512, truncated
there) and encoded on its own; hidden_states[-2], each string's real tokens only.

SigLIP (prepare_siglip_embeds): an image larger than 1024 x 1024 pixels is first resized (Lanczos) at
its aspect ratio to the output's height x width area where the pipeline is given a size (samples:
encode's sample_size), else to 1024 x 1024 (training's references) (Flux2ImageProcessor.
_resize_to_target_area: the image its VAE path takes too), then Siglip2ImageProcessor makes its
patches (at most max_num_patches, the aspect kept) and Siglip2VisionModel's last_hidden_state, cut to
the sH x sW real patches, is the feature grid [sH, sW, C] float32 (C = 1152 for SigLIP2 so400m). The
pipeline loads both from the repo's siglip/ and siglip_processor/ folders; so do we (transformers'
classes).

The cache entry of one caption with its references (library/data/caches.py; no batch axis):
  embeds [T, 2560] float32   the segments' real tokens, concatenated
  segments [S] int64         each segment's token count (S = N + 2, or 1)
  siglip [sum sH sW, C]      the references' feature grids, each flattened row-major, concatenated
  siglip_grid [N, 2] int64   each reference's (sH, sW)            (both only when N > 0)
"""

from __future__ import annotations

import math

import torch

from library.models.zimage.text_encoder import ZImageTextEncoder

SIGLIP_MAX_AREA = 1024 * 1024  # the pipeline resizes larger condition images to this area first


def omni_prompt_segments(prompt: str, images: int) -> list[str]:
    """The strings ZImageOmniPipeline._encode_prompt encodes for `prompt` with `images` condition images."""
    if images == 0:
        return ["<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n"]
    return (["<|im_start|>user\n<|vision_start|>"] + ["<|vision_end|><|vision_start|>"] * (images - 1)
            + ["<|vision_end|>" + prompt + "<|im_end|>\n<|im_start|>assistant\n<|vision_start|>",
               "<|vision_end|><|im_end|>"])


class ZImageOmniTextEncoder(ZImageTextEncoder):
    """The Z-Image encoder on Omni's template strings (tokenized verbatim, no chat template)."""

    def tokenize(self, texts: list[str]):
        return self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt")

    def encode_segments(self, prompts: list[str], images: list[int]) -> list[list[torch.Tensor]]:
        """Per prompt its segments' embeddings [n_j, D] float32 (the pipeline's prompt_embeds list);
        images[i]: prompt i's condition image count. All segments run as one batch."""
        per_prompt = [omni_prompt_segments(p, n) for p, n in zip(prompts, images)]
        flat = self.encode_list([s for segments in per_prompt for s in segments])
        out, start = [], 0
        for segments in per_prompt:
            out.append(flat[start : start + len(segments)])
            start += len(segments)
        return out


def siglip_view(image, area: int = SIGLIP_MAX_AREA):
    """A PIL image as the pipeline hands it to SigLIP: larger than SIGLIP_MAX_AREA pixels -> resized
    (Lanczos) to `area` (the output's width x height where the pipeline is given a size, else
    SIGLIP_MAX_AREA), int-truncated sides (Flux2ImageProcessor._resize_to_target_area)."""
    from PIL import Image

    w, h = image.size
    if w * h <= SIGLIP_MAX_AREA:
        return image
    scale = math.sqrt(area / (w * h))
    return image.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)


class SiglipFeatures:
    """image (PIL RGB) -> [sH, sW, C] float32: prepare_siglip_embeds for one image."""

    def __init__(self, model, processor):
        self.model, self.processor = model.eval().requires_grad_(False), processor

    @property
    def width(self) -> int:
        return self.model.config.hidden_size

    @torch.no_grad()
    def __call__(self, image, area: int = SIGLIP_MAX_AREA) -> torch.Tensor:
        param = next(self.model.parameters())
        inputs = self.processor(images=[siglip_view(image, area)], return_tensors="pt")
        inputs = {k: (v.to(param.device, param.dtype) if v.is_floating_point() else v.to(param.device))
                  for k, v in inputs.items()}
        sh, sw = (int(v) for v in inputs["spatial_shapes"][0])
        hidden = self.model(**inputs).last_hidden_state  # [1, max_num_patches, C]
        return hidden[0, : sh * sw].float().view(sh, sw, -1)


def load_siglip(path: str, dtype: torch.dtype = torch.float32) -> SiglipFeatures:
    """Siglip2VisionModel from `path`'s siglip/ folder (or `path` itself) and Siglip2ImageProcessor from
    siglip_processor/ beside it (or `path`): ZImageOmniPipeline's components, through transformers."""
    import os

    from transformers import Siglip2ImageProcessor, Siglip2VisionModel

    from library.io import CheckpointError, component_folder

    folder = component_folder(path, "siglip")
    processor_folder = next((f for f in (os.path.join(os.path.dirname(folder.rstrip("/")), "siglip_processor"), folder)
                             if os.path.isfile(os.path.join(f, "preprocessor_config.json"))), None)
    if not os.path.isfile(os.path.join(folder, "config.json")) or processor_folder is None:
        raise CheckpointError(f"{path}: expected a SigLIP2 vision model folder (config.json + weights, the Omni repo's "
                              f"siglip/) with its preprocessor_config.json (siglip_processor/ beside it, or inside)")
    model = Siglip2VisionModel.from_pretrained(folder, dtype=dtype)
    return SiglipFeatures(model, Siglip2ImageProcessor.from_pretrained(processor_folder))


class OmniConditionEncoder:
    """encode(captions, condition_images, sample_size=None) -> one cache dict per caption (module
    docstring); sample_size: the (w, h) a sample renders at, the area large references are fitted to."""

    def __init__(self, text: ZImageOmniTextEncoder, siglip: SiglipFeatures):
        self.text, self.siglip = text, siglip

    def __call__(self, captions: list[str], condition_images: list[list],
                 sample_size: tuple[int, int] | None = None) -> list[dict]:
        area = sample_size[0] * sample_size[1] if sample_size else SIGLIP_MAX_AREA
        segments = self.text.encode_segments(captions, [len(images) for images in condition_images])
        out = []
        for caption_segments, images in zip(segments, condition_images):
            entry = {"embeds": torch.cat(caption_segments),
                     "segments": torch.tensor([s.shape[0] for s in caption_segments], dtype=torch.int64)}
            if images:
                grids = [self.siglip(image.convert("RGB"), area) for image in images]  # (reference views are RGBA)
                entry["siglip"] = torch.cat([g.reshape(-1, g.shape[-1]) for g in grids])
                entry["siglip_grid"] = torch.tensor([g.shape[:2] for g in grids], dtype=torch.int64)
            out.append(entry)
        return out


def unpack_condition(text: dict, references: int) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]] | None]:
    """A batch of cache dicts (stacked, zero-padded at the end: collate_batch) -> per row its caption
    segments and its references' SigLIP grids [sH, sW, C], what ZImageOmni.forward takes. Reads the
    lengths on the host (one sync)."""
    segments = text["segments"].tolist()
    captions = [list(e[: sum(lengths)].split(lengths)) for e, lengths in zip(text["embeds"], segments)]
    if any(len(lengths) != (references + 2 if references else 1) for lengths in segments):
        raise ValueError(f"Z-Image Omni: the cached caption has {len(segments[0])} segment(s), but {references} "
                         f"reference(s) need {references + 2 if references else 1} (encoded for another reference count)")
    if not references:
        return captions, None
    siglip = []
    for features, grid in zip(text["siglip"], text["siglip_grid"].tolist()):
        sizes = [h * w for h, w in grid]
        parts = features[: sum(sizes)].split(sizes)
        siglip.append([p.view(h, w, -1) for p, (h, w) in zip(parts, grid)])
    return captions, siglip
