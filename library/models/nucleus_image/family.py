"""Nucleus-Image as a diffusion family: the diffusers-named sparse-MoE transformer (model.py, loaded by
checkpoint.py), Qwen-Image's VAE (the same AutoencoderKLQwenImage: qwen_image/vae.py, 16 latent channels normalised
by its latents_mean / latents_std, packed 2x2 to 64) and Qwen3-VL-8B text (text_encoder.py: hidden_states[-8] of the
pipeline's chat, each caption's own tokens).

The network predicts the NEGATED flow velocity (x0 - noise): NucleusMoEImagePipeline negates its prediction before
the scheduler step and ai-toolkit negates it before its loss against noise - latents. The model returns the raw
output and `predict` negates it, so that training's target noise - latents and the Euler sampler hold as for every
family.

Inference as the pipeline runs it: sigmas linspace(1, 1/N, N) unshifted (the released scheduler's shift 1.0, no
dynamic shifting: spec.py SAMPLING), 50 steps, classifier-free guidance 4.0 with the empty negative prompt when the
guidance is above 1, the guided prediction rescaled per token to the conditional one's norm (Qwen-Image's rule:
norm_rescaled_cfg). The noise is drawn [B, 16, lh, lw] (the pipeline's [B, 1, 16, lh, lw], the same order).

Text: each caption is cached as its own tokens (the chat text cut at 1024, no padding). A batch pads them to its
longest with zeros and a mask (collate); the transformer hides the masked keys, and a caption's text positions do
not depend on what follows it (the released processor pads on the right), so a padded caption predicts as alone.
"""

from __future__ import annotations

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile
from library.models.nucleus_image.spec import SPEC

RELEASE = "nucleus-image"  # model_version (ai-toolkit's get_base_model_version: nucleus_image)


class NucleusImageFamily(DiffusionFamily):
    """Nucleus-Image: diffusers module names, the Qwen-Image VAE, Qwen3-VL text with a mask, norm-rescaled true CFG."""

    name = "nucleus_image"
    vae = "library.models.qwen_image.vae:QwenImageVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance = SPEC.sample_guidance[RELEASE]  # the pipeline's CFG scale, run with the (empty) negative prompt
    sample_steps = SPEC.sample_steps[RELEASE]
    true_cfg = True  # CFG above 1 (cfg_above), as the pipeline's do_cfg = guidance_scale > 1

    def model_version(self, model) -> str:
        return RELEASE

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.qwen_image.vae import qwen_image_vae_file

        return [
            qwen_image_vae_file(self.vae_path),
            # the tokenizer is checked as its loader looks for it (check_model_files): processor/ or tokenizer/
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen3-VL language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_norm.weight": None}),
        ]

    def check_model_files(self) -> None:
        """The generic checks, then the text encoder's tokenizer where load_nucleus_text_encoder finds it: the
        pipeline's processor/ beside text_encoder/, else the weights folder or tokenizer/ beside it (no torch)."""
        from library.models.nucleus_image.text_encoder import nucleus_tokenizer_folder

        super().check_model_files()
        nucleus_tokenizer_folder(self.text_paths["text_encoder"])

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.joint_attention_dim}

    def text_on_meta(self, model, batch, tokens):
        # No mask: every planned caption is `tokens` long (a run's all-real mask is dropped before attention, and
        # SDPA's masked grouped-query kernel has no meta backward of the right shape).
        return {"embeds": torch.empty(batch, tokens, model.config.joint_attention_dim, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """diffusers' names (the model's own), in a diffusers folder or a single file, plain or behind a ComfyUI
        prefix; nothing fused."""
        from library.models.nucleus_image.checkpoint import MARKER, PREFIXES

        prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
        return None if prefix is None else CheckpointNames("diffusers", prefix)

    # -- text ----------------------------------------------------------------------------------
    def text_encoding_constants(self) -> dict:
        from library.models.nucleus_image import text_encoder as te

        return {"system": te.NUCLEUS_SYSTEM_PROMPT, "template": te.NUCLEUS_CHAT_TEXT,
                "hidden_state": te.NUCLEUS_HIDDEN_STATE, "max_length": te.NUCLEUS_MAX_SEQUENCE_LENGTH}

    def caption_token_limit(self, args):
        """The pipeline cuts the chat text (system prompt and template included) at 1024 tokens."""
        from library.data.check import TokenLimit
        from library.models.nucleus_image import text_encoder as te
        from library.models.text_encoders import load_chat_tokenizer

        tokenizer = load_chat_tokenizer(te.nucleus_tokenizer_folder(self.text_paths["text_encoder"]))
        return TokenLimit("Qwen3-VL", te.NUCLEUS_MAX_SEQUENCE_LENGTH, lambda text: len(
            tokenizer(te.nucleus_prompt_text(tokenizer, text), verbose=False).input_ids))

    def load_text_encoder(self, precision="bf16", device=None):
        from library.models.nucleus_image.text_encoder import load_nucleus_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_nucleus_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8)
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            embeds, mask = encoder.encode(captions)  # [B, T, 4096] float32, mask [B, T]: each caption's own tokens
            return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]

        return encode

    def text_encoder_weights(self):
        """Qwen3-VL-8B's embeddings, decoder layers up to hidden_states[-8] (29 of 36) and the final norm."""
        from library.models.nucleus_image.text_encoder import nucleus_text_weights

        return [nucleus_text_weights(self.text_paths["text_encoder"])]

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t: the packed noisy target [B, h*w, 64] (the pipeline's _pack_latents layout); text: embeds [B, T, D],
        with mask [B, T] where captions differ in length. Returns the flow velocity noise - x0 [B, h*w, 64] in the
        model's compute dtype: the network's output negated (it predicts x0 - noise)."""
        mask = text.get("mask")
        raw = model(img=x_t, txt=text["embeds"].to(x_t.device), timesteps=sigmas, h=h, w=w,
                    txt_mask=None if mask is None else mask.to(x_t.device))
        return -raw

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        """NucleusMoEImagePipeline's CFG when g > 1: uncond + g (cond - uncond), rescaled per token to the
        conditional prediction's norm, in float32 (the rescale commutes with predict's negation)."""
        from library.models.flow_matching import norm_rescaled_cfg

        cond = self.predict(model, x, s, text, h, w, guidance).float()
        if negative_text is None or guidance is None or guidance <= self.cfg_above:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance).float()
        return norm_rescaled_cfg(cond, uncond, guidance)
