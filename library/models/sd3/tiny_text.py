"""Stable Diffusion 3's tiny text encoder files (tools/make_tiny_models.py, once the family lists the writer), in the
diffusers repo's layout (stabilityai/stable-diffusion-3.5-large's text_encoder*/ + tokenizer*/), SAI's single files
and a ComfyUI full checkpoint's text encoders:

  sd3/text_encoder/ + sd3/tokenizer/      CLIP-L: transformers' CLIPTextModelWithProjection, width CLIP_WIDTH 32,
                                          projection 32 (the identity: module docstring of text_encoder.py), 2
                                          layers of 2 heads, quick_gelu; the CLIP-style tokenizer, padding with its
                                          "<|endoftext|>" as the released tokenizer/
  sd3/text_encoder_2/ + sd3/tokenizer_2/  CLIP-G: the same shapes with gelu and a random projection; the same
                                          tokenizer padding with "!" (id 0) as the released tokenizer_2/
  sd3/text_encoder_3/ + sd3/tokenizer_3/  T5: T5EncoderModel of d_model T5_WIDTH 64 = 32 + 32, so the CLIP join
                                          fills it (tiny_files.write_t5_encoder), its T5-style tokenizer
  sd3/text_encoders/clip_l.safetensors    SAI's single files (`text_model.*` + `text_projection.weight`; T5's
  sd3/text_encoders/clip_g.safetensors    `shared.weight` + `encoder.*`), no config or tokenizer inside: their
  sd3/text_encoders/t5xxl.safetensors     configs and tokenizers are the repo folders beside text_encoders/, as in
                                          the released repo. clip_l's projection is random (as a file holding
                                          openai's would be): a single file's CLIP-L never applies it
  sd3/sd3_tiny_text_encoders.safetensors  the three under `text_encoders.{clip_l,clip_g,t5xxl}.transformer.` (the
                                          full checkpoint's names; bundled_text_tensors gives them to a writer
                                          adding the transformer and VAE)

The tiny transformer's context width must be T5_WIDTH (64; released 4096) and its pooled width 2 * CLIP_WIDTH (64;
released 2048). Seed offsets 122 (CLIP-L), 123 (CLIP-G), 124 (T5), 125 (clip_l.safetensors' projection) are this
writer's. Weights are float32 (parity at 1e-5).
"""

from __future__ import annotations

import os

import torch

CLIP_WIDTH = 32
T5_WIDTH = 2 * CLIP_WIDTH
BUNDLED_PREFIXES = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
                    "t5xxl": "text_encoders.t5xxl.transformer."}


def tiny_clip_config(tokenizer, hidden_act: str):
    """transformers' CLIPTextConfig of a tiny CLIP tower (module docstring), its ids the tokenizer's."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=CLIP_WIDTH, intermediate_size=2 * CLIP_WIDTH, projection_dim=CLIP_WIDTH,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, hidden_act=hidden_act,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def write_clip(folder: str, tokenizer_folder: str, tokenizer, hidden_act: str, seed: int, offset: int,
               identity_projection: bool = False, positions: int = 77) -> dict[str, torch.Tensor]:
    """A CLIPTextModelWithProjection folder (the released `text_model.*` + `text_projection.weight` names) of
    `positions` positions (Long-CLIP's 248 for HiDream-I1) and its tokenizer; returns the weights."""
    from transformers import CLIPTextModelWithProjection

    from library.io import save_safetensors
    from library.models.tiny_files import save_tokenizer, seed_component, write_json

    seed_component(seed, offset)
    config = tiny_clip_config(tokenizer, hidden_act)
    config.max_position_embeddings = positions
    model = CLIPTextModelWithProjection(config)  # float32
    if identity_projection:
        with torch.no_grad():
            model.text_projection.weight.copy_(torch.eye(CLIP_WIDTH))
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("position_ids")}
    os.makedirs(folder, exist_ok=True)
    save_safetensors(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(folder, "config.json"), {"architectures": ["CLIPTextModelWithProjection"],
                                                     **config.to_dict()})
    save_tokenizer(tokenizer, tokenizer_folder)
    return weights


def write_t5(folder: str, tokenizer_folder: str, seed: int, offset: int = 124) -> dict[str, torch.Tensor]:
    """tiny_files.write_t5_encoder at T5_WIDTH, its tokenizer moved to `tokenizer_folder`; returns the weights."""
    from library.io import CheckpointReader
    from library.models.tiny_files import write_t5_encoder

    write_t5_encoder(folder, seed, offset, d_model=T5_WIDTH)
    os.makedirs(tokenizer_folder, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(folder, name)):
            os.replace(os.path.join(folder, name), os.path.join(tokenizer_folder, name))
    return dict(CheckpointReader(folder).items())


def bundled_text_tensors(clip_l: dict, clip_g: dict, t5: dict) -> dict[str, torch.Tensor]:
    """The three encoders' single-file tensors under a ComfyUI full checkpoint's `text_encoders.<name>.transformer.`."""
    parts = {"clip_l": clip_l, "clip_g": clip_g, "t5xxl": t5}
    return {BUNDLED_PREFIXES[name] + k: v for name, weights in parts.items() for k, v in weights.items()}


def write_sd3_text_encoders(out: str, seed: int) -> dict[str, str]:
    """The three text encoders under out/sd3/ in each layout (module docstring); returns their paths."""
    from library.io import save_safetensors
    from library.models.tiny_files import build_clip_tokenizer, seed_component

    root = os.path.join(out, "sd3")
    singles = os.path.join(root, "text_encoders")
    paths = {"sd3_clip_l": os.path.join(root, "text_encoder"), "sd3_tokenizer": os.path.join(root, "tokenizer"),
             "sd3_clip_g": os.path.join(root, "text_encoder_2"), "sd3_tokenizer_2": os.path.join(root, "tokenizer_2"),
             "sd3_t5xxl": os.path.join(root, "text_encoder_3"), "sd3_tokenizer_3": os.path.join(root, "tokenizer_3"),
             "sd3_clip_l_single": os.path.join(singles, "clip_l.safetensors"),
             "sd3_clip_g_single": os.path.join(singles, "clip_g.safetensors"),
             "sd3_t5xxl_single": os.path.join(singles, "t5xxl.safetensors"),
             "sd3_text_bundled": os.path.join(root, "sd3_tiny_text_encoders.safetensors")}
    clip_l = write_clip(paths["sd3_clip_l"], paths["sd3_tokenizer"], build_clip_tokenizer(), "quick_gelu", seed, 122,
                        identity_projection=True)
    tokenizer_g = build_clip_tokenizer()
    tokenizer_g.pad_token = "!"  # the released tokenizer_2/'s pad (id 0 there and here)
    clip_g = write_clip(paths["sd3_clip_g"], paths["sd3_tokenizer_2"], tokenizer_g, "gelu", seed, 123,
                        identity_projection=False)
    t5 = write_t5(paths["sd3_t5xxl"], paths["sd3_tokenizer_3"], seed)

    seed_component(seed, 125)  # a projection clip_l.safetensors holds and a single file's CLIP-L never applies
    clip_l_file = {**clip_l, "text_projection.weight": torch.randn(CLIP_WIDTH, CLIP_WIDTH) * CLIP_WIDTH ** -0.5}
    os.makedirs(singles, exist_ok=True)
    for key, weights in (("sd3_clip_l_single", clip_l_file), ("sd3_clip_g_single", clip_g),
                         ("sd3_t5xxl_single", t5)):
        save_safetensors(weights, paths[key])
    save_safetensors(bundled_text_tensors(clip_l_file, clip_g, t5), paths["sd3_text_bundled"])
    return paths
