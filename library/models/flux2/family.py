"""FLUX.2 as a diffusion family: the BFL-named transformer (model.py, loaded by checkpoint.py), the
FLUX.2 VAE (32 latent channels, BatchNorm-normalised in patch space: vae.py) and
the text encoders: [klein]'s Qwen3 (text_encoder.py), [dev]'s Mistral (dev_text_encoder.py).

Variants, read from the transformer checkpoint: a guidance embedding (`guidance_in`) is [dev],
none is [klein] (4B / 9B by width); [dev] encodes prompts with the language model of Mistral Small
3.1 (dev_text_encoder.py), [klein] with Qwen3. Inference as the diffusers pipelines do it:
- [klein] (Flux2KleinPipeline): no guidance embedding; the base (non-distilled) models run
  classifier-free guidance with an empty negative prompt when guidance > 1, the distilled ones
  (`is_distilled` in the pipeline's model_index.json) never do;
- [dev] (Flux2Pipeline): the guidance value goes through the guidance embedding, no CFG.
Positions: image tokens (0, row, col, 0), text tokens (0, 0, 0, index), int64 (model.py).

References (multi-reference editing, both variants): a target may carry reference images (a subset's
control_directory, a sample prompt's --ci), none for text-to-image. As the pipelines run them, each reference's
latent is packed like the target's and appended after the target's tokens, reference k at positions
(10 + 10 k, row, col, 0) (Flux2Pipeline._prepare_image_ids); the prediction is the target's tokens (the loss is
on them only), and CFG's negative pass keeps the references. The text encoder never sees them. A reference is
encoded at its own size up to ~1 MP (references.py: the pipelines' rule), in training and samples alike.
"""

from __future__ import annotations

import json
import os
from functools import cached_property

import torch

from library.models.family import DiffusionFamily, ModelFile
from library.models.flux2.spec import DISTILLED_VERSIONS, SPEC, VERSIONS


