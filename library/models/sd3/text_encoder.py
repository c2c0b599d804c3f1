"""Stable Diffusion 3 / 3.5 prompt encoding: CLIP-L and CLIP-G (OpenCLIP bigG) at their second-to-last layer, joined
by channels and zero-padded to T5-XXL's width, then T5-XXL's last hidden state; the pooled vector is both CLIPs'
projected pooled outputs joined.

As diffusers' StableDiffusion3Pipeline.encode_prompt (pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py,
clip_skip None, one prompt for the three encoders):
- _get_clip_prompt_embeds, once per CLIP: 77 tokens (tokenizer_max_length: CLIP-L's tokenizer's model_max_length),
  padded to max_length with each tokenizer's own pad token, cut at 77, run without a mask; hidden_states[-2] (the
  last layer's input, no final norm) and output [0], CLIPTextModelWithProjection's text_embeds (the EOT token's
  final-normed state through text_projection). Pad tokens: the released tokenizer/ (CLIP-L) pads with
  "<|endoftext|>" (49407), tokenizer_2/ (CLIP-G) with "!" (id 0): the 77 states differ after the caption's EOT.
- context = cat(CLIP-L [77, 768], CLIP-G [77, 1280]) by channels = [77, 2048], zero-padded to T5's 4096, then
  T5-XXL's [max_sequence_length 256, 4096] (padded to 256 with <pad>, `</s>` appended, cut at 256, no mask):
  [77 + 256, 4096]; pooled = cat(CLIP-L 768, CLIP-G 1280) = 2048.
- Without text_encoder_3 the pipeline feeds zeros [256, joint_attention_dim] for T5 (t5xxl=None here).

CLIP-L's projection: SD3 was conditioned on CLIP-L's unprojected pooled output. SAI's reference and ComfyUI
(comfy/text_encoders/sd3_clip.py: clip_l return_projected_pooled=False) never apply it, and diffusers' single-file
loader (single_file_utils.create_diffusers_clip_model_from_ldm, the `clip_sd3` branch) sets text_projection to
torch.eye(768). So a single file's CLIP-L (SAI's text_encoders/clip_l.safetensors, a full checkpoint's
text_encoders.clip_l.*) gets the identity whatever projection it holds; a folder (the diffusers repo's
text_encoder/) its own text_projection.weight, as transformers loads it there. CLIP-G always applies its own.

Where the peers differ (read from their code):
- sd-scripts (library/strategy_sd3.py, sd3_utils.py): the same 77 / 77 / 256 tokens and pads (it sets CLIP-G's
  pad_token_id = 0 itself), hidden_states[-2], no masks by default (apply_lg_attn_mask / apply_t5_attn_mask off);
  CLIP-L's projection is the file's text_projection.weight when it holds one, torch.eye(768) only when it does not.
  Its full-checkpoint path strips only `text_encoders.clip_l.` / `.clip_g.` (leaving `transformer.` before each key,
  which load_state_dict(strict=False) then skips). Without T5 its concat_encodings uses zeros of 77 tokens, not 256.
- ComfyUI (comfy/text_encoders/sd3_clip.py, sd1_clip.py): the same pads (CLIP-L pad_with_end, CLIP-G pad 0) and
  layer -2, but a prompt over 75 tokens is split into several 77-token windows joined along the sequence (cut at 77
  here), the pooled vectors are the first window's, and T5 is padded to 77 tokens at least, never to 256 nor cut.

Files (one path per encoder; load_sd3_text_encoders): a diffusers repo (text_encoder/ + tokenizer/, text_encoder_2/
+ tokenizer_2/, text_encoder_3/ + tokenizer_3/) or a component folder; SAI's single files (text_encoders/clip_l,
clip_g, t5xxl_fp16.safetensors: `text_model.*` + `text_projection.weight` in HF's Linear orientation, T5's
`shared.weight` + `encoder.*`); a ComfyUI full checkpoint holding them under `text_encoders.{clip_l,clip_g,t5xxl}.
transformer.` (sd3_medium_incl_clips_t5xxlfp8.safetensors: the same path for each). A single file's config is
config.json beside it, else the component folder's (text_encoder*/config.json) beside its folder or in it (the
released repos hold both layouts), else the released one; its tokenizer by tokenizer_folder (tokenizer*/ beside
the file or its folder).

Memory planner (sd3_text_weights, on meta, the released configs): CLIP-L 123,650,304 (its projection 589,824
included), CLIP-G 694,659,840 (projection 1,638,400 included), both never fp8 (bf16 under fp8, as every CLIP-L here);
T5-XXL's encoder 4,762,310,656 as load_t5 keeps it (fp8: 3,623,878,656 weights of 168 Linears, 56,623,104 scale
elements under fp8_scaled, the 24 `wo` bf16; fp16: the `wo`, 1,006,632,960, float32).
"""

