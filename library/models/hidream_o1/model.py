"""HiDream-O1-Image (HiDream-ai): a Qwen3-VL-8B whose language model is the denoiser of raw pixel patches,
on the LLM core (library/models/llm.py), with the RELEASED MODULE NAMES: those of transformers'
Qwen3VLForConditionalGeneration as the Comfy-Org single file and the HF repos store them, less the vision tower
(`model.visual.*`, used only with reference images) and `lm_head` (never used). So model.state_dict() keys are the
file's keys, and a kohya LoRA's names are musubi-tuner's (lora_unet_model_language_model_layers_0_self_attn_q_proj).

What the model is (musubi-tuner's hidream_o1/qwen3_vl_transformers.py, ai-toolkit's copy and ComfyUI's
comfy/ldm/hidream_o1/model.py agree):
- `model.language_model`: Qwen3-VL-8B's text decoder (36 layers of width 4096, 32 query / 8 key-value heads of 128,
  per-head q / k RMSNorm, SwiGLU 12288, RMSNorm eps 1e-6, interleaved M-RoPE with sections (24, 20, 20) and theta
  5e6, vocabulary 151936): llm.Decoder with HF names.
- `model.x_embedder` (BottleneckPatchEmbed): a raw 32 x 32 RGB patch, features in (channel, row, col) order (3072
  values in [-1, 1] as noised), to the width through proj1 (3072 -> 1024, no bias) and proj2 (1024 -> 4096), no
  activation between.
- `model.t_embedder1` (TimestepEmbedder): the DiT sinusoid of 1000 t (256 wide, cos half first, max period 1e4) ->
  mlp.0, SiLU, mlp.2. Its output REPLACES the embedding of the `<|tms_token|>` (id 151673): the time is a token.
- `model.final_layer2` (FinalLayer): one Linear from the decoder's final RMSNorm output to a patch's 3072 values.
  No adaLN anywhere.

The forward (text-to-image; musubi's _forward_generation): a row is [its prompt's ids (the chat template + boi + tms,
the tms token its last real one: the family checks the tokenizer's tms id against the config's as it loads), zeros
up to the batch's longest, the h x w image patches]. Positions: the text's 0..T-1 on the three M-RoPE axes, the patch
at (r, c) (4096, 4096 + r, 4096 + c) whatever T is (musubi's get_rope_index_fix_point with fix point 4096).
Attention: the text before tms is causal over its real tokens; tms and every patch (the "gen" rows) see every real
key; pads are no key. The prediction is x0, the clean patch pixels, read at the image positions. Time: the model's
t = 1 - sigma (1 = clean).

Precision (shared/DESIGN.md): positions are int64 and their RoPE tables float32 from float64 angles
(llm.mrope_tables_per_axis, through core.rope_tables), computed per forward, never a buffer; the peers compute the
angles in float32 (musubi's `original_inv_freq`), which at positions past 4096 differs from float64 by up to
2.8e-4 in cos at 2048 px and moves the tiny model's output by 2.8e-6 of its largest value
(tests/test_hidream_o1_model.py). The sinusoid of t is float32 (t = 1 - sigma in float32; musubi's training builds t
in bf16, ComfyUI's sampling in float32), cast to compute_dtype for the MLP. The output is float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from library.models.core import TimestepMLP, timestep_embedding
from library.models.llm import CausalThenFull, Decoder, LLMConfig

TIME_DIM = 256  # TimestepEmbedder's frequency_embedding_size
TIME_FACTOR = 1000.0  # the sinusoid of 1000 t: timestep_embedding(t * 1000, 256)
MAX_POSITIONS = 262144  # Qwen3-VL-8B's max_position_embeddings (no RoPE scaling: informational)


def released_mrope_sections(head_dim: int) -> tuple[int, int, int]:
    """The M-RoPE sections (time, height, width) of a head: the released 5/16 of the head's frequencies for height and
    for width each, the rest for time: (24, 20, 20) for 128; (4, 2, 2) for a tiny 16."""
    half = head_dim // 2
    spatial = half * 20 // 64
    return half - 2 * spatial, spatial, spatial


@dataclass(frozen=True)
class HiDreamO1Config:
    """Defaults: HiDream-O1-Image (Full and Dev share it: ai-toolkit's model_config.py and ComfyUI's
    HiDreamO1TextConfig build both from one config; musubi reads each repo's config.json into the same class)."""

    hidden_size: int = 4096
    num_layers: int = 36
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 12288
    rms_norm_eps: float = 1e-6
    mrope_section: tuple[int, ...] = (24, 20, 20)  # interleaved (Qwen3-VL's mrope_interleaved)
    rope_theta: float = 5_000_000.0
    vocab_size: int = 151936
    patch_size: int = 32  # pixels a side of one image token
    in_channels: int = 3  # RGB
    bottleneck_dim: int = 1024  # x_embedder.proj1's width: hidden_size // 4 as released
    tms_token_id: int = 151673  # <|tms_token|>: its embedding is replaced by t_embedder1(t)
    image_position_start: int = 4096  # the fix point: the target image's (t, h, w) ids start here

    def __post_init__(self):
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"HiDream-O1 mrope_section {self.mrope_section}: expected 3 sections summing to head_dim "
                             f"/ 2 = {self.head_dim // 2}")
        if not 0 <= self.tms_token_id < self.vocab_size:
            raise ValueError(f"HiDream-O1 tms_token_id {self.tms_token_id} lies outside the vocabulary "
                             f"({self.vocab_size} tokens)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"HiDream-O1 num_heads {self.num_heads} is no multiple of num_kv_heads "
                             f"{self.num_kv_heads}")

    @property
    def width(self) -> int:
        return self.hidden_size

    @property
    def token_width(self) -> int:
        """Values of one image token: 3 x 32 x 32 = 3072 (what the tools size a packed token by)."""
        return self.in_channels * self.patch_size ** 2

    @property
    def llm(self) -> LLMConfig:
        """The language model's config for the LLM core (Qwen3: qk-norm, no qkv bias, untied)."""
        return LLMConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
                         num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                         intermediate_size=self.intermediate_size, rope_theta=self.rope_theta,
                         rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=False, qkv_bias=False,
                         max_position_embeddings=MAX_POSITIONS, head_dim=self.head_dim, qk_norm=True,
                         mrope_section=self.mrope_section, mrope_interleaved=True)


