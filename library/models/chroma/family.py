"""Chroma as a diffusion family: the BFL-named transformer without per-block modulation (model.py,
loaded by checkpoint.py), FLUX.1's VAE, T5-XXL text with Chroma's mask, and true classifier-free
guidance with a negative prompt at inference (ChromaPipeline: guidance_scale 5.0, no norm rescale)."""

from __future__ import annotations

import torch

from library.models.chroma.spec import SPEC
from library.models.family import CheckpointNames, DiffusionFamily, ModelFile


class ChromaFamily(DiffusionFamily):
    """Chroma: FLUX.1-schnell's blocks, one approximator for the modulation, T5-XXL with a text mask."""

    name = "chroma"
    vae = "library.models.flux1.vae:FluxVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("t5xxl",)
    sample_guidance = SPEC.sample_guidance["chroma"]  # ChromaPipeline's default guidance_scale: a true CFG scale, not an embedded guidance
    sample_steps = SPEC.sample_steps["chroma"]  # ChromaPipeline's num_inference_steps default
    true_cfg = True

    def model_files(self) -> list[ModelFile]:
        from library.models.chroma.text_encoder import t5_paths
        from library.models.vae import vae_markers

        return [
            ModelFile("ae", self.vae_path, "a FLUX.1 VAE (16 latent channels)", "vae", vae_markers(self.latent_channels)),
            ModelFile("t5xxl", self.text_paths["t5xxl"], "a T5 encoder", "text_encoder",
                      {"block.0.layer.0.SelfAttention.q.weight": None},
                      (t5_paths(self.text_paths["t5xxl"])[1], "tokenizer_2", "T5")),  # as load_chroma_t5 looks
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"t5xxl": config.context_in_dim}

    def model_version(self, model) -> str:
        return "chroma"

    # -- the VAE: FLUX.1's ---------------------------------------------------------------------
    # -- text ----------------------------------------------------------------------------------
    def text_options(self, args) -> dict:
        return {"t5_max_length": getattr(args, "t5xxl_max_token_length", None) or self.default_t5_length()}

    @staticmethod
    def default_t5_length() -> int:
        from library.models.chroma.text_encoder import T5_MAX_LENGTH

        return T5_MAX_LENGTH

    def text_encoding_constants(self) -> dict:
        """The mask rule (tokens + EOS + one padding token attended) and the cut to that prefix."""
        return {"text_mask": "tokens+1", "cache": "attended prefix"}

    def text_encoder_weights(self):
        """T5-XXL, found as load_text_encoder finds it (a repo folder: its text_encoder/), as load_t5 keeps it."""
        from library.models.chroma.text_encoder import t5_paths
        from library.models.text_encoders import t5_text_weights

        return [t5_text_weights(t5_paths(self.text_paths["t5xxl"])[0])]

    def text_on_meta(self, model, batch, tokens):
        return {"t5": torch.empty(batch, tokens, model.config.context_in_dim, device="meta"),
                "mask": torch.ones(batch, tokens, dtype=torch.bool, device="meta")}

    def caption_token_limit(self, args):
        """T5-XXL's sequence is cut at t5_max_length tokens, its </s> included."""
        from library.data.check import TokenLimit
        from library.models.chroma.text_encoder import t5_tokenizer

        tokenizer = t5_tokenizer(self.text_paths["t5xxl"])
        return TokenLimit("T5-XXL", self.text_options(args)["t5_max_length"],
                          lambda text: len(tokenizer(text, verbose=False).input_ids))

    def load_text_encoder(self, precision="bf16", device=None, t5_max_length: int = 512):
        from library.models.chroma.text_encoder import encode_chroma_prompts, load_chroma_t5, per_caption
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        t5 = load_chroma_t5(self.text_paths["t5xxl"], dtype=dtype, fp8=fp8)
        t5.model.to(device)

        def encode(captions: list[str]) -> list[dict]:
            return per_caption(*encode_chroma_prompts(captions, t5, t5_max_length))

        return encode

    # -- checkpoints ---------------------------------------------------------------------------
    @classmethod
    def checkpoint_names(cls, keys, shape):
        """BFL names (plain or behind a ComfyUI prefix) or a diffusers folder's, told from FLUX.1's by
        the approximator; the module map sized from the file's shapes."""
        from library.models.chroma.checkpoint import BFL_PREFIXES, MARKER, chroma_diffusers_module_map
        from library.models.chroma.checkpoint import config_from_bfl_shapes, config_from_diffusers_shapes

        prefix = next((p for p in BFL_PREFIXES if p + MARKER in keys and any(k.startswith(p + "img_in.") for k in keys)), None)
        if prefix is not None:
            shapes = {k[len(prefix):]: shape(k) for k in keys if k.startswith(prefix)}
            return CheckpointNames("bfl", prefix, chroma_diffusers_module_map(config_from_bfl_shapes(shapes)))
        if MARKER in keys and "x_embedder.weight" in keys:
            config = config_from_diffusers_shapes(keys, shape)
            return CheckpointNames("diffusers", "", chroma_diffusers_module_map(config), native=False)
        return None

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        from library.models.chroma.model import make_img_ids, make_txt_ids

        b, device = x_t.shape[0], x_t.device
        t5 = text["t5"].to(device)
        return model(img=x_t, img_ids=make_img_ids(b, h, w, device), txt=t5, txt_ids=make_txt_ids(b, t5.shape[1], device),
                     timesteps=sigmas, txt_mask=text["mask"].to(device).bool())
