"""The one small interface through which FLUX.1 and Qwen-Image plug into training, sampling and
the tools: load (transformer, VAE, text encoders), encode (images, captions), predict (one
denoiser call on packed latents) and sample (Euler flow matching, the same code for training
samples and tools/generate.py).

Dtypes at the boundaries: latents and text embeddings are float32 (bf16 on disk); the model
casts its inputs to its `compute_dtype`; sigmas and positions stay float32/int64.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.nn as nn

from library import flow_matching as fm
from library.vae import pack_latents, unpack_latents

BASE_PRECISIONS = ("bf16", "fp8", "fp8_scaled")  # how the frozen base is stored


def file_fingerprint(*paths: str | None) -> str:
    """Short id of model files (names, sizes, mtimes) for cache keys: a changed model file
    invalidates the caches made with it without hashing gigabytes."""
    h = hashlib.sha256()
    for path in paths:
        if not path:
            continue
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith((".safetensors", ".json"))
        )
        for f in files:
            st = os.stat(f)
            h.update(f"{os.path.relpath(f, path) if f != path else os.path.basename(f)}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:10]


def fp8_prepare(mode: str | None, family: str):
    """The `prepare` hook for load_flux / load_qwen_image: on the meta-built model, swap Linears
    for FP8Linear and return the per-tensor quantizing converter (quantization while loading)."""
    if mode in (None, "bf16"):
        return None
    from library.fp8 import fp8_load_converter, prepare_fp8

    return lambda model: fp8_load_converter(prepare_fp8(model, mode, family))


class DiffusionFamily:
    name: str
    vae_downsample = 8
    patch = 2

    def __init__(self, model_path: str, vae_path: str | None = None, **text_paths):
        self.model_path, self.vae_path, self.text_paths = model_path, vae_path, text_paths

    # -- loading -------------------------------------------------------------------------------
    def load_transformer(self, dtype: torch.dtype, base_precision: str = "bf16") -> nn.Module:
        raise NotImplementedError

    def load_vae(self, dtype: torch.dtype = torch.float32):
        raise NotImplementedError

    def load_text_encoder(self, dtype: torch.dtype = torch.float32):
        """-> callable(captions: list[str]) -> list of per-caption dicts of tensors (cacheable)."""
        raise NotImplementedError

    def cache_keys(self) -> tuple[str, str]:
        """(latent cache key, text cache key): family + fingerprints of the encoder files."""
        return (
            f"{self.name}_{file_fingerprint(self.vae_path)}",
            f"{self.name}_{file_fingerprint(*self.text_paths.values())}",
        )

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model: nn.Module, x_t: torch.Tensor, sigmas: torch.Tensor, text: dict, h: int, w: int,
                guidance: float | None) -> torch.Tensor:
        """x_t: packed latents [B, h*w, 64] float32 (h, w in patches); sigmas [B] float32.
        Returns the predicted velocity, packed, in the model's compute dtype."""
        raise NotImplementedError

    # -- training objective --------------------------------------------------------------------
    def training_loss(self, model, latents: torch.Tensor, text: dict, args, generators: list[torch.Generator]):
        """Flow-matching loss for a batch of latents [B, 16, H/8, W/8] (float32). One CPU
        generator per sample draws its noise and sigma, so a sample's draw does not depend on its
        batch position or process. Returns the scalar float32 loss and the sigmas used."""
        b, _, lh, lw = latents.shape
        h, w = lh // self.patch, lw // self.patch
        method = args.timestep_sampling or fm.DEFAULTS[self.name]["timestep_sampling"]
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g, dtype=torch.float32) for g in generators])
        sigmas = torch.cat([
            fm.sample_sigmas(1, method, generator=g, shift=args.discrete_flow_shift,
                             sigmoid_scale=args.sigmoid_scale, image_seq_len=h * w)
            for g in generators
        ])
        noise, sigmas = noise.to(latents.device), sigmas.to(latents.device)
        x_t = pack_latents(fm.noisy_input(latents, noise, sigmas))
        pred = self.predict(model, x_t, sigmas, text, h, w, args.guidance_scale)
        target = pack_latents(fm.flow_target(latents, noise))
        weights = fm.loss_weighting(sigmas, args.weighting_scheme)
        return fm.flow_loss(pred, target, weights, args.loss_type, args.huber_c), sigmas

    # -- sampling ------------------------------------------------------------------------------
    @torch.no_grad()
    def sample_latents(self, model, text: dict, width: int, height: int, steps: int, seed: int,
                       guidance: float | None, negative_text: dict | None = None) -> torch.Tensor:
        """Euler flow-matching sampling; returns unpacked latents [B, 16, height/8, width/8] float32."""
        lh, lw = height // self.vae_downsample, width // self.vae_downsample
        h, w = lh // self.patch, lw // self.patch
        batch = next(iter(text.values())).shape[0]
        device = next(iter(text.values())).device
        gen = torch.Generator("cpu").manual_seed(seed)
        noise = torch.randn(batch, 16, lh, lw, generator=gen, dtype=torch.float32).to(device)
        sigmas = fm.inference_sigmas(steps, h * w, self.name, dynamic_shift=self.dynamic_shift(model))

        def velocity(x, s):
            return self.guided_velocity(model, x, s, text, negative_text, h, w, guidance)

        return unpack_latents(fm.euler_sample(velocity, pack_latents(noise), sigmas), lh, lw)

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance):
        return self.predict(model, x, s, text, h, w, guidance).float()

    def dynamic_shift(self, model) -> bool:
        return True


