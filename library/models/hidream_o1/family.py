"""HiDream-O1-Image (Full, Dev) as a diffusion family: a pixel-space model whose denoiser is a Qwen3-VL language
model (model.py, loaded by checkpoint.py) reading the prompt's token ids (text_encoder.py: the ids are what is
cached) and 32 x 32 pixel patches (the file's patch_size); no VAE (the pixel VAE: images as they are, [-1, 1]).

Training follows musubi-tuner's hidream_o1_train_network.py (the release's recommended settings, its docs): the
noisy input x_t = (1 - sigma) x0 + sigma s clip(n) with the release's noise scale s (Full 8.0, Dev 7.5) and clip
(Full none, Dev 2.5 std: model_noise; the config's noise_scale_start / noise_scale_end / noise_clip_std, musubi-tuner's
options, set them for training and samples alike), sigma drawn uniformly (default_timestep_sampling), the model
predicting x0: predict returns the velocity (x_t - x0_pred) / sigma, so `weighting_scheme = "sigma_sq"`
(configs/hidream_o1.toml) is musubi-tuner's MSE on x0 and "none" ai-toolkit's velocity MSE.

Sampling as the releases' pipelines: Full 50 steps of CFG 5.0 against " ", shift 3, from 8 x randn (Euler on the
velocity; the pipeline's UniPC solver is not reproduced); Dev 28 steps on its fixed timesteps without guidance, the
flash scheduler's re-noising step (x0_pred re-noised to the next sigma with fresh clipped noise). The release comes
from `model_version`, else the model path's name (hidream_o1_image_dev_bf16.safetensors), else Full: the files
of the two cannot be told apart.
"""

from __future__ import annotations

import os
import re
from functools import cached_property

import torch

from library.models import flow_matching as fm
from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, NamedReleases
# the releases (model_version) and their noise, named in the spec (its converters read them)
from library.models.hidream_o1.spec import DEV, FULL, NOISE, NOISE_KEYS
from library.models.hidream_o1.text_encoder import NEGATIVE_PROMPT
# Dev's pipeline timesteps (musubi-tuner's hidream_o1/pipeline.py DEFAULT_TIMESTEPS, the official inference.py's)
DEV_TIMESTEPS = (999, 987, 974, 960, 945, 929, 913, 895, 877, 857, 836, 814, 790, 764, 737, 707, 675, 640, 602, 560,
                 515, 464, 409, 347, 278, 199, 110, 8)
SIGMA_FLOOR = 1e-3  # the pipelines' velocity (x_t - x0) / max(sigma, 1e-3)


def release_in_name(path: str) -> str | None:
    """The release a file or folder name says ("hidream_o1_image_dev_bf16.safetensors", "HiDream-O1-Image-Dev")."""
    name = os.path.basename(os.path.normpath(path)).lower()
    return DEV if re.search(r"(?<![a-z])dev(?![a-z])", name) else None


def shaped_noise(noise: torch.Tensor, sigmas: torch.Tensor, start: float, end: float, clip: float) -> torch.Tensor:
    """s(sigma) clip(n): n clamped to +-clip std of the whole tensor (clip 0: not clamped), scaled by
    s = start + (end - start)(1 - sigma) (musubi-tuner's training noise, the flash scheduler's). float32."""
    noise = noise.float()
    if clip > 0:
        bound = clip * noise.std().item()
        noise = noise.clamp(-bound, bound)
    scale = start + (end - start) * (1.0 - sigmas.float())
    return noise * scale.reshape(-1, *([1] * (noise.dim() - 1)))


