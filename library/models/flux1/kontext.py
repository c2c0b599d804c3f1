"""FLUX.1 Kontext [dev]: image editing with the FLUX.1 transformer unchanged. The reference
image's latent tokens are appended after the target's (same packing), at positions whose first
axis is 1 instead of 0, and the prediction of the target tokens is the output:

    img     = [target tokens | reference tokens]       ids = [(0, r, c) | (1, r, c)]
    v_pred  = transformer(img, ids, ...)[:, :target tokens]

as diffusers' FluxKontextPipeline calls FluxTransformer2DModel. The loss is thus on the target
tokens only. Several references (an extension: Kontext is trained with one, the pipeline takes one)
are placed as ComfyUI places them by default (its "offset" reference method for FLUX.1): all at
first axis 1, each next to the rows x cols box the previous ones cover: right of it (column offset
cols) where rows + its height > cols + its width, else below it (row offset rows); so no two share
positions. In training a reference is fitted to its target's bucket (DiffusionFamily.control_bucket's
default, musubi-tuner's default for control images). In samples (generate.py, training samples) it is
fitted to the preferred ~1 MP size nearest its own aspect ratio (PREFERRED_RESOLUTIONS, by the
absolute difference of w / h), as FluxKontextPipeline (_auto_resize) and ComfyUI's
FluxKontextImageScale do; covered and centre-cropped like ComfyUI's node (the pipeline stretches, a
few percent at most); the target keeps --w/--h. Everything else
(text, VAE, guidance embedding, sigma schedule, LoRA targets, fp8 rules) is FLUX.1-dev's.
"""

from __future__ import annotations

import torch

from library.models.flux1.family import FluxFamily
from library.models.flux1.spec import SPEC
from library.models.latents import pack_latents


# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS (w, h): the sizes Kontext was trained on.
PREFERRED_RESOLUTIONS = [(672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
                         (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
                         (1456, 720), (1504, 688), (1568, 672)]


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    arch = "flux"  # the FLUX.1 transformer: its LoRA targets, fp8 rules and flow-matching constants
    sample_guidance = SPEC.sample_guidance["kontext"]  # 2.5: BFL's usage example (FluxKontextPipeline's default is 3.5)
    sample_steps = SPEC.sample_steps["kontext"]
    max_controls = 4
    plan_controls = 1
    edits_without_references_warn = True  # Kontext runs text-to-image too; musubi-tuner stops without references
    # Samples: FluxKontextPipeline (_auto_resize) stretches each reference (Lanczos) to its preferred resolution,
    # of nearly its aspect ratio; training crops them to the target's bucket (musubi-tuner's), as samples did before
    stretches_sample_references = True

    def model_version(self, model) -> str:
        return "flux1-kontext-dev"

    def sample_control_bucket(self, target: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
        """The preferred resolution nearest the reference's aspect ratio (the first of a tie, as
        min() over the pipeline's table), whatever the target. The ratio is the pipeline's: of the sides
        rounded down to multiples of 16 first (its image processor's get_default_height_width)."""
        w, h = (max(16, side // 16 * 16) for side in size)
        ratio = w / h
        return min(PREFERRED_RESOLUTIONS, key=lambda wh: abs(ratio - wh[0] / wh[1]))

    def predict(self, model, x_t, sigmas, text, h, w, guidance, control=None):
        img, img_ids = kontext_tokens(x_t, h, w, control or [])
        out = self.transformer_call(model, img, img_ids, sigmas, text, guidance)
        return out[:, : x_t.shape[1]]


def kontext_tokens(x_t: torch.Tensor, h: int, w: int, control: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, L, 64], ids [B, L, 3] int64): the packed target x_t (h x w patches), then each
    reference latent [B, 16, h_k, w_k] packed, at (1, row + top_k, col + left_k): the first at
    (0, 0), each next one right of or below the references before it (ComfyUI's "offset")."""
    from library.models.flux1.model import make_img_ids

    b, device = x_t.shape[0], x_t.device
    tokens, ids = [x_t], [make_img_ids(b, h, w, device)]
    rows = cols = 0  # the patches the references so far cover: rows x cols from (0, 0)
    for k, ref in enumerate(control):
        if ref.shape[0] != b or ref.shape[1] != 16 or ref.shape[2] % 2 or ref.shape[3] % 2:
            raise ValueError(f"reference latent {k} has shape {tuple(ref.shape)}; expected [{b}, 16, h, w] with "
                             f"even h and w (2x2 patches)")
        rh, rw = ref.shape[2] // 2, ref.shape[3] // 2
        top, left = (0, cols) if rh + rows > rw + cols else (rows, 0)
        rows, cols = max(rows, top + rh), max(cols, left + rw)
        ref_ids = make_img_ids(b, rh, rw, device)
        ref_ids[..., 0] = 1
        ref_ids[..., 1] += top
        ref_ids[..., 2] += left
        tokens.append(pack_latents(ref.to(device=device, dtype=torch.float32)))
        ids.append(ref_ids)
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=1)
