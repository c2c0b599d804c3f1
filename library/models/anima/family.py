"""Anima as a diffusion family: the Cosmos-Predict2 DiT with its LLM adapter, in the released single file's names
(model.py, loaded by checkpoint.py), Qwen-Image's VAE (the same AutoencoderKLQwenImage: qwen_image/vae.py) and
Qwen3-0.6B text with T5 token ids (text_encoder.py).

Text: each caption is cached as its own tokens twice: Qwen3's last hidden states (zero where masked) with their
mask, and its T5 token ids with theirs. A batch pads both to its longest with zeros and the masks (collate); the
transformer's adapter turns them into the 512 cross-attention tokens every block reads (padding masked there,
the output zero past the T5 tokens), so a padded caption predicts as it does alone. The adapter runs inside the
transformer's forward (it is part of the released DiT file, and its LoRA trains with `adapter_dim`).

Inference as the modular pipeline (AnimaAutoBlocks) runs it: sigmas linspace(1, 1/N, N) with the release's
constant shift 3 (spec.py SAMPLING), 50 steps, classifier-free guidance 4.0 with the empty negative prompt when the
guidance is above 1, pred = uncond + g (cond - uncond); the noise drawn [B, 16, 1, lh, lw] (one frame: the same
values as [B, 16, lh, lw] from one generator).
"""

from __future__ import annotations

import torch

from library.models.anima.spec import SPEC
from library.models.family import CheckpointNames, DiffusionFamily, ModelFile

RELEASE = "anima"  # model_version (ai-toolkit's get_base_model_version: anima)
TEXT_KEYS = ("qwen", "qwen_mask", "t5_ids", "t5_mask")  # a cached caption's tensors (each caption's own tokens)


class AnimaFamily(DiffusionFamily):
    """Anima: Cosmos names, the Qwen-Image VAE, Qwen3-0.6B states and T5 ids through the DiT's LLM adapter, CFG."""

    name = "anima"
    vae = "library.models.qwen_image.vae:QwenImageVAE"  # its VAE wrapper (DiffusionFamily.load_vae / vae_on_meta)
    text_path_keys = ("text_encoder",)
    optional_path_keys = ("t5_tokenizer",)  # t5_tokenizer/ beside the text encoder where unset
    sample_guidance = SPEC.sample_guidance[RELEASE]  # the guider's scale, run with the (empty) negative prompt
    sample_steps = SPEC.sample_steps[RELEASE]
    true_cfg = True  # CFG above 1 (ClassifierFreeGuidance's test)
    option_keys = ("t5_tokenizer",)

    def __init__(self, model_path: str, vae_path: str | None = None, t5_tokenizer: str | None = None, **text_paths):
        # a T5 tokenizer given apart is one of the text files (the text cache's key fingerprints its files)
        super().__init__(model_path, vae_path, **text_paths, **({"t5_tokenizer": t5_tokenizer} if t5_tokenizer else {}))
        self.t5_tokenizer = t5_tokenizer

    def model_version(self, model) -> str:
        return RELEASE

    # -- loading -------------------------------------------------------------------------------
    def model_files(self) -> list[ModelFile]:
        from library.models.qwen_image.vae import qwen_image_vae_file

        return [
            qwen_image_vae_file(self.vae_path),
            ModelFile("text_encoder", self.text_paths["text_encoder"], "a Qwen3 language model", "text_encoder",
                      {"embed_tokens.weight": None, "layers.0.self_attn.q_norm.weight": None},
                      (None, "tokenizer", "Qwen2")),  # as its loader looks for the tokenizer
        ]

    def text_widths(self, config) -> dict[str, int]:
        return {"text_encoder": config.adapter_source_dim}

    def text_on_meta(self, model, batch, tokens):
        # No masks: every planned caption is `tokens` long in both tokenizations (the forward reads nothing on the host)
        cfg = model.config
        return {"qwen": torch.empty(batch, tokens, cfg.adapter_source_dim, device="meta"),
                "t5_ids": torch.zeros(batch, tokens, dtype=torch.int64, device="meta")}

    @classmethod
    def checkpoint_names(cls, keys, shape):
        """Our (the single file's) names, plain or behind `net.` / a ComfyUI prefix, or a diffusers transformer/
        folder's (renamed through the module map; nothing is fused; the adapter lives in text_conditioner/ there)."""
        from library.models.anima.checkpoint import MARKER, PREFIXES
        from library.models.anima.lora_files import DIFFUSERS_MARKER, module_map_of_keys

        prefix = next((p for p in PREFIXES if p + MARKER in keys), None)
        if prefix is not None:
            return CheckpointNames("anima", prefix)
        if DIFFUSERS_MARKER in keys:
            return CheckpointNames("diffusers", "", module_map_of_keys(keys, shape), native=False)
        return None

    # -- text ----------------------------------------------------------------------------------
    def text_encoding_constants(self) -> dict:
        from library.models.anima.text_encoder import ANIMA_MAX_LENGTH

        return {"hidden_state": "last", "max_length": ANIMA_MAX_LENGTH, "t5_ids": True}

    def caption_token_limit(self, args):
        """The pipeline keeps a prompt's first 512 Qwen3 tokens and its first 512 T5 tokens (the longer row counts)."""
        from library.models.anima.text_encoder import anima_caption_token_limit

        return anima_caption_token_limit(self.text_paths["text_encoder"], t5_tokenizer=self.t5_tokenizer)

    def load_text_encoder(self, precision="bf16", device=None):
        from library.models.anima.text_encoder import load_anima_text_encoder
        from library.models.text_encoders import encoder_precision

        dtype, fp8 = encoder_precision(precision)
        encoder = load_anima_text_encoder(self.text_paths["text_encoder"], t5_tokenizer=self.t5_tokenizer,
                                          dtype=dtype, fp8=fp8)
        encoder.llm.to(device)

        def encode(captions: list[str]) -> list[dict]:
            return per_caption(*(t.cpu() for t in encoder.encode(captions)))

        return encode

    def text_encoder_weights(self):
        """Qwen3's embeddings, its decoder layers and the final norm (last_hidden_state), no head."""
        from library.models.anima.text_encoder import anima_llm_config, anima_text_weights

        return [anima_text_weights(anima_llm_config(self.text_paths["text_encoder"]))]

    # -- the denoiser --------------------------------------------------------------------------
    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        """x_t: the packed noisy target [B, h*w, 64]; text: a batch of cached captions (TEXT_KEYS, the masks where
        captions differ in length). Returns the velocity noise - x0 of the target's tokens [B, h*w, 64]."""
        device = x_t.device
        masks = {k: text[k].to(device).bool() for k in ("qwen_mask", "t5_mask") if k in text}
        return model(img=x_t, qwen=text["qwen"].to(device), t5_ids=text["t5_ids"].to(device), timesteps=sigmas,
                     h=h, w=w, **masks)


def per_caption(qwen, qwen_mask, t5_ids, t5_mask) -> list[dict]:
    """A batch's padded encodings -> each caption's own tokens (its masks' real tokens first). An empty caption keeps
    its one masked Qwen3 token (zeros), as the pipeline feeds it."""
    out = []
    for q, qm, t, tm in zip(qwen, qwen_mask, t5_ids, t5_mask):
        nq, nt = max(1, int(qm.sum())), max(1, int(tm.sum()))
        out.append({"qwen": q[:nq], "qwen_mask": qm[:nq], "t5_ids": t[:nt], "t5_mask": tm[:nt]})
    return out
