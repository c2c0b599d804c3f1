"""Z-Image (Turbo, Base) as a diffusion family: the diffusers-named single-stream transformer
(model.py, loaded by checkpoint.py), FLUX.1's VAE (the same AutoencoderKL, 16 latent channels, shift
0.1159 and scale 0.3611: flux1/vae.py) and Qwen3-4B text with a padding mask (text_encoder.py).

Turbo and Base share the transformer config; they differ in weights and in how ZImagePipeline samples
them. Turbo is step-distilled: 8 steps, guidance 0 (no CFG), its scheduler's constant shift 3.0. Base
samples with CFG (the pipeline's default guidance 5.0: pred = pos + g (pos - neg), i.e. standard CFG
at 1 + g) and its scheduler's shift 6.0, over 50 steps (ZImagePipeline's defaults). Samples default to
the release's call (SAMPLE_DEFAULTS). The version comes from `model_version`, else from a pipeline
folder's scheduler/scheduler_config.json shift; a single file is taken as Turbo.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import cached_property

import torch

from library.models.family import CheckpointNames, DiffusionFamily, ModelFile
from library.models.zimage.spec import SPEC

TURBO, BASE = "zimage-turbo", "zimage-base"
VERSION_SHIFT = {TURBO: 3.0, BASE: 6.0}  # each release's scheduler_config.json `shift`
# Each release's pipeline call (guidance_scale, num_inference_steps): Turbo's model card, and Base's, which
# are ZImagePipeline's defaults.
SAMPLE_DEFAULTS = {v: (SPEC.sample_guidance[k], SPEC.sample_steps[k]) for v, k in ((TURBO, "turbo"), (BASE, "base"))}


class ZImageFamily(DiffusionFamily):
    """Z-Image: diffusers module names, FLUX.1's VAE, Qwen3-4B text with a mask, CFG for Base only."""

    name = "zimage"
    vae = "library.models.flux1.vae:FluxVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    true_cfg = True  # a negative prompt is encoded for samples; guided_velocity runs it when guidance > 0
    cfg_above = 0.0  # ZImagePipeline: do_classifier_free_guidance is guidance_scale > 0
    option_keys = ("model_version",)

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None, **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        if model_version is not None and model_version not in VERSION_SHIFT:
            raise ValueError(f"model_version {model_version!r}: expected {TURBO} or {BASE}")
        self._version = model_version

    # -- the release ---------------------------------------------------------------------------
    def scheduler_shift(self) -> float | None:
        """`shift` of the pipeline folder's scheduler/scheduler_config.json (None: no such file)."""
        folder = self.model_path if os.path.isdir(self.model_path) else os.path.dirname(self.model_path)
        for candidate in (folder, os.path.dirname(folder.rstrip("/"))):
            path = os.path.join(candidate, "scheduler", "scheduler_config.json")
            if os.path.isfile(path):
                with open(path) as f:
                    return float(json.load(f).get("shift", VERSION_SHIFT[TURBO]))
        return None

    @cached_property
    def version(self) -> str:
        """model_version, else the release whose scheduler shift the folder has (Turbo without one)."""
        if self._version is not None:
            return self._version
        shift = self.scheduler_shift()
        return BASE if shift is not None and shift >= VERSION_SHIFT[BASE] else TURBO

    def model_version(self, model) -> str:
        return self.version

    def lora_release_note(self, metadata: dict) -> str | None:
        """Where the release was guessed (a file without its pipeline folder's scheduler, whose shift says which)."""
        trained = metadata.get("ss_base_model_version")
        guessed = self._version is None and self.scheduler_shift() is None
        if not guessed or trained not in VERSION_SHIFT or trained == self.version:
            return None
        return self.other_release_note(trained, "a file without its pipeline folder's scheduler is read as Turbo")

    @property
    def sample_guidance(self) -> float:
        """The release's default --g: Turbo 0 (no CFG), Base 5 (CFG with the negative prompt)."""
        return SAMPLE_DEFAULTS[self.version][0]

    @property
    def sample_steps(self) -> int:
        """The release's default --s: Turbo 8, Base 50."""
        return SAMPLE_DEFAULTS[self.version][1]

    def inference_sampling(self):
        """The spec's constant shift is Turbo's; Base's scheduler shifts by 6. model_version decides
        where given, else the folder's scheduler shift (else Turbo's)."""
        from library.models.flow_matching import sampling_of

        shift = VERSION_SHIFT[self._version] if self._version else self.scheduler_shift() or VERSION_SHIFT[TURBO]
        sampling = sampling_of(self.arch)
        return None if shift == sampling.shift else dataclasses.replace(sampling, shift=shift)

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        return [
            ModelFile("ae", self.vae_path, "a FLUX.1 VAE (16 latent channels)", "vae", vae_markers(self.latent_channels)),
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen3 language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_norm.weight": None},
                      (None, "tokenizer", "Qwen2")),  # as its loader looks for the tokenizer
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.cap_feat_dim}

    def text_on_meta(self, model, batch, tokens):
        # No mask: every planned caption is `tokens` long, and the forward reads a mask's lengths on the
        # host (one sync), which meta tensors cannot give; without one it runs on meta alike.
        return {"embeds": torch.empty(batch, tokens, model.config.cap_feat_dim, device="meta")}

    def text_encoder_weights(self):
        """The embeddings, the decoder layers up to the one read (35 of Qwen3-4B's 36) and the final
        norm; no lm_head (llm.checkpoint_key_to_llm's mapping)."""
        from library.io import CheckpointReader, component_folder
        from library.models.llm import _find_config, _kept_layer_key, checkpoint_key_to_llm, llm_text_weights

        path = component_folder(self.text_paths["text_encoder"], "text_encoder")
        reader = CheckpointReader(path)
        try:
            keep = _find_config(path).num_layers - 1
        except Exception:  # a single file without config.json: Qwen3-4B (the loader checks its width)
            keep = 35
        used = [k for k in reader.keys() if (name := _kept_layer_key(checkpoint_key_to_llm(k, True), keep)) is not None
                and not name.startswith("lm_head.")]
        return [llm_text_weights(reader, used)]

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """diffusers names (the model's own: `all_x_embedder.2-1`), or the single-file names (fused
        attention.qkv, attention.out, x_embedder, final_layer) plain or behind a ComfyUI prefix, with
        the map from its fused rows to the model's modules."""
        from library.models.zimage.checkpoint import DIFFUSERS_MARKER, MARKER, PREFIXES, SINGLE_FILE_MARKER

        if DIFFUSERS_MARKER in keys and MARKER in keys:
            return CheckpointNames("diffusers")
        prefix = next((p for p in PREFIXES if p + MARKER in keys and p + SINGLE_FILE_MARKER in keys), None)
        if prefix is None:
            return None
        from library.models.zimage.lora_files import single_file_module_map

        module_map = single_file_module_map([k[len(prefix):] for k in keys if k.startswith(prefix)], lambda k: shape(prefix + k))
        return CheckpointNames("single_file", prefix, module_map, parts_are_model=True)

    def load_text_encoder(self, precision="bf16", device=None):
        from library.models.text_encoders import encoder_precision
        from library.models.zimage.text_encoder import load_zimage_text_encoder

        dtype, fp8 = encoder_precision(precision)
        encoder = load_zimage_text_encoder(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8)
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            embeds, mask = encoder.encode(captions)  # [B, T, 2560] float32, mask [B, T] bool (real tokens first)
            return [{"embeds": e[: int(m.sum())], "mask": m[: int(m.sum())]} for e, m in zip(embeds, mask)]

        return encode

    def text_encoding_constants(self) -> dict:
        from library.models.zimage import text_encoder as te

        return {"template": te.QWEN3_THINKING_PROMPT, "max_length": te.ZIMAGE_MAX_LENGTH, "hidden_state": -2}

    def caption_token_limit(self, args):
        """The pipeline cuts the chat text (template included) at 512 tokens."""
        from library.data.check import TokenLimit
        from library.io import component_folder
        from library.models.text_encoders import _load_tokenizer
        from library.models.zimage import text_encoder as te

        tokenizer = _load_tokenizer(component_folder(self.text_paths["text_encoder"], "text_encoder"), None, "tokenizer", "Qwen2")
        return TokenLimit("Qwen3", te.ZIMAGE_MAX_LENGTH,
                          lambda text: len(tokenizer(te.zimage_prompt_text(tokenizer, text), verbose=False).input_ids))

    def largest_image(self) -> tuple[int, int]:
        """RoPE axes 1 and 2 (patch rows, columns) hold axes_lens positions each, as diffusers' tables do (the
        forward refuses more): 512 patches of 16 pixels, 8192 per side, for the releases."""
        config = self.load_transformer(torch.float32, read_weights=False).config
        pixels = self.vae_downsample * self.patch
        return config.axes_lens[2] * pixels, config.axes_lens[1] * pixels

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """Captions of a batch differ in length: the cached ones are stacked to the longest with
        the mask (collate pads them); the model takes each row's real tokens alone."""
        device = x_t.device
        mask = text.get("mask")
        return model(img=x_t, txt=text["embeds"].to(device), timesteps=sigmas, h=h, w=w,
                     txt_mask=None if mask is None else mask.to(device).bool())

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance):
        """ZImagePipeline: CFG when guidance > 0, pred = pos + g (pos - neg) in float32 (no
        renormalisation, no truncation: the pipeline's defaults)."""
        pos = self.predict(model, x, s, text, h, w, guidance).float()
        if negative_text is None or guidance is None or guidance <= self.cfg_above:
            return pos
        neg = self.predict(model, x, s, negative_text, h, w, guidance).float()
        return pos + guidance * (pos - neg)