class FluxFamily(DiffusionFamily):
    """FLUX.1 dev/schnell: BFL module names, CLIP-L pooled + T5-XXL text, guidance embedding (dev)."""

    name = "flux"

    def load_transformer(self, dtype, base_precision="bf16"):
        from library.flux_checkpoint import load_flux

        return load_flux(self.model_path, dtype=dtype, prepare=fp8_prepare(base_precision, self.name))

    def load_vae(self, dtype=torch.float32):
        from library.vae import load_flux_vae

        return load_flux_vae(self.vae_path, dtype)

    def load_text_encoder(self, dtype=torch.float32, t5_max_length: int = 512):
        from library.text_encoders import encode_flux_prompts, load_clip_l, load_t5

        clip = load_clip_l(self.text_paths["clip_l"], dtype=dtype)
        t5 = load_t5(self.text_paths["t5xxl"], dtype=dtype)

        def encode(captions: list[str]) -> list[dict]:
            t5_hidden, pooled = encode_flux_prompts(captions, clip, t5, t5_max_length)
            return [{"t5": t, "clip_pooled": p} for t, p in zip(t5_hidden, pooled)]

        return encode

    def t5_max_length(self) -> int:
        """512 T5 tokens for dev, 256 for schnell (no guidance embedding), read from the
        checkpoint's key names or config.json without loading any weights."""
        from library.io import CheckpointReader, component_folder

        keys = CheckpointReader(component_folder(self.model_path, "transformer")).keys()
        return 512 if any("guidance_in." in k or "guidance_embedder." in k for k in keys) else 256

    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        from library.flux import make_img_ids, make_txt_ids

        b, device = x_t.shape[0], x_t.device
        t5 = text["t5"].to(device)
        g = None
        if model.guidance_in is not None:
            g = torch.full((b,), 1.0 if guidance is None else float(guidance), dtype=torch.float32, device=device)
        return model(
            img=x_t, img_ids=make_img_ids(b, h, w, device), txt=t5, txt_ids=make_txt_ids(b, t5.shape[1], device),
            timesteps=sigmas, y=text["clip_pooled"].to(device), guidance=g,
        )

    def dynamic_shift(self, model) -> bool:
        return model.guidance_in is not None  # schnell's scheduler has no resolution shift


class QwenImageFamily(DiffusionFamily):
    """Qwen-Image: diffusers module names, Qwen2.5-VL (our LLM core) text with a padding mask,
    true classifier-free guidance with a negative prompt at inference."""

    name = "qwen_image"

    def load_transformer(self, dtype, base_precision="bf16"):
        from library.qwen_image import load_qwen_image

        return load_qwen_image(self.model_path, dtype=dtype, prepare=fp8_prepare(base_precision, self.name))

    def load_vae(self, dtype=torch.float32):
        from library.vae import load_qwen_image_vae

        return load_qwen_image_vae(self.vae_path, dtype)

    def load_text_encoder(self, dtype=torch.float32):
        from library.text_encoders import load_qwen_image_text_encoder

        encoder = load_qwen_image_text_encoder(self.text_paths["text_encoder"], dtype=dtype)

        def encode(captions: list[str]) -> list[dict]:
            embeds, mask = encoder.encode(captions)
            return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]

        return encode

    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        device = x_t.device
        return model(
            img=x_t, txt=text["embeds"].to(device), txt_mask=text["mask"].to(device).bool(),
            timesteps=sigmas, img_shapes=[(1, h, w)] * x_t.shape[0],
        )

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance):
        cond = self.predict(model, x, s, text, h, w, guidance).float()
        if negative_text is None or guidance is None or guidance <= 1.0:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance).float()
        # Qwen-Image's pipeline rescales the guided prediction to the conditional one's norm.
        guided = uncond + guidance * (cond - uncond)
        return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))


def stack_text(per_caption: list[dict]) -> dict:
    """Per-caption encoder outputs (as cached) -> one batch dict [B, ...]."""
    return {k: torch.stack([d[k] for d in per_caption]) for k in per_caption[0]}


def get_family(args) -> DiffusionFamily:
    if args.model_type == "flux":
        return FluxFamily(args.pretrained_model_name_or_path, args.ae, clip_l=args.clip_l, t5xxl=args.t5xxl)
    if args.model_type == "qwen_image":
        return QwenImageFamily(args.pretrained_model_name_or_path, args.ae, text_encoder=args.text_encoder)
    raise ValueError(f"model_type {args.model_type!r} is not a diffusion family")