from __future__ import annotations

import os

import torch

from library.io import CheckpointError, CheckpointReader, component_folder, read_json_file
from library.models.spec import TextWeights
from library.models.text_encoders import (
    CLIP_G_CONFIG, CLIP_L_CONFIG, CLIP_MAX_LENGTH, RESIDENT, T5_XXL_CONFIG, CLIPPenultimateEncoder, T5TextEncoder,
    bundled_prefix, clip_with_projection_weights, load_clip_with_projection, load_t5, place_text_encoders,
    t5_text_weights, tokenizer_folder,
)

T5_MAX_LENGTH = 256  # the pipeline's max_sequence_length default; sd-scripts' t5xxl_max_token_length too
CONTEXT_WIDTH = 4096  # the released transformers' joint_attention_dim (T5-XXL's d_model)
CLIP_G_PAD_TOKEN = "!"  # the released tokenizer_2/'s pad (id 0); CLIP-L's tokenizer/ pads with its EOT
# What the cached text depends on beyond the files and t5_max_length (the family's text_encoding_constants)
ENCODING_CONSTANTS = {"clip_max_length": CLIP_MAX_LENGTH, "clip_hidden_state": -2, "clip_g_pad_token": CLIP_G_PAD_TOKEN,
                      "clip_l_single_file_projection": "identity"}


class EncoderFiles:
    """Where one encoder's files are in an SD3 layout: `bundled` its name in a ComfyUI full checkpoint, `component` /
    `tokenizer` the diffusers repo's folders, `config` the released config, `marker` a key every checkpoint of it
    has (told before loading: a wrong file is one error naming the key)."""

    def __init__(self, title: str, bundled: str, component: str, tokenizer: str, kind: str, config: dict,
                 marker: str):
        self.title, self.bundled, self.component, self.tokenizer = title, bundled, component, tokenizer
        self.kind, self.config, self.marker = kind, config, marker


CLIP_L_FILES = EncoderFiles("CLIP-L", "clip_l", "text_encoder", "tokenizer", "CLIP", CLIP_L_CONFIG,
                            "text_model.final_layer_norm.weight")
CLIP_G_FILES = EncoderFiles("CLIP-G", "clip_g", "text_encoder_2", "tokenizer_2", "CLIP", CLIP_G_CONFIG,
                            "text_model.final_layer_norm.weight")
T5_FILES = EncoderFiles("T5-XXL", "t5xxl", "text_encoder_3", "tokenizer_3", "T5", T5_XXL_CONFIG,
                        "encoder.final_layer_norm.weight")


class ResolvedEncoder:
    """One encoder's weights path (file or folder), key prefix ('' or a full checkpoint's), config dict."""

    def __init__(self, weights: str, prefix: str, config: dict):
        self.weights, self.prefix, self.config = weights, prefix, config

    @property
    def is_file(self) -> bool:
        return os.path.isfile(self.weights)


def resolve_encoder(path: str, files: EncoderFiles, read_keys: bool = True) -> ResolvedEncoder:
    """Where `files`' encoder is at `path` (module docstring) and its config; read_keys: check the checkpoint's
    header for the encoder's marker key (False: the planner, configs only)."""
    weights = component_folder(path, files.component)
    if not os.path.exists(weights):
        raise CheckpointError(f"{weights}: no such file or folder (the {files.title} text encoder)")
    prefix = ""
    if read_keys:
        reader = CheckpointReader(weights)
        prefix = bundled_prefix(reader, files.bundled)
        if prefix + files.marker not in reader:
            first = next(iter(reader.keys()), None)
            raise CheckpointError(f"{weights}: not a {files.title} checkpoint: no '{prefix}{files.marker}' "
                                  f"(keys like {first!r})")
    return ResolvedEncoder(weights, prefix, _encoder_config(weights, files, bundled=bool(prefix)))