class Flux2Family(DiffusionFamily):
    """FLUX.2 [klein] / [dev]: BFL module names, 32 latent channels, Qwen3 (klein) / Mistral (dev) text."""

    name = "flux2"
    vae = "library.models.flux2.vae:Flux2VAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    sample_guidance = SPEC.sample_guidance["klein base"]  # the pipelines' default guidance_scale ([dev]'s is the same)
    true_cfg = True  # klein base: negative prompt encoded for samples (guided_velocity decides)
    latent_channels = 32
    max_controls = 4  # the pipelines take any number, each a further frame on the t axis; four as the other edit models
    plan_controls = 0  # a text-to-image model first: presets plan none, a dataset's references are counted
    option_keys = ("model_version",)

    def __init__(self, model_path: str, vae_path: str | None = None, model_version: str | None = None, **text_paths):
        super().__init__(model_path, vae_path, **text_paths)
        if model_version is not None and model_version not in VERSIONS:
            raise ValueError(f"model_version {model_version!r}: expected one of {', '.join(VERSIONS)} (musubi-tuner's "
                             f"names; the size is read from the checkpoint)")
        self._version = model_version

    def model_files(self) -> list[ModelFile]:
        from library.models.vae import vae_markers

        # [dev]: Mistral Small 3.1's language model; [klein]: Qwen3, whose attention has q_norm.
        what, attention, kind = (("a Mistral Small 3.1 language model", "q_proj.weight", "Mistral") if self.is_dev()
                                 else ("a Qwen3 language model", "q_norm.weight", "Qwen2"))
        markers = {"embed_tokens.weight": None, f"layers.0.self_attn.{attention}": None}
        return [
            ModelFile("ae", self.vae_path, "a FLUX.2 VAE (32 latent channels)", "vae",
                      {**vae_markers(self.latent_channels), "bn.running_mean": None}),  # the BatchNorm of its latents
            ModelFile("text_encoder", self.text_paths["text_encoder"], what, "text_encoder", markers,
                      (None, "tokenizer", kind)),
        ]

    def text_widths(self, config) -> dict[str, int]:
        """txt_in takes three of the encoder's layers side by side (text_encoding_constants' hidden_layers)."""
        return {"text_encoder": config.context_in_dim // len(self.text_encoding_constants()["hidden_layers"])}

    def text_on_meta(self, model, batch, tokens):
        # every token the encoder pads to, pads included: the transformer sees them all (no mask)
        return {"embeds": torch.empty(batch, tokens, model.config.context_in_dim, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """FLUX.1's namings (BFL, or a diffusers folder's) with FLUX.2's shared modulation."""
        from library.models.flux1.family import bfl_checkpoint_names
        from library.models.flux2.checkpoint import FLUX2_MARKERS, row_tables

        if not any(k.endswith(FLUX2_MARKERS) for k in keys):
            return None
        return bfl_checkpoint_names(keys, shape, row_tables)

    def model_version(self, model) -> str:
        if model.guidance_in is not None:
            return "flux2-dev"
        return {3072: "flux2-klein-4b", 4096: "flux2-klein-9b"}.get(model.config.hidden_size, "flux2-klein")

    def text_encoding_constants(self) -> dict:
        from library.models.flux2 import dev_text_encoder as dev
        from library.models.flux2 import text_encoder as te

        if self.is_dev():
            return {"hidden_layers": dev.DEV_HIDDEN_LAYERS, "system_message": dev.DEV_SYSTEM_MESSAGE,
                    "template": dev.MISTRAL_PROMPT}
        return {"hidden_layers": te.KLEIN_HIDDEN_LAYERS, "template": te.QWEN3_NO_THINKING_PROMPT}

    def text_options(self, args) -> dict:
        """max_length: the tokens a caption is padded / cut to (chat template included), the pipelines'
        max_sequence_length: 512 for both encoders unless the config's max_sequence_length says otherwise."""
        from library.models.flux2.text_encoder import KLEIN_MAX_LENGTH  # == DEV_MAX_LENGTH

        return {"max_length": getattr(args, "max_sequence_length", None) or KLEIN_MAX_LENGTH}

    def caption_token_limit(self, args):
        """Both encoders cut the whole chat text (template included) at max_length tokens (512: text_options)."""
        from library.data.check import TokenLimit
        from library.io import component_folder
        from library.models.flux2 import dev_text_encoder as dev
        from library.models.flux2 import text_encoder as te
        from library.models.text_encoders import _load_tokenizer

        kind = "Mistral" if self.is_dev() else "Qwen2"
        tokenizer = _load_tokenizer(component_folder(self.text_paths["text_encoder"], "text_encoder"), None, "tokenizer", kind)
        length = self.text_options(args)["max_length"]
        if not self.is_dev():
            return TokenLimit("Qwen3", length,
                              lambda text: len(tokenizer(te.klein_prompt_text(tokenizer, text), verbose=False).input_ids))
        template = dev.folder_chat_template(tokenizer)

        def count(text: str) -> int:
            chat = dev.dev_prompt_text(tokenizer, text, template)
            return len(tokenizer(chat, add_special_tokens=dev.adds_special_tokens(tokenizer, chat), verbose=False).input_ids)

        return TokenLimit("Mistral Small 3.1", length, count)

    def load_text_encoder(self, precision="bf16", device=None, max_length: int | None = None):
        from library.models.flux2.dev_text_encoder import load_dev_text_encoder
        from library.models.flux2.text_encoder import load_klein_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        load = load_dev_text_encoder if self.is_dev() else load_klein_text_encoder  # Mistral Small 3.1 / Qwen3
        encoder = load(self.text_paths["text_encoder"], dtype=dtype, fp8=fp8,
                       max_length=max_length or self.text_options(None)["max_length"])  # unset: the pipelines' 512
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            embeds, _ = encoder.encode(captions)  # [B, max_length, 3D] float32, pads kept: the transformer sees all
            return [{"embeds": e} for e in embeds]

        return encode

    def text_encoder_weights(self):
        """What the text encoder loader reads of its files: the embeddings and the decoder layers up
        to the last stacked one (27 of Qwen3-4B's 36 for [klein], 30 of Mistral Small 3.1's 40 for
        [dev]), no lm_head, no vision tower or projector (llm.checkpoint_key_to_llm's mapping)."""
        from library.io import CheckpointReader, component_folder
        from library.models.flux2.dev_text_encoder import DEV_HIDDEN_LAYERS
        from library.models.flux2.text_encoder import KLEIN_HIDDEN_LAYERS
        from library.models.llm import _kept_layer_key, checkpoint_key_to_llm, llm_text_weights

        keep = max(DEV_HIDDEN_LAYERS if self.is_dev() else KLEIN_HIDDEN_LAYERS)
        reader = CheckpointReader(component_folder(self.text_paths["text_encoder"], "text_encoder"))
        used = [k for k in reader.keys() if _kept_layer_key(checkpoint_key_to_llm(k, True), keep) is not None]
        return [llm_text_weights(reader, used)]

    def is_dev(self) -> bool:
        """[dev] has the guidance embedding; read from the key names, no weights loaded."""
        from library.models.flux1.family import checkpoint_has_guidance_embedding

        return checkpoint_has_guidance_embedding(self.model_path)

    def reads_training_guidance(self) -> bool:
        return self.is_dev()  # [klein] has no guidance embedding

    def unread_sample_options(self) -> dict[str, str]:
        if self.is_dev():
            return {"negative": f"{self.model_path} is FLUX.2 [dev]: it samples with its guidance embedding, without CFG"}
        if self.is_distilled:
            return dict.fromkeys(("negative", "guidance"), f"{self.model_path} is a step-distilled FLUX.2 [klein]: it "
                                                           f"samples without CFG")
        return {}

    @property
    def sample_steps(self) -> int:
        """Default --s: the pipelines' 50 ([dev], [klein] base), a step-distilled [klein]'s own 4 (its card,
        ComfyUI's templates)."""
        if self.is_distilled:
            return SPEC.sample_steps["klein distilled"]
        return SPEC.sample_steps["dev" if self.is_dev() else "klein base"]

    @cached_property
    def is_distilled(self) -> bool:
        """The step-distilled [klein] (samples in 4 steps without CFG): model_version where set (musubi-tuner's names),
        else `is_distilled` of a diffusers pipeline folder's model_index.json, else the file name: BFL's and
        Comfy-Org's single files of the distilled [klein] are flux-2-klein-4b / -9b, the base's flux-2-klein-base-*
        (a single file read as the base before: 50 steps and CFG 4 on the distilled model)."""
        if self._version is not None:
            return self._version in DISTILLED_VERSIONS
        folder = self.model_path if os.path.isdir(self.model_path) else os.path.dirname(self.model_path)
        for candidate in (folder, os.path.dirname(folder.rstrip("/"))):
            index = os.path.join(candidate, "model_index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    return bool(json.load(f).get("is_distilled", False))
        name = os.path.basename(self.model_path.rstrip("/")).lower()
        return os.path.isfile(self.model_path) and "klein" in name and "base" not in name

    # -- references ----------------------------------------------------------------------------
    def control_bucket(self, bucket: tuple[int, int], size: tuple[int, int],
                       resolution: tuple[int, int] | None = None) -> tuple[int, int]:
        """The pipelines' size for a reference, whatever the target's: its own up to 1024 x 1024 pixels (larger
        ones scaled to that area), sides floored to 16 (references.py). musubi-tuner fits references to the
        target's bucket by default; ai-toolkit and the pipelines keep their size."""
        from library.models.flux2.references import condition_size

        return condition_size(size)

    def reference_resize(self, bucket: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
        """The pipelines' pixels, in training and samples: resized (Lanczos) only over 1 MP, then centre-cropped."""
        from library.models.flux2.references import resized_size

        return resized_size(size)

    def largest_reference(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """The planner's reference without files: one of 1024 x 1024 pixels, the most a reference keeps."""
        return 1024, 1024

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance, control: list[torch.Tensor] | None = None):
        """x_t: the packed noisy target [B, h*w, 128]; control: reference latents [B, 32, H_k, W_k] (float32,
        BN-normalised as the target's). Returns the target tokens' velocity [B, h*w, 128]."""
        from library.models.flux2.text_encoder import klein_text_ids

        b, device = x_t.shape[0], x_t.device
        txt = text["embeds"].to(device)
        g = None
        if model.guidance_in is not None:
            g = torch.full((b,), 1.0 if guidance is None else float(guidance), dtype=torch.float32, device=device)
        img, img_ids = reference_tokens(x_t, h, w, control or [])
        out = model(img=img, img_ids=img_ids, txt=txt, txt_ids=klein_text_ids(b, txt.shape[1], device),
                    timesteps=sigmas, guidance=g)
        return out[:, : x_t.shape[1]]

    def guided_velocity(self, model, x, s, text, negative_text, h, w, guidance, control=None):
        cond = self.predict(model, x, s, text, h, w, guidance, control).float()
        cfg = model.guidance_in is None and negative_text is not None and guidance is not None and guidance > self.cfg_above
        if not cfg or self.is_distilled:
            return cond
        uncond = self.predict(model, x, s, negative_text, h, w, guidance, control).float()  # the references kept
        return uncond + guidance * (cond - uncond)

    def initial_noise(self, batch, lh, lw, generator):
        # Flux2Pipeline.prepare_latents draws [B, 4C, lh/2, lw/2] (patchified), then packs.
        from library.models.latents import unpatchify

        return unpatchify(torch.randn(batch, 4 * self.latent_channels, lh // 2, lw // 2, generator=generator,
                                      dtype=torch.float32))


REFERENCE_T_STEP = 10  # reference k sits at t = 10 + 10 k (Flux2Pipeline._prepare_image_ids' scale)


def reference_tokens(x_t: torch.Tensor, h: int, w: int,
                     control: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, L, 128], ids [B, L, 4] int64): the packed target x_t (h x w patches) at t = 0, then each
    reference latent [B, 32, H_k, W_k] packed the same way at (10 + 10 k, row, col, 0)."""
    from library.models.flux2.model import make_img_ids
    from library.models.latents import pack_latents

    b, device = x_t.shape[0], x_t.device
    tokens, ids = [x_t], [make_img_ids(b, h, w, device=device)]
    for k, ref in enumerate(control):
        if ref.ndim != 4 or ref.shape[0] != b or ref.shape[1] != 32 or ref.shape[2] % 2 or ref.shape[3] % 2:
            raise ValueError(f"reference latent {k} has shape {tuple(ref.shape)}; expected [{b}, 32, h, w] with even "
                             f"h and w (2x2 patches)")
        tokens.append(pack_latents(ref.to(device=device, dtype=x_t.dtype)))
        ids.append(make_img_ids(b, ref.shape[2] // 2, ref.shape[3] // 2, t=REFERENCE_T_STEP * (k + 1), device=device))
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=1)
