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
positions. A reference is fitted to its target's bucket (DiffusionFamily.control_bucket's default), in training and in samples (--w/--h give the
target; FluxKontextPipeline instead snaps the reference to one of its preferred ~1 MP sizes and
makes the target that size: pick such --w/--h for the same picture). Everything else
(text, VAE, guidance embedding, sigma schedule, LoRA targets, fp8 rules) is FLUX.1-dev's.
"""

from __future__ import annotations

import torch

from library.models.flux1.family import FluxFamily
from library.models.latents import pack_latents


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    arch = "flux"  # the FLUX.1 transformer: its LoRA targets, fp8 rules and flow-matching constants
    sample_guidance = 2.5  # FluxKontextPipeline's default guidance_scale
    max_controls = 4
    plan_controls = 1

    def model_version(self, model) -> str:
        return "flux1-kontext-dev"

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