def _encoder_config(weights: str, files: EncoderFiles, bundled: bool) -> dict:
    """A folder's config.json; a single file's beside it (not for a full checkpoint, which holds three encoders),
    else the component folder's next to or above it, else the released config."""
    if os.path.isdir(weights):
        return _config_json(os.path.join(weights, "config.json"), weights)
    folder = os.path.dirname(os.path.abspath(weights))
    beside = [] if bundled else [os.path.join(folder, "config.json")]
    components = [os.path.join(base, files.component, "config.json") for base in (folder, os.path.dirname(folder))]
    candidates = beside + components
    found = next((c for c in candidates if os.path.isfile(c)), None)
    return files.config if found is None else _config_json(found, weights)


def _config_json(config_file: str, weights: str) -> dict:
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{weights}: text encoder folder has no config.json")
    return read_json_file(config_file)


def join_sd3_context(clip_l: torch.Tensor, clip_g: torch.Tensor, t5: torch.Tensor) -> torch.Tensor:
    """cat(CLIP-L [B, 77, Dl], CLIP-G [B, 77, Dg]) by channels, zero-padded to T5's width W, then T5 [B, L, W] along
    the sequence -> [B, 77 + L, W], in the inputs' dtype. The pipeline's F.pad would cut a join wider than W."""
    joined = torch.cat([clip_l, clip_g], dim=-1)
    if joined.shape[-1] > t5.shape[-1]:
        raise ValueError(f"SD3 context: CLIP-L + CLIP-G width {joined.shape[-1]} exceeds T5's {t5.shape[-1]}")
    joined = torch.nn.functional.pad(joined, (0, t5.shape[-1] - joined.shape[-1]))
    return torch.cat([joined, t5], dim=-2)


