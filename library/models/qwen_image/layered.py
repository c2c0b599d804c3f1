"""Qwen-Image-Layered as a diffusion family: an RGBA image decomposed into layers. Facts from
diffusers' QwenImageLayeredPipeline and musubi-tuner's `--model_version layered` training:

- The transformer is Qwen-Image's with `use_layer3d_rope` (frame i for the i-th output, -1 for the
  condition image: model.py joint_positions) and `use_additional_t_cond` (0 = RGBA, the pipeline's
  `is_rgb`, always 0). Neither flag is in a single file's tensors: this family sets them.
- The VAE is AutoencoderKLQwenImage with `input_channels = 4` (RGBA in and out).
- A target is 1 + layers frames, the composite first, each VAE-encoded on its own: latents
  [B, 16, F, h, w], packed frame after frame (the pipeline's _pack_latents over (F, h/2, w/2)); the
  clean composite follows as the condition image (control; library/data/layers.py). The loss is on
  every frame (musubi-tuner's default), the condition's outputs are dropped.
- Text: Qwen-Image's prompt template and Qwen2.5-VL encoding (the pipeline's encode_prompt is copied
  from QwenImagePipeline); the text encoder does not see the image.
- Sampling: the image to decompose (RGBA) sets the size, its aspect ratio at --w x --h's area (sample_size);
  Qwen-Image's scheduler (exponential time shift, shift_terminal 0.02) at
  mu = sqrt(condition tokens / 256) (the pipeline's rule), true CFG with norm rescale.
  Training draws sigmas as Qwen-Image (qwen_shift at one frame's token count).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from library.models.latents import pack_latents, unpack_latents
from library.models.qwen_image.edit import SIZE_MULTIPLE, area_size
from library.models.qwen_image.family import QwenImageFamily
from library.models.qwen_image.model import QWEN_IMAGE
from library.models.qwen_image.spec import SPEC
from library.models.qwen_image.vae import QwenImageVAE
from library.models.vae import VIDEO_VAE_CONV_IN
from library.models.spec import Sampling

LAYERED_FLAGS = {"use_layer3d_rope": True, "use_additional_t_cond": True}
QWEN_IMAGE_LAYERED = dataclasses.replace(QWEN_IMAGE, **LAYERED_FLAGS)  # the released transformer's config
LAYERED_VAE_CONFIG = {"input_channels": 4}  # Qwen-Image-Layered's vae/config.json (RGBA)
DEFAULT_LAYERS = 4  # the pipeline's `layers`


def layered_mu(image_seq_len: int, steps: int) -> float:
    """QwenImageLayeredPipeline: mu = sqrt(condition image tokens / (256 * 256 / 16 / 16))."""
    return math.sqrt(image_seq_len / 256)


SAMPLING = Sampling(method="qwen_shift", mu="library.models.qwen_image.layered:layered_mu", shift_terminal=0.02)


def pack_frames(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, F, h, w] -> [B, F * (h/2) * (w/2), 4C]: each frame packed, frame after frame."""
    return torch.cat([pack_latents(latents[:, :, f]) for f in range(latents.shape[2])], dim=1)


def unpack_frames(x: torch.Tensor, frames: int, lh: int, lw: int) -> torch.Tensor:
    """The inverse of pack_frames: [B, F * (lh/2) * (lw/2), 4C] -> [B, C, F, lh, lw]."""
    return torch.stack([unpack_latents(part, lh, lw) for part in x.chunk(frames, dim=1)], dim=2)


