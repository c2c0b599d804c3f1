"""Stable Diffusion 3 / 3.5 as a diffusion family: SAI's MMDiT in its released names (model.py, loaded by
checkpoint.py), the 16-channel VAE with SD3's factors (vae.py), and three text encoders (text_encoder.py): CLIP-L's
and CLIP-G's hidden_states[-2] joined by channels and padded to T5's width, followed by T5-XXL's states (the
context, 77 + 256 tokens), and both CLIPs' projected pooled outputs joined (the pooled vector, 2048).

Latents enter the transformer as 2x2 patches (pack_latents, the base class's): 1024 px is 64 x 64 = 4096 tokens. The
positions are a fixed sin-cos table of pos_embed_max_size^2 patches (192 for SD3.5-Large: 3072 px a side), cropped
at the centre: a larger image is refused before caching (largest_image).

Inference: the released schedulers' constant shift 3 (no resolution shift), the model cards' steps and guidance
(SD3.5-Large 28 at 3.5, SD3.5-Medium 40 at 4.5, SD3-Medium 28 at 7.0), classifier-free guidance with the empty
negative prompt, as StableDiffusion3Pipeline. Skip-layer guidance (the SD3.5-Medium card's option) is not run.
"""

from __future__ import annotations

import functools

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile
from library.models.sd3.spec import SPEC

CLIP_TOKENS = 77  # both CLIPs' sequence, first in the context