class HiDreamO1Family(NamedReleases, DiffusionFamily):
    """HiDream-O1-Image: pixels in 32 px patches, the prompt's ids into the Qwen3-VL denoiser, CFG for Full."""

    name = "hidream_o1"
    vae = "library.models.vae:PixelVAE"  # no VAE: the pixels themselves, [-1, 1]
    vae_file = False
    vae_downsample = 1
    latent_channels = 3
    text_path_keys = ("tokenizer",)  # optional: the model folder's, or a tokenizer/ folder beside the file
    true_cfg = True  # Full runs the " " negative prompt; Dev defaults to guidance 0 (none run)
    empty_negative = NEGATIVE_PROMPT  # the pipelines' unconditional prompt, a sample's without --n
    cfg_above = 1.0
    render_size = 2048  # musubi-tuner's hidream_o1_generate_image.py default (the release's 2K images)
    # the official pipeline (musubi-tuner's and ai-toolkit's copies): torch.Generator("cpu").manual_seed(seed + 1)
    sample_seed_offset = 1
    releases = (FULL, DEV)
    release_in_name = staticmethod(release_in_name)
    noise_given = (None, None, None)  # the config's NOISE_KEYS (None: the release's); a planner's preset sets none
    option_keys = ("model_version", *NOISE_KEYS)  # the tokenizer is a text path key

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None,
                 tokenizer: str | None = None, noise_scale_start: float | None = None,
                 noise_scale_end: float | None = None, noise_clip_std: float | None = None):
        super().__init__(model_path, vae_path, tokenizer=tokenizer)
        self.set_release(model_version)
        self.noise_given = (noise_scale_start, noise_scale_end, noise_clip_std)
        for key, value in zip(NOISE_KEYS, self.noise_given):
            clip = key == "noise_clip_std"
            if value is not None and (value < 0 or (value == 0 and not clip)):
                raise ValueError(f"{key} = {value}: expected " + ("0 (no clip) or more noise stds" if clip
                                                                  else "a scale above 0"))

    @classmethod
    def required_paths(cls) -> tuple[str, ...]:
        return ("pretrained_model_name_or_path",)  # the tokenizer is found beside the model where not given

    # -- the release (NamedReleases: model_version, else the path's name, else Full) ----------------
    def default_timestep_sampling(self, model) -> str:
        """sigma ~ U(0, 1): musubi-tuner's recommended draw (the paper's post-training)."""
        return "uniform"

    def inference_sampling(self):
        """Dev's pipeline does not shift its fixed timesteps (shift 1: sample_latents runs them as they are)."""
        import dataclasses

        return dataclasses.replace(fm.sampling_of(self.arch), shift=1.0) if self.version == DEV else None

    @cached_property
    def noise(self) -> tuple[float, float, float]:
        """(scale at sigma 1, scale at sigma 0, clip in noise stds or 0) of the model's noise, in training and
        samples: the config's NOISE_KEYS, each left out the release's (NOISE; the end: the start's, as musubi-tuner)."""
        given_start, end, clip = self.noise_given
        released = NOISE[self.version]
        start = released[0] if given_start is None else float(given_start)
        if end is None:
            end = released[1] if given_start is None else start
        return start, float(end), released[2] if clip is None else float(clip)

    @cached_property
    def transformer_config(self):
        """The file's config (our metadata, config.json or the shapes) from its header alone: the meta model's, built
        once per family."""
        return self.load_transformer(torch.float32, read_weights=False).config

    @property
    def patch(self) -> int:
        """Pixels a side of an image token: the file's patch_size (released 32; the model builds its embedder and final
        layer from it)."""
        return self.transformer_config.patch_size

    # -- files ---------------------------------------------------------------------------------
    @cached_property
    def tokenizer_folder(self) -> str:
        from library.models.hidream_o1.text_encoder import hidream_o1_tokenizer_folder

        return hidream_o1_tokenizer_folder(self.model_path, self.text_paths.get("tokenizer"))

    def model_files(self) -> list[ModelFile]:
        return []  # the transformer's own loader checks its keys; the tokenizer is checked as it loads

    def text_widths(self, config) -> dict[str, int]:
        return {}

    def text_on_meta(self, model, batch, tokens):
        return {"input_ids": torch.zeros(batch, tokens, dtype=torch.int64, device="meta"),
                "length": torch.full((batch,), tokens, dtype=torch.int64, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """Our names as they are (Comfy-Org's and the HF repo's files), or behind musubi-tuner's `diffusion_model.`;
        ComfyUI's files without the root's `model.` are no prefix of ours (not merged into)."""
        from library.models.hidream_o1.checkpoint import MARKER, OURS

        for prefix in ("", "diffusion_model."):
            if prefix + OURS + MARKER in keys:
                return CheckpointNames("released", prefix)
        return None

    # -- text: the prompt's ids ----------------------------------------------------------------
    def text_encoding_constants(self) -> dict:
        from library.models.hidream_o1 import text_encoder as te

        # "negative": an empty --n encodes it (until 2026-12-03 the constant was named but "" encoded: re-encoded)
        return {"template": "chat + boi + tms", "empty negative": te.NEGATIVE_PROMPT}

    def text_cache_key(self, options: dict, precision: str) -> str:
        """The ids depend on the tokenizer and the template (text_encoding_constants), not on a precision."""
        return super().text_cache_key(options, "ids")

    def text_files(self) -> list[str]:
        """The tokenizer's files (the folder found beside the model where no `tokenizer` is given)."""
        from library.models.text_encoders import tokenizer_files

        return tokenizer_files(self.tokenizer_folder)

    @cached_property
    def prompt_ids(self):
        """The tokenizer's prompt ids (text_encoder.py), its <|tms_token|> checked against the transformer's config
        (before caching: caption_token_limit is the run's first use)."""
        from library.models.hidream_o1.text_encoder import load_hidream_o1_prompt_ids

        return load_hidream_o1_prompt_ids(self.model_path, self.text_paths.get("tokenizer"),
                                          self.transformer_config.tms_token_id)

    def caption_token_limit(self, args):
        from library.models.hidream_o1.text_encoder import hidream_o1_caption_token_limit

        return hidream_o1_caption_token_limit(self.prompt_ids)

    def load_text_encoder(self, precision="bf16", device=None):
        """encode(captions) -> per caption {"input_ids": int64 [T], "length": int64 []} (text_encoder.py)."""
        return self.prompt_ids.encode

    def text_encoder_weights(self):
        return []  # no text encoder: the ids enter the transformer

    # -- the denoiser --------------------------------------------------------------------------
    def pack_target(self, latents: torch.Tensor) -> torch.Tensor:
        from library.models.latents import pack_latents

        return pack_latents(latents, self.patch)

    def unpack_target(self, tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        from library.models.latents import unpack_latents

        return unpack_latents(tokens, shape[-2], shape[-1], self.patch)

    def model_noise(self, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """The scaled (for Dev clipped) noise the model was trained on (shaped_noise at `noise`: the release's unless
        the config's noise keys say otherwise)."""
        return shaped_noise(noise, sigmas, *self.noise)

    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t [B, h*w, 3 p^2]: p px patches of the noisy pixels (3072 values at the released 32). The model predicts
        x0; returns the velocity (x_t - x0) / sigma in float32 (sigma at least 1e-3, as the pipelines)."""
        device = x_t.device
        x0 = model(x_t, text["input_ids"].to(device), text["length"].to(device), sigmas, h, w)
        floor = sigmas.float().clamp_min(SIGMA_FLOOR).reshape(-1, 1, 1)
        return (x_t.float() - x0.float()) / floor

    # -- sampling ------------------------------------------------------------------------------
    def initial_noise(self, batch: int, lh: int, lw: int, generator: torch.Generator) -> torch.Tensor:
        """The noise scale at sigma 1 times randn (the release's: Full 8, Dev 7.5), the pipelines' starting point."""
        start, _, _ = self.noise
        return start * torch.randn(batch, self.latent_channels, lh, lw, generator=generator, dtype=torch.float32)

    @torch.no_grad()
    def sample_latents(self, model, text, width, height, steps, seed, guidance, negative_text=None, control=None,
                       flow_shift=None):
        """Full: the base class's Euler on the velocity (shift 3). Dev at its 28 steps without --fs: the flash
        scheduler on DEV_TIMESTEPS: x0 from the model, then re-noised to the next sigma with fresh clipped noise."""
        if self.version != DEV or steps != len(DEV_TIMESTEPS) or flow_shift is not None:
            return super().sample_latents(model, text, width, height, steps, seed, guidance, negative_text,
                                          control, flow_shift)
        h, w = height // self.patch, width // self.patch
        batch, device = text["input_ids"].shape[0], text["input_ids"].device
        gen = torch.Generator("cpu").manual_seed(seed + self.sample_seed_offset)
        x = self.initial_noise(batch, height, width, gen).to(device)
        sigmas = torch.tensor([t / 1000 for t in DEV_TIMESTEPS] + [0.0])
        start, end, clip = self.noise
        # each step's noise scale, start to end over the steps (the flash scheduler's noise_scale_schedule)
        scales = iter([start + (end - start) * k / max(len(sigmas) - 2, 1) for k in range(len(sigmas) - 1)])

        def velocity(x_t, s):
            return self.guided_velocity(model, x_t, s, text, negative_text, h, w, guidance)

        def fresh_noise():  # clipped, at this step's scale, drawn in the pixels' shape
            scale = next(scales)
            fresh = torch.randn(x.shape, generator=gen, dtype=torch.float32)
            return self.pack_target(shaped_noise(fresh, torch.zeros(batch), scale, scale, clip)).to(device)

        return self.unpack_target(fm.flash_sample(velocity, self.pack_target(x), sigmas, fresh_noise), x.shape)
