"""Lumina Image 2.0 as a diffusion family: the NextDiT in the released single file's names (model.py, loaded by
checkpoint.py), FLUX.1's VAE (the same AutoencoderKL, 16 latent channels, shift 0.1159 and scale 0.3611:
flux1/vae.py) and Gemma-2-2B text (text_encoder.py). Neta Lumina and NetaYume Lumina are fine-tunes of it: the same
files, another system prompt on their model cards (config `system_prompt`).

Text: each caption is encoded as '<system prompt> <Prompt Start> <caption>' (the pipeline's and sd-scripts' string)
and cached as its own real tokens of Gemma's hidden_states[-2] with the mask; a batch pads to its longest (collate)
and the transformer masks the rest, so a padded caption predicts as it does alone.

Inference as diffusers' Lumina2Pipeline runs it: FlowMatchEulerDiscreteScheduler with the release's constant shift
6 (spec.py SAMPLING: ComfyUI's and sd-scripts' sampler), 30 steps, classifier-free guidance 4.0 with the empty
negative prompt, and its cfg_normalization: the guided velocity rescaled to the conditional one's norm
(guided_velocity).
"""

from __future__ import annotations

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile
from library.models.lumina2.spec import SPEC

RELEASE = "lumina2"  # model_version (ai-toolkit's lumina2)


class Lumina2Family(DiffusionFamily):
    """Lumina Image 2.0: single-file names, FLUX.1's VAE, Gemma-2-2B states with a system prompt, normalised CFG."""

    name = "lumina2"
    vae = "library.models.flux1.vae:FluxVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance = SPEC.sample_guidance[RELEASE]
    sample_steps = SPEC.sample_steps[RELEASE]
    true_cfg = True  # Lumina2Pipeline: CFG above 1 (do_classifier_free_guidance)
    option_keys = ("system_prompt",)

    def __init__(self, model_path: str, vae_path: str | None = None, system_prompt: str | None = None, **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        self.system_prompt = system_prompt

    def model_version(self, model) -> str:
        return RELEASE

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        return [
            ModelFile("ae", self.vae_path, "a FLUX.1 VAE (16 latent channels)", "vae",
                      vae_markers(self.latent_channels)),
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Gemma 2 language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.pre_feedforward_layernorm.weight": None},
                      (None, "tokenizer", "Gemma", True)),  # as its loader looks for it (tokenizer/ beside a file)
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.cap_feat_dim}

    def text_on_meta(self, model, batch, tokens):
        # No mask: every planned caption is `tokens` long (a mask's lengths are read on the host, which meta cannot)
        return {"embeds": torch.empty(batch, tokens, model.config.cap_feat_dim, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """Our (the single file's) names, plain or behind a ComfyUI prefix, or a diffusers transformer/ folder's
        (its split q / k / v rows fused through the module map)."""
        from library.models.lumina2.checkpoint import MARKER, PREFIXES
        from library.models.lumina2.lora_files import DIFFUSERS_MARKER, module_map_of_keys

        prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
        if prefix is not None:
            return CheckpointNames("lumina2", prefix)
        if DIFFUSERS_MARKER in keys:
            return CheckpointNames("diffusers", "", module_map_of_keys(keys, shape), native=False)
        return None

    # -- text ----------------------------------------------------------------------------------
    def text_options(self, args) -> dict:
        """The system prompt is part of every caption's text (the cache key holds it): the config's, else the
        pipeline's; "" for none (sd-scripts' default: the caption alone)."""
        from library.models.lumina2.text_encoder import LUMINA2_SYSTEM_PROMPT

        prompt = getattr(args, "system_prompt", None)
        return {"system_prompt": LUMINA2_SYSTEM_PROMPT if prompt is None else prompt}

    def text_encoding_constants(self) -> dict:
        from library.models.lumina2.text_encoder import LUMINA2_MAX_LENGTH

        return {"hidden_state": -2, "max_length": LUMINA2_MAX_LENGTH, "separator": "<Prompt Start>"}

    def caption_token_limit(self, args):
        """The pipeline keeps the first 256 Gemma tokens of '<system prompt> <Prompt Start> <caption>'."""
        from library.models.lumina2.text_encoder import lumina2_caption_token_limit

        system = self.text_options(args)["system_prompt"]
        return lumina2_caption_token_limit(self.text_paths["text_encoder"], system_prompt=system or None)

    def load_text_encoder(self, precision="bf16", device=None, system_prompt: str | None = None):
        """encode(captions) -> each caption's own tokens of Gemma's hidden_states[-2] ("embeds", float32) and its
        mask, the system prompt before it; a sample's negative (NegativePrompt) without one, as the pipeline."""
        from library.data.prompts import NegativePrompt
        from library.models.lumina2.text_encoder import LUMINA2_SYSTEM_PROMPT, load_lumina2_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_lumina2_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8)
        encoder.llm.to(device)
        system = (LUMINA2_SYSTEM_PROMPT if system_prompt is None else system_prompt) or None  # "": none

        def encode(captions: list[str]) -> list[dict]:  # the negatives apart: no system prompt before them
            results: list[dict] = [{}] * len(captions)
            for negative in (False, True):
                index = [i for i, c in enumerate(captions) if isinstance(c, NegativePrompt) == negative]
                if index:
                    embeds, mask = encoder.encode([captions[i] for i in index], None if negative else system)
                    for i, e, m in zip(index, embeds.cpu(), mask.cpu()):  # [T, 2304] float32, real tokens first
                        results[i] = {"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]}
            return results

        return encode

    def text_encoder_weights(self):
        """Gemma's embeddings and the decoder layers up to the one read (25 of 26), no final norm, no head."""
        from library.models.lumina2.text_encoder import lumina2_llm_config, lumina2_text_weights

        return [lumina2_text_weights(lumina2_llm_config(self.text_paths["text_encoder"]))]

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """Captions of a batch differ in length: the cached ones are stacked to the longest with the mask (collate
        pads them); the model masks each row's padding. Returns the velocity noise - x0 [B, h*w, 64]."""
        device = x_t.device
        mask = text.get("mask")
        return model(img=x_t, txt=text["embeds"].to(device), timesteps=sigmas, h=h, w=w,
                     txt_mask=None if mask is None else mask.to(device).bool())

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        """Lumina2Pipeline: above guidance 1, uncond + g (cond - uncond), then its cfg_normalization: rescaled to the
        conditional velocity's norm along the latents' last axis (each latent row of [B, 16, H, W]: the pipeline's
        torch.norm(dim=-1) on its unpacked latents, where Qwen-Image's runs over a token's channels), in float32."""
        from library.models.latents import pack_latents, unpack_latents
        from library.models.flow_matching import norm_rescaled_cfg

        cond = self.predict(model, x, s, text, h, w, guidance).float()
        if negative_text is None or guidance is None or guidance <= self.cfg_above:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance).float()
        rows = [unpack_latents(v, 2 * h, 2 * w) for v in (cond, uncond)]  # [B, 16, H, W]: 2 x 2 patches
        return pack_latents(norm_rescaled_cfg(*rows, guidance))