HIDREAM_O1 = HiDreamO1Config()


# ----------------------------------------------------------------------------------------------
# Positions and attention


def sequence_positions(text_len: int, h: int, w: int, start: int = HIDREAM_O1.image_position_start,
                       device=None) -> torch.Tensor:
    """int64 [1, text_len + h*w, 3] M-RoPE ids (time, height, width): the text block's 0..text_len-1 on every axis
    (a row's pads keep counting: they are no key), then the row-major patch grid's (start, start + r, start + c)."""
    text = torch.arange(text_len, device=device)[:, None].expand(text_len, 3)
    rows = torch.arange(h, device=device)[:, None].expand(h, w).reshape(-1)
    cols = torch.arange(w, device=device)[None, :].expand(h, w).reshape(-1)
    image = torch.stack((torch.zeros_like(rows), rows, cols), dim=-1) + start
    return torch.cat((text, image))[None]


def generation_attention(text_lengths: torch.Tensor, text_len: int, image_tokens: int) -> CausalThenFull:
    """Each row's attention: the text before its tms token (at text_lengths - 1) causal, tms and the image over every
    real key, its pads (text_lengths .. text_len - 1) no key. One host sync (the lengths)."""
    lengths = text_lengths.to(torch.long)
    if lengths.device.type == "meta":  # the memory planner's step: every row as long as the ids (no pads)
        return CausalThenFull(text_len, lengths - 1, text_len - 1, None)
    shortest, longest = (int(v) for v in torch.aminmax(lengths))
    if shortest < 1 or longest > text_len:
        raise ValueError(f"HiDream-O1: text_lengths {lengths.tolist()} must lie in 1..{text_len} (the ids' length)")
    key_mask = None
    if shortest < text_len:  # pads between the text and the image
        index = torch.arange(text_len + image_tokens, device=lengths.device)
        key_mask = (index[None, :] < lengths[:, None]) | (index[None, :] >= text_len)  # [B, L]
    return CausalThenFull(text_len, lengths - 1, shortest - 1, key_mask)


# ----------------------------------------------------------------------------------------------
# Layers


