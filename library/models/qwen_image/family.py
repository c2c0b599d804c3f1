"""Qwen-Image as a diffusion family: the diffusers-named MMDiT (model.py), the Qwen-Image VAE,
Qwen2.5-VL text on our LLM core with a padding mask, and true CFG with norm rescale at inference."""

from __future__ import annotations

import json
import os

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, control_kwargs, fp8_prepare
from library.models.flow_matching import norm_rescaled_cfg
from library.models.qwen_image.spec import SPEC


def refuse_layered(where: str, flags: dict) -> None:
    """A Qwen-Image-Layered transformer (its config's use_layer3d_rope / use_additional_t_cond; a single file's
    addition_t_embedding) loads as Qwen-Image or an Edit model too, and failed only at the first step, after
    caching, asking for additional_t_cond: a ValueError naming the model type it is."""
    flag = next((f for f in ("use_additional_t_cond", "use_layer3d_rope") if flags.get(f)), None)
    if flag:
        raise ValueError(f"{where}: {flag} is true: a Qwen-Image-Layered transformer; set model_type = "
                         f"\"qwen_image_layered\"")


class QwenImageFamily(DiffusionFamily):
    """Qwen-Image: diffusers module names, Qwen2.5-VL (our LLM core) text with a padding mask,
    true classifier-free guidance with a negative prompt at inference."""

    name = "qwen_image"
    vae = "library.models.qwen_image.vae:QwenImageVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance = SPEC.sample_guidance["qwen-image"]  # a true-CFG scale, run with the negative (" ")
    sample_steps = SPEC.sample_steps["qwen-image"]  # QwenImagePipeline's 50
    true_cfg = True
    # The model cards' negative_prompt " " (Qwen-Image, its Edit and Layered releases; musubi-tuner's samples;
    # diffusers: "even an empty negative prompt like " " should enable" CFG): one more Qwen2.5-VL token than "".
    empty_negative = " "
    # The text encoder: Qwen2.5-VL's language model (Qwen2 layers: q_proj has a bias).
    text_encoder_kind = ("a Qwen2.5-VL language model", {"embed_tokens.weight": None, "layers.0.self_attn.q_proj.bias": None})
    text_tokenizer = (None, "tokenizer", "Qwen2")  # as load_qwen_image_text_encoder looks for it (ModelFile.tokenizer)

    def model_version(self, model) -> str:
        return "qwen-image"

    def text_encoding_constants(self) -> dict:
        from library.models.qwen_image import text_encoder as te

        return {"template": te.QWEN_IMAGE_PROMPT_TEMPLATE, "drop": te.QWEN_IMAGE_DROP_TOKENS,
                "max_tokens": te.QWEN_IMAGE_MAX_TOKENS}

    def caption_token_limit(self, args):
        """1024 tokens kept after the template's 34 leading ones (caption + the template's end), as
        QwenImagePipeline.encode_prompt keeps; its __call__ cuts to max_sequence_length=512 by default,
        ComfyUI keeps every token."""
        from library.data.check import TokenLimit
        from library.models.qwen_image import text_encoder as te
        from library.models.text_encoders import load_qwen2_5_vl_tokenizer

        tokenizer = load_qwen2_5_vl_tokenizer(self.text_paths["text_encoder"])
        return TokenLimit("Qwen2.5-VL", te.QWEN_IMAGE_MAX_TOKENS, lambda text: len(
            tokenizer(te.QWEN_IMAGE_PROMPT_TEMPLATE.format(text), verbose=False).input_ids) - te.QWEN_IMAGE_DROP_TOKENS)

    def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
        import dataclasses

        from library.models.qwen_image.model import load_qwen_image

        model = load_qwen_image(self.model_path, dtype=dtype, prepare=fp8_prepare(base_precision, self.arch),
                                read_weights=read_weights)
        refuse_layered(self.model_path, dataclasses.asdict(model.config))
        return model

    def transformer_config(self) -> tuple[str, dict | None]:
        """(transformer path, its config.json dict or None for a single file)."""
        from library.io import component_folder

        path = component_folder(self.model_path, "transformer")
        config_file = os.path.join(path, "config.json")
        if not (os.path.isdir(path) and os.path.isfile(config_file)):
            return path, None
        with open(config_file) as f:
            return path, json.load(f)

    def load_flagged_transformer(self, flags: dict, dtype, base_precision="bf16", read_weights=True):
        """The transformer of a variant whose config flags (zero_cond_t, use_layer3d_rope, ...) change no
        tensor: a folder's config.json gives them, a single file (ComfyUI's) gets `flags`, its shapes
        the rest."""
        import dataclasses

        from library.io import CheckpointReader
        from library.models.qwen_image.model import _transformer_prefix, infer_config, load_qwen_image

        path, config = self.transformer_config()
        model_config = None
        if config is None:
            reader = CheckpointReader(path)
            model_config = dataclasses.replace(infer_config(reader, _transformer_prefix(reader.keys())), **flags)
        return load_qwen_image(path, dtype=dtype, config=model_config, prepare=fp8_prepare(base_precision, self.arch),
                               read_weights=read_weights)

    def model_files(self) -> list[ModelFile]:
        from library.models.qwen_image.vae import qwen_image_vae_file

        what, markers = self.text_encoder_kind
        return [
            qwen_image_vae_file(self.vae_path),
            ModelFile("text_encoder", self.text_paths["text_encoder"], what, "text_encoder", markers, self.text_tokenizer),
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.joint_attention_dim}

    def text_encoder_weights(self):
        """Qwen2.5-VL's language model, lm_head included, as load_llm keeps it; its vision tower (a
        Qwen-Image repo's text_encoder/ holds one) only where the encoder sees the references, which
        loads it too (in the encoders' float dtype: never fp8)."""
        from library.io import CheckpointReader, component_folder
        from library.models.family import TextWeights
        from library.models.llm import checkpoint_key_to_llm, llm_text_weights

        reader = CheckpointReader(component_folder(self.text_paths["text_encoder"], "text_encoder"))
        language = [k for k in reader.keys() if checkpoint_key_to_llm(k) is not None]  # vision keys are skipped
        weights = [llm_text_weights(reader, language)]
        if self.text_sees_controls:
            weights.append(TextWeights(reader.numel() - reader.numel(language)))
        return weights

    def text_on_meta(self, model, batch, tokens):
        return {"embeds": torch.empty(batch, tokens, model.config.joint_attention_dim, device="meta"),
                "mask": torch.ones(batch, tokens, dtype=torch.bool, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """diffusers names (the model's own), plain or behind a ComfyUI prefix; the text norm `txt_norm`
        is Qwen-Image's alone."""
        from library.models.qwen_image.model import CHECKPOINT_PREFIXES

        prefix = next((p for p in CHECKPOINT_PREFIXES + ("",) if any(k.startswith(p + "txt_norm.") for k in keys)), None)
        return None if prefix is None else CheckpointNames("diffusers", prefix)

    def load_text_encoder(self, precision="bf16", device=None):
        from library.models.qwen_image.text_encoder import load_qwen_image_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_qwen_image_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8)
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            return per_caption(*encoder.encode(captions))

        return encode

    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        return self.transformer_call(model, x_t, [(1, h, w)] * x_t.shape[0], sigmas, text)

    def transformer_call(self, model, img, img_shapes, sigmas, text, **inputs):
        """One transformer call on image tokens img [B, L, 64] laid out as img_shapes (per sample);
        inputs: the variant's other model inputs (Layered's additional_t_cond)."""
        device = img.device
        return model(img=img, txt=text["embeds"].to(device), txt_mask=text["mask"].to(device).bool(),
                     timesteps=sigmas, img_shapes=img_shapes, **inputs)

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        refs = control_kwargs(control)  # Qwen-Image-Edit: both passes see the condition latents
        cond = self.predict(model, x, s, text, h, w, guidance, **refs).float()
        if negative_text is None or guidance is None or guidance <= self.cfg_above:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance, **refs).float()
        return norm_rescaled_cfg(cond, uncond, guidance)


def per_caption(embeds: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """Encoder output [B, T, D] + mask [B, T] -> per caption its unpadded tensors (as cached)."""
    return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]
