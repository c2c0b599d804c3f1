"""Ideogram 4 as a diffusion family: the single-stream transformer with diffusers' names (model.py,
loaded by checkpoint.py as released: BFL fp8r / nvfp4, kept as stored), FLUX.2's VAE normalised the
Ideogram way (vae.py), Qwen3-VL text with 13 tapped layers flattened per token (text_encoder.py), and
the pipeline's logit-normal schedule (sampling.py).

LoRAs train the conditional transformer. Sampling runs the pipeline's guidance blend
v = g v_cond + (1 - g) v_uncond where the unconditional branch is the release's second transformer
(`unconditional_transformer/`, image tokens only). Where no such folder is beside the transformer, the
unconditional branch is the trained transformer itself without text (an approximation, said once).
"""

from __future__ import annotations

import os
import warnings
from functools import cached_property

import torch

from library.models import flow_matching as fm
from library.models.family import CheckpointNames, DiffusionFamily, ModelFile, fp8_prepare
from library.models.ideogram4.spec import SPEC
from library.models.latents import unpack_latents


class Ideogram4Family(DiffusionFamily):
    name = "ideogram4"
    vae = "library.models.ideogram4.vae:Ideogram4VAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance, sample_steps = SPEC.sample_guidance["ideogram4"], SPEC.sample_steps["ideogram4"]  # Ideogram4Pipeline: 48 steps, guidance 7 (3 for the last 3)
    true_cfg = False  # the unconditional branch takes no text: no negative prompt is encoded
    latent_channels = 32

    def guidance_is_cfg_scale(self) -> bool:
        return True  # CFG against the unconditional transformer, without a negative prompt

    def unread_sample_options(self) -> dict[str, str]:
        return {**super().unread_sample_options(),
                "flow_shift": "Ideogram 4 samples on its pipeline's logit-normal schedule at the image's resolution, not a "
                              "shifted one"}

    # -- loading -------------------------------------------------------------------------------
    def load_transformer(self, dtype, base_precision="bf16", read_weights=True):
        from library.models.ideogram4.checkpoint import load_ideogram4

        prepare = None if self.stored_layout() else fp8_prepare(base_precision, self.arch)
        return load_ideogram4(self.model_path, dtype=dtype, prepare=prepare, read_weights=read_weights)

    @cached_property
    def unconditional(self):
        """The release's unconditional transformer folder beside the transformer, or None."""
        root = self.model_path if os.path.isdir(self.model_path) else os.path.dirname(self.model_path)
        for folder in (root, os.path.dirname(root.rstrip("/"))):
            candidate = os.path.join(folder, "unconditional_transformer")
            if os.path.isdir(candidate):
                return candidate
        return None

    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        return [
            ModelFile("ae", self.vae_path, "a FLUX.2 VAE (32 latent channels)", "vae",
                      {**vae_markers(self.latent_channels), "bn.running_mean": None}),
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen3-VL language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_norm.weight": None},
                      (None, "tokenizer", "Qwen2")),  # as its loader looks for the tokenizer
        ]

    def text_on_meta(self, model, batch, tokens):
        return {"embeds": torch.empty(batch, tokens, model.config.llm_features_dim, device="meta")}

    def load_text_encoder(self, precision="bf16", device=None):
        from library.models.ideogram4.text_encoder import IDEOGRAM4_TAPS, load_ideogram4_text_encoder
        from library.models.text_encoders import encoder_precision

        features = self.load_transformer(torch.float32, read_weights=False).config.llm_features_dim  # headers only
        dtype, fp8 = encoder_precision(precision)
        encoder = load_ideogram4_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8,
                                              taps=self.taps(features))
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            embeds, mask = encoder.encode(captions)  # [B, T, taps * D] float32, mask [B, T] (real tokens first)
            return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]

        return encode

    def taps(self, features: int) -> tuple[int, ...]:
        """The released 13 taps; a smaller encoder (the tiny one) taps its own layers so that taps x width
        = the transformer's llm_features_dim: the pipeline's spacing is not defined for it, so every
        third layer from 0 and the last, as the released ones."""
        from library.io import component_folder
        from library.models.ideogram4.text_encoder import IDEOGRAM4_TAPS
        from library.models.llm import _find_config

        config = _find_config(component_folder(self.text_paths["text_encoder"], "text_encoder"))
        count = features // config.hidden_size
        if count == len(IDEOGRAM4_TAPS) and config.num_layers > max(IDEOGRAM4_TAPS):
            return IDEOGRAM4_TAPS
        taps = tuple(range(0, config.num_layers - 1, 3))[: count - 1] + (config.num_layers - 1,)
        if len(taps) != count or count * config.hidden_size != features:
            raise ValueError(f"{self.model_path}: the transformer takes {features} text features per token, which "
                             f"no set of layers of a {config.hidden_size}-wide, {config.num_layers}-layer encoder gives")
        return taps

    def text_encoder_weights(self):
        """The embeddings and the decoder layers up to the deepest tap (all 36 released), no head, no vision."""
        from library.io import CheckpointReader, component_folder
        from library.models.llm import _kept_layer_key, checkpoint_key_to_llm, llm_text_weights

        reader = CheckpointReader(component_folder(self.text_paths["text_encoder"], "text_encoder"))
        features = self.load_transformer(torch.float32, read_weights=False).config.llm_features_dim
        keep = max(self.taps(features)) + 1
        used = [k for k in reader.keys() if (name := _kept_layer_key(checkpoint_key_to_llm(k, True), keep)) is not None
                and not name.startswith("lm_head.")]
        return [llm_text_weights(reader, used)]

    def text_encoding_constants(self) -> dict:
        from library.models.ideogram4 import text_encoder as te

        return {"taps": list(te.IDEOGRAM4_TAPS), "max_length": te.IDEOGRAM4_MAX_SEQUENCE_LENGTH, "template": "chat"}

    def caption_token_limit(self, args):
        """The pipeline takes up to 2048 tokens of the chat-formatted caption and refuses longer ones
        (so does our encoder, while caching): the dataset check names them first, as errors, and
        training refuses them before caching."""
        from library.data.check import TokenLimit
        from library.io import component_folder
        from library.models.ideogram4 import text_encoder as te
        from library.models.text_encoders import _load_tokenizer

        tokenizer = _load_tokenizer(component_folder(self.text_paths["text_encoder"], "text_encoder"), None, "tokenizer", "Qwen2")
        return TokenLimit("Qwen3-VL", te.IDEOGRAM4_MAX_SEQUENCE_LENGTH,
                          lambda text: len(tokenizer(te.chat_prompt(tokenizer, text), add_special_tokens=False).input_ids),
                          refuses=True)

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """diffusers' names, plain or under a prefix (the original single file's qkv is fused: those
        are read by load_ideogram4, not merged into)."""
        from library.models.ideogram4.checkpoint import MARKER, PREFIXES

        prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
        return None if prefix is None else CheckpointNames("diffusers", prefix)

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t: pack_latents' (c, ph, pw) tokens; the transformer takes the pipeline's (ph, pw, c)."""
        from library.models.ideogram4.vae import from_ideogram_tokens, to_ideogram_tokens

        device = x_t.device
        mask = text.get("mask")
        out = model(img=to_ideogram_tokens(x_t), txt=text["embeds"].to(device), timesteps=sigmas, h=h, w=w,
                    txt_mask=None if mask is None else mask.to(device).bool())
        return from_ideogram_tokens(out)

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance):
        cond = self.predict(model, x, s, text, h, w, guidance).float()
        if guidance is None or guidance == 1.0:
            return cond
        empty = {"embeds": text["embeds"][:, :0]}
        uncond = self.predict(self.unconditional_model(model), x, s, empty, h, w, guidance).float()
        return guidance * cond + (1.0 - guidance) * uncond

    def unconditional_model(self, model):
        """The release's unconditional transformer (loaded once per round of samples, in the model's
        dtype: release_sample_models frees it), else `model`."""
        if self.unconditional is None:
            if not getattr(self, "_warned", False):
                self._warned = True
                warnings.warn(f"{self.model_path}: no unconditional_transformer/ beside the transformer; samples use "
                              f"the trained transformer without text as the unconditional branch", stacklevel=3)
            return model
        if getattr(self, "_uncond", None) is None:
            from library.models.ideogram4.checkpoint import load_ideogram4

            device = next(model.parameters()).device
            self._uncond = load_ideogram4(self.unconditional, dtype=model.compute_dtype).to(device)
        return self._uncond

    # The released unconditional transformer's bytes (BFL fp8r, the rest bf16): a preset's (no files) answer.
    unconditional_bytes: int | None = None

    def sample_model_bytes(self, dtype) -> int:
        """The unconditional transformer as unconditional_model loads it, on meta from its header."""
        if self.unconditional_bytes is not None:
            return self.unconditional_bytes
        if self.unconditional is None:
            return 0
        from library.models.ideogram4.checkpoint import load_ideogram4

        uncond = load_ideogram4(self.unconditional, dtype=dtype, read_weights=False)
        return sum(t.numel() * t.element_size() for t in (*uncond.parameters(), *uncond.buffers()))

    def release_sample_models(self) -> None:
        """Freed, not kept on the CPU: it is ~9 GiB (released fp8r) the host's memory would hold through
        training beside block swap's copies, and reading it again is seconds beside a round of 48-step
        samples (render_samples reads its bf16 reference base anew per round too)."""
        self._uncond = None

    # -- training and sampling schedules --------------------------------------------------------
    def unread_training_keys(self, args) -> dict[str, str]:
        unread = super().unread_training_keys(args)
        if args.timestep_sampling in (None, self.arch + "_shift"):  # its law's spread is the pipeline's 1.5
            for key in ("sigmoid_scale", "sigmoid_mean"):
                unread[key] = (f"timestep_sampling {args.timestep_sampling or 'unset'}: model_type {self.name} "
                               f"draws sigma = expit(mu + 1.5 n), its pipeline's law; a sigmoid draw "
                               f"(timestep_sampling = \"sigmoid\") reads it")
            unread["shifted_draw"] = (f"timestep_sampling {args.timestep_sampling or 'unset'}: model_type {self.name} "
                                      f"draws its pipeline's law, sigma = expit(mu + 1.5 n), no shift of another draw")
        return unread

    def law_sigmas(self, model, args, method, generator, lh, lw, count, quantiles=None):
        """The pipeline's law, sigma = expit(mu + 1.5 n) at the image's resolution, for its own method (the
        default, or named); flow_matching's for another."""
        if method != self.arch + "_shift":
            return super().law_sigmas(model, args, method, generator, lh, lw, count, quantiles)
        from library.models.ideogram4.sampling import training_sigmas

        return training_sigmas(count, lh * self.vae_downsample, lw * self.vae_downsample, generator,
                               bias=getattr(args, "timestep_bias", "none"), quantiles=quantiles)

    @torch.no_grad()
    def sample_latents(self, model, text, width, height, steps, seed, guidance, negative_text=None, control=None,
                       flow_shift=None):
        """The pipeline's logit-normal schedule and guidance blend; noise drawn as its packed tokens. (No flow
        shift: unread_sample_options says so where a prompt sets one.)"""
        from library.models.ideogram4.sampling import GUIDANCE_SCHEDULE, STEPS, inference_sigmas
        from library.models.ideogram4.vae import from_ideogram_tokens

        lh, lw = height // self.vae_downsample, width // self.vae_downsample
        h, w = lh // self.patch, lw // self.patch
        batch, device = text["embeds"].shape[0], text["embeds"].device
        gen = torch.Generator("cpu").manual_seed(seed)
        noise = torch.randn(batch, h * w, 4 * self.latent_channels, generator=gen, dtype=torch.float32)
        x = from_ideogram_tokens(noise).to(device)  # the pipeline's tokens, in pack_latents' order
        sigmas = inference_sigmas(steps, height, width)
        # At the pipeline's defaults (48 steps, guidance 7) its default schedule, 3 for the last 3 "polish" steps,
        # as Ideogram4Pipeline() runs without a guidance argument; else the one guidance on every step.
        pipeline_default = steps == STEPS and guidance == self.sample_guidance
        per_step = iter(GUIDANCE_SCHEDULE if pipeline_default else [guidance] * steps)  # euler_sample: once a step
        velocity = lambda x, s: self.guided_velocity(model, x, s, text, negative_text, h, w, next(per_step))  # noqa: E731
        return unpack_latents(fm.euler_sample(velocity, x, sigmas), lh, lw)
