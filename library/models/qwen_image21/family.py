"""Qwen-Image-2.1 as a diffusion family: the single-stream block-causal transformer with diffusers names
(model.py, loaded by checkpoint.py), the RGBA 16x VAE with 64 latent channels (vae.py, diffusers'
AutoencoderKLQwenImage21), Qwen3-VL-8B text on our LLM core with a padding mask (text_encoder.py), and
true CFG with a negative prompt at inference (QwenImage21Pipeline: 40 steps, no norm rescale).

Latents enter the transformer unpatched (one token per latent pixel, row-major: the pipeline's
_pack_latents), so `patch` is 1 and a token is 16 px, as a 2 x 2 patch of an 8x VAE: the training draw's
resolution shift counts h*w latent pixels (4096 at 1024 px). loss_at and sample_latents lay latents out
as these tokens; predict also takes the 2 x 2-packed layout the shared tools build (pack_latents, with
h, w the latent's size), and answers in it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from functools import cached_property

import torch

from library.models import flow_matching as fm
from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, control_kwargs
from library.models.latents import from_tokens, pack_latents, to_tokens, unpack_latents
from library.models.qwen_image21.spec import SPEC

SAMPLE_STEPS = SPEC.sample_steps["qwen-image-2.1"]  # QwenImage21Pipeline's num_inference_steps default
REFERENCE_RESOLUTION = 1024  # QwenImage21Pipeline's output_resolution: references are resized to its square's area
REFERENCE_MULTIPLE = 32  # calculate_dimensions rounds to 32 px: one merged vision token = 2 x 2 latent tokens


def reference_size(width: int, height: int, resolution: int = REFERENCE_RESOLUTION) -> tuple[int, int]:
    """A condition image's size for both the VAE and the vision tower, as QwenImage21Pipeline resizes it once for
    both: its aspect ratio at resolution^2 pixels, each side a multiple of 32 (diffusers' calculate_dimensions,
    Python round)."""
    import math

    ratio = width / height
    w = math.sqrt(resolution * resolution * ratio)
    h = w / ratio
    w, h = round(w / REFERENCE_MULTIPLE) * REFERENCE_MULTIPLE, round(h / REFERENCE_MULTIPLE) * REFERENCE_MULTIPLE
    return max(w, REFERENCE_MULTIPLE), max(h, REFERENCE_MULTIPLE)
SAMPLE_GUIDANCE = SPEC.sample_guidance["qwen-image-2.1"]  # true_cfg_scale: the pipeline's 1.0 runs no CFG (--g above 1 does, against --n or the empty prompt)


def planned_slots(embeds: torch.Tensor, control: list[torch.Tensor]) -> torch.Tensor:
    """The memory planner's stand-in for a cached prompt's slots (text_on_meta gives `embeds` alone, its tokens
    counting the references' vision tokens: reference_text_tokens): bool [B, T] on the host, the first ones the
    references' slots, one per SLOT_TOKENS latent tokens of theirs."""
    from library.models.qwen_image21.model import SLOT_TOKENS

    slots = torch.zeros(embeds.shape[:2], dtype=torch.bool)
    slots[:, : sum(c.shape[2] * c.shape[3] for c in control) // SLOT_TOKENS] = True
    return slots


class QwenImage21Family(DiffusionFamily):
    """Qwen-Image-2.1: diffusers module names, Qwen3-VL-8B text with a padding mask, true CFG; optional
    reference images (a subset's control_directory, a sample's --ci): the text encoder sees them and their
    latents take the prompt's image slots in the transformer."""

    name = "qwen_image21"
    vae = "library.models.qwen_image21.vae:QwenImage21VAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance, sample_steps = SAMPLE_GUIDANCE, SAMPLE_STEPS  # an instance's steps: a shipped grid's length
    true_cfg = True
    vae_downsample = 16
    patch = 1  # the transformer takes latent pixels
    latent_channels = 64
    max_controls = 3  # the pipeline takes any number; three as the Qwen-Image-Edit-Plus releases
    min_controls = 0  # text-to-image and editing are one model
    text_sees_controls = True  # encode(captions, reference views): the prompt holds the references' vision tokens
    stretches_references = True  # QwenImage21Pipeline resizes them to reference_size (VaeImageProcessor.resize)
    # and converts them to RGBA: the VAE reads all four channels (only the vision tower's copy is white-backed)
    reference_mode = "RGBA"
    reference_resolution = REFERENCE_RESOLUTION  # an instance takes the config's
    option_keys = ("reference_resolution",)

    def __init__(self, model_path: str, vae_path: str | None = None, reference_resolution: int | None = None,
                 **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        self.reference_resolution = reference_resolution or REFERENCE_RESOLUTION
        self.sample_steps = len(self.sample_sigmas) if self.sample_sigmas else SAMPLE_STEPS

    def control_bucket(self, bucket: tuple[int, int], size: tuple[int, int],
                       resolution: tuple[int, int] | None = None) -> tuple[int, int]:
        """The pipeline's rule, whatever the target's size: the reference's ratio at reference_resolution^2."""
        return reference_size(size[0], size[1], self.reference_resolution)

    # -- the release's sampling -----------------------------------------------------------------
    def _pipeline_json(self, *parts: str) -> dict:
        """A json file of the pipeline folder holding the transformer (its model_index.json, scheduler/...), or {}."""
        folder = self.model_path if os.path.isdir(self.model_path) else os.path.dirname(self.model_path)
        for candidate in (folder, os.path.dirname(folder.rstrip("/"))):
            path = os.path.join(candidate, *parts)
            if os.path.isfile(path):
                with open(path) as f:
                    return json.load(f)
        return {}

    @cached_property
    def sample_sigmas(self) -> list[float] | None:
        """model_index.json's `sample_sigmas`: the grid a release ships (the Turbo checkpoint's few steps), which
        QwenImage21Pipeline samples on in place of linspace(1, 1/n, n); None where the folder has none (the base)."""
        grid = self._pipeline_json("model_index.json").get("sample_sigmas")
        return [float(s) for s in grid] if grid else None

    def inference_sampling(self):
        """The folder's scheduler/scheduler_config.json as QwenImage21Pipeline reads it: mu from its constants
        (fallbacks 256, 4096, 0.5, 1.15) where it shifts dynamically, else its constant `shift`; None without
        the file (the spec's line)."""
        from library.models.flow_matching import sampling_of
        from library.models.spec import MuLine

        config = self._pipeline_json("scheduler", "scheduler_config.json")
        if not config:
            return None
        sampling = dataclasses.replace(sampling_of(self.arch), shift_terminal=config.get("shift_terminal"))
        if config.get("use_dynamic_shifting"):
            mu = MuLine(config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                        config.get("base_shift", 0.5), config.get("max_shift", 1.15))
            return dataclasses.replace(sampling, mu=mu, shift=None)
        return dataclasses.replace(sampling, mu=None, shift=float(config.get("shift", 1.0)))

    def reference_vl_size(self, width: int, height: int) -> tuple[int, int]:
        """load_text_encoder's resize, refused (ConfigError) where its pixels lie outside those the text encoder's
        image processor takes (its preprocessor_config.json's size: Qwen3-VL's 256^2 to 4096^2): the processor
        resized such a reference again, to other vision tokens than the VAE's latents hold, and the run stopped at
        its first step, after caching, in the model's words ("N image slots hold M latent tokens")."""
        w, h = reference_size(width, height, self.reference_resolution)
        low, high, config_file = self._image_processor_pixels
        if config_file and not low <= w * h <= high:
            from library.errors import ConfigError

            side = self.reference_resolution
            raise ConfigError(f"key 'reference_resolution' = {side}: a reference resized to {w} x {h} pixels lies "
                              f"outside the {low}-{high} pixels the text encoder's image processor takes "
                              f"({config_file}), which would resize it again; give a reference_resolution from "
                              f"{math.isqrt(low - 1) + 1} to {math.isqrt(high)}")
        return w, h

    @cached_property
    def _image_processor_pixels(self) -> tuple[int, int, str | None]:
        """(fewest, most pixels, the processor's config file), read once; its file None: none found."""
        from library.models.qwen_image21.text_encoder import image_processor_folder

        path = self.text_paths.get("text_encoder")
        folder = image_processor_folder(path)[0] if path and os.path.exists(path) else None
        if folder is None:  # the text encoder's load names what is missing
            return 0, 0, None
        config_file = os.path.join(folder, "preprocessor_config.json")
        with open(config_file, encoding="utf-8") as f:
            size = json.load(f).get("size") or {}
        low, high = size.get("shortest_edge"), size.get("longest_edge")  # pixels, as Qwen2VLImageProcessor reads them
        return (low, high, config_file) if isinstance(low, int) and isinstance(high, int) else (0, 0, None)

    def reference_text_tokens(self, width: int, height: int) -> int:
        w, h = self.reference_vl_size(width, height)
        return (w // REFERENCE_MULTIPLE) * (h // REFERENCE_MULTIPLE)

    def model_version(self, model) -> str:
        return "qwen-image-2.1"

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.qwen_image21.text_encoder import pipeline_tokenizer

        return [
            # AutoencoderKLQwenImage21 stores its causal convolutions' kernels as 3 x 3 (one frame).
            ModelFile("ae", self.vae_path, "a Qwen-Image-2.1 VAE (RGBA in, 64 latent channels)", "vae",
                      {"encoder.conv_out.weight": (2 * self.latent_channels, None, 3, 3),
                       "encoder.conv_in.weight": (None, 4, 3, 3)}),
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen3-VL language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_norm.weight": None},
                      (pipeline_tokenizer(self.text_paths["text_encoder"]), "processor", "Qwen2")),  # as its loader looks
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.context_in_dim}

    def text_on_meta(self, model, batch, tokens):
        # No mask: every planned caption is `tokens` long (the forward then reads nothing on the host).
        return {"embeds": torch.empty(batch, tokens, model.config.context_in_dim, device="meta")}

    def load_text_encoder(self, precision="bf16", device=None):
        """-> encode(captions, reference_views=None): a caption with references is encoded with their vision
        tokens (each resized by control_bucket's rule, as the VAE sees it), its `slots` marking them. The
        vision tower loads on the first caption with references (text-to-image never reads it)."""
        from PIL import Image

        from library.models.qwen_image21.text_encoder import load_qwen_image21_text_encoder, with_vision
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        path = self.text_paths["text_encoder"]
        encoder = load_qwen_image21_text_encoder(path, dtype=dtype, fp8=fp8)
        encoder.llm.to(device)
        vision = []  # the encoder with its vision tower, once needed

        def row(embeds, mask, slots) -> dict:
            n = int(mask.sum())  # embeds float32, mask / slots bool, real tokens first
            return {"embeds": embeds[:n], "mask": mask[:n], "slots": slots[:n]}

        def encode(captions: list[str], references: list[list] | None = None) -> list[dict]:
            references = references or [[]] * len(captions)
            out: list[dict | None] = [None] * len(captions)
            plain = [i for i, images in enumerate(references) if not images]
            if plain:  # captions without references: one batch
                embeds, mask = encoder.encode([captions[i] for i in plain])
                for j, i in enumerate(plain):
                    out[i] = row(embeds[j], mask[j], torch.zeros_like(mask[j]))
            for i, images in enumerate(references):
                if not images:
                    continue
                if not vision:
                    vision.append(with_vision(encoder, path, dtype))
                    vision[0].visual.to(device)
                # Lanczos on the RGBA view, then white-backed by the encoder: the pipeline's VaeImageProcessor.resize
                # (PIL's default bicubic was 2.4e-3 off its embeddings, the alpha dropped 0.11 for a cut-out)
                sized = [img.resize(reference_size(*img.size, self.reference_resolution), Image.Resampling.LANCZOS)
                         for img in images]
                embeds, mask, slots = vision[0].encode_with_images([captions[i]], [sized])
                out[i] = row(embeds[0], mask[0], slots[0])
            return out

        return encode

    def text_encoder_weights(self):
        """The embeddings and every decoder layer with the final norm (no head, no vision tower)."""
        from library.io import CheckpointReader, component_folder
        from library.models.llm import checkpoint_key_to_llm, llm_text_weights

        reader = CheckpointReader(component_folder(self.text_paths["text_encoder"], "text_encoder"))
        used = [k for k in reader.keys() if (name := checkpoint_key_to_llm(k, True)) is not None
                and not name.startswith("lm_head.")]
        return [llm_text_weights(reader, used)]

    def text_encoding_constants(self) -> dict:
        from library.models.qwen_image21 import text_encoder as te

        return {"template": te.QWEN_IMAGE21_TEMPLATE, "system_turn": te.QWEN_IMAGE21_SYSTEM_TURN, "layer": "last, unnormed",
                "image_slot": te.IMAGE_SLOT, "reference_resolution": self.reference_resolution,
                "reference_view": "rgba lanczos, white-backed"}  # (bicubic RGB until 2026-11-28)

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """diffusers names (the model's own), plain or behind a ComfyUI prefix; `txt_in.text_norm` is
        Qwen-Image-2.1's alone (diffusers' detection key). A ComfyUI file fuses each block's SwiGLU gate and
        up projections into `img_mlp.gate_up` (gate rows first): the module map names the file's fused
        module with our two as its row parts, so a LoRA on them merges as one stacked LoRA there."""
        from library.models.qwen_image21.checkpoint import FUSED, MARKER, PREFIXES

        prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
        if prefix is None:
            return None
        fused = {}
        for key in keys:
            if key.startswith(prefix) and (m := FUSED.fullmatch(key[len(prefix):])):
                rows = shape(key)[0] // 2
                fused[m.group(1) + "gate_up"] = [(m.group(1) + "gate_layer", 0, rows), (m.group(1) + "proj", rows, 2 * rows)]
        return CheckpointNames("diffusers", prefix, fused or None, parts_are_model=True)

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance, control=None):
        """x_t [B, h*w, C]: the latent's h x w pixels as tokens. The shared tools' 2 x 2-packed latents
        ([B, h*w / 4, 4C], pack_latents) are taken too and answered in their layout. control: the references'
        latents, each [B, C, H_i, W_i]; they take the prompt's image slots (text["slots"], one layout for the
        batch: a bucket holds one reference count and size, and the slots precede the caption; the planner's meta
        text has none: planned_slots)."""
        packed = x_t.shape[1] != h * w
        img = to_tokens(unpack_latents(x_t, h, w)) if packed else x_t
        mask = text.get("mask")
        references = {}
        if control:
            # read where they are (a host copy stays there: the layout reads them, which meta cannot)
            slots = (text["slots"] if "slots" in text else planned_slots(text["embeds"], control)).bool()
            if not bool((slots == slots[:1]).all()):
                raise ValueError("qwen_image21: the batch's prompts hold their references' slots at different places")
            references = dict(control=torch.cat([to_tokens(c.to(x_t.device, img.dtype)) for c in control], dim=1),
                              control_shapes=[tuple(c.shape[2:]) for c in control], image_slots=slots[0])
        elif "slots" in text and bool(text["slots"].any()):
            raise ValueError("qwen_image21: the prompt was encoded with reference images, but none were given")
        out = model(img=img, txt=text["embeds"].to(x_t.device), timesteps=sigmas, h=h, w=w,
                    txt_mask=None if mask is None else mask.to(x_t.device).bool(), **references)
        return pack_latents(from_tokens(out, h, w)) if packed else out

    def loss_at(self, model, latents, text, noise, sigmas, guidance, weighting="none", loss_type="l2", huber_c=0.1,
                mask=None, sample_weights=None, control=None, preservation=None, input_noise=None):
        """The shared flow-matching loss (DiffusionFamily.loss_at) on latent-pixel tokens."""
        h, w = latents.shape[2], latents.shape[3]
        noise, input_noise = self.model_noises(noise, input_noise, sigmas)
        x_t = to_tokens(fm.noisy_input(latents, noise if input_noise is None else input_noise, sigmas))
        pred = self.predict(model, x_t, sigmas, text, h, w, guidance, **control_kwargs(control))
        target = to_tokens(fm.flow_target(latents, noise))
        if mask is not None:  # one weight per latent element, laid out like the latents
            mask = to_tokens(mask.expand_as(latents))
        weights = fm.loss_weighting(sigmas, weighting)
        if sample_weights is not None:
            weights = sample_weights.float() if weights is None else weights * sample_weights.float()
        loss = fm.flow_loss(pred, target, weights, loss_type, huber_c, mask)
        if preservation is not None:
            loss = loss + self.preservation_term(model, x_t, sigmas, h, w, guidance, control, preservation)
        return loss

    @torch.no_grad()
    def sample_latents(self, model, text, width, height, steps, seed, guidance, negative_text=None, control=None,
                       flow_shift=None):
        """Euler flow-matching sampling (DiffusionFamily.sample_latents) on latent-pixel tokens; returns
        latents [B, 64, height/16, width/16] float32."""
        h, w = height // self.vae_downsample, width // self.vae_downsample
        batch, device = next(iter(text.values())).shape[0], next(iter(text.values())).device
        noise = self.initial_noise(batch, h, w, torch.Generator("cpu").manual_seed(seed)).to(device)
        # the shipped grid at its own step count (the pipeline takes it whatever the count; another --s: linspace)
        grid = self.sample_sigmas if self.sample_sigmas and len(self.sample_sigmas) == steps else None
        sigmas = fm.inference_sigmas(steps, h * w, self.arch, sampling=self.inference_sampling(), grid=grid,
                                     shift=flow_shift)

        def velocity(x, s):
            return self.guided_velocity(model, x, s, text, negative_text, h, w, guidance, **control_kwargs(control))

        return from_tokens(fm.euler_sample(velocity, to_tokens(noise), sigmas), h, w)