class SD3Family(DiffusionFamily):
    """SD3 / SD3.5: SAI's names, the 16-channel VAE, CLIP-L + CLIP-G + T5-XXL text, true CFG."""

    name = "sd3"
    vae = "library.models.sd3.vae:SD3VAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("clip_l", "clip_g", "t5xxl")
    true_cfg = True
    # CLIP-L resident; CLIP-G and T5-XXL take turns on a card that cannot hold the three together (SD3TextEncoder.place)
    text_encoders_take_turns = True

    def model_version(self, model) -> str:
        return release_of(model.config)

    @functools.cached_property
    def _file_config(self):
        """The transformer's config as its file's header gives it (a model on meta, no weight read): once per family."""
        return self.load_transformer(torch.float32, read_weights=False).config

    @property
    def sample_steps(self) -> int:
        """Default --s: the model card's for the release (28 for Large and SD3-Medium, 40 for SD3.5-Medium)."""
        return SPEC.sample_steps[release_of(self._file_config)]

    @property
    def sample_guidance(self) -> float:
        """Default --g: the model card's for the release (3.5 Large, 4.5 SD3.5-Medium, 7.0 SD3-Medium)."""
        return SPEC.sample_guidance[release_of(self._file_config)]

    def largest_image(self) -> tuple[int, int]:
        """The positional table's pos_embed_max_size patches a side (192 for SD3.5-Large, 384 for SD3.5-Medium), the
        forward refusing more, as diffusers' PatchEmbed."""
        from library.models.sd3.model import max_patch_grid

        side = max_patch_grid(self._file_config) * self.patch
        return side * self.vae_downsample, side * self.vae_downsample

    # -- files ---------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        return [ModelFile("ae", self.vae_path, "an SD3 VAE (16 latent channels)", "vae",
                          vae_markers(self.latent_channels)), *clip_t5_model_files(self.text_paths)]

    def text_widths(self, config) -> dict[str, int]:
        return {"t5xxl": config.context_dim}  # the joined CLIP states are padded to it; pooled_dim the two CLIPs'

    def text_on_meta(self, model, batch, tokens):
        c = model.config
        return {"context": torch.empty(batch, CLIP_TOKENS + tokens, c.context_dim, device="meta"),
                "pooled": torch.empty(batch, c.pooled_dim, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """SAI's names (ours), plain or behind a prefix (the released model.diffusion_model., ComfyUI's
        diffusion_model.); a diffusers transformer/ folder through its module map."""
        from library.models.sd3.checkpoint import DIFFUSERS_MARKER, DIFFUSERS_PATCH, MARKER, PREFIXES, module_map

        for prefix in PREFIXES:
            if prefix + MARKER in keys:
                return CheckpointNames("sai", prefix)
        if DIFFUSERS_MARKER in keys and DIFFUSERS_PATCH in keys:  # FLUX.1's folder has add_q_proj, no pos_embed.proj
            return CheckpointNames("diffusers", "", module_map(keys, shape), native=False)
        return None

    # -- text ----------------------------------------------------------------------------------
    def text_options(self, args) -> dict:
        return {"t5_max_length": getattr(args, "t5xxl_max_token_length", None) or self.t5_max_length()}

    @staticmethod
    def t5_max_length() -> int:
        return 256  # StableDiffusion3Pipeline's max_sequence_length, sd-scripts' t5xxl_max_token_length

    def text_encoding_constants(self) -> dict:
        from library.models.sd3 import text_encoder as te

        return te.ENCODING_CONSTANTS

    def caption_token_limit(self, args):
        """T5-XXL's sequence is cut at t5_max_length tokens (its </s> included); the CLIPs' 77 lead the context
        whatever T5 keeps."""
        from library.models.sd3.text_encoder import sd3_caption_token_limit

        return sd3_caption_token_limit(self.text_paths["t5xxl"], self.text_options(args)["t5_max_length"])

    def load_text_encoder(self, precision="bf16", device=None, t5_max_length: int = 256, one_at_a_time: bool = False):
        """encode(captions) -> per caption {"context": float32 [77 + t5_max_length, 4096], "pooled": float32 [2048]}.
        one_at_a_time: they take turns on the device (text_encoders_take_turns)."""
        from library.models.sd3.text_encoder import load_sd3_text_encoders
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_sd3_text_encoders(self.text_paths["clip_l"], self.text_paths["clip_g"],
                                         self.text_paths["t5xxl"], dtype=dtype, fp8=fp8, t5_max_length=t5_max_length)
        encoder.place(device, one_at_a_time)
        return encoder.encode

    def text_encoder_weights(self):
        """CLIP-L and CLIP-G with their projections (never fp8), T5-XXL's encoder as load_t5 keeps it."""
        from library.models.sd3.text_encoder import sd3_text_weights

        return sd3_text_weights(self.text_paths["clip_l"], self.text_paths["clip_g"], self.text_paths["t5xxl"])

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t [B, h*w, 64]: 2x2 latent patches (pack_latents). Returns the velocity noise - x0 [B, h*w, 64]."""
        device = x_t.device
        return model(img=x_t, txt=text["context"].to(device), pooled=text["pooled"].to(device), timesteps=sigmas,
                     h=h, w=w)


def clip_t5_model_files(paths: dict[str, str]) -> list[ModelFile]:
    """CLIP-L, CLIP-G (each with its projection) and T5-XXL at paths["clip_l" / "clip_g" / "t5xxl"], with the
    diffusers repo's component and tokenizer folders (text_encoder/ ... tokenizer_3/)."""
    tower = {"text_model.embeddings.token_embedding.weight": None, "text_projection.weight": None}
    return [
        ModelFile("clip_l", paths["clip_l"], "a CLIP-L text encoder with its projection", "text_encoder", tower,
                  (None, "tokenizer", "CLIP", True)),
        ModelFile("clip_g", paths["clip_g"], "a CLIP-G text encoder with its projection", "text_encoder_2", tower,
                  (None, "tokenizer_2", "CLIP", True)),
        ModelFile("t5xxl", paths["t5xxl"], "a T5 encoder", "text_encoder_3",
                  {"block.0.layer.0.SelfAttention.q.weight": None}, (None, "tokenizer_3", "T5", True)),
    ]


def release_of(config) -> str:
    """sd3.5-large (38 blocks), sd3.5-medium (MMDiT-X's attn2 blocks) or sd3-medium (the released configs)."""
    if config.dual_attention_layers:
        return "sd3.5-medium"
    return "sd3.5-large" if config.depth >= 38 else "sd3-medium"