class LayeredVAE(QwenImageVAE):
    """The RGBA VAE. encode: images [B, 3 or 4, H, W] in [-1, 1] (RGB gets alpha +1, opaque) ->
    latents [B, 16, H/8, W/8]; decode_rgba: latents [B, 16, H/8, W/8] or [B, 16, F, H/8, W/8] ->
    RGBA frames [B, 4, H, W] (or a list of F of them); decode: what a person looks at, RGB
    [B, 3, H, F * W], the frames side by side over a grey checkerboard (transparency shows)."""

    default_config = LAYERED_VAE_CONFIG

    @torch.no_grad()
    def encode(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if images.shape[1] == 3:  # an opaque picture, as the pipeline's convert("RGBA") gives it
            images = torch.cat((images, torch.ones_like(images[:, :1])), dim=1)
        return super().encode(images, generator)

    @torch.no_grad()
    def decode_rgba(self, latents: torch.Tensor):
        if latents.dim() == 5:
            return [super(LayeredVAE, self).decode(latents[:, :, f]) for f in range(latents.shape[2])]
        return super().decode(latents)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        frames = self.decode_rgba(latents)
        frames = frames if isinstance(frames, list) else [frames]
        return torch.cat([over_checkerboard(f) for f in frames], dim=3)


def over_checkerboard(rgba: torch.Tensor, cell: int = 8) -> torch.Tensor:
    """RGBA [B, 4, H, W] in [-1, 1] composited over a light/dark grey checkerboard: RGB [B, 3, H, W]."""
    h, w = rgba.shape[-2:]
    ys, xs = torch.arange(h, device=rgba.device)[:, None] // cell, torch.arange(w, device=rgba.device)[None] // cell
    board = torch.where((ys + xs) % 2 == 0, 0.6, 0.2).to(rgba.dtype)  # [-1, 1] greys
    alpha = (rgba[:, 3:4] + 1) / 2
    return rgba[:, :3] * alpha + board * (1 - alpha)


class QwenImageLayeredFamily(QwenImageFamily):
    """Qwen-Image-Layered: targets of 1 + layers frames, the composite as the condition image."""

    name = "qwen_image_layered"
    vae = "library.models.qwen_image.layered:LayeredVAE"  # the RGBA VAE (DiffusionFamily.load_vae / vae_on_meta)
    arch = "qwen_image"  # Qwen-Image's transformer: its LoRA targets, fp8 rules and flow-matching constants
    min_controls = max_controls = plan_controls = 1  # the image to decompose (training: the composite itself)
    takes_layers = True
    sample_steps = SPEC.sample_steps["layered"]  # QwenImageLayeredPipeline's 50
    reference_mode = "RGBA"  # the image to decompose keeps its alpha (training's composite is an RGBA frame)
    # A sample's --ci is resized to its sample_size (VaeImageProcessor.resize), not cropped; training's condition
    # is the composite, fitted as its frames are (multiple_target takes no control_directory)
    stretches_references = True
    option_keys = ("layers",)

    def __init__(self, model_path: str, vae_path: str | None = None, layers: int | None = None, **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        self.layers = int(layers or DEFAULT_LAYERS)
        if self.layers < 1:
            raise ValueError(f"layers must be >= 1 (the layers a sample decomposes into), got {self.layers}")

    def model_version(self, model) -> str:
        return "qwen-image-layered"

    def model_files(self):
        vae, text = super().model_files()
        rgba = {**vae.markers, VIDEO_VAE_CONV_IN: (None, 4, 3, 3, 3)}  # RGBA in
        return [type(vae)(vae.key, vae.path, "a Qwen-Image-Layered VAE (RGBA in, 16 latent channels)",
                          vae.component, rgba), text]

    def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
        """A folder's config.json must have the Layered flags; a single file (ComfyUI's
        qwen_image_layered_bf16.safetensors) gets them."""
        path, config = self.transformer_config()
        for flag in LAYERED_FLAGS if config is not None else ():
            if not config.get(flag, False):
                raise ValueError(f"{path}/config.json: {flag} is {config.get(flag, False)!r}; a Qwen-Image-Layered "
                                 f"transformer has {flag}=true (model_type qwen_image_layered)")
        return self.load_flagged_transformer(LAYERED_FLAGS, dtype, base_precision, read_weights)

    def sample_size(self, width: int, height: int, references: list[tuple[int, int]]) -> tuple[int, int]:
        """QwenImageLayeredPipeline sizes its output from the image to decompose: its aspect ratio at the
        prompt's --w x --h area (the pipeline's resolution^2), each side a multiple of 32 (calculate_dimensions);
        the image is resized to it. A square --w 640 --h 640 is the pipeline's resolution=640."""
        if not references:
            return width, height
        w, h = area_size(*references[0], width * height)
        return max(w, SIZE_MULTIPLE), max(h, SIZE_MULTIPLE)

    def inference_sampling(self):
        return SAMPLING

    # -- the denoiser --------------------------------------------------------------------------
    def pack_target(self, latents: torch.Tensor) -> torch.Tensor:
        return pack_frames(latents) if latents.dim() == 5 else pack_latents(latents)

    def unpack_target(self, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return unpack_frames(tokens, shape[2], shape[-2], shape[-1]) if len(shape) == 5 else unpack_latents(
            tokens, shape[-2], shape[-1])

    def target_on_meta(self, batch: int, lh: int, lw: int, layers: int | None = None) -> torch.Tensor:
        """The composite and `layers` frames (the dataset's; None: the layers a sample decomposes into)."""
        return torch.empty(batch, self.latent_channels, 1 + (layers or self.layers), lh, lw, device="meta")

    def initial_noise(self, batch: int, lh: int, lw: int, generator: torch.Generator) -> torch.Tensor:
        """[B, 16, 1 + layers, lh, lw], drawn as the pipeline draws [B, 1 + layers, 16, lh, lw]. Sampling
        (the base class's loop) then runs at one frame's token count, which is the condition's: the sample's
        size follows the --ci image (sample_size) and the image is resized to it, so mu = sqrt(condition
        tokens / 256)."""
        shape = (batch, 1 + self.layers, self.latent_channels, lh, lw)
        return torch.randn(shape, generator=generator, dtype=torch.float32).transpose(1, 2)

    def predict(self, model, x_t, sigmas, text, h, w, guidance, control: list[torch.Tensor] | None = None):
        """x_t: the packed noisy frames [B, F*h*w, 64] (h, w: one frame's patch grid); control: [the
        composite's latents [B, 16, H, W]]. Returns the frames' velocity [B, F*h*w, 64]."""
        if not control or len(control) != 1:
            raise ValueError("qwen_image_layered: predict needs the image to decompose (control=[latents])")
        (cond,) = control
        shapes = [(1, h, w)] * (x_t.shape[1] // (h * w)) + [(1, cond.shape[2] // self.patch, cond.shape[3] // self.patch)]
        img = torch.cat([x_t, pack_latents(cond.to(x_t.device, x_t.dtype))], dim=1)
        rgba = torch.zeros(x_t.shape[0], dtype=torch.long, device=x_t.device)  # is_rgb = 0, as the pipeline
        pred = self.transformer_call(model, img, [shapes] * x_t.shape[0], sigmas, text, additional_t_cond=rgba)
        return pred[:, : x_t.shape[1]]
