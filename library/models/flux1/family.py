"""FLUX.1 dev/schnell as a diffusion family: the BFL-named transformer (model.py, loaded by
checkpoint.py), the FLUX VAE, CLIP-L pooled + T5-XXL text, and the distilled guidance embedding."""

from __future__ import annotations

import functools

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, file_fingerprint
from library.models.flux1.spec import SPEC


class FluxFamily(DiffusionFamily):
    """FLUX.1 dev/schnell: BFL module names, CLIP-L pooled + T5-XXL text, guidance embedding (dev)."""

    name = "flux"
    vae = "library.models.flux1.vae:FluxVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("clip_l", "t5xxl")
    sample_guidance = SPEC.sample_guidance["dev"]  # FluxPipeline's guidance_scale

    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        clip_l, t5xxl = self.text_paths["clip_l"], self.text_paths["t5xxl"]
        return [
            ModelFile("ae", self.vae_path, "a FLUX.1 VAE (16 latent channels)", "vae", vae_markers(self.latent_channels)),
            ModelFile("clip_l", clip_l, "a CLIP-L text encoder", "text_encoder", {"embeddings.token_embedding.weight": None},
                      (None, "tokenizer", "CLIP")),  # as load_clip_l and load_t5 look for them
            ModelFile("t5xxl", t5xxl, "a T5 encoder", "text_encoder_2", {"block.0.layer.0.SelfAttention.q.weight": None},
                      (None, "tokenizer_2", "T5")),
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"t5xxl": config.context_in_dim, "clip_l": config.vec_in_dim}  # T5's states, CLIP's pooled output

    def text_on_meta(self, model, batch, tokens):
        cfg = model.config
        return {"t5": torch.empty(batch, tokens, cfg.context_in_dim, device="meta"),
                "clip_pooled": torch.empty(batch, cfg.vec_in_dim, device="meta")}

    def text_encoder_weights(self):
        """T5-XXL as load_t5 keeps it, CLIP-L's every tensor (never fp8: bf16 under fp8)."""
        from library.io import CheckpointReader, component_folder
        from library.models.family import TextWeights
        from library.models.text_encoders import t5_text_weights

        clip = CheckpointReader(component_folder(self.text_paths["clip_l"], "text_encoder")).numel()
        return [t5_text_weights(self.text_paths["t5xxl"]), TextWeights(clip)]

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """BFL names or a diffusers folder's; FLUX.2 shares the block names, its shared modulation is its own."""
        from library.models.flux1.checkpoint import row_tables

        if any("single_stream_modulation." in k for k in keys):
            return None
        return bfl_checkpoint_names(keys, shape, row_tables)

    def text_options(self, args) -> dict:
        return {"t5_max_length": getattr(args, "t5xxl_max_token_length", None) or self.t5_max_length()}

    def text_encoding_constants(self) -> dict:
        from library.models.text_encoders import CLIP_MAX_LENGTH

        return {"clip_max_length": CLIP_MAX_LENGTH}

    def model_version(self, model) -> str:
        return "flux1-dev" if model.guidance_in is not None else "flux1-schnell"

    def caption_token_limit(self, args):
        """T5-XXL's sequence is cut at t5_max_length tokens (its </s> included); CLIP-L's 77 only
        feed the pooled vector, and are not counted."""
        from library.data.check import TokenLimit
        from library.io import component_folder
        from library.models.text_encoders import _load_tokenizer

        tokenizer = _load_tokenizer(component_folder(self.text_paths["t5xxl"], "text_encoder_2"), None, "tokenizer_2", "T5")
        return TokenLimit("T5-XXL", self.text_options(args)["t5_max_length"], lambda text: len(tokenizer(text, verbose=False).input_ids))

    def load_text_encoder(self, precision="bf16", device=None, t5_max_length: int = 512):
        from library.models.flux1.text_encoder import encode_flux_prompts
        from library.models.text_encoders import encoder_precision, load_clip_l, load_t5

        dtype, fp8 = encoder_precision(precision)
        clip = load_clip_l(self.text_paths["clip_l"], dtype=dtype)
        t5 = load_t5(self.text_paths["t5xxl"], dtype=dtype, fp8=fp8)
        clip.model.to(device), t5.model.to(device)

        def encode(captions: list[str]) -> list[dict]:
            t5_hidden, pooled = encode_flux_prompts(captions, clip, t5, t5_max_length)
            return [{"t5": t, "clip_pooled": p} for t, p in zip(t5_hidden, pooled)]

        return encode

    def t5_max_length(self) -> int:
        """512 T5 tokens for dev, 256 for schnell (no guidance embedding)."""
        return 512 if self.has_guidance_embedding() else 256

    @property
    def sample_steps(self) -> int:
        """Default --s: FluxPipeline's 28 (dev), schnell's own 4 (a checkpoint without the guidance embedding)."""
        return SPEC.sample_steps["dev" if self.has_guidance_embedding() else "schnell"]

    def has_guidance_embedding(self) -> bool:
        """dev's guidance embedding (schnell has none)."""
        return checkpoint_has_guidance_embedding(self.model_path)

    def reads_training_guidance(self) -> bool:
        return self.has_guidance_embedding()  # schnell's checkpoint has none

    def unread_sample_options(self) -> dict[str, str]:
        unread = super().unread_sample_options()
        if not self.has_guidance_embedding():
            unread["guidance"] = f"{self.model_path} has no guidance embedding (a FLUX.1 schnell checkpoint)"
        return unread

    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        from library.models.flux1.model import make_img_ids

        return self.transformer_call(model, x_t, make_img_ids(x_t.shape[0], h, w, x_t.device), sigmas, text, guidance)

    def transformer_call(self, model, img, img_ids, sigmas, text, guidance):
        """One transformer call on image tokens img [B, L, 64] at positions img_ids [B, L, 3] int64."""
        from library.models.flux1.model import make_txt_ids

        b, device = img.shape[0], img.device
        t5 = text["t5"].to(device)
        g = None
        if model.guidance_in is not None:
            g = torch.full((b,), 1.0 if guidance is None else float(guidance), dtype=torch.float32, device=device)
        return model(
            img=img, img_ids=img_ids, txt=t5, txt_ids=make_txt_ids(b, t5.shape[1], device),
            timesteps=sigmas, y=text["clip_pooled"].to(device), guidance=g,
        )

    def dynamic_shift(self, model) -> bool:
        return model.guidance_in is not None  # schnell's scheduler has no resolution shift