class SD3TextEncoder:
    """encode(captions) -> one dict per caption: "context" float32 [77 + t5_max_length, W] and "pooled" float32
    [Dl + Dg] (module docstring). `.models`: the loaded modules (for .to(device)); t5 None: zeros for T5's tokens,
    of width context_width."""

    def __init__(self, clip_l: CLIPPenultimateEncoder, clip_g: CLIPPenultimateEncoder, t5: T5TextEncoder | None,
                 t5_max_length: int = T5_MAX_LENGTH, context_width: int = CONTEXT_WIDTH):
        self.clip_l, self.clip_g, self.t5 = clip_l, clip_g, t5
        self.t5_max_length, self.context_width = t5_max_length, context_width
        self.placement = RESIDENT  # text_encoders.OneAtATime where the encoders take turns on the device (place)

    @property
    def models(self) -> list[torch.nn.Module]:
        return [e.model for e in (self.clip_l, self.clip_g, self.t5) if e is not None]

    def place(self, device, one_at_a_time: bool = False) -> None:
        """All on `device`, or CLIP-L resident and CLIP-G, then T5-XXL, each on it for its own stage
        (SD3Family.text_encoders_take_turns; text_encoder_weights' order)."""
        self.placement = place_text_encoders(self.models, device, one_at_a_time)

    def encode_batch(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(context [B, 77 + L, W], pooled [B, Dl + Dg]), both float32 (each encoder's output widened from its
        weights' dtype before the join: the values are those of the pipeline's join in that dtype)."""
        l_hidden, l_pooled = self.clip_l.encode(captions)  # [B, 77, Dl], [B, Dl]
        with self.placement.stage(1):
            g_hidden, g_pooled = self.clip_g.encode(captions)  # [B, 77, Dg], [B, Dg]
        if self.t5 is not None:
            with self.placement.stage(2):
                t5 = self.t5.encode(captions, self.t5_max_length)  # [B, L, W]
        else:
            t5 = l_hidden.new_zeros(len(captions), self.t5_max_length, self.context_width)
        return join_sd3_context(l_hidden, g_hidden, t5), torch.cat([l_pooled, g_pooled], dim=-1)

    def encode(self, captions: list[str]) -> list[dict[str, torch.Tensor]]:
        context, pooled = self.encode_batch(captions)
        return [{"context": c, "pooled": p} for c, p in zip(context, pooled)]


def _check_pad(encoder: CLIPPenultimateEncoder, expected: str, folder: str, title: str) -> None:
    """A CLIP tokenizer padding otherwise than the released one changes the 77 states after the EOT."""
    if encoder.tokenizer.pad_token != expected:
        raise CheckpointError(f"{folder}: {title}'s tokenizer pads with {encoder.tokenizer.pad_token!r}, the released "
                              f"one with {expected!r}: give the {title} tokenizer")


def load_sd3_clip(path: str, files: EncoderFiles, dtype: torch.dtype = torch.float32) -> CLIPPenultimateEncoder:
    """CLIP-L (CLIP_L_FILES) or CLIP-G (CLIP_G_FILES) from `path` with its tokenizer; CLIP-L's projection is the
    identity from a single file (module docstring)."""
    found = resolve_encoder(path, files)
    tokenizer = tokenizer_folder(found.weights, None, files.tokenizer, files.kind, beside_file=True)
    identity = files is CLIP_L_FILES and found.is_file
    encoder = load_clip_with_projection(found.weights, tokenizer, dtype, found.config, found.prefix, identity)
    pad = CLIP_G_PAD_TOKEN if files is CLIP_G_FILES else encoder.tokenizer.eos_token
    _check_pad(encoder, pad, tokenizer, files.title)
    return encoder


def load_sd3_t5(path: str, dtype: torch.dtype = torch.float32, fp8: str | None = None) -> T5TextEncoder:
    """T5-XXL from `path` (text_encoder_3/ + tokenizer_3/ in a diffusers repo) as load_t5 keeps it."""
    found = resolve_encoder(path, T5_FILES)
    tokenizer = tokenizer_folder(found.weights, None, T5_FILES.tokenizer, "T5", beside_file=True)
    return load_t5(found.weights, tokenizer, dtype=dtype, config=found.config, fp8=fp8, prefix=found.prefix)


def load_sd3_text_encoders(clip_l: str, clip_g: str, t5xxl: str | None, dtype: torch.dtype = torch.bfloat16,
                           fp8: str | None = None, t5_max_length: int = T5_MAX_LENGTH,
                           context_width: int | None = None) -> SD3TextEncoder:
    """The three encoders (one path each; a full checkpoint or a repo may be all three) in `dtype`; fp8 ("fp8" /
    "fp8_scaled"): T5-XXL's Linears as load_t5 stores them, the CLIPs stay in `dtype`. t5xxl None: no T5 (zeros).
    context_width: the transformer's joint_attention_dim; None: T5's d_model, or 4096 without T5."""
    encoder_l = load_sd3_clip(clip_l, CLIP_L_FILES, dtype)
    encoder_g = load_sd3_clip(clip_g, CLIP_G_FILES, dtype)
    t5 = None if t5xxl is None else load_sd3_t5(t5xxl, dtype, fp8)
    width = t5.model.config.d_model if t5 is not None else context_width or CONTEXT_WIDTH
    if context_width is not None and context_width != width:
        raise ValueError(f"{t5xxl}: T5's width {width} is not the context width {context_width}")
    return SD3TextEncoder(encoder_l, encoder_g, t5, t5_max_length, width)


def sd3_text_weights(clip_l: str | None = None, clip_g: str | None = None, t5xxl: str | None = None,
                     with_t5: bool = True) -> list[TextWeights]:
    """The memory planner's TextWeights of what load_sd3_text_encoders keeps (module docstring), counted on meta
    from each path's config (None: the released one) without reading a weight: CLIP-L, CLIP-G (never fp8), then
    T5-XXL unless with_t5 is False."""
    configs = [files.config if path is None else resolve_encoder(path, files, read_keys=False).config
               for path, files in ((clip_l, CLIP_L_FILES), (clip_g, CLIP_G_FILES), (t5xxl, T5_FILES))]
    weights = [clip_with_projection_weights(configs[0]), clip_with_projection_weights(configs[1])]
    return weights + [t5_text_weights(config=configs[2])] if with_t5 else weights


def sd3_caption_token_limit(t5xxl: str, t5_max_length: int = T5_MAX_LENGTH):
    """-> TokenLimit: T5-XXL's sequence is cut at t5_max_length tokens (its `</s>` included); the CLIPs' 77 are cut
    too, but T5 carries the long captions."""
    from transformers import AutoTokenizer

    from library.data.check import TokenLimit

    weights = component_folder(t5xxl, T5_FILES.component)
    folder = tokenizer_folder(weights, None, T5_FILES.tokenizer, "T5", beside_file=True)
    loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return TokenLimit("T5-XXL", t5_max_length, lambda text: len(loaded(text, verbose=False).input_ids))