class BottleneckPatchEmbed(nn.Module):
    """proj2(proj1(patch)): 3072 pixel values -> bottleneck (no bias) -> width, no activation."""

    def __init__(self, cfg: HiDreamO1Config):
        super().__init__()
        self.proj1 = nn.Linear(cfg.token_width, cfg.bottleneck_dim, bias=False)
        self.proj2 = nn.Linear(cfg.bottleneck_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj2(self.proj1(x))


class FinalLayer(nn.Module):
    """`linear`: the final RMSNorm's output -> a patch's 3072 values (no adaLN: the release has none)."""

    def __init__(self, cfg: HiDreamO1Config):
        super().__init__()
        self.linear = nn.Linear(cfg.hidden_size, cfg.token_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen3VLGenerationModel(nn.Module):
    """The `model.` level of the released Qwen3VLForConditionalGeneration: the language model and the three
    generation modules (the vision tower is not built: text-to-image never runs it)."""

    def __init__(self, cfg: HiDreamO1Config):
        super().__init__()
        self.language_model = Decoder(cfg.llm)
        self.t_embedder1 = TimestepMLP(cfg.hidden_size, freq_dim=TIME_DIM)
        self.x_embedder = BottleneckPatchEmbed(cfg)
        self.final_layer2 = FinalLayer(cfg)


# ----------------------------------------------------------------------------------------------
# Model


class HiDreamO1(nn.Module):
    def __init__(self, config: HiDreamO1Config = HIDREAM_O1):
        super().__init__()
        self.config = config
        self.compute_dtype = torch.float32
        self.gradient_checkpointing = False
        self.block_swap = None  # a BlockSwap once enable_block_swap() is called
        self.model = Qwen3VLGenerationModel(config)

    def text_embeddings(self, input_ids: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """[B, T, width] in compute_dtype: the token embeddings, each tms token's replaced by its row's t embedding
        (t = 1 - sigma in float32, its sinusoid float32, then cast)."""
        dtype, inner = self.compute_dtype, self.model
        embedded = inner.language_model.embed_tokens(input_ids).to(dtype)
        t = 1.0 - timesteps.float()  # the model's time: 1 = clean
        t_emb = inner.t_embedder1(timestep_embedding(t, TIME_DIM, time_factor=TIME_FACTOR).to(dtype))  # [B, width]
        is_tms = (input_ids == self.config.tms_token_id)[..., None]
        return torch.where(is_tms, t_emb[:, None].to(embedded.dtype), embedded)

    def forward(self, img: torch.Tensor, input_ids: torch.Tensor, text_lengths: torch.Tensor,
                timesteps: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Predict x0, the clean patches, for noisy ones.

        img [B, h*w, 3072]: x_t's 32 px patches, (channel, row, col) values, the grid row-major.
        input_ids int64 [B, T]: each row's prompt (the template + prompt + boi + tms), right-padded with anything
        (zeros); text_lengths int64 [B]: each row's real length (its tms token is its last real one).
        timesteps [B]: sigma in [0, 1] (1 = pure noise); the model embeds t = 1 - sigma.
        Returns x0's patches [B, h*w, 3072] float32.
        """
        cfg, dtype = self.config, self.compute_dtype
        b, n = img.shape[:2]
        if n != h * w:
            raise ValueError(f"HiDream-O1: {n} image tokens do not fit a {h} x {w} patch grid")
        text_len = input_ids.shape[1]
        text = self.text_embeddings(input_ids, timesteps)
        x = torch.cat((text, self.model.x_embedder(img.to(dtype))), dim=1)  # [B, T + h*w, width]
        positions = sequence_positions(text_len, h, w, cfg.image_position_start, img.device)
        attention = generation_attention(text_lengths.to(img.device), text_len, n)
        states = self.model.language_model.run_embeddings(x, positions, attention, self.gradient_checkpointing,
                                                          self.block_swap)
        return self.model.final_layer2(states[:, text_len:]).float()

    def swappable_blocks(self) -> list[nn.Module]:
        """The decoder layers, in run order."""
        return list(self.model.language_model.layers)


def random_inputs(config: HiDreamO1Config, h: int, w: int, text_len: int, generator: torch.Generator):
    """The conditioning of one forward at an h x w patch grid with random text (tools/precision_doctor.py): text_len
    random ids, the last the tms token. The expected positions are the ids core.rope_tables gets: int64 [1, text_len
    + h*w, 3], the text's 0..text_len-1, then the image's (4096, 4096 + r, 4096 + c); each axis a table over the
    whole head (llm.mrope_tables_per_axis)."""
    from library.models.spec import RandomInputs

    ids = torch.randint(0, config.vocab_size - 1, (1, text_len), generator=generator)
    ids = ids + (ids >= config.tms_token_id).long()  # any token but tms ...
    ids[0, -1] = config.tms_token_id  # ... which ends the prompt
    fixed = dict(input_ids=ids, text_lengths=torch.tensor([text_len]), h=h, w=w)
    positions = sequence_positions(text_len, h, w, config.image_position_start)
    return RandomInputs(fixed, positions, (config.head_dim,) * 3, config.rope_theta)