def checkpoint_has_guidance_embedding(model_path: str) -> bool:
    """Whether a BFL-named transformer's checkpoint (FLUX.1 or FLUX.2, BFL or diffusers names) has the
    guidance embedding, read from its key names without loading any weights: once per file (a run
    asks for each sample's steps and options), again when a file's size or mtime changes."""
    from library.io import component_folder

    path = component_folder(model_path, "transformer")
    return _has_guidance_keys(path, file_fingerprint(path))


@functools.lru_cache(maxsize=16)
def _has_guidance_keys(path: str, fingerprint: str) -> bool:
    from library.io import CheckpointReader

    return any("guidance_in." in k or "guidance_embedder." in k for k in CheckpointReader(path).keys())


def bfl_checkpoint_names(keys, shape, row_tables) -> CheckpointNames | None:
    """The names of a checkpoint of a BFL-named transformer (FLUX.1's block names): BFL's, plain or
    behind a ComfyUI prefix, or a diffusers folder's (fused rows split: not the model's own); the
    module map of its fused rows (row_tables) sized from its shapes. None: neither."""
    from library.models.flux1.checkpoint import BFL_PREFIXES

    blocks = ("double_blocks.", "single_blocks.")
    prefix = next((p for p in BFL_PREFIXES if any(k.startswith(p + b) for k in keys for b in blocks)), None)
    if prefix is not None:
        shapes = {k[len(prefix):]: shape(k) for k in keys if k.startswith(prefix)}
        return CheckpointNames("bfl", prefix, row_tables(list(shapes), shapes.__getitem__, diffusers=False)[0])
    # A diffusers FLUX folder; other transformers have an x_embedder too, none of them a proj_out beside it.
    diffusers = ("single_transformer_blocks.", "x_embedder.", "context_embedder.")
    if "proj_out.weight" in keys and any(k.startswith(m) for k in keys for m in diffusers):
        return CheckpointNames("diffusers", "", row_tables(keys, shape, diffusers=True)[0], native=False)
    return None
